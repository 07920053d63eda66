"""The scaled gmm kernel on quantised operands, interpreted on the CPU.

Each recipe's in-kernel product (the E4M3 data into the kernel, the scales
applied there) against the definition, dequantise then multiply, computed
here in float64 numpy; and the kernel's scale placement on hand-built
operands whose products are exact.
"""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from backends.pallas import kernels
from backends.pallas import ops
from backends.pallas import tiling
from moe_core import operands
from moe_core import precision
from moe_core import quantized_gemm
from reference import backend as reference

# bn = 16 (< 128: a weight block's scale covers several column blocks) and
# bn = 256 (> 128: one column block spans two weight blocks).
_NARROW = tiling.Tiles(bm=16, bk=16, bn=16)
_WIDE = tiling.Tiles(bm=32, bk=64, bn=256)

# (name, m, k, n, group_sizes, transpose_rhs, tiles). Group boundaries fall
# inside row tiles, one group is empty, the rows past the sum are NaN; K =
# 200 is no multiple of 16, 32 or 128 (a zero-padded last block) and N = 72
# or 300 no multiple of 128 (a padded 128x128 weight block).
_CASES = (
    ("ragged_narrow_tiles", 72, 200, 72, (13, 0, 30, 21), False, _NARROW),
    ("transposed", 72, 200, 72, (5, 40, 0, 17), True, _NARROW),
    ("wide_columns", 48, 200, 300, (0, 29, 11), False, _WIDE),
)


def _params():
  """Every recipe on every case but wide_columns, which only fp8_block's
  128-column weight blocks (and fp8_tensor, the other FP8 MMA) need."""
  return [
      (f"{recipe}_{name}", recipe, name, *case)
      for recipe in precision.QUANTIZED_RECIPES
      for name, *case in _CASES
      if name != "wide_columns" or recipe in ("fp8_tensor", "fp8_block")
  ]


def _inputs(m, k, n, group_sizes, transpose_rhs, seed=0):
  """rows [m, k] float32 with NaN past sum(group_sizes); weights [E, k, n]."""
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal((m, k)).astype(np.float32)
  rows[sum(group_sizes) :] = np.nan
  shape = (
      (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
  )
  weights = (rng.standard_normal(shape) * k**-0.5).astype(np.float32)
  return (
      jnp.asarray(rows),
      jnp.asarray(weights),
      jnp.asarray(group_sizes, jnp.int32),
  )


def _quantize(rows, weights, group_sizes, recipe, transpose_rhs):
  return operands.QuantizedGemmOperands(
      rows=precision.quantize_grouped_rows(rows, group_sizes, recipe),
      weights=precision.quantize_grouped_weights(
          weights, recipe, contract_axis=2 if transpose_rhs else 1
      ),
      group_sizes=group_sizes,
      transpose_rhs=transpose_rhs,
      out_dtype=jnp.dtype(jnp.float32),
      recipe=recipe,
  )


def _dequantized_product(q):
  """(product, |a| @ |w|) in float64 of the dequantised operands, per group.

  Rows outside every group are zero in both.
  """
  rows = np.asarray(precision.dequantize(q.rows), np.float64)
  weights = np.asarray(precision.dequantize(q.weights), np.float64)
  if q.transpose_rhs:
    weights = np.swapaxes(weights, 1, 2)
  out = np.zeros((rows.shape[0], weights.shape[2]))
  magnitude = np.zeros_like(out)
  start = 0
  for g, size in enumerate(np.asarray(q.group_sizes)):
    a = rows[start : start + size]
    out[start : start + size] = a @ weights[g]
    magnitude[start : start + size] = np.abs(a) @ np.abs(weights[g])
    start += size
  return out, magnitude


def _run(q, tiles):
  """ops.quantized_grouped_gemm(q) under jit, interpreted, as numpy."""
  launch = ops.Launch(tiling.TileConfig.parse(tiles), interpret=True)

  # QuantizedGemmOperands is no pytree: jit over its arrays.
  @jax.jit
  def run(q_rows, q_weights, group_sizes):
    return ops.quantized_grouped_gemm(
        dataclasses.replace(
            q, rows=q_rows, weights=q_weights, group_sizes=group_sizes
        ),
        launch,
    )

  return np.asarray(run(q.rows, q.weights, q.group_sizes))


class QuantizedGroupedGemmTest(parameterized.TestCase):
  """ops.quantized_grouped_gemm against dequantise-then-multiply."""

  @parameterized.named_parameters(_params())
  def test_matches_dequantized_product(
      self, recipe, name, m, k, n, group_sizes, transpose_rhs, tiles
  ):
    del name  # In the test's name only.
    rows, weights, group_sizes = _inputs(m, k, n, group_sizes, transpose_rhs)
    q = _quantize(rows, weights, group_sizes, recipe, transpose_rhs)
    out = _run(q, tiles)
    self.assertEqual(out.shape, (m, n))
    self.assertEqual(out.dtype, np.float32)
    used = int(np.sum(group_sizes))
    with self.subTest("padding_rows_are_zero"):
      np.testing.assert_array_equal(out[used:], 0.0)
    with self.subTest("within_float32_summation_error"):
      want, magnitude = _dequantized_product(q)
      # A float32 dot of k terms: each product and partial sum rounds once,
      # plus the scale products (a few roundings each).
      bound = (k + 8) * 2.0**-24 * magnitude
      err = np.abs(out - want)
      self.assertTrue(np.all(np.isfinite(out)))
      worst = np.unravel_index(np.argmax(err - bound), err.shape)
      self.assertTrue(
          np.all(err <= bound),
          f"error {err[worst]} > bound {bound[worst]} at {worst}",
      )
    with self.subTest("agrees_with_quantized_gemm_definition"):

      def gemm(r, w, g):
        return reference.grouped_gemm(r, w, g, out_dtype=jnp.float32)

      shared = np.asarray(quantized_gemm.dequantized_grouped_gemm(q, gemm))
      np.testing.assert_allclose(
          out, shared, rtol=0, atol=2 * np.max(bound) + 1e-30
      )

  # fp8_tensor: a NaN poisons the expert's scale, which the padding visits
  # would borrow; fp8_block: its 128x128 block covers all of this K and N.
  @parameterized.parameters("fp8_tensor", "fp8_block")
  def test_nan_expert_poisons_its_rows_only(self, recipe):
    """A NaN weight makes its expert's rows NaN; padding rows stay zero.

    The rows past the sum are visited as a padding group that borrows the
    last expert's scales: here NaN ones, which must not reach them.
    """
    rows, weights, group_sizes = _inputs(48, 64, 32, (10, 0, 21), False, 2)
    weights = weights.at[2, 5, 7].set(jnp.nan)
    q = _quantize(rows, weights, group_sizes, recipe, False)
    out = _run(q, _NARROW)
    want, _ = _dequantized_product(q)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    self.assertTrue(np.all(np.isnan(out[10:31])))
    self.assertTrue(np.all(np.isfinite(out[:10])))
    np.testing.assert_array_equal(out[31:], 0.0)


def _e4m3_integers(rng, shape):
  """Small integers, exact in E4M3, as float8_e4m3fn."""
  return jnp.asarray(rng.integers(-8, 9, shape), jnp.float8_e4m3fn)


def _powers_of_two(rng, shape):
  return jnp.asarray(2.0 ** rng.integers(-3, 4, shape), jnp.float32)


class ScaledGmmKernelTest(parameterized.TestCase):
  """kernels.scaled_gmm on operands whose every product is exact."""

  M, K, N, BK = 40, 64, 32, 16
  GROUP_SIZES = (7, 0, 26)

  def _operands(self):
    rng = np.random.default_rng(3)
    e, kb = len(self.GROUP_SIZES), self.K // self.BK
    lhs = _e4m3_integers(rng, (self.M, self.K))
    rhs = _e4m3_integers(rng, (e, self.K, self.N))
    scales = kernels.QuantizedScales(
        row_blocks=_powers_of_two(rng, (kb, self.M)),
        weight_blocks=_powers_of_two(rng, (e, kb, self.N)),
        rows=_powers_of_two(rng, (self.M,)),
        experts=_powers_of_two(rng, (e,)),
    )
    return lhs, rhs, scales

  def _want(self, lhs, rhs, scales, block_scales, tensor_scales):
    """sum_kb a[r, kb] w[g, kb] s_row[kb, r] s_w[g, kb, :], float64 numpy."""
    a = np.asarray(lhs, np.float64)
    w = np.asarray(rhs, np.float64)
    out = np.zeros((self.M, self.N))
    start = 0
    for g, size in enumerate(self.GROUP_SIZES):
      r = slice(start, start + size)
      for kb in range(self.K // self.BK):
        k = slice(kb * self.BK, (kb + 1) * self.BK)
        part = a[r, k] @ w[g, k]
        if block_scales:
          part = part * np.asarray(scales.row_blocks)[kb, r, None]
          part = part * np.asarray(scales.weight_blocks)[g, kb]
        out[r] += part
      if tensor_scales:
        out[r] *= np.asarray(scales.rows)[r, None] * float(scales.experts[g])
      start += size
    return out

  # (block_scales, tensor_scales, dequantize_first): fp8_tensor, fp8_block,
  # mxfp8 and nvfp4's placements, and block scales after the product with
  # tensor scales too.
  @parameterized.parameters(
      (False, True, False),
      (True, False, False),
      (True, False, True),
      (True, True, True),
      (True, True, False),
  )
  def test_scales_are_applied_per_k_block_exactly(
      self, block_scales, tensor_scales, dequantize_first
  ):
    lhs, rhs, scales = self._operands()
    if not block_scales:
      scales = scales._replace(row_blocks=None, weight_blocks=None)
    if not tensor_scales:
      scales = scales._replace(rows=None, experts=None)
    out = kernels.scaled_gmm(
        lhs,
        rhs,
        jnp.asarray(self.GROUP_SIZES, jnp.int32),
        scales,
        tiles=tiling.Tiles(bm=16, bk=self.BK, bn=16),
        interpret=True,
        dequantize_first=dequantize_first,
    )
    want = self._want(lhs, rhs, scales, block_scales, tensor_scales)
    np.testing.assert_array_equal(np.asarray(out), want)

  def test_block_scales_need_whole_blocks_of_k(self):
    lhs, rhs, scales = self._operands()
    with self.assertRaisesRegex(ValueError, r"multiple of the scale block"):
      kernels.scaled_gmm(
          lhs,
          rhs,
          jnp.asarray(self.GROUP_SIZES, jnp.int32),
          scales,
          tiles=tiling.Tiles(bm=16, bk=128, bn=16),
          interpret=True,
      )


if __name__ == "__main__":
  absltest.main()
