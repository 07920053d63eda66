"""What a bad call must give: `raises(...)` or `nan_and_count(check)`, the
table's `Row`, and the checks a value row runs on its result."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import chex
import jax
import numpy as np

import moe_core
from conformance import base
from conformance import oracles
from conformance.bad_input_calls import CFG, ENTRIES, kept_mask

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
Check = Callable[[base.BackendTestCase, Any, dict, Callable[[], Any]], None]


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
  cfg: moe_core.MoEConfig = CFG
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


def nan_rows(which: Callable[[dict], np.ndarray]) -> Check:
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


def non_finite_rows(which: Callable[[dict], np.ndarray]) -> Check:
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


def all_nan(test, got, bad, good):
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


def both(*checks: Check) -> Check:
  def check(test, got, bad, good):
    for each in checks:
      each(test, got, bad, good)

  return check


def tokens_with_bad_ids(bad) -> np.ndarray:
  aux, cfg = bad["aux"], bad["cfg"]
  ids = _numpy(aux.expert_ids)
  return ((ids < 0) | (ids >= cfg.num_experts)).any(axis=1)


def tokens_with_nan_x(bad) -> np.ndarray:
  return ~np.isfinite(_numpy(bad["x"])).all(axis=1)


def tokens_with_nan_weight(bad) -> np.ndarray:
  return np.isnan(_numpy(bad["combine_weights"])).any(axis=1)


def nan_bias_entries(bad) -> np.ndarray:
  return np.isnan(_numpy(bad["correction_bias"]))


def tokens_of_nan_expert(bad) -> np.ndarray:
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
      np.bincount(
          aux.expert_ids[valid].ravel(), minlength=cfg.num_router_experts
      ),
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


def route_invalid(test, got, bad, good):
  invalid = _invalid_tokens(bad["x"], bad["router"], bad["correction_bias"])
  test.assertTrue(invalid.any(), "the row makes no token invalid")
  _assert_routing_accounts(test, got, invalid, bad["cfg"], good())


def layer_invalid(test, got, bad, good):
  params = bad["params"]
  invalid = _invalid_tokens(
      bad["x"], params["router"], params.get("correction_bias")
  )
  _assert_routing_accounts(test, got[1], invalid, bad["cfg"], good()[1])


def tokens_with_bad_hash(bad) -> np.ndarray:
  """[T] bool: the tokens hash routing makes invalid, from numpy: a token
  id outside [0, V), or a table row (route's hash_table, or the layer's
  params["hash_table"]) holding an expert id outside [0, E + Z)."""
  cfg = bad["cfg"]
  table = bad["hash_table"] if "hash_table" in bad else bad["params"]
  if isinstance(table, dict):
    table = table["hash_table"]
  table = _numpy(table).astype(np.int64)
  ids = _numpy(bad["token_ids"]).astype(np.int64).ravel()
  in_vocab = (ids >= 0) & (ids < cfg.hash_vocab_size)
  rows = table[np.clip(ids, 0, cfg.hash_vocab_size - 1)]
  bad_row = ((rows < 0) | (rows >= cfg.num_router_experts)).any(axis=1)
  return ~in_vocab | bad_row


def hash_invalid(test, got, bad, good):
  """R1 for hash routing: the tokens `tokens_with_bad_hash` marks are
  invalid, counted and NaN-weighted, the others routed as in the valid
  call; route's aux, or the layer's (y, aux)."""
  invalid = tokens_with_bad_hash(bad)
  test.assertTrue(invalid.any(), "the row makes no token invalid")
  aux, good_aux = got, good
  if isinstance(got, tuple):  # moe_layer: (y, aux).
    aux, good_aux = got[1], lambda: good()[1]
  _assert_routing_accounts(test, aux, invalid, bad["cfg"], good_aux())


def _dispatch_arguments(bad):
  """(x, expert_ids, num_experts, kept) of moe_core.dispatch or of
  Backend.dispatch(x, aux, cfg)."""
  if "aux" in bad:
    cfg, aux = bad["cfg"], bad["aux"]
    return bad["x"], aux.expert_ids, cfg.num_experts, kept_mask(cfg, aux)
  return bad["x"], bad["expert_ids"], bad["num_experts"], bad["kept"]


def dispatch_invalid(test, got, bad, good):
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
