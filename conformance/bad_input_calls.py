"""The bad-input table's valid calls: each public entry point's valid
arguments (`ENTRIES`) and the helpers that turn them into bad ones."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import moe_core

# The shapes: E experts, top-K, width D, expert width F, T tokens.
E, K, D, F, T = 8, 2, 16, 8, 10
CFG = moe_core.MoEConfig(
    num_experts=E, top_k=K, hidden_size=D, expert_ffn_size=F
)
# DeepSeek-V3's routing: sigmoid scores steered by a correction bias.
BIAS_CFG = CFG.replace(score_func="sigmoid", correction_bias=True)
# ceil(1.0 * T * K / E) = 3 slots per expert: some assignments are dropped.
CAPACITY_CFG = CFG.replace(capacity_factor=1.0)
# The expert FFN's switches: biases on its linears; no gate GEMM.
EXPERT_BIAS_CFG = CFG.replace(expert_bias=True)
RELU_CFG = CFG.replace(activation="relu")
# The routed experts at a latent width of 8 (Nemotron-H, Muse Spark).
LATENT_CFG = CFG.replace(expert_latent_size=8)
# DeepSeek-V4's hash routing: token t's experts are row token_ids[t] of a
# [V, K] table; with Z = 2 zero experts, ids E and E + 1 are theirs.
V = 12
HASH_CFG = CFG.replace(hash_vocab_size=V)
HASH_ZERO_CFG = HASH_CFG.replace(num_zero_experts=2)

# The grouped GEMM's inputs: rows [M, C] x weights [G, C, N], G groups.
GEMM_M, GEMM_C, GEMM_N = 28, 16, 8
GEMM_GROUP_SIZES = (4, 10, 6, 8)  # Sums to M: every row is used.
# The expert FFN's buffer: T*K rows in E groups.
_FFN_GROUP_SIZES = (2, 3, 1, 4, 0, 5, 2, 3)


# --- Valid inputs of each entry point -----------------------------------------


def _normal(rng, shape, scale=1.0) -> jax.Array:
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def token_ids(cfg) -> jax.Array | None:
  """[T] int32 token ids 0, 1, ..., T - 1 for a hash-routing config (token
  t reads row t of the table), else None."""
  if not cfg.hash_vocab_size:
    return None
  return jnp.arange(T, dtype=jnp.int32) % cfg.hash_vocab_size


def _hash_table(cfg) -> jax.Array:
  """[V, K] int32: row v holds the K distinct ids v, v + 1, ... mod E + Z."""
  v, e = cfg.hash_vocab_size, cfg.num_router_experts
  return jnp.asarray(
      (np.arange(v)[:, None] + np.arange(cfg.top_k)) % e, jnp.int32
  )


@functools.lru_cache(maxsize=None)
def _model(cfg: moe_core.MoEConfig) -> tuple[dict, jax.Array, moe_core.MoEAux]:
  """(params, x [T, D], the routing of x) for `cfg`, from a fixed seed.

  The correction bias (if any) is on the scale of the spread of the scores,
  so that it changes which experts are chosen.
  """
  rng = np.random.default_rng(1700)
  params = {}
  for name, shape in moe_core.param_shapes(cfg).items():
    if name == "hash_table":
      params[name] = _hash_table(cfg)
      continue
    scale = 0.1 if name == "correction_bias" else shape[-2] ** -0.5
    params[name] = _normal(rng, shape, scale)
  x = _normal(rng, (T, cfg.hidden_size))
  aux = moe_core.route(
      x,
      params["router"],
      cfg,
      params.get("correction_bias"),
      **_hash_args(cfg, params),
  )
  return params, x, aux


def _hash_args(cfg, params) -> dict:
  """route's hash_table and token_ids for a hash-routing config, else {}."""
  if not cfg.hash_vocab_size:
    return {}
  return dict(hash_table=params["hash_table"], token_ids=token_ids(cfg))


def kept_mask(cfg, aux):
  """What the stages take as `kept`: None when dropless."""
  return None if cfg.dropless else aux.kept


def _expert_out(cfg) -> jax.Array:
  """[T*K, D] stand-in expert outputs for combine."""
  return _normal(np.random.default_rng(1701), (T * K, cfg.hidden_size))


@functools.lru_cache(maxsize=None)
def _dispatched(cfg) -> moe_core.Dispatched:
  _, x, aux = _model(cfg)
  return moe_core.dispatch(
      x, aux.expert_ids, cfg.num_experts, kept_mask(cfg, aux)
  )


def _good_route(cfg):
  params, x, _ = _model(cfg)
  return dict(
      x=x,
      router=params["router"],
      cfg=cfg,
      correction_bias=params.get("correction_bias"),
      **_hash_args(cfg, params),
  )


def _good_dispatch(cfg):
  _, x, aux = _model(cfg)
  return dict(
      x=x,
      expert_ids=aux.expert_ids,
      num_experts=cfg.num_experts,
      kept=kept_mask(cfg, aux),
  )


def _good_combine(cfg):
  _, _, aux = _model(cfg)
  return dict(
      expert_out=_expert_out(cfg),
      dispatched=_dispatched(cfg),
      combine_weights=aux.combine_weights,
      kept=kept_mask(cfg, aux),
  )


def _good_gemm(cfg):
  del cfg  # The GEMM takes no config.
  rng = np.random.default_rng(1702)
  groups = len(GEMM_GROUP_SIZES)
  return dict(
      rows=_normal(rng, (GEMM_M, GEMM_C)),
      weights=_normal(rng, (groups, GEMM_C, GEMM_N), GEMM_C**-0.5),
      group_sizes=jnp.asarray(GEMM_GROUP_SIZES, jnp.int32),
      transpose_rhs=False,
      out_dtype=None,
  )


def _good_expert_ffn(cfg):
  params, _, _ = _model(cfg)
  rng = np.random.default_rng(1703)
  return dict(
      rows=_normal(rng, (T * K, cfg.expert_width)),
      group_sizes=jnp.asarray(_FFN_GROUP_SIZES, jnp.int32),
      params={n: params[n] for n in params if n.startswith(("w_", "b_"))},
      cfg=cfg,
  )


def _good_backend_dispatch(cfg):
  _, x, aux = _model(cfg)
  return dict(x=x, aux=aux, cfg=cfg)


def _good_backend_combine(cfg):
  _, _, aux = _model(cfg)
  return dict(
      expert_out=_expert_out(cfg),
      dispatched=_dispatched(cfg),
      aux=aux,
      cfg=cfg,
  )


def _good_routed_experts(cfg):
  params, x, aux = _model(cfg)
  return dict(params=params, x=x, aux=aux, cfg=cfg)


def _good_layer(cfg):
  params, x, _ = _model(cfg)
  if cfg.hash_vocab_size:
    return dict(params=params, x=x, cfg=cfg, token_ids=token_ids(cfg))
  return dict(params=params, x=x, cfg=cfg)


def _good_update_bias(cfg):
  _, _, aux = _model(cfg)
  rng = np.random.default_rng(1704)
  return dict(
      correction_bias=_normal(rng, (cfg.num_experts,), 0.1),
      tokens_per_expert=aux.tokens_per_expert,
      rate=1e-3,
  )


def _call_in_order(fn, kw: dict):
  """fn with kw's values in the order of fn's signature: positionally, the
  keyword-only ones by keyword (as a caller writes the call)."""
  bound = inspect.signature(fn).bind(**kw)
  return fn(*bound.args, **bound.kwargs)


@dataclasses.dataclass(frozen=True)
class Entry:
  """A public entry point: valid arguments, and how to call it.

  Attributes:
    good: cfg -> the keyword arguments of a valid call (a dict).
    function: backend -> the entry point, which `call` calls.
    on_backend: whether the call goes through the backend (a method of it,
      or the layer given it); the others are backend-independent code.
    grads: arguments to differentiate by: `call` gives the output and the
      gradients of sum(output) w.r.t. them (() = the output alone).
  """

  good: Callable[[moe_core.MoEConfig], dict]
  function: Callable[[Any], Callable[..., Any]]
  on_backend: bool
  grads: tuple[str, ...] = ()

  def call(self, backend, kw: dict):
    """The entry point's result on the keyword arguments `kw`."""
    fn = self.function(backend)
    if not self.grads:
      return _call_in_order(fn, kw)

    def of_grads(*values):
      return _call_in_order(fn, {**kw, **dict(zip(self.grads, values))})

    out, vjp = jax.vjp(of_grads, *(kw[name] for name in self.grads))
    return out, vjp(jnp.ones_like(out))


def _function(good, fn) -> Entry:
  """A backend-independent entry point."""
  return Entry(good, lambda backend: fn, on_backend=False)


def _method(good, name, grads=()) -> Entry:
  """The backend's method `name`."""
  return Entry(good, lambda b: getattr(b, name), on_backend=True, grads=grads)


def _layer_on(backend):
  return functools.partial(moe_core.moe_layer, backend=backend)


ENTRIES = {
    "route": _function(_good_route, moe_core.route),
    "dispatch": _function(_good_dispatch, moe_core.dispatch),
    "combine": _function(_good_combine, moe_core.combine),
    "grouped_gemm": _method(_good_gemm, "grouped_gemm"),
    "grouped_gemm_vjp": _method(
        _good_gemm, "grouped_gemm", grads=("rows", "weights")
    ),
    "expert_ffn": _method(_good_expert_ffn, "expert_ffn"),
    "expert_ffn_vjp": _method(
        _good_expert_ffn, "expert_ffn", grads=("rows", "params")
    ),
    "backend.dispatch": _method(_good_backend_dispatch, "dispatch"),
    "backend.combine": _method(_good_backend_combine, "combine"),
    "routed_experts": _method(_good_routed_experts, "routed_experts"),
    "moe_layer": Entry(_good_layer, _layer_on, on_backend=True),
    "update_correction_bias": _function(
        _good_update_bias, moe_core.update_correction_bias
    ),
    "init_params": _function(
        lambda cfg: dict(key=jax.random.key(0), cfg=cfg, dtype=jnp.float32),
        moe_core.init_params,
    ),
    "param_shapes": _function(lambda cfg: dict(cfg=cfg), moe_core.param_shapes),
    # By keyword: a config is built from named fields.
    "MoEConfig": _function(
        dataclasses.asdict, lambda **fields: moe_core.MoEConfig(**fields)
    ),
}


# --- Turning a good call into a bad one ---------------------------------------

# A change: a valid value -> a bad one. Short names: the table's rows are one
# line each.


def to(value):
  """Replaces the value by `value`."""
  return lambda _: value


def cast(dtype):
  return lambda a: a.astype(dtype)


def zeros(*shape):
  """Replaces the value by float32 zeros of `shape`."""
  return lambda _: jnp.zeros(shape, jnp.float32)


def set_at(index, value):
  return lambda a: a.at[index].set(value)


def head(n):
  """The first n entries (along the first axis)."""
  return lambda a: a[:n]


def reshape(*shape):
  return lambda a: a.reshape(shape)


# A corruption: the valid keyword arguments -> bad ones.


def replace_args(**values):
  """Replaces arguments by the given values."""

  def corrupt(kw):
    return {**kw, **values}

  return corrupt


def map_arg(name, change):
  """Replaces argument `name` by change(its value)."""

  def corrupt(kw):
    return {**kw, name: change(kw[name])}

  return corrupt


def map_param(name, change):
  """Replaces params[name] by change(params[name]) (None: removes it)."""

  def corrupt(kw):
    params = dict(kw["params"])
    new = change(params.get(name))
    if new is None:
      del params[name]
    else:
      params[name] = new
    return {**kw, "params": params}

  return corrupt


def map_aux(name, change):
  """Replaces the aux field `name` by change(its value)."""

  def corrupt(kw):
    aux = kw["aux"]
    new = change(getattr(aux, name))
    return {**kw, "aux": dataclasses.replace(aux, **{name: new})}

  return corrupt


def nan_in_chosen_expert(kw):
  """A NaN in the gate weights of token 0's first expert."""
  expert = int(kw["aux"].expert_ids[0, 0])
  return map_param("w_gate", set_at((expert, 0, 0), jnp.nan))(kw)


# Where a change goes.


@dataclasses.dataclass(frozen=True)
class Target:
  """What a row changes: `corrupt(change)` is the row's corruption; `label`
  names it in the row's name ("" for a change of the whole call)."""

  label: str
  corrupt: Callable[[Callable[[Any], Any]], Callable[[dict], dict]]


def arg(name: str, label: str | None = None) -> Target:
  """The argument `name`."""
  return Target(label or name, functools.partial(map_arg, name))


def param(name: str, label: str | None = None) -> Target:
  """params[name] (added if absent, removed by a change to None)."""
  return Target(label or name, functools.partial(map_param, name))


def aux_field(name: str, label: str | None = None) -> Target:
  """The field `name` of the argument aux (a MoEAux)."""
  return Target(label or name, functools.partial(map_aux, name))


# The change is itself the corruption: a change to the call as a whole.
WHOLE_CALL = Target("", lambda corrupt: corrupt)
