"""PrecisionSuite: quantised grouped GEMMs and layers (moe_core.precision).

Each quantised recipe, on each backend that lists it in `precisions`, is
checked through the grouped GEMM (against the exact product within a bound
derived from the format, and against the reference backend's product of
the same quantised operands), its straight-through gradients,
`jax.nn.scaled_matmul` and the whole layer against the reference oracle
(the list: `PrecisionSuite`). The quantise/dequantise round trips
themselves (bit-exact, hand-built blocks) are backend-independent:
moe_core/precision_test.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl.testing import parameterized
import numpy as np

from conformance import base
from conformance import cases
from conformance import tolerances
import moe_core
from moe_core import precision

RECIPES = precision.QUANTIZED_RECIPES

# Ragged groups whose boundaries fall inside every tile and block grid (the
# row blocks are along C, so row boundaries never split a block; they do
# split the kernels' row tiles), an empty group, NaN padding past the sum;
# C = 200 is not a multiple of 16, 32 or 128 (a padded last block); N = 72
# not a multiple of 128 (a padded 128x128 weight block).
PRECISION_GEMM_CASES = (
    cases.GemmCase("ragged_f32", 72, 200, 72, (13, 0, 30, 21)),
    cases.GemmCase(
        "ragged_bf16_transposed",
        72,
        200,
        72,
        (5, 40, 0, 17),
        "bfloat16",
        transpose_rhs=True,
    ),
)


def _params():
  return [
      (f"{recipe}_{case.name}", recipe, case)
      for recipe in RECIPES
      for case in PRECISION_GEMM_CASES
  ]


def _exact_and_bound(case, recipe):
  """(exact product of the unquantised operands, its error bound), float64.

  [m, n] each; rows past sum(group_sizes) are zero in both.
  """
  rows, weights, group_sizes, _ = cases.gemm_inputs(case)
  rows = np.asarray(rows.astype(jnp.float32), np.float64)
  weights = np.asarray(weights.astype(jnp.float32), np.float64)
  if case.transpose_rhs:
    weights = np.swapaxes(weights, 1, 2)  # [E, C, N] from here on.
  exact = np.zeros((case.m, case.n))
  bound = np.zeros((case.m, case.n))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    a = rows[start : start + size]
    w = weights[g]
    e_a = tolerances.quantization_error(a, recipe, axis=1, tensor_axes=(0, 1))
    e_w = tolerances.quantization_error(
        w, recipe, axis=0, tensor_axes=(0, 1), block_axis=1
    )
    exact[start : start + size] = a @ w
    magnitude = np.abs(a) @ np.abs(w)
    bound[start : start + size] = (
        e_a @ np.abs(w)
        + np.abs(a) @ e_w
        + e_a @ e_w
        + 4 * case.k * 2.0**-24 * magnitude
    )
    if case.result_dtype == "bfloat16":
      bound[start : start + size] += 2.0**-8 * (
          np.abs(exact[start : start + size]) + bound[start : start + size]
      )
    start += size
  return exact, bound


class PrecisionSuite(base.BackendTestCase):
  """Quantised recipes through Backend.grouped_gemm and the layer.

  Each quantised recipe, on each backend that lists it in `precisions`:

    * the grouped GEMM against the exact product of the unquantised
      operands, within the bound `tolerances.quantization_error` derives
      from the element format and block (not from the code under test),
      and against the reference backend's product of the same quantised
      operands within the float32/bfloat16 rows (only the order of sums may
      differ);
    * empty groups, NaN-poisoned padding rows, group boundaries off every
      block and tile grid, both weight layouts;
    * straight-through gradients: exactly the unquantised GEMM's;
    * per group, `jax.nn.scaled_matmul` on the same quantised data and
      scales (mxfp8, nvfp4; where the installed JAX lowers it on this
      platform);
    * the layer (route, dispatch, quantised FFN, combine) against the
      reference oracle, which quantises per expert without sorting.
  """

  def skip_unless_quantizes(self, recipe: str) -> None:
    """Skips a recipe outside the backend's `precisions`, with the reason,
    after checking the backend refuses it as documented."""
    if recipe in self.backend.precisions:
      return
    rows, weights, group_sizes, _ = cases.gemm_inputs(PRECISION_GEMM_CASES[0])
    with self.assertRaisesRegex(NotImplementedError, recipe):
      self.backend.grouped_gemm(rows, weights, group_sizes, precision=recipe)
    self.skipTest(
        f"backend {self.BACKEND!r} has no quantised GEMM for {recipe!r} "
        "(it raises NotImplementedError)"
    )

  def _quantized_gemm(self, case, recipe, backend=None, grads=False):
    """(out,) or (out, d_rows, d_weights) of the quantised GEMM, numpy."""
    backend = backend or self.backend
    rows, weights, _, _ = cases.gemm_inputs(case)
    fn = base.gemm_function(backend, case, grads=grads, precision=recipe)
    return tuple(np.asarray(v) for v in jax.jit(fn)(rows, weights))

  @parameterized.named_parameters(_params())
  def test_quantized_gemm_within_bound_and_matches_reference(
      self, recipe, case
  ):
    self.skip_unless_computes(case.dtype)
    self.skip_unless_quantizes(recipe)
    (out,) = self._quantized_gemm(case, recipe)
    self.assertAllZero(out[case.used_rows :], msg="output of NaN padding rows")
    exact, bound = _exact_and_bound(case, recipe)
    err = np.abs(out.astype(np.float64) - exact)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    self.assertTrue(
        np.all(err <= bound),
        f"{recipe}: {np.sum(err > bound)} values past the derived bound; "
        f"worst at {worst}: error {err[worst]:.3g}, bound {bound[worst]:.3g}",
    )
    # The bound is not vacuous: it stays well under the size of the terms
    # (a lost scale or block would be off by about that much).
    magnitude = np.abs(exact).max()
    self.assertLess(bound.max(), 0.9 * magnitude * (case.k**0.5))
    # The same quantised operands on the reference: only the order of the
    # float32 sums may differ.
    if not self.is_oracle():
      (want,) = self._quantized_gemm(
          case, recipe, backend=moe_core.get_backend("reference")
      )
      self.assertClose(out, want, case.dtype, msg="vs reference")

  @parameterized.parameters(*RECIPES)
  def test_gradients_are_straight_through(self, recipe):
    case = PRECISION_GEMM_CASES[0]
    self.skip_unless_computes(case.dtype)
    self.skip_unless_quantizes(recipe)
    _, d_rows, d_weights = self._quantized_gemm(case, recipe, grads=True)
    plain = self.run_gemm(
        cases.GemmCase("plain", case.m, case.k, case.n, case.group_sizes)
    )
    np.testing.assert_array_equal(d_rows, plain.d_rows)
    np.testing.assert_array_equal(d_weights, plain.d_weights)
    self.assertAllZero(d_weights[1], msg="d weights of the empty group")
    self.assertAllZero(
        d_rows[case.used_rows :], msg="d rows of NaN padding rows"
    )

  @parameterized.parameters("mxfp8", "nvfp4")
  def test_matches_scaled_matmul_per_group(self, recipe):
    """Each group's output equals jax.nn.scaled_matmul of its quantised
    rows and expert (block scales; nvfp4's tensor scales applied after)."""
    case = PRECISION_GEMM_CASES[0]
    self.skip_unless_computes(case.dtype)
    self.skip_unless_quantizes(recipe)
    rows, weights, group_sizes, _ = cases.gemm_inputs(case)
    q_rows = precision.quantize_grouped_rows(rows, group_sizes, recipe)
    q_weights = precision.quantize_grouped_weights(
        weights, recipe, contract_axis=1
    )
    (out,) = self._quantized_gemm(case, recipe)
    start = 0
    for g, size in enumerate(case.group_sizes):
      if size == 0:
        continue
      lhs = q_rows.data[start : start + size][None]
      lhs_scales = q_rows.scales[start : start + size][None]
      rhs = jnp.swapaxes(q_weights.data[g], 0, 1)[None]  # [1, N, C].
      rhs_scales = jnp.swapaxes(q_weights.scales[g], 0, 1)[None]
      try:
        want = jax.nn.scaled_matmul(
            lhs,
            rhs,
            lhs_scales,
            rhs_scales,
            preferred_element_type=jnp.float32,
        )[0]
      except NotImplementedError as e:
        self.skipTest(f"jax.nn.scaled_matmul on {jax.default_backend()}: {e}")
      want = want[:, : case.n]
      want = want * q_rows.tensor_scale[start : start + size].reshape(-1, 1)
      want = want * q_weights.tensor_scale[g].reshape(())
      self.assertClose(
          out[start : start + size],
          np.asarray(want),
          case.dtype,
          msg=f"group {g}",
      )
      start += size

  @parameterized.parameters(*RECIPES)
  def test_layer_matches_reference_oracle(self, recipe):
    """The sorted, quantised layer against the oracle, which quantises each
    expert's tokens in place (a mask, no sort): float32 sums in another
    order may move a value across an element-format rounding boundary (one
    E4M3 step is 2^-3 of it, one E2M1 step up to 2^-1); such a flip moves
    one term of a D- or F-wide sum, well under 2^-6 of the output's size."""
    self.skip_unless_computes(jnp.float32)  # x below is float32.
    self.skip_unless_quantizes(recipe)
    cfg = cases.layer_config(
        hidden_size=64, shared_ffn_size=32, precision=recipe
    )
    params = moe_core.init_params(jax.random.key(1), cfg)
    x = jax.random.normal(jax.random.key(2), (37, cfg.hidden_size))

    def loss(params, backend):
      y, _ = moe_core.moe_layer(params, x, cfg, backend)
      return jnp.sum(y * y), y

    if recipe == "mxfp8":  # One recipe is enough for the backward's wiring.
      (_, got), grads = jax.jit(
          jax.value_and_grad(lambda p: loss(p, self.backend), has_aux=True)
      )(params)
    else:
      (_, got), grads = jax.jit(lambda p: loss(p, self.backend))(params), {}
    _, want = loss(params, "reference")
    problem = tolerances.violation(
        got, want, tolerances.Tolerance(atol=2.0**-6, rtol=0.0)
    )
    self.assertIsNone(problem, f"{recipe}: layer vs oracle")
    for name, grad in grads.items():
      self.assertTrue(np.all(np.isfinite(np.asarray(grad))), name)
