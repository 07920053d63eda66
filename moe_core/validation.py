"""Input checks shared by every stage; errors name the argument, want, got."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moe_core import config as config_lib
from moe_core import params as params_lib

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _dtype_name(x) -> str:
  return np.dtype(x.dtype).name


def check_config(cfg) -> None:
  if not isinstance(cfg, config_lib.MoEConfig):
    raise TypeError(f"cfg must be a moe_core.MoEConfig, got {type(cfg)}.")


def check_tokens(x, cfg: config_lib.MoEConfig, *, name: str = "x") -> None:
  """x: [..., D] floating activations with at least one token."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x)}.")
  if x.ndim < 1 or x.shape[-1] != cfg.hidden_size:
    raise ValueError(
        f"{name} must have shape [..., hidden_size={cfg.hidden_size}], got "
        f"{name}.shape={tuple(x.shape)}."
    )
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f"{name} must be floating point, got dtype " f"{_dtype_name(x)}."
    )
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
    if not jnp.issubdtype(params[name].dtype, jnp.floating):
      raise TypeError(
          f"params[{name!r}] must be floating point, got dtype "
          f"{_dtype_name(params[name])}."
      )
  extra = sorted(set(params) - set(expected))
  if extra:
    # A stray correction_bias or shared expert would be silently ignored.
    raise ValueError(
        f"params has keys {extra} that this config does not use "
        f"(expected {sorted(expected)}); check correction_bias / "
        "shared_ffn_size / shared_expert_gate."
    )


def check_group_sizes(
    group_sizes, num_groups: int, *, name: str = "group_sizes"
) -> None:
  if not hasattr(group_sizes, "dtype"):
    raise TypeError(f"{name} must be an int32 array, got {type(group_sizes)}.")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(
        f"{name} must be an integer (int32) array, got dtype "
        f"{_dtype_name(group_sizes)}."
    )
  if group_sizes.shape != (num_groups,):
    raise ValueError(
        f"{name} must have shape ({num_groups},) (one size per "
        f"group), got {name}.shape={tuple(group_sizes.shape)}."
    )


def check_grouped_gemm(
    rows, weights, group_sizes, *, transpose_rhs: bool = False
) -> None:
  """rows [M, C], weights [E, C, N] ([E, N, C] if transposed), sizes [E].

  C is the contracted width (K is top-k elsewhere).
  """
  for name, arr in (("rows", rows), ("weights", weights)):
    if not hasattr(arr, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(arr)}.")
    if not jnp.issubdtype(arr.dtype, jnp.floating):
      raise TypeError(
          f"{name} must be floating point, got dtype " f"{_dtype_name(arr)}."
      )
  if rows.ndim != 2:
    raise ValueError(f"rows must be 2-D [M, C], got rows.shape={rows.shape}.")
  if weights.ndim != 3:
    raise ValueError(
        "weights must be 3-D [E, C, N], got " f"weights.shape={weights.shape}."
    )
  c_axis = 2 if transpose_rhs else 1
  if weights.shape[c_axis] != rows.shape[1]:
    layout = "[E, N, C]" if transpose_rhs else "[E, C, N]"
    raise ValueError(
        f"weights {layout} must contract over rows' C={rows.shape[1]}, got "
        f"rows.shape={rows.shape}, weights.shape={weights.shape}."
    )
  check_group_sizes(group_sizes, weights.shape[0])
  check_group_sizes_fit(group_sizes, rows.shape[0])


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
  if floating and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f"{name} must be floating point, got dtype " f"{_dtype_name(x)}."
    )


def check_token_matrix(x, cfg: config_lib.MoEConfig, caller: str) -> None:
  """x: [T, D] tokens, as the stages after the layer's flattening take them."""
  check_tokens(x, cfg)
  if x.ndim != 2:
    raise ValueError(
        f"{caller} needs tokens of shape [T, D], got "
        f"x.shape={tuple(x.shape)}; flatten the batch first."
    )


def check_route(x, router, cfg: config_lib.MoEConfig, correction_bias) -> None:
  """route's x [T, D], router [D, E] and correction_bias [E] (or None)."""
  check_config(cfg)
  check_token_matrix(x, cfg, "route")
  check_array(router, "router", (cfg.hidden_size, cfg.num_experts))
  if correction_bias is not None:
    check_array(correction_bias, "correction_bias", (cfg.num_experts,))


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
  if not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
    raise ValueError(
        f"num_experts must be a positive int, got " f"{num_experts!r}."
    )
  for name, arr in (("x", x), ("expert_ids", expert_ids)):
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(arr)}.")
    if arr.ndim != 2:
      raise ValueError(
          f"{name} must be 2-D, got {name}.shape=" f"{tuple(arr.shape)}."
      )
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(
        "expert_ids must be an integer (int32) array, got dtype "
        f"{_dtype_name(expert_ids)}."
    )
  if expert_ids.shape[0] != x.shape[0]:
    raise ValueError(
        "dispatch needs one expert_ids row per token, got "
        f"x.shape={tuple(x.shape)}, "
        f"expert_ids.shape={tuple(expert_ids.shape)}."
    )
  if kept is not None and (
      tuple(kept.shape) != tuple(expert_ids.shape) or kept.dtype != jnp.bool_
  ):
    raise ValueError(
        f"kept must be bool of expert_ids' shape "
        f"{tuple(expert_ids.shape)}, got {_dtype_name(kept)}"
        f"{list(kept.shape)}."
    )
  check_expert_ids_in_range(expert_ids, num_experts)


def check_combine(expert_out, num_rows: int, combine_weights, kept) -> None:
  """combine's expert_out [M, D] and combine_weights [T, K], T*K == M."""
  if not hasattr(expert_out, "shape") or expert_out.ndim != 2:
    raise ValueError(
        "expert_out must be 2-D [M, D], got "
        f"{getattr(expert_out, 'shape', type(expert_out))}."
    )
  if expert_out.shape[0] != num_rows:
    raise ValueError(
        f"expert_out must have the dispatched M={num_rows} rows,"
        f" got expert_out.shape={tuple(expert_out.shape)}."
    )
  if not hasattr(combine_weights, "shape") or combine_weights.ndim != 2:
    raise ValueError(
        "combine_weights must be 2-D [T, K], got "
        f"{getattr(combine_weights, 'shape', None)}."
    )
  t, k = combine_weights.shape
  if t * k != num_rows:
    raise ValueError(
        f"combine_weights [T, K] must have T*K = the dispatched "
        f"M={num_rows}, got combine_weights.shape={(t, k)}."
    )
  if kept is not None and tuple(kept.shape) != (t, k):
    raise ValueError(
        f"kept must have combine_weights' shape {(t, k)}, got "
        f"{tuple(kept.shape)}."
    )


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
  """expert_ffn's rows [M, D] and group_sizes [E_local]; overrides call it.

  E_local is the experts params holds: all of cfg.num_experts on one
  device, this device's slice under expert parallelism.
  """
  check_config(cfg)
  if (
      not hasattr(rows, "shape")
      or rows.ndim != 2
      or (rows.shape[1] != cfg.hidden_size)
  ):
    raise ValueError(
        f"rows must have shape [M, hidden_size={cfg.hidden_size}], got "
        f"rows.shape={tuple(getattr(rows, 'shape', ()))}."
    )
  check_group_sizes(group_sizes, params["w_gate"].shape[0])
  check_group_sizes_fit(group_sizes, rows.shape[0])


def check_routed_experts(x, aux, cfg: config_lib.MoEConfig) -> None:
  """routed_experts' tokens [T, D] and the routing decision [T, K] (shapes;
  the ids' values are checked where they are consumed, by dispatch)."""
  check_token_matrix(x, cfg, "routed_experts")
  check_routing(aux.expert_ids, aux.combine_weights, x.shape[0], cfg)


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
