"""BadInputSuite: runs every row of the bad-input table (bad_input_table)
on a backend, eagerly and under jit."""

from __future__ import annotations

import dataclasses

from absl.testing import parameterized
import chex
import jax
import numpy as np

import moe_core
from conformance import base
from conformance.bad_input_calls import ENTRIES
from conformance.bad_input_outcomes import NanAndCount, Raises, Row
from conformance.bad_input_table import TABLE
from conformance.bad_input_table import X64_TABLE

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
    self._check_row(row)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(_named(X64_TABLE))
  def test_bad_input_under_x64(self, row: Row):
    """The rows of int64 values, with jax_enable_x64 on (values past int32
    are checked before any cast to int32)."""
    with jax.enable_x64(True):
      self._check_row(row)

  def _check_row(self, row: Row):
    """The row's outcome, in the current variant (eager or jit)."""
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
