"""Input checks shared by every stage; errors name the argument, want, got.

Over 400 lines because it is one job: the raising check of every public
entry point's every argument, in one place so their messages agree.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moe_core import config as config_lib
from moe_core import params as params_lib
from moe_core import router_inputs


def _dtype_name(x) -> str:
  return np.dtype(x.dtype).name


def check_config(cfg) -> None:
  if not isinstance(cfg, config_lib.MoEConfig):
    raise TypeError(f"cfg must be a moe_core.MoEConfig, got {type(cfg)}.")


def check_moe_layer(params, x, cfg, token_ids=None) -> None:
  """moe_layer's params (every one the config needs, exact shapes), tokens
  x [..., D], config and token_ids (given iff hash routing)."""
  check_config(cfg)
  check_params(params, cfg)
  check_tokens(x, cfg)
  check_token_ids(token_ids, x.size // cfg.hidden_size, cfg)


def check_tokens(
    x, cfg: config_lib.MoEConfig, *, name: str = "x", experts: bool = False
) -> None:
  """x: [..., D] floating activations with at least one token; with
  `experts`, the routed experts' input [..., W] (W = cfg.expert_width: the
  latent width where cfg.expert_latent_size is set)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x)}.")
  width, field = cfg.hidden_size, "hidden_size"
  if experts and cfg.expert_latent_size:
    width, field = cfg.expert_latent_size, "expert_latent_size"
  if x.ndim < 1 or x.shape[-1] != width:
    raise ValueError(
        f"{name} must have shape [..., {field}={width}], got "
        f"{name}.shape={tuple(x.shape)}."
    )
  check_floating(x, name)
  if x.size == 0:
    raise ValueError(
        f"{name} must hold at least one token, got "
        f"{name}.shape={tuple(x.shape)}."
    )


def check_params(params, cfg: config_lib.MoEConfig) -> None:
  """Every parameter `cfg` needs is present with its exact shape."""
  if not isinstance(params, dict):
    raise TypeError(f"params must be a dict of arrays, got {type(params)}.")
  expected = params_lib.param_shapes(cfg)
  missing = sorted(set(expected) - set(params))
  if missing:
    raise ValueError(
        f"params is missing {missing} for this config; expected "
        f"keys {sorted(expected)}, got {sorted(params)}."
    )
  for name, shape in expected.items():
    got = tuple(getattr(params[name], "shape", ()))
    if got != shape:
      raise ValueError(f"params[{name!r}] must have shape {shape}, got {got}.")
    if name == "hash_table":  # Expert ids, not weights.
      check_hash_table(params[name], cfg)
      continue
    check_floating(params[name], f"params[{name!r}]")
  extra = sorted(set(params) - set(expected))
  if extra:
    # A stray correction_bias or shared expert would be silently ignored.
    raise ValueError(
        f"params has keys {extra} that this config does not use "
        f"(expected {sorted(expected)}); check correction_bias / "
        "shared_ffn_size / shared_expert_gate / activation / expert_bias."
    )


def check_group_sizes(
    group_sizes,
    num_groups: int,
    *,
    name: str = "group_sizes",
    at_least: bool = False,
) -> None:
  """group_sizes: an integer [num_groups] array; with `at_least`, [G] with
  G >= num_groups (every global group's size, num_groups of them local)."""
  if not hasattr(group_sizes, "dtype"):
    raise TypeError(f"{name} must be an int32 array, got {type(group_sizes)}.")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(
        f"{name} must be an integer (int32) array, got dtype "
        f"{_dtype_name(group_sizes)}."
    )
  if at_least:
    if group_sizes.ndim != 1 or group_sizes.shape[0] < num_groups:
      raise ValueError(
          f"{name} must have shape (G,) with G >= the {num_groups} groups "
          f"of weights, got {name}.shape={tuple(group_sizes.shape)}."
      )
  elif group_sizes.shape != (num_groups,):
    raise ValueError(
        f"{name} must have shape ({num_groups},) (one size per "
        f"group), got {name}.shape={tuple(group_sizes.shape)}."
    )


def check_grouped_gemm(
    rows,
    weights,
    group_sizes,
    *,
    transpose_rhs: bool = False,
    global_groups: bool = False,
) -> None:
  """rows [M, C], weights [E, C, N] ([E, N, C] if transposed), sizes [E]
  ([G], G >= E, with `global_groups`: a group offset picks weights' E).

  C is the contracted width (K is top-k elsewhere).
  """
  for name, arr in (("rows", rows), ("weights", weights)):
    if not hasattr(arr, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(arr)}.")
    check_floating(arr, name)
  if rows.ndim != 2:
    raise ValueError(f"rows must be 2-D [M, C], got rows.shape={rows.shape}.")
  if weights.ndim != 3:
    raise ValueError(
        "weights must be 3-D [E, C, N], got " f"weights.shape={weights.shape}."
    )
  if not isinstance(transpose_rhs, (bool, np.bool_)):
    raise TypeError(f"transpose_rhs must be a bool, got {transpose_rhs!r}.")
  c_axis = 2 if transpose_rhs else 1
  if weights.shape[c_axis] != rows.shape[1]:
    layout = "[E, N, C]" if transpose_rhs else "[E, C, N]"
    raise ValueError(
        f"weights {layout} must contract over rows' C={rows.shape[1]}, got "
        f"rows.shape={rows.shape}, weights.shape={weights.shape}."
    )
  check_group_sizes(group_sizes, weights.shape[0], at_least=global_groups)
  check_group_sizes_fit(group_sizes, rows.shape[0])


def check_out_dtype(out_dtype, default) -> jnp.dtype:
  """grouped_gemm's out_dtype: None (rows' dtype) or a floating dtype."""
  if out_dtype is None:
    return jnp.dtype(default)
  try:
    dtype = jnp.dtype(out_dtype)
  except TypeError:
    raise TypeError(
        f"out_dtype must be None or a floating dtype, got {out_dtype!r}."
    ) from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"out_dtype must be None or a floating dtype, got {dtype.name}."
    )
  return dtype


def check_routing(
    expert_ids, combine_weights, num_tokens: int, cfg: config_lib.MoEConfig
) -> None:
  """expert_ids and combine_weights [T, K] for `num_tokens` tokens."""
  want = (num_tokens, cfg.top_k)
  if tuple(expert_ids.shape) != want:
    raise ValueError(
        f"expert_ids must have shape [T, K]={want}, got "
        f"{tuple(expert_ids.shape)}."
    )
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(f"expert_ids must be int32, got {_dtype_name(expert_ids)}.")
  if tuple(combine_weights.shape) != want:
    raise ValueError(
        f"combine_weights must have shape [T, K]={want}, got "
        f"{tuple(combine_weights.shape)}."
    )


def concrete_value(x) -> np.ndarray | None:
  """x as numpy if its value is known now (not traced under jit), else None.

  Value checks run only on concrete arrays: under jit they would need a
  device-to-host copy (or checkify), which a training step must not pay.
  """
  try:
    return np.asarray(x)
  except (
      jax.errors.ConcretizationTypeError,
      jax.errors.TracerArrayConversionError,
  ):
    return None


def check_array(
    x, name: str, shape: tuple[int, ...], *, floating: bool = True
) -> None:
  """x is an array of exactly `shape` (floating point if `floating`)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x)}.")
  if tuple(x.shape) != tuple(shape):
    raise ValueError(
        f"{name} must have shape {tuple(shape)}, got "
        f"{name}.shape={tuple(x.shape)}."
    )
  if floating:
    check_floating(x, name)


def check_token_matrix(
    x, cfg: config_lib.MoEConfig, caller: str, *, experts: bool = False
) -> None:
  """x: [T, D] tokens, as the stages after the layer's flattening take them
  ([T, W], the routed experts' input, with `experts`: `check_tokens`)."""
  check_tokens(x, cfg, experts=experts)
  if x.ndim != 2:
    raise ValueError(
        f"{caller} needs tokens of shape [T, D], got "
        f"x.shape={tuple(x.shape)}; flatten the batch first."
    )


def check_route(
    x, router, cfg: config_lib.MoEConfig, correction_bias, **extras
) -> None:
  """route's x [T, D], router [D, E], correction_bias [E] (or None) and
  its keywords, `router_inputs.RouterInputs` (router_bias [E],
  router_norm_scale [D], expert_output_scale [E], hash_table, token_ids),
  each given iff its config field says so."""
  inputs = router_inputs.RouterInputs(**extras)
  check_config(cfg)
  check_token_matrix(x, cfg, "route")
  e, d = cfg.num_router_experts, cfg.hidden_size
  check_array(router, "router", (d, e))
  # Each optional [E] or [D] input, with the config field that requires it.
  shapes = {
      "router_bias": (e,),
      "router_norm_scale": (d,),
      "expert_output_scale": (e,),
  }
  optional = [("correction_bias", correction_bias, (e,), "correction_bias")]
  optional += [
      (name, getattr(inputs, name), shape, router_inputs.ROUTER_EXTRAS[name])
      for name, shape in shapes.items()
  ]
  check_token_ids(inputs.token_ids, x.shape[0], cfg)
  hash_table = inputs.hash_table
  if bool(cfg.hash_vocab_size) != (hash_table is not None):
    raise ValueError(
        "hash_table must be given iff cfg.hash_vocab_size > 0, got "
        f"cfg.hash_vocab_size={cfg.hash_vocab_size}, hash_table="
        f"{'None' if hash_table is None else 'an array'}."
    )
  if hash_table is not None:
    check_hash_table(hash_table, cfg)
  for name, value, shape, field in optional:
    if value is not None:
      check_array(value, name, shape)
    if bool(getattr(cfg, field)) != (value is not None):
      raise ValueError(
          f"{name} must be given iff cfg.{field} is True, got "
          f"cfg.{field}={getattr(cfg, field)}, {name}="
          f"{'None' if value is None else 'an array'}."
      )


def check_hash_table(table, cfg: config_lib.MoEConfig) -> None:
  """hash_table: int [V, K], concrete ids in [0, E + Z)."""
  check_array(
      table, "hash_table", (cfg.hash_vocab_size, cfg.top_k), floating=False
  )
  if not jnp.issubdtype(table.dtype, jnp.integer):
    raise TypeError(
        f"hash_table must be an int32 array, got dtype {_dtype_name(table)}."
    )
  ids = concrete_value(table)
  e = cfg.num_router_experts
  if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= e):
    raise ValueError(
        f"hash_table must hold expert ids in [0, {e}), got values in "
        f"[{int(ids.min())}, {int(ids.max())}]."
    )


def check_token_ids(token_ids, num_tokens: int, cfg) -> None:
  """token_ids: int [...] with one id per token, given iff hash routing."""
  if bool(cfg.hash_vocab_size) != (token_ids is not None):
    raise ValueError(
        "token_ids must be given iff cfg.hash_vocab_size > 0, got "
        f"cfg.hash_vocab_size={cfg.hash_vocab_size}, token_ids="
        f"{'None' if token_ids is None else 'an array'}."
    )
  if token_ids is None:
    return
  check_is_array(token_ids, "token_ids")
  if not jnp.issubdtype(token_ids.dtype, jnp.integer):
    raise TypeError(
        f"token_ids must be an int array, got dtype {_dtype_name(token_ids)}."
    )
  if token_ids.size != num_tokens:
    raise ValueError(
        f"token_ids must hold one id per token ({num_tokens}), got "
        f"token_ids.shape={tuple(token_ids.shape)}."
    )


def check_expert_ids_in_range(expert_ids, num_experts: int) -> None:
  """Every id in [0, num_experts), when the ids are concrete.

  An id out of range would fall outside every group: its token would be
  lost without a trace. Traced ids (under jit) come from `route`, which
  only makes valid ones.
  """
  ids = concrete_value(expert_ids)
  if ids is None or ids.size == 0:
    return
  low, high = int(ids.min()), int(ids.max())
  if low < 0 or high >= num_experts:
    raise ValueError(
        f"expert_ids must lie in [0, num_experts={num_experts})"
        f", got values in [{low}, {high}]."
    )


def check_dispatch(x, expert_ids, num_experts, kept) -> None:
  """dispatch's x [T, D], expert_ids [T, K] int, kept [T, K] bool or None."""
  check_plan(expert_ids, num_experts, kept)
  check_is_array(x, "x")
  if x.ndim != 2:
    raise ValueError(f"x must be 2-D, got x.shape={tuple(x.shape)}.")
  check_floating(x, "x")
  if expert_ids.shape[0] != x.shape[0]:
    raise ValueError(
        "dispatch needs one expert_ids row per token, got "
        f"x.shape={tuple(x.shape)}, "
        f"expert_ids.shape={tuple(expert_ids.shape)}."
    )


def check_dispatch_stage(x, aux, cfg: config_lib.MoEConfig) -> None:
  """Backend.dispatch's x [T, D], `MoEAux` and config."""
  kept = _stage_kept(aux, cfg)
  check_dispatch(x, aux.expert_ids, cfg.num_experts, kept)


def check_combine_stage(
    expert_out, dispatched, aux, cfg: config_lib.MoEConfig
) -> None:
  """Backend.combine's expert_out [T*K, D], `Dispatched`, aux and config."""
  kept = _stage_kept(aux, cfg)
  check_combine(expert_out, dispatched, aux.combine_weights, kept)


def _stage_kept(aux, cfg):
  """Checks a Backend stage's config and aux; the kept [T, K] it uses (None
  for a dropless config)."""
  check_config(cfg)
  check_aux(aux)
  return aux.kept if cfg.masks_copies else None


def check_plan(expert_ids, num_experts, kept) -> None:
  """permute.plan's expert_ids [T, K] int, num_experts, kept [T, K] bool or
  None; concrete ids must lie in [0, num_experts)."""
  if (
      isinstance(num_experts, bool)
      or not isinstance(num_experts, (int, np.integer))
      or num_experts < 1
  ):
    raise ValueError(
        f"num_experts must be a positive int, got {num_experts!r}."
    )
  check_is_array(expert_ids, "expert_ids")
  if expert_ids.ndim != 2:
    raise ValueError(
        "expert_ids must be 2-D, got "
        f"expert_ids.shape={tuple(expert_ids.shape)}."
    )
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(
        "expert_ids must be an integer (int32) array, got dtype "
        f"{_dtype_name(expert_ids)}."
    )
  if kept is not None:
    check_kept(kept, tuple(expert_ids.shape), "expert_ids'")
  check_expert_ids_in_range(expert_ids, num_experts)


def check_combine(expert_out, dispatched, combine_weights, kept) -> None:
  """combine's expert_out [M, D] and combine_weights [T, K], T*K == M, with
  the T and K of the `Dispatched` (so a transposed [K, T] is refused)."""
  check_is_array(expert_out, "expert_out")
  if expert_out.ndim != 2:
    raise ValueError(
        f"expert_out must be 2-D [M, D], got {tuple(expert_out.shape)}."
    )
  check_floating(expert_out, "expert_out")
  if not hasattr(dispatched, "position"):
    raise TypeError(
        "dispatched must be the moe_core.Dispatched of dispatch, got "
        f"{type(dispatched).__name__}."
    )
  num_rows = dispatched.position.shape[0]
  if expert_out.shape[0] != num_rows:
    raise ValueError(
        f"expert_out must have the dispatched M={num_rows} rows,"
        f" got expert_out.shape={tuple(expert_out.shape)}."
    )
  check_is_array(combine_weights, "combine_weights")
  top_k = dispatched.top_k
  want = (num_rows // top_k, top_k)
  if tuple(combine_weights.shape) != want:
    raise ValueError(
        f"combine_weights must have the dispatched shape [T, K]={want}, got "
        f"combine_weights.shape={tuple(combine_weights.shape)}."
    )
  check_floating(combine_weights, "combine_weights")
  if kept is not None:
    check_kept(kept, want, "combine_weights'")


def check_kept(kept, shape: tuple[int, ...], whose: str) -> None:
  """kept: a bool array of `shape` (`whose` names where it comes from)."""
  check_is_array(kept, "kept")
  if kept.dtype != jnp.bool_:
    raise TypeError(
        f"kept must be a bool array, got dtype {_dtype_name(kept)}."
    )
  if tuple(kept.shape) != tuple(shape):
    raise ValueError(
        f"kept must have {whose} shape {tuple(shape)}, got "
        f"{tuple(kept.shape)}."
    )


def check_aux(aux) -> None:
  """aux is a `MoEAux` (a Backend stage was handed something else)."""
  if not all(
      hasattr(aux, n) for n in ("expert_ids", "combine_weights", "kept")
  ):
    raise TypeError(
        f"aux must be the moe_core.MoEAux of route, got {type(aux).__name__}."
    )


def check_python_number(name: str, value, *, minimum: float) -> None:
  """value is a finite int or float (not a bool) >= minimum."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
    raise TypeError(f"{name} must be a number, got {value!r}.")
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value!r}.")


def check_correction_bias_update(correction_bias, tokens_per_expert, rate):
  """update_correction_bias's bias [E], counts [..., E] and rate >= 0."""
  check_is_array(correction_bias, "correction_bias")
  check_floating(correction_bias, "correction_bias")
  if correction_bias.ndim != 1:
    raise ValueError(
        "correction_bias must be 1-D [E], got shape "
        f"{tuple(correction_bias.shape)}."
    )
  check_is_array(tokens_per_expert, "tokens_per_expert")
  if tokens_per_expert.dtype == jnp.bool_ or not (
      jnp.issubdtype(tokens_per_expert.dtype, jnp.integer)
      or jnp.issubdtype(tokens_per_expert.dtype, jnp.floating)
  ):
    raise TypeError(
        "tokens_per_expert must be an integer or float array of counts, got "
        f"dtype {_dtype_name(tokens_per_expert)}."
    )
  if tokens_per_expert.shape[-1:] != correction_bias.shape:
    raise ValueError(
        f"tokens_per_expert must end in E={correction_bias.shape[0]}, got "
        f"shape {tuple(tokens_per_expert.shape)}."
    )
  if hasattr(rate, "shape") and hasattr(rate, "dtype"):
    if rate.shape != () or not (
        jnp.issubdtype(rate.dtype, jnp.floating)
        or jnp.issubdtype(rate.dtype, jnp.integer)
    ):
      raise TypeError(
          "rate must be a number or a scalar numeric array, got "
          f"{_dtype_name(rate)}{list(rate.shape)}."
      )
    concrete_rate = concrete_value(rate)
    if concrete_rate is not None:
      check_python_number("rate", float(concrete_rate), minimum=0)
  else:
    check_python_number("rate", rate, minimum=0)
  counts = concrete_value(tokens_per_expert)
  if counts is not None and counts.size:
    if not np.all(np.isfinite(counts)) or (counts < 0).any():
      raise ValueError(
          "tokens_per_expert must be finite counts >= 0, got "
          f"{counts.tolist()}."
      )


def check_floating(x, name: str) -> None:
  """x's dtype is floating point (TypeError naming `name` otherwise)."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f"{name} must be floating point, got dtype {_dtype_name(x)}."
    )


def check_is_array(x, name: str) -> None:
  """x has a shape and a dtype (a jax or numpy array, or a tracer)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}.")


def expert_weight_names(cfg: config_lib.MoEConfig) -> tuple[str, ...]:
  """The routed experts' parameters of `cfg`: w_gate (if gated), w_up,
  w_down, then b_gate (if gated), b_up, b_down where cfg.expert_bias."""
  shapes = params_lib.param_shapes(cfg)
  return tuple(
      n
      for n in ("w_gate", "w_up", "w_down") + params_lib.BIAS_NAMES
      if n in shapes
  )


def check_expert_weights(params, cfg: config_lib.MoEConfig) -> int:
  """w_gate, w_up [E_l, D, F], w_down [E_l, F, D] (and the biases b_gate,
  b_up [E_l, F], b_down [E_l, D]) as cfg has them; returns E_l.

  E_l is the experts `params` holds: cfg.num_experts on one device, this
  device's slice under expert parallelism. A missing key is named.
  """
  if not isinstance(params, dict):
    raise TypeError(f"params must be a dict of arrays, got {type(params)}.")
  names = expert_weight_names(cfg)
  missing = [n for n in names if n not in params]
  if missing:
    raise ValueError(
        f"params is missing {missing}, needed by the expert FFN; got keys "
        f"{sorted(params)}."
    )
  for name in names:
    check_is_array(params[name], f"params[{name!r}]")
  first = names[0]
  num_local = params[first].shape[0] if params[first].ndim else 0
  d, f = cfg.expert_width, cfg.expert_ffn_size
  want = {
      name: (num_local,) + shape[1:]
      for name, shape in params_lib.param_shapes(cfg).items()
      if name in names
  }
  for name, shape in want.items():
    got = tuple(params[name].shape)
    if got != shape:
      raise ValueError(
          f"params[{name!r}] must have shape {shape} ([E, D, F] for w_gate "
          f"and w_up, [E, F, D] for w_down, [E, F] for b_gate and b_up, "
          f"[E, D] for b_down, with D={d}, F={f} and the {num_local} "
          f"experts of {first}), got {got}."
      )
    check_floating(params[name], f"params[{name!r}]")
  if num_local < 1:
    raise ValueError(
        f"params[{first!r}] must hold at least one expert, got shape "
        f"{tuple(params[first].shape)}."
    )
  return num_local


def check_group_sizes_fit(group_sizes, num_rows: int) -> None:
  """0 <= group_sizes and sum(group_sizes) <= num_rows, when concrete.

  Past that a kernel would read rows that do not exist (or a negative
  count would shift every later group); under jit the caller vouches.
  """
  sizes = concrete_value(group_sizes)
  if sizes is None:
    return
  if (sizes < 0).any():
    raise ValueError(f"group_sizes must be >= 0, got {sizes.tolist()}.")
  if int(sizes.sum()) > num_rows:
    raise ValueError(
        f"sum(group_sizes) must be <= the {num_rows} rows, got "
        f"sum={int(sizes.sum())} (group_sizes={sizes.tolist()})."
    )


def check_expert_ffn(
    rows, group_sizes, params: dict, cfg: config_lib.MoEConfig
) -> None:
  """expert_ffn's rows [M, D] and group_sizes [E_l]; overrides call it.

  E_l is the experts params holds: all of cfg.num_experts on one
  device, this device's slice under expert parallelism.
  """
  check_config(cfg)
  check_is_array(rows, "rows")
  if rows.ndim != 2 or rows.shape[1] != cfg.expert_width:
    field = "expert_latent_size" if cfg.expert_latent_size else "hidden_size"
    raise ValueError(
        f"rows must have shape [M, {field}={cfg.expert_width}], got "
        f"rows.shape={tuple(rows.shape)}."
    )
  check_floating(rows, "rows")
  num_local = check_expert_weights(params, cfg)
  check_group_sizes(group_sizes, num_local)
  check_group_sizes_fit(group_sizes, rows.shape[0])


def check_routed_experts(
    x, aux, cfg: config_lib.MoEConfig, params: dict | None = None
) -> None:
  """routed_experts' tokens [T, D], the routing decision [T, K] (concrete
  ids in [0, E), kept where the config has a capacity) and, if given, the
  expert weights of all E experts: everything the block's stages take."""
  check_config(cfg)
  check_token_matrix(x, cfg, "routed_experts", experts=True)
  check_aux(aux)
  check_routing(aux.expert_ids, aux.combine_weights, x.shape[0], cfg)
  check_plan(
      aux.expert_ids, cfg.num_experts, aux.kept if cfg.masks_copies else None
  )
  if params is not None:
    num_local = check_expert_weights(params, cfg)
    if num_local != cfg.num_experts:
      raise ValueError(
          f"routed_experts needs the weights of all num_experts="
          f"{cfg.num_experts} experts, got "
          f"params[{expert_weight_names(cfg)[0]!r}] with {num_local}."
      )


def check_choice(name: str, value, choices: Sequence) -> None:
  """value is one of `choices` (an option given by name)."""
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


# --- Expert parallelism (moe_core.parallel) ----------------------------------


def check_ep_options(options, *, exchanges, overflow_policies) -> None:
  """An `EPOptions`: known names, a finite factor > 0, whole chunks."""
  check_choice("exchange", options.exchange, exchanges)
  check_choice("overflow", options.overflow, overflow_policies)
  factor = options.buffer_factor
  if factor is not None and not (
      isinstance(factor, (int, float))
      and not isinstance(factor, bool)
      and math.isfinite(factor)
      and factor > 0
  ):
    raise ValueError(
        "buffer_factor must be None (drop-free) or a finite "
        f"number > 0, got {factor!r}."
    )
  chunks = options.num_chunks
  if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
    raise ValueError(f"num_chunks must be a positive int, got {chunks!r}.")


def check_dropless(cfg: config_lib.MoEConfig) -> None:
  """Capacity needs a global token order that token shards do not share."""
  if not cfg.dropless:
    raise NotImplementedError(
        "expert parallelism supports dropless configs only (capacity_factor="
        f"None), got capacity_factor={cfg.capacity_factor}."
    )


def check_experts_divide(num_experts: int, ep: int, got: str) -> None:
  """E splits evenly over the ep devices of the expert axis; `got` names ep."""
  if num_experts % ep:
    raise ValueError(
        f"num_experts={num_experts} must be divisible by the expert axis "
        f"size, got {got}."
    )


def check_mesh(
    mesh, cfg: config_lib.MoEConfig, expert_axis: str, data_axes: Sequence[str]
) -> tuple[str, ...]:
  """Validates the mesh arguments; returns the token axes."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh)}.")
  if isinstance(data_axes, str):
    raise TypeError(
        "data_axes must be a sequence of axis names, got the "
        f"string {data_axes!r}; write ({data_axes!r},)."
    )
  data_axes = tuple(data_axes)
  names = tuple(mesh.axis_names)
  if expert_axis not in names:
    raise ValueError(
        f"expert_axis={expert_axis!r} is not an axis of the "
        f"mesh; mesh axes are {names}."
    )
  missing = [a for a in data_axes if a not in names]
  if missing:
    raise ValueError(
        f"data_axes={data_axes} names axes {missing} the mesh "
        f"lacks; mesh axes are {names} (data_axes=() for none)."
    )
  if expert_axis in data_axes or len(set(data_axes)) != len(data_axes):
    raise ValueError(
        "data_axes must be distinct and exclude expert_axis, got "
        f"data_axes={data_axes}, expert_axis={expert_axis!r}."
    )
  ep = mesh.shape[expert_axis]
  check_experts_divide(cfg.num_experts, ep, f"mesh.shape[{expert_axis!r}]={ep}")
  return (*data_axes, expert_axis)


def check_token_split(
    x, mesh, token_axes: tuple[str, ...], num_chunks: int
) -> None:
  """x's tokens split evenly over the token axes' devices and the chunks."""
  shards = math.prod(mesh.shape[a] for a in token_axes)
  num_tokens = math.prod(x.shape[:-1])
  if num_tokens % (shards * num_chunks):
    chunks = f" and num_chunks={num_chunks}" if num_chunks > 1 else ""
    raise ValueError(
        f"the {num_tokens} tokens of x (shape {tuple(x.shape)}) must split "
        f"evenly over the {shards} devices of axes {token_axes}{chunks}."
    )


def check_chunks(num_tokens: int, num_chunks: int) -> None:
  """A device's T_l tokens split into num_chunks equal chunks."""
  if num_tokens % num_chunks:
    raise ValueError(
        f"num_chunks={num_chunks} must divide the tokens per device, got "
        f"{num_tokens} tokens per device."
    )
