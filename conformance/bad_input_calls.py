"""The bad-input table's valid calls: each public entry point's valid
arguments (`ENTRIES`) and the helpers that turn them into bad ones."""

from __future__ import annotations

import dataclasses
import functools
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

# The grouped GEMM's inputs: rows [M, C] x weights [G, C, N], G groups.
GEMM_M, GEMM_C, GEMM_N = 28, 16, 8
GEMM_GROUP_SIZES = (4, 10, 6, 8)  # Sums to M: every row is used.
# The expert FFN's buffer: T*K rows in E groups.
_FFN_GROUP_SIZES = (2, 3, 1, 4, 0, 5, 2, 3)


# --- Valid inputs of each entry point -----------------------------------------


def _normal(rng, shape, scale=1.0) -> jax.Array:
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


@functools.lru_cache(maxsize=None)
def _model(cfg: moe_core.MoEConfig) -> tuple[dict, jax.Array, moe_core.MoEAux]:
  """(params, x [T, D], the routing of x) for `cfg`, from a fixed seed.

  The correction bias (if any) is on the scale of the spread of the scores,
  so that it changes which experts are chosen.
  """
  rng = np.random.default_rng(1700)
  params = {}
  for name, shape in moe_core.param_shapes(cfg).items():
    scale = 0.1 if name == "correction_bias" else shape[-2] ** -0.5
    params[name] = _normal(rng, shape, scale)
  x = _normal(rng, (T, cfg.hidden_size))
  aux = moe_core.route(x, params["router"], cfg, params.get("correction_bias"))
  return params, x, aux


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
      rows=_normal(rng, (T * K, cfg.hidden_size)),
      group_sizes=jnp.asarray(_FFN_GROUP_SIZES, jnp.int32),
      params={n: params[n] for n in ("w_gate", "w_up", "w_down")},
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
  return dict(params=params, x=x, cfg=cfg)


def _good_update_bias(cfg):
  _, _, aux = _model(cfg)
  rng = np.random.default_rng(1704)
  return dict(
      correction_bias=_normal(rng, (cfg.num_experts,), 0.1),
      tokens_per_expert=aux.tokens_per_expert,
      rate=1e-3,
  )


def _gemm_and_grads(backend, kw):
  """grouped_gemm and the gradients of sum(out) w.r.t. rows and weights."""

  def gemm(rows, weights):
    return backend.grouped_gemm(
        rows,
        weights,
        kw["group_sizes"],
        transpose_rhs=kw["transpose_rhs"],
        out_dtype=kw["out_dtype"],
    )

  out, vjp = jax.vjp(gemm, kw["rows"], kw["weights"])
  return out, vjp(jnp.ones_like(out))


def _expert_ffn_and_grads(backend, kw):
  """expert_ffn and the gradients of sum(out) w.r.t. rows and weights."""

  def ffn(rows, params):
    return backend.expert_ffn(rows, kw["group_sizes"], params, kw["cfg"])

  out, vjp = jax.vjp(ffn, kw["rows"], kw["params"])
  return out, vjp(jnp.ones_like(out))


@dataclasses.dataclass(frozen=True)
class Entry:
  """A public entry point: valid arguments, and how to call it.

  Attributes:
    good: cfg -> the keyword arguments of a valid call (a dict).
    call: (backend, kwargs) -> the entry point's result.
    on_backend: whether the call goes through the backend (a method of it,
      or the layer given it); the others are backend-independent code.
  """

  good: Callable[[moe_core.MoEConfig], dict]
  call: Callable[[Any, dict], Any]
  on_backend: bool


# Positional calls: the table names the arguments, the API their order.
ENTRIES = {
    "route": Entry(
        _good_route,
        lambda b, kw: moe_core.route(
            kw["x"], kw["router"], kw["cfg"], kw["correction_bias"]
        ),
        on_backend=False,
    ),
    "dispatch": Entry(
        _good_dispatch,
        lambda b, kw: moe_core.dispatch(
            kw["x"], kw["expert_ids"], kw["num_experts"], kw["kept"]
        ),
        on_backend=False,
    ),
    "combine": Entry(
        _good_combine,
        lambda b, kw: moe_core.combine(
            kw["expert_out"],
            kw["dispatched"],
            kw["combine_weights"],
            kw["kept"],
        ),
        on_backend=False,
    ),
    "grouped_gemm": Entry(
        _good_gemm,
        lambda b, kw: b.grouped_gemm(
            kw["rows"],
            kw["weights"],
            kw["group_sizes"],
            transpose_rhs=kw["transpose_rhs"],
            out_dtype=kw["out_dtype"],
        ),
        on_backend=True,
    ),
    "grouped_gemm_vjp": Entry(_good_gemm, _gemm_and_grads, on_backend=True),
    "expert_ffn": Entry(
        _good_expert_ffn,
        lambda b, kw: b.expert_ffn(
            kw["rows"], kw["group_sizes"], kw["params"], kw["cfg"]
        ),
        on_backend=True,
    ),
    "expert_ffn_vjp": Entry(
        _good_expert_ffn, _expert_ffn_and_grads, on_backend=True
    ),
    "backend.dispatch": Entry(
        _good_backend_dispatch,
        lambda b, kw: b.dispatch(kw["x"], kw["aux"], kw["cfg"]),
        on_backend=True,
    ),
    "backend.combine": Entry(
        _good_backend_combine,
        lambda b, kw: b.combine(
            kw["expert_out"], kw["dispatched"], kw["aux"], kw["cfg"]
        ),
        on_backend=True,
    ),
    "routed_experts": Entry(
        _good_routed_experts,
        lambda b, kw: b.routed_experts(
            kw["params"], kw["x"], kw["aux"], kw["cfg"]
        ),
        on_backend=True,
    ),
    "moe_layer": Entry(
        _good_layer,
        lambda b, kw: moe_core.moe_layer(
            kw["params"], kw["x"], kw["cfg"], backend=b
        ),
        on_backend=True,
    ),
    "update_correction_bias": Entry(
        _good_update_bias,
        lambda b, kw: moe_core.update_correction_bias(
            kw["correction_bias"], kw["tokens_per_expert"], kw["rate"]
        ),
        on_backend=False,
    ),
    "init_params": Entry(
        lambda cfg: dict(key=jax.random.key(0), cfg=cfg, dtype=jnp.float32),
        lambda b, kw: moe_core.init_params(kw["key"], kw["cfg"], kw["dtype"]),
        on_backend=False,
    ),
    "param_shapes": Entry(
        lambda cfg: dict(cfg=cfg),
        lambda b, kw: moe_core.param_shapes(kw["cfg"]),
        on_backend=False,
    ),
    "MoEConfig": Entry(
        dataclasses.asdict,
        lambda b, kw: moe_core.MoEConfig(**kw),
        on_backend=False,
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
