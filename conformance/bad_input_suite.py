"""BadInputSuite: one table of bad inputs to every public entry point."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from conformance import base
from conformance import oracles

# The shapes: E experts, top-K, width D, expert width F, T tokens.
_E, _K, _D, _F, _T = 8, 2, 16, 8, 10
_CFG = moe_core.MoEConfig(
    num_experts=_E, top_k=_K, hidden_size=_D, expert_ffn_size=_F
)
# DeepSeek-V3's routing: sigmoid scores steered by a correction bias.
_BIAS_CFG = _CFG.replace(score_func="sigmoid", correction_bias=True)
# ceil(1.0 * T * K / E) = 3 slots per expert: some assignments are dropped.
_CAPACITY_CFG = _CFG.replace(capacity_factor=1.0)

# The grouped GEMM's inputs: rows [M, C] x weights [G, C, N], G groups.
_GEMM_M, _GEMM_C, _GEMM_N = 28, 16, 8
_GEMM_GROUP_SIZES = (4, 10, 6, 8)  # Sums to M: every row is used.
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
  x = _normal(rng, (_T, cfg.hidden_size))
  aux = moe_core.route(x, params["router"], cfg, params.get("correction_bias"))
  return params, x, aux


def _kept(cfg, aux):
  """What the stages take as `kept`: None when dropless."""
  return None if cfg.dropless else aux.kept


def _expert_out(cfg) -> jax.Array:
  """[T*K, D] stand-in expert outputs for combine."""
  return _normal(np.random.default_rng(1701), (_T * _K, cfg.hidden_size))


@functools.lru_cache(maxsize=None)
def _dispatched(cfg) -> moe_core.Dispatched:
  _, x, aux = _model(cfg)
  return moe_core.dispatch(x, aux.expert_ids, cfg.num_experts, _kept(cfg, aux))


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
      kept=_kept(cfg, aux),
  )


def _good_combine(cfg):
  _, _, aux = _model(cfg)
  return dict(
      expert_out=_expert_out(cfg),
      dispatched=_dispatched(cfg),
      combine_weights=aux.combine_weights,
      kept=_kept(cfg, aux),
  )


def _good_gemm(cfg):
  del cfg  # The GEMM takes no config.
  rng = np.random.default_rng(1702)
  groups = len(_GEMM_GROUP_SIZES)
  return dict(
      rows=_normal(rng, (_GEMM_M, _GEMM_C)),
      weights=_normal(rng, (groups, _GEMM_C, _GEMM_N), _GEMM_C**-0.5),
      group_sizes=jnp.asarray(_GEMM_GROUP_SIZES, jnp.int32),
      transpose_rhs=False,
      out_dtype=None,
  )


def _good_expert_ffn(cfg):
  params, _, _ = _model(cfg)
  rng = np.random.default_rng(1703)
  return dict(
      rows=_normal(rng, (_T * _K, cfg.hidden_size)),
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


def _set(**values):
  """Replaces arguments by the given values."""

  def corrupt(kw):
    return {**kw, **values}

  return corrupt


def _map(name, change):
  """Replaces argument `name` by change(its value)."""

  def corrupt(kw):
    return {**kw, name: change(kw[name])}

  return corrupt


def _map_param(name, change):
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


def _map_aux(**changes):
  """Replaces aux fields by change(field)."""

  def corrupt(kw):
    aux = kw["aux"]
    return {
        **kw,
        "aux": dataclasses.replace(
            aux, **{f: c(getattr(aux, f)) for f, c in changes.items()}
        ),
    }

  return corrupt


def _zeros(shape, dtype=jnp.float32):
  return lambda _: jnp.zeros(shape, dtype)


def _astype(dtype):
  return lambda a: a.astype(dtype)


def _nan_in_chosen_expert(kw):
  """A NaN in the gate weights of token 0's first expert."""
  expert = int(kw["aux"].expert_ids[0, 0])
  return _map_param("w_gate", lambda w: w.at[expert, 0, 0].set(jnp.nan))(kw)


# --- What a bad call must give ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Raises:
  """A static problem: `error`, its message matching `pattern` (naming the
  argument and the value given), eagerly and under jit (at trace time)."""

  error: type[Exception]
  pattern: str


# check(test, got, bad, good): `got` is the result of the bad call, `bad`
# its arguments, `good()` the result of the same function on the valid
# arguments the bad ones were made from.
Check = Callable[["BadInputSuite", Any, dict, Callable[[], Any]], None]


@dataclasses.dataclass(frozen=True)
class NanAndCount:
  """A value problem: under jit, NaN where it touches and the counts, as
  `check` asserts. Eagerly, a ValueError matching `eager_error` (the values
  are known there), which `moe_core.checked` raises under jit too; or, when
  `eager_error` is None (non-finite data, which is no error), the same
  result as under jit."""

  check: Check
  eager_error: str | None = None


def raises(error: type[Exception], pattern: str) -> Raises:
  return Raises(error, pattern)


def nan_and_count(check: Check, eager_error: str | None = None) -> NanAndCount:
  return NanAndCount(check, eager_error)


@dataclasses.dataclass(frozen=True)
class Row:
  """One bad input.

  Attributes:
    name: the test name suffix.
    entry: a key of ENTRIES.
    corrupt: the valid keyword arguments (ENTRIES[entry].good(cfg)) -> bad.
    outcome: `raises(...)` or `nan_and_count(...)`.
    cfg: the config the valid arguments are built for.
    setting: valid arguments -> the valid arguments of this row (e.g. a rate
      given as an array), to which a value row's bad call is compared.
  """

  name: str
  entry: str
  corrupt: Callable[[dict], dict]
  outcome: Raises | NanAndCount
  cfg: moe_core.MoEConfig = _CFG
  setting: Callable[[dict], dict] = lambda kw: kw

  def good_kwargs(self) -> dict:
    return self.setting(ENTRIES[self.entry].good(self.cfg))

  def bad_kwargs(self) -> dict:
    return self.corrupt(self.good_kwargs())


def _numpy(x) -> np.ndarray:
  return np.asarray(x)


def _output(got):
  """The array a row's NaN checks look at: y of (y, aux), out of (out,
  grads), the result itself otherwise."""
  return got[0] if isinstance(got, tuple) else got


def _assert_close(test, got, want, msg):
  """chex.assert_trees_all_close within the float32 forward tolerance."""
  tol = test.tolerance("float32")
  want_np = jax.tree_util.tree_map(_numpy, want)
  scale = max(
      [float(np.abs(w).max(initial=0.0)) for w in jax.tree.leaves(want_np)]
  )
  try:
    chex.assert_trees_all_close(
        got, want_np, atol=tol.atol * scale, rtol=tol.rtol
    )
  except AssertionError as e:
    test.fail(f"{test.BACKEND}: {msg}: {e}")


def _nan_rows(which: Callable[[dict], np.ndarray]) -> Check:
  """The rows `which(bad)` marks are all NaN; every other row is finite and
  equals that of the valid call."""

  def check(test, got, bad, good):
    y, mask = _numpy(_output(got)), which(bad)
    test.assertTrue(mask.any(), "the row marks no bad row")
    test.assertTrue(
        np.isnan(y[mask]).all(), f"rows {np.flatnonzero(mask)} not all NaN"
    )
    test.assertTrue(
        np.isfinite(y[~mask]).all(), "a row the bad value does not touch"
    )
    _assert_close(test, y[~mask], _numpy(_output(good()))[~mask], "untouched")

  return check


def _non_finite_rows(which: Callable[[dict], np.ndarray]) -> Check:
  """Every row `which(bad)` marks holds a non-finite value (R7: bad data
  never gives a finite output for what it touches). The other rows are left
  alone: a dense oracle multiplies NaN weights by zero for every token."""

  def check(test, got, bad, good):
    del good
    y, mask = _numpy(_output(got)), which(bad)
    test.assertTrue(mask.any(), "the row marks no bad row")
    finite = np.isfinite(y[mask]).all(axis=-1)
    test.assertFalse(
        finite.any(),
        f"rows {np.flatnonzero(mask)[finite]} are finite, touched by NaN",
    )

  return check


def _all_nan(test, got, bad, good):
  """The whole output is NaN; with gradients, they hold NaN too."""
  del bad, good
  out = _numpy(_output(got))
  test.assertTrue(np.isnan(out).all(), "output not all NaN")
  if isinstance(got, tuple):  # (out, grads w.r.t. rows and weights)
    for path, grad in jax.tree_util.tree_leaves_with_path(got[1]):
      test.assertTrue(
          np.isnan(_numpy(grad)).any(),
          f"gradient {jax.tree_util.keystr(path)} has no NaN",
      )


def _both(*checks: Check) -> Check:
  def check(test, got, bad, good):
    for each in checks:
      each(test, got, bad, good)

  return check


def _tokens_with_bad_ids(bad) -> np.ndarray:
  aux, cfg = bad["aux"], bad["cfg"]
  ids = _numpy(aux.expert_ids)
  return ((ids < 0) | (ids >= cfg.num_experts)).any(axis=1)


def _tokens_with_nan_x(bad) -> np.ndarray:
  return ~np.isfinite(_numpy(bad["x"])).all(axis=1)


def _tokens_with_nan_weight(bad) -> np.ndarray:
  return np.isnan(_numpy(bad["combine_weights"])).any(axis=1)


def _nan_bias_entries(bad) -> np.ndarray:
  return np.isnan(_numpy(bad["correction_bias"]))


def _tokens_of_nan_expert(bad) -> np.ndarray:
  """Tokens with a kept assignment to an expert whose weights hold NaN."""
  aux, cfg = bad["aux"], bad["cfg"]
  poisoned = np.zeros(cfg.num_experts, bool)
  for name in ("w_gate", "w_up", "w_down"):
    poisoned |= np.isnan(_numpy(bad["params"][name])).any(axis=(1, 2))
  return (poisoned[_numpy(aux.expert_ids)] & _numpy(aux.kept)).any(axis=1)


def _invalid_tokens(x, router, correction_bias) -> np.ndarray:
  """R1: [T] bool, the tokens whose selection scores are not all finite,
  from the float64 logits (NaN/Inf in x's row or anywhere in the router or
  the correction bias)."""
  with np.errstate(invalid="ignore", over="ignore"):
    logits = oracles.f64(x) @ oracles.f64(router)
  invalid = ~np.isfinite(logits).all(axis=1)
  if correction_bias is not None and not np.isfinite(correction_bias).all():
    invalid[:] = True
  return invalid


def _assert_routing_accounts(test, aux, invalid, cfg, good_aux):
  """The aux of a routing where the tokens `invalid` marks are invalid.

  R1: their K assignments are invalid (combine weights NaN, not kept,
  counted in invalid_assignments, not in tokens_per_expert); every
  assignment is kept, dropped or invalid; the valid tokens are routed as in
  the valid call (capacity: kept as GShard's order would keep them with the
  invalid tokens left out).
  """
  aux = jax.tree_util.tree_map(_numpy, aux)
  t, k = aux.expert_ids.shape
  valid = ~invalid
  test.assertEqual(int(aux.invalid_assignments), k * int(invalid.sum()))
  test.assertTrue(np.isnan(aux.combine_weights[invalid]).all())
  test.assertFalse(aux.kept[invalid].any(), "an invalid assignment is kept")
  test.assertEqual(
      int(aux.kept.sum())
      + int(aux.dropped_tokens)
      + int(aux.invalid_assignments),
      t * k,
      "kept + dropped + invalid != T*K",
  )
  np.testing.assert_array_equal(
      aux.tokens_per_expert,
      np.bincount(aux.expert_ids[valid].ravel(), minlength=cfg.num_experts),
      "tokens_per_expert must count the valid assignments only",
  )
  if not valid.any():
    return
  good_aux = jax.tree_util.tree_map(_numpy, good_aux)
  np.testing.assert_array_equal(
      aux.expert_ids[valid], good_aux.expert_ids[valid]
  )
  if cfg.dropless:
    _assert_close(
        test,
        aux.combine_weights[valid],
        good_aux.combine_weights[valid],
        "combine_weights of the valid tokens",
    )
  else:  # Invalid tokens take no slot: the valid ones fill them in order.
    capacity = cfg.expert_capacity(t)
    np.testing.assert_array_equal(
        aux.kept[valid],
        oracles.gshard_keep(aux.expert_ids[valid], cfg.num_experts, capacity),
        "kept of the valid tokens",
    )


def _route_invalid(test, got, bad, good):
  invalid = _invalid_tokens(bad["x"], bad["router"], bad["correction_bias"])
  test.assertTrue(invalid.any(), "the row makes no token invalid")
  _assert_routing_accounts(test, got, invalid, bad["cfg"], good())


def _layer_invalid(test, got, bad, good):
  params = bad["params"]
  invalid = _invalid_tokens(
      bad["x"], params["router"], params.get("correction_bias")
  )
  _assert_routing_accounts(test, got[1], invalid, bad["cfg"], good()[1])


def _dispatch_arguments(bad):
  """(x, expert_ids, num_experts, kept) of moe_core.dispatch or of
  Backend.dispatch(x, aux, cfg)."""
  if "aux" in bad:
    cfg, aux = bad["cfg"], bad["aux"]
    return bad["x"], aux.expert_ids, cfg.num_experts, _kept(cfg, aux)
  return bad["x"], bad["expert_ids"], bad["num_experts"], bad["kept"]


def _dispatch_invalid(test, got, bad, good):
  """R2: copies with ids outside [0, E) are marked invalid, sorted past
  every group and every dropped copy, NaN and left out of group_sizes; every
  other copy lands in its expert's group (or among the dropped) with its
  token's row."""
  del good
  x, ids, num_experts, kept = _dispatch_arguments(bad)
  x, ids = _numpy(x), _numpy(ids)
  t, k = ids.shape
  flat = ids.ravel()
  invalid = (flat < 0) | (flat >= num_experts)
  test.assertTrue(invalid.any(), "the row makes no copy invalid")
  kept = np.ones(t * k, bool) if kept is None else _numpy(kept).ravel()
  live = kept & ~invalid
  dropped = ~kept & ~invalid
  got = jax.tree_util.tree_map(_numpy, got)
  np.testing.assert_array_equal(got.invalid, invalid, "Dispatched.invalid")
  sizes = got.group_sizes
  np.testing.assert_array_equal(
      sizes, np.bincount(flat[live], minlength=num_experts), "group_sizes"
  )
  position, rows = got.position, got.rows
  first_invalid = t * k - int(invalid.sum())
  test.assertTrue((position[invalid] >= first_invalid).all())
  test.assertTrue(np.isnan(rows[position[invalid]]).all(), "invalid rows")
  in_dropped = (position[dropped] >= sizes.sum()) & (
      position[dropped] < first_invalid
  )
  test.assertTrue(in_dropped.all(), "dropped copies between groups and invalid")
  ends = np.cumsum(sizes)
  starts = ends - sizes
  where, expert = position[live], flat[live]
  test.assertTrue(
      ((where >= starts[expert]) & (where < ends[expert])).all(),
      "a valid copy outside its expert's group",
  )
  _assert_close(
      test, rows[where], x[np.flatnonzero(live) // k], "valid copies' rows"
  )


_IDS_8_AND_MINUS_3 = lambda ids: ids.at[1, 0].set(8).at[6, 1].set(-3)
_IDS_RANGE_ERROR = (
    r"expert_ids must lie in \[0, num_experts=8\), got values in \[-3, 8\]"
)


# --- The table ----------------------------------------------------------------

TABLE = (
    # route(x [T, D], router [D, E], cfg, correction_bias [E] or None).
    Row(
        "route_x_rank3",
        "route",
        _map("x", lambda x: x.reshape(2, 5, _D)),
        raises(ValueError, r"x\.shape=\(2, 5, 16\)"),
    ),
    Row(
        "route_x_int",
        "route",
        _map("x", _astype(jnp.int32)),
        raises(TypeError, r"\bx\b.*int32"),
    ),
    Row(
        "route_x_str",
        "route",
        _set(x="tokens"),
        raises(TypeError, r"\bx\b.*str"),
    ),
    Row(
        "route_router_wrong_shape",
        "route",
        _map("router", _zeros((_D, 7))),
        raises(ValueError, r"router.*\(16, 7\)"),
    ),
    Row(
        "route_router_bool",
        "route",
        _map("router", _astype(jnp.bool_)),
        raises(TypeError, r"router.*bool"),
    ),
    Row(
        "route_correction_bias_missing",
        "route",
        _set(correction_bias=None),
        raises(ValueError, r"correction_bias.*None"),
        cfg=_BIAS_CFG,
    ),
    Row(
        "route_correction_bias_unused",
        "route",
        _set(correction_bias=jnp.zeros((_E,), jnp.float32)),
        raises(ValueError, r"cfg\.correction_bias=False"),
    ),
    Row(
        "route_correction_bias_wrong_shape",
        "route",
        _map("correction_bias", lambda b: b[:1]),
        raises(ValueError, r"correction_bias.*\(1,\)"),
        cfg=_BIAS_CFG,
    ),
    Row(
        "route_cfg_not_a_config",
        "route",
        _set(cfg={"num_experts": _E}),
        raises(TypeError, r"cfg.*dict"),
    ),
    Row(
        "route_x_nan_token",
        "route",
        _map("x", lambda x: x.at[3].set(jnp.nan)),
        nan_and_count(_route_invalid),
    ),
    Row(
        "route_x_inf_entry",
        "route",
        _map("x", lambda x: x.at[6, 2].set(jnp.inf)),
        nan_and_count(_route_invalid),
    ),
    Row(
        "route_router_nan",
        "route",
        _map("router", lambda r: r.at[5, 2].set(jnp.nan)),
        nan_and_count(_route_invalid),
    ),
    # Today: finite output, every token sent to the same experts.
    Row(
        "route_correction_bias_nan",
        "route",
        _map("correction_bias", lambda b: b.at[2].set(jnp.nan)),
        nan_and_count(_route_invalid),
        cfg=_BIAS_CFG,
    ),
    Row(
        "route_x_nan_token_with_capacity",
        "route",
        _map("x", lambda x: x.at[3].set(jnp.nan)),
        nan_and_count(_route_invalid),
        cfg=_CAPACITY_CFG,
    ),
    # dispatch(x [T, D], expert_ids [T, K], num_experts, kept [T, K] or None).
    # Today, under jit: sum(group_sizes) is 19 of 20.
    Row(
        "dispatch_expert_ids_out_of_range",
        "dispatch",
        _map("expert_ids", _IDS_8_AND_MINUS_3),
        nan_and_count(_dispatch_invalid, _IDS_RANGE_ERROR),
    ),
    Row(
        "dispatch_expert_ids_out_of_range_with_drops",
        "dispatch",
        _map("expert_ids", _IDS_8_AND_MINUS_3),
        nan_and_count(_dispatch_invalid, _IDS_RANGE_ERROR),
        cfg=_CAPACITY_CFG,
    ),
    Row(
        "dispatch_expert_ids_float",
        "dispatch",
        _map("expert_ids", _astype(jnp.float32)),
        raises(TypeError, r"expert_ids.*float32"),
    ),
    Row(
        "dispatch_expert_ids_rank1",
        "dispatch",
        _map("expert_ids", lambda ids: ids.reshape(-1)),
        raises(ValueError, r"expert_ids.*\(20,\)"),
    ),
    Row(
        "dispatch_expert_ids_of_other_tokens",
        "dispatch",
        _map("expert_ids", lambda ids: ids[:9]),
        raises(ValueError, r"expert_ids\.shape=\(9, 2\)"),
    ),
    Row(
        "dispatch_x_int",
        "dispatch",
        _map("x", _astype(jnp.int32)),
        raises(TypeError, r"\bx\b.*int32"),
    ),
    Row(
        "dispatch_num_experts_bool",
        "dispatch",
        _set(num_experts=True),
        raises(ValueError, r"num_experts must .*got True"),
    ),
    Row(
        "dispatch_num_experts_float",
        "dispatch",
        _set(num_experts=8.0),
        raises(ValueError, r"num_experts.*8\.0"),
    ),
    Row(
        "dispatch_kept_int",
        "dispatch",
        _map("kept", _astype(jnp.int32)),
        raises(TypeError, r"kept.*int32"),
        cfg=_CAPACITY_CFG,
    ),
    Row(
        "dispatch_kept_wrong_shape",
        "dispatch",
        _map("kept", lambda kept: kept[:, :1]),
        raises(ValueError, r"kept.*10, 1"),
        cfg=_CAPACITY_CFG,
    ),
    # Backend.dispatch(x, aux, cfg).
    Row(
        "backend_dispatch_expert_ids_out_of_range",
        "backend.dispatch",
        _map_aux(expert_ids=_IDS_8_AND_MINUS_3),
        nan_and_count(_dispatch_invalid, _IDS_RANGE_ERROR),
    ),
    Row(
        "backend_dispatch_aux_not_an_aux",
        "backend.dispatch",
        _map("aux", lambda aux: dict(expert_ids=aux.expert_ids)),
        raises(TypeError, r"aux.*dict"),
    ),
    # combine(expert_out [M, D], dispatched, combine_weights [T, K], kept).
    # Today: no error, an output of shape (2, 16).
    Row(
        "combine_weights_transposed",
        "combine",
        _map("combine_weights", lambda w: w.T),
        raises(ValueError, r"combine_weights.*\(2, 10\)"),
    ),
    Row(
        "combine_expert_out_of_other_rows",
        "combine",
        _map("expert_out", lambda out: out[:19]),
        raises(ValueError, r"expert_out\.shape=\(19, 16\)"),
    ),
    Row(
        "combine_weights_wrong_shape",
        "combine",
        _map("combine_weights", _zeros((_T, 3))),
        raises(ValueError, r"combine_weights\.shape=\(10, 3\)"),
    ),
    Row(
        "combine_expert_out_int",
        "combine",
        _map("expert_out", _astype(jnp.int32)),
        raises(TypeError, r"expert_out.*int32"),
    ),
    Row(
        "combine_weights_bool",
        "combine",
        _map("combine_weights", _astype(jnp.bool_)),
        raises(TypeError, r"combine_weights.*bool"),
    ),
    Row(
        "combine_dispatched_not_dispatched",
        "combine",
        _map("dispatched", lambda d: (d.rows, d.group_sizes)),
        raises(TypeError, r"dispatched.*tuple"),
    ),
    Row(
        "combine_weight_nan",
        "combine",
        _map("combine_weights", lambda w: w.at[4, 1].set(jnp.nan)),
        nan_and_count(_nan_rows(_tokens_with_nan_weight)),
    ),
    # Backend.combine(expert_out, dispatched, aux, cfg).
    Row(
        "backend_combine_weights_transposed",
        "backend.combine",
        _map_aux(combine_weights=lambda w: w.T),
        raises(ValueError, r"combine_weights.*\(2, 10\)"),
    ),
    # Backend.grouped_gemm(rows [M, C], weights [G, C, N], group_sizes [G]).
    Row(
        "gemm_rows_rank3",
        "grouped_gemm",
        _map("rows", lambda r: r[None]),
        raises(ValueError, r"rows.*\(1, 28, 16\)"),
    ),
    Row(
        "gemm_rows_int",
        "grouped_gemm",
        _map("rows", _astype(jnp.int32)),
        raises(TypeError, r"rows.*int32"),
    ),
    Row(
        "gemm_rows_bool_scalar",
        "grouped_gemm",
        _set(rows=True),
        raises(TypeError, r"rows.*bool"),
    ),
    Row(
        "gemm_weights_rank2",
        "grouped_gemm",
        _map("weights", lambda w: w[0]),
        raises(ValueError, r"weights.*\(16, 8\)"),
    ),
    Row(
        "gemm_weights_wrong_contraction",
        "grouped_gemm",
        _map("weights", _zeros((4, 15, _GEMM_N))),
        raises(ValueError, r"weights.*\(4, 15, 8\)"),
    ),
    Row(
        "gemm_weights_not_transposed",
        "grouped_gemm",
        _set(transpose_rhs=True),
        raises(ValueError, r"weights.*\(4, 16, 8\)"),
    ),
    Row(
        "gemm_weights_bfloat16",
        "grouped_gemm",
        _map("weights", _astype(jnp.bfloat16)),
        raises(TypeError, r"weights.*bfloat16"),
    ),
    Row(
        "gemm_group_sizes_float",
        "grouped_gemm",
        _map("group_sizes", _astype(jnp.float32)),
        raises(TypeError, r"group_sizes.*float32"),
    ),
    Row(
        "gemm_group_sizes_wrong_length",
        "grouped_gemm",
        _map("group_sizes", lambda g: g[:3]),
        raises(ValueError, r"group_sizes.*\(3,\)"),
    ),
    Row(
        "gemm_group_sizes_list",
        "grouped_gemm",
        _set(group_sizes=list(_GEMM_GROUP_SIZES)),
        raises(TypeError, r"group_sizes.*list"),
    ),
    Row(
        "gemm_out_dtype_int",
        "grouped_gemm",
        _set(out_dtype=jnp.int32),
        raises(TypeError, r"out_dtype.*int32"),
    ),
    Row(
        "gemm_out_dtype_not_a_dtype",
        "grouped_gemm",
        _set(out_dtype="fast"),
        raises(TypeError, r"out_dtype.*fast"),
    ),
    # Today, under jit: the backends disagree.
    Row(
        "gemm_group_sizes_negative",
        "grouped_gemm_vjp",
        _set(group_sizes=jnp.asarray([-4, 10, 10, 8], jnp.int32)),
        nan_and_count(
            _all_nan, r"group_sizes must be >= 0, got \[-4, 10, 10, 8\]"
        ),
    ),
    Row(
        "gemm_group_sizes_past_the_rows",
        "grouped_gemm_vjp",
        _set(group_sizes=jnp.asarray([4, 10, 10, 8], jnp.int32)),
        nan_and_count(
            _all_nan, r"sum\(group_sizes\) must be <= the 28 rows, got sum=32"
        ),
    ),
    # Backend.expert_ffn(rows [M, D], group_sizes [E], params, cfg).
    # Today: pallas gives a finite result.
    Row(
        "ffn_w_up_narrower_than_w_gate",
        "expert_ffn",
        _map_param("w_up", _zeros((_E, _D, 4))),
        raises(ValueError, r"w_up.*\(8, 16, 4\)"),
    ),
    Row(
        "ffn_w_down_mismatched",
        "expert_ffn",
        _map_param("w_down", _zeros((_E, 4, _D))),
        raises(ValueError, r"w_down.*\(8, 4, 16\)"),
    ),
    Row(
        "ffn_w_down_missing",
        "expert_ffn",
        _map_param("w_down", lambda w: None),
        raises(ValueError, r"w_down"),
    ),
    Row(
        "ffn_w_gate_int",
        "expert_ffn",
        _map_param("w_gate", _astype(jnp.int32)),
        raises(TypeError, r"w_gate.*int32"),
    ),
    Row(
        "ffn_rows_wrong_width",
        "expert_ffn",
        _map("rows", _zeros((_T * _K, 12))),
        raises(ValueError, r"rows\.shape=\(20, 12\)"),
    ),
    Row(
        "ffn_rows_int",
        "expert_ffn",
        _map("rows", _astype(jnp.int32)),
        raises(TypeError, r"rows.*int32"),
    ),
    Row(
        "ffn_params_not_a_dict",
        "expert_ffn",
        _map("params", lambda p: tuple(p.values())),
        raises(TypeError, r"params.*tuple"),
    ),
    Row(
        "ffn_cfg_not_a_config",
        "expert_ffn",
        _set(cfg="cfg"),
        raises(TypeError, r"cfg.*str"),
    ),
    Row(
        "ffn_group_sizes_negative",
        "expert_ffn_vjp",
        _set(group_sizes=jnp.asarray([-4, 6, 2, 4, 0, 5, 2, 3], jnp.int32)),
        nan_and_count(
            _all_nan,
            r"group_sizes must be >= 0, got \[-4, 6, 2, 4, 0, 5, 2, 3\]",
        ),
    ),
    Row(
        "ffn_group_sizes_past_the_rows",
        "expert_ffn_vjp",
        _set(group_sizes=jnp.asarray([4, 3, 1, 4, 0, 5, 2, 3], jnp.int32)),
        nan_and_count(
            _all_nan, r"sum\(group_sizes\) must be <= the 20 rows, got sum=22"
        ),
    ),
    # Backend.routed_experts(params, x [T, D], aux, cfg).
    # Today, under jit: token 3's output is 0.
    Row(
        "routed_experts_expert_ids_out_of_range",
        "routed_experts",
        _map_aux(expert_ids=lambda ids: ids.at[3].set(99)),
        nan_and_count(
            _nan_rows(_tokens_with_bad_ids),
            r"expert_ids must lie in \[0, num_experts=8\), got values in "
            r"\[\d+, 99\]",
        ),
    ),
    Row(
        "routed_experts_routing_of_other_tokens",
        "routed_experts",
        _map("x", lambda x: x[:9]),
        raises(ValueError, r"expert_ids.*\(10, 2\)"),
    ),
    Row(
        "routed_experts_w_up_missing",
        "routed_experts",
        _map_param("w_up", lambda w: None),
        raises(ValueError, r"w_up"),
    ),
    Row(
        "routed_experts_w_down_mismatched",
        "routed_experts",
        _map_param("w_down", _zeros((_E, _D, _D))),
        raises(ValueError, r"w_down.*\(8, 16, 16\)"),
    ),
    Row(
        "routed_experts_aux_not_an_aux",
        "routed_experts",
        _map("aux", lambda aux: dict(expert_ids=aux.expert_ids)),
        raises(TypeError, r"aux.*dict"),
    ),
    Row(
        "routed_experts_expert_ids_float",
        "routed_experts",
        _map_aux(expert_ids=_astype(jnp.float32)),
        raises(TypeError, r"expert_ids.*float32"),
    ),
    Row(
        "routed_experts_x_int",
        "routed_experts",
        _map("x", _astype(jnp.int32)),
        raises(TypeError, r"\bx\b.*int32"),
    ),
    Row(
        "routed_experts_x_nan_token",
        "routed_experts",
        _map("x", lambda x: x.at[3].set(jnp.nan)),
        nan_and_count(_nan_rows(_tokens_with_nan_x)),
    ),
    Row(
        "routed_experts_w_gate_nan",
        "routed_experts",
        _nan_in_chosen_expert,
        nan_and_count(_non_finite_rows(_tokens_of_nan_expert)),
    ),
    # moe_layer(params, x, cfg, backend).
    Row(
        "layer_x_nan_token",
        "moe_layer",
        _map("x", lambda x: x.at[3].set(jnp.nan)),
        nan_and_count(_both(_nan_rows(_tokens_with_nan_x), _layer_invalid)),
    ),
    Row(
        "layer_router_nan",
        "moe_layer",
        _map_param("router", lambda r: r.at[5, 2].set(jnp.nan)),
        nan_and_count(
            _both(
                _non_finite_rows(lambda bad: np.ones(_T, bool)), _layer_invalid
            )
        ),
    ),
    Row(
        "layer_extra_parameter",
        "moe_layer",
        _map_param("shared_gate", _zeros((_D, 1))),
        raises(ValueError, r"shared_gate"),
    ),
    Row(
        "layer_cfg_not_a_config",
        "moe_layer",
        _set(cfg=None),
        raises(TypeError, r"cfg.*None"),
    ),
    # update_correction_bias(correction_bias [E], tokens_per_expert [E], rate).
    # Today: accepted.
    Row(
        "update_bias_rate_nan",
        "update_correction_bias",
        _set(rate=math.nan),
        raises(ValueError, r"rate.*nan"),
    ),
    Row(
        "update_bias_rate_inf",
        "update_correction_bias",
        _set(rate=math.inf),
        raises(ValueError, r"rate.*inf"),
    ),
    Row(
        "update_bias_rate_negative",
        "update_correction_bias",
        _set(rate=-1e-3),
        raises(ValueError, r"rate.*-0\.001"),
    ),
    Row(
        "update_bias_rate_array_nan",
        "update_correction_bias",
        _set(rate=jnp.asarray(jnp.nan, jnp.float32)),
        nan_and_count(_all_nan, r"rate.*nan"),
        setting=_set(rate=jnp.asarray(1e-3, jnp.float32)),
    ),
    Row(
        "update_bias_tokens_per_expert_negative",
        "update_correction_bias",
        _map("tokens_per_expert", lambda n: n.at[2].set(-1)),
        nan_and_count(_all_nan, r"tokens_per_expert.*-1"),
    ),
    Row(
        "update_bias_tokens_per_expert_nan",
        "update_correction_bias",
        _map(
            "tokens_per_expert",
            lambda n: n.astype(jnp.float32).at[2].set(jnp.nan),
        ),
        nan_and_count(_all_nan, r"tokens_per_expert.*nan"),
    ),
    Row(
        "update_bias_correction_bias_nan",
        "update_correction_bias",
        _map("correction_bias", lambda b: b.at[1].set(jnp.nan)),
        nan_and_count(_nan_rows(_nan_bias_entries)),
    ),
    Row(
        "update_bias_correction_bias_rank2",
        "update_correction_bias",
        _map("correction_bias", lambda b: b[None]),
        raises(ValueError, r"correction_bias.*\(1, 8\)"),
    ),
    Row(
        "update_bias_tokens_per_expert_wrong_length",
        "update_correction_bias",
        _map("tokens_per_expert", lambda n: n[:7]),
        raises(ValueError, r"tokens_per_expert.*\(7,\)"),
    ),
    Row(
        "update_bias_correction_bias_int",
        "update_correction_bias",
        _map("correction_bias", _astype(jnp.int32)),
        raises(TypeError, r"correction_bias.*int32"),
    ),
    Row(
        "update_bias_correction_bias_str",
        "update_correction_bias",
        _set(correction_bias="bias"),
        raises(TypeError, r"correction_bias.*str"),
    ),
    # init_params(key, cfg, dtype).
    Row(
        "init_params_key_int",
        "init_params",
        _set(key=0),
        raises(TypeError, r"key.*int"),
    ),
    Row(
        "init_params_key_float",
        "init_params",
        _set(key=jnp.zeros((2,), jnp.float32)),
        raises(TypeError, r"key.*float32"),
    ),
    Row(
        "init_params_key_str",
        "init_params",
        _set(key="seed"),
        raises(TypeError, r"key.*str"),
    ),
    Row(
        "init_params_key_batch",
        "init_params",
        _map("key", lambda key: jax.random.split(key, 3)),
        raises(ValueError, r"key.*\(3,\)"),
    ),
    Row(
        "init_params_cfg_not_a_config",
        "init_params",
        _set(cfg={"num_experts": _E}),
        raises(TypeError, r"cfg.*dict"),
    ),
    Row(
        "init_params_dtype_int",
        "init_params",
        _set(dtype=jnp.int32),
        raises(TypeError, r"dtype.*int32"),
    ),
    # param_shapes(cfg).
    Row(
        "param_shapes_cfg_dict",
        "param_shapes",
        _set(cfg={"num_experts": _E}),
        raises(TypeError, r"cfg.*dict"),
    ),
    Row(
        "param_shapes_cfg_none",
        "param_shapes",
        _set(cfg=None),
        raises(TypeError, r"cfg.*None"),
    ),
    # MoEConfig(**fields).
    Row(
        "config_num_experts_negative",
        "MoEConfig",
        _set(num_experts=-8),
        raises(ValueError, r"num_experts.*-8"),
    ),
    Row(
        "config_top_k_zero",
        "MoEConfig",
        _set(top_k=0),
        raises(ValueError, r"top_k.*got 0"),
    ),
    Row(
        "config_hidden_size_bool",
        "MoEConfig",
        _set(hidden_size=True),
        raises(ValueError, r"hidden_size.*True"),
    ),
    Row(
        "config_expert_ffn_size_float",
        "MoEConfig",
        _set(expert_ffn_size=8.0),
        raises(ValueError, r"expert_ffn_size.*8\.0"),
    ),
    Row(
        "config_shared_ffn_size_negative",
        "MoEConfig",
        _set(shared_ffn_size=-1),
        raises(ValueError, r"shared_ffn_size.*-1"),
    ),
    Row(
        "config_top_k_above_num_experts",
        "MoEConfig",
        _set(top_k=9),
        raises(ValueError, r"top_k=9"),
    ),
    Row(
        "config_norm_epsilon_nan",
        "MoEConfig",
        _set(norm_epsilon=math.nan),
        raises(ValueError, r"norm_epsilon.*nan"),
    ),
    Row(
        "config_norm_epsilon_inf",
        "MoEConfig",
        _set(norm_epsilon=math.inf),
        raises(ValueError, r"norm_epsilon.*inf"),
    ),
    Row(
        "config_routed_scaling_factor_nan",
        "MoEConfig",
        _set(routed_scaling_factor=math.nan),
        raises(ValueError, r"routed_scaling_factor.*nan"),
    ),
    Row(
        "config_capacity_factor_inf",
        "MoEConfig",
        _set(capacity_factor=math.inf),
        raises(ValueError, r"capacity_factor.*inf"),
    ),
    Row(
        "config_capacity_factor_bool",
        "MoEConfig",
        _set(capacity_factor=True),
        raises(ValueError, r"capacity_factor.*True"),
    ),
    Row(
        "config_score_func_unknown",
        "MoEConfig",
        _set(score_func="relu"),
        raises(ValueError, r"score_func.*relu"),
    ),
    Row(
        "config_unknown_field",
        "MoEConfig",
        _set(num_expert=_E),
        raises(TypeError, r"\bnum_expert\b"),
    ),
)

# The entry points without gradients: the checks run in the forward pass.
_FORWARD = {"grouped_gemm_vjp": "grouped_gemm", "expert_ffn_vjp": "expert_ffn"}

# Value rows that raise when the values are known: moe_core.checked raises
# the same error under jit (on the forward entry point, one compile less).
_CHECKED_ROWS = tuple(
    dataclasses.replace(row, entry=_FORWARD.get(row.entry, row.entry))
    for row in TABLE
    if isinstance(row.outcome, NanAndCount) and row.outcome.eager_error
)


def _named(rows) -> list[tuple[str, Row]]:
  return [(row.name, row) for row in rows]


# --- Running a row ------------------------------------------------------------


def _is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray))


def _split(kwargs: dict):
  """(arrays, static, rebuild): the array leaves of kwargs, the others (with
  the tree structure), and rebuild(arrays) -> kwargs.

  Under jit the arrays are traced; everything else (configs, Python numbers,
  strings, dtypes) is closed over, as a caller's Python values would be.
  """
  leaves, treedef = jax.tree_util.tree_flatten(kwargs)
  traced_at = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
  static = (
      treedef,
      [l for i, l in enumerate(leaves) if i not in traced_at],
  )

  def rebuild(arrays):
    full = list(leaves)
    for i, array in zip(traced_at, arrays):
      full[i] = array
    return jax.tree_util.tree_unflatten(treedef, full)

  return [leaves[i] for i in traced_at], static, rebuild


def _arrays_only(result):
  """result with its non-array leaves (a config, shape tuples) as None, so
  that a jitted function may return it."""
  return jax.tree_util.tree_map(
      lambda leaf: leaf if _is_array(leaf) else None, result
  )


def _function(backend, row: Row, kwargs: dict):
  """(f, arrays, static): f(arrays) calls the row's entry point on kwargs."""
  arrays, static, rebuild = _split(kwargs)
  call = ENTRIES[row.entry].call

  def run(arrays):
    return _arrays_only(call(backend, rebuild(arrays)))

  return run, arrays, static


def _raised(fn, *args) -> Exception | None:
  try:
    fn(*args)
  except Exception as e:  # pylint: disable=broad-exception-caught
    return e
  return None


class BadInputSuite(base.BackendTestCase):
  """Every row of TABLE, eagerly and under jit, on this backend.

  A static problem raises the same error both ways, with the reference's
  type and message; a value problem raises eagerly and, under jit, gives
  NaN where it touches and counts it (moe_core.checked raises it there).
  """

  def _assert_raises(self, row: Row, error_type, pattern, error):
    if error is None:
      self.fail(
          f"{self.BACKEND}: {row.name}: no error; expected "
          f"{error_type.__name__} matching {pattern!r}"
      )
    if not isinstance(error, error_type):
      self.fail(
          f"{self.BACKEND}: {row.name}: expected {error_type.__name__} "
          f"matching {pattern!r}, got {type(error).__name__}: {error}"
      )
    self.assertRegex(str(error), pattern, f"{self.BACKEND}: {row.name}")

  def _assert_reference_agrees(self, row: Row, kwargs: dict, error):
    """The reference raises the same type with the same message."""
    if not ENTRIES[row.entry].on_backend or self.is_oracle():
      return
    reference = moe_core.get_backend("reference")
    run, arrays, _ = _function(reference, row, kwargs)
    want = _raised(self.variant(run), arrays)
    self.assertIs(type(error), type(want), f"{row.name}: vs reference")
    self.assertEqual(str(error), str(want), f"{row.name}: vs reference")

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(_named(TABLE))
  def test_bad_input(self, row: Row):
    bad = row.bad_kwargs()
    run, arrays, static = _function(self.backend, row, bad)
    fn = self.variant(run)
    outcome = row.outcome
    traced = self.variant.type == chex.ChexVariantType.WITH_JIT
    if isinstance(outcome, Raises):
      error = _raised(fn, arrays)
      self._assert_raises(row, outcome.error, outcome.pattern, error)
      self._assert_reference_agrees(row, bad, error)
      return
    # The rows' arrays are float32: the NaN-and-count outcomes need a run.
    self.skip_unless_computes("float32")
    if outcome.eager_error and not traced:
      error = _raised(fn, arrays)
      self._assert_raises(row, ValueError, outcome.eager_error, error)
      self._assert_reference_agrees(row, bad, error)
      return
    good_arrays, good_static, _ = _split(row.good_kwargs())
    # The valid call reruns the same function: only array values differ.
    self.assertEqual(
        static, good_static, f"{row.name} changes more than values"
    )
    outcome.check(self, fn(arrays), bad, lambda: fn(good_arrays))

  @parameterized.named_parameters(_named(_CHECKED_ROWS))
  def test_checked_bad_input(self, row: Row):
    """moe_core.checked(jax.jit(f)) raises a ValueError stating what the
    eager one states: its text up to ", got" (the values that follow are
    formatted on the device, numpy style)."""
    self.skip_unless_computes("float32")  # The rows' arrays are float32.
    bad = row.bad_kwargs()
    run, arrays, _ = _function(self.backend, row, bad)
    eager = _raised(run, arrays)
    self._assert_raises(row, ValueError, row.outcome.eager_error, eager)
    checked = _raised(moe_core.checked(jax.jit(run)), arrays)
    if not isinstance(checked, ValueError):
      self.fail(f"{self.BACKEND}: {row.name}: checked raised {checked!r}")
    requirement = str(eager).split(", got")[0]
    self.assertIn(requirement, str(checked), f"{self.BACKEND}: {row.name}")
