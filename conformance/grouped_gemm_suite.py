"""GroupedGemmSuite: Backend.grouped_gemm against float64 numpy, reference."""

from __future__ import annotations

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from conformance import base
from conformance import cases
from conformance import oracles


def _named(case_list):
  return parameterized.named_parameters(cases.named(case_list))


class GroupedGemmSuite(base.BackendTestCase):
  """rows [M, C] x weights [E, C, N] -> [M, N] over ragged, sorted groups.

  C is the contracted width (K is top-k elsewhere in the library).
  """

  @_named(cases.GEMM_CASES)
  def test_forward_matches_numpy_and_reference(self, case):
    rows, weights, group_sizes, _ = cases.gemm_inputs(case)
    got = self.run_gemm(case).out
    self.assertEqual(got.shape, (case.m, case.n))
    self.assertEqual(got.dtype, np.dtype(case.result_dtype))
    want = oracles.grouped_gemm(rows, weights, group_sizes, case.transpose_rhs)
    self.assertClose(got, want, case.dtype, msg="vs float64 numpy")
    if not self.is_oracle():  # The oracle's reference_gemm is itself.
      self.assertClose(
          got,
          base.reference_gemm(case).out,
          case.dtype,
          msg="vs reference backend",
      )

  @_named(cases.GEMM_GRAD_CASES)
  def test_gradients_match_numpy(self, case):
    rows, weights, group_sizes, cotangent = cases.gemm_inputs(case)
    got = self.run_gemm(case)
    want_rows, want_weights = oracles.grouped_gemm_grads(
        rows, weights, group_sizes, cotangent, case.transpose_rhs
    )
    with self.subTest("rows"):
      self.assertEqual(got.d_rows.dtype, rows.dtype)
      self.assertClose(
          got.d_rows, want_rows, case.dtype, "gradient", msg="d rows"
      )
    with self.subTest("weights"):
      self.assertEqual(got.d_weights.dtype, weights.dtype)
      self.assertClose(
          got.d_weights, want_weights, case.dtype, "gradient", msg="d weights"
      )

  @_named(cases.GEMM_PADDED_CASES)
  def test_nan_padding_rows_give_zero_output_and_gradient(self, case):
    """Rows past sum(group_sizes) hold NaN (see cases.gemm_inputs): their
    output and their gradient are exactly zero, and the weight gradient is
    finite (checked against numpy in test_gradients_match_numpy)."""
    got = self.run_gemm(case)
    used = case.used_rows
    self.assertAllZero(got.out[used:], msg="output of NaN padding rows")
    self.assertAllZero(got.d_rows[used:], msg="d rows of NaN padding rows")
    self.assertTrue(
        np.isfinite(got.d_weights.astype(np.float32)).all(),
        "NaN padding rows leaked into d weights",
    )

  @_named([c for c in cases.GEMM_CASES if 0 in c.group_sizes])
  def test_empty_groups_get_exactly_zero_weight_gradient(self, case):
    got = self.run_gemm(case)
    for g, size in enumerate(case.group_sizes):
      if size == 0:
        self.assertAllZero(
            got.d_weights[g], msg=f"d weights of empty group {g}"
        )

  def test_zero_groups_give_zero_rows_and_gradients(self):
    # No groups (weights [0, C, N], group_sizes [0]): every row is past
    # sum(group_sizes) = 0, so the contract's zeros, the same everywhere.
    dtype = jnp.dtype(self.compute_dtype())
    rows = jnp.ones((5, 3), dtype)
    weights = jnp.zeros((0, 3, 4), dtype)
    group_sizes = jnp.zeros((0,), jnp.int32)

    def loss(r, w):
      out = self.backend.grouped_gemm(r, w, group_sizes)
      return jnp.sum(out.astype(jnp.float32)), out

    for jit in (False, True):
      with self.subTest(f"jit={jit}"):
        fn = jax.value_and_grad(loss, (0, 1), has_aux=True)
        (_, out), (d_rows, d_weights) = (jax.jit(fn) if jit else fn)(
            rows, weights
        )
        self.assertEqual(out.shape, (5, 4))
        self.assertEqual(out.dtype, dtype)
        self.assertAllZero(out, msg="output with zero groups")
        self.assertAllZero(d_rows, msg="d rows with zero groups")
        self.assertEqual(d_weights.shape, (0, 3, 4))

  def test_jit_and_eager_agree(self):
    case = cases.GEMM_BY_NAME["rows_129"]
    eager = self.run_gemm(case, jit=False)
    jitted = self.run_gemm(case)
    for name in ("out", "d_rows", "d_weights"):
      with self.subTest(name):
        self.assertClose(
            getattr(eager, name),
            getattr(jitted, name),
            case.dtype,
            msg=f"{name}, eager vs jit",
        )

  def test_results_are_bitwise_deterministic(self):
    case = cases.GEMM_BY_NAME["bf16_transposed_padded"]
    first = self.run_gemm(case)
    out, d_rows, d_weights = first.rerun()
    again = dict(out=out, d_rows=d_rows, d_weights=d_weights)
    for name in again:
      with self.subTest(name):
        self.assertBitwiseEqual(again[name], getattr(first, name), msg=name)
