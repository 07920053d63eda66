"""The Mosaic GPU kernels in Mosaic GPU's interpreter, against the reference.

Every grouped-GEMM case of the conformance suite (conformance/cases.py, in
bfloat16: the kernels take no float32) runs forward, dX and dW through the
backend with 64-row, 64-wide tiles, so the cases hit tiles shared by
groups, empty groups, one group holding every row, boundaries off the tile
grid, C and N padded to the blocks, and NaN in the padding rows; then the
expert FFN (fused gate+up, with and without the SwiGLU epilogue) and a small
MoE layer with gradients. The interpreter simulates the GPU's threads,
shared memory, TMA copies, barriers and warpgroup MMAs on the CPU.
"""

from __future__ import annotations

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.mosaic_gpu import backend as mosaic_backend
from conformance import base
from conformance import cases
from conformance import tolerances

_TILES = {"bm": 64, "bk": 64, "bn": 64}
_BF16_CASES = tuple(
    dataclasses.replace(c, dtype="bfloat16") for c in cases.GEMM_CASES
)


class InterpretTest(parameterized.TestCase):
  """The Hopper (wgmma) kernels."""

  GENERATION = "sm90"

  def setUp(self):
    super().setUp()
    ok, reason = self._backend().availability()
    if not ok:
      self.skipTest(reason)

  def _backend(self, **options):
    return mosaic_backend.MosaicGpuBackend(
        interpret=True, tiles=_TILES, generation=self.GENERATION, **options
    )

  def assertClose(self, actual, expected, kind, msg):
    tol = tolerances.lookup("bfloat16", kind)
    problem = tolerances.violation(actual, expected, tol)
    if problem:
      self.fail(f"{msg}: {problem}")

  @parameterized.named_parameters((c.name, c) for c in _BF16_CASES)
  def test_grouped_gemm_matches_reference(self, case):
    got = base.compute_gemm(self._backend(), case, jit=True)
    want = base.reference_gemm(case)
    used = case.used_rows
    self.assertEqual(got.out.dtype, np.dtype(case.result_dtype))
    self.assertClose(got.out[:used], want.out[:used], "forward", "out")
    self.assertClose(
        got.d_rows[:used], want.d_rows[:used], "gradient", "d_rows"
    )
    self.assertClose(got.d_weights, want.d_weights, "gradient", "d_weights")
    # Padding rows hold NaN: their output and gradient are exactly zero.
    np.testing.assert_array_equal(got.out[used:].astype(np.float32), 0)
    np.testing.assert_array_equal(got.d_rows[used:].astype(np.float32), 0)
    for g, size in enumerate(case.group_sizes):
      if size == 0:
        np.testing.assert_array_equal(
            got.d_weights[g].astype(np.float32), 0, err_msg=f"group {g}"
        )

  @parameterized.named_parameters(
      ("unfused", False, {}),
      ("fused", True, {}),
      (
          "fused_gpt_oss_glu_clamped",
          True,
          dict(activation="gpt_oss_glu", swiglu_alpha=1.702, swiglu_limit=0.3),
      ),
      (
          "fused_softcapped_silu",
          True,
          dict(activation="softcapped_silu", gate_softcap=0.4, up_softcap=0.5),
      ),
  )
  def test_expert_ffn_matches_reference(self, fuse_activation, activation):
    m, d, f = 150, 96, 80
    sizes = jnp.array([40, 0, 70, 25], jnp.int32)  # 15 padding rows
    keys = jax.random.split(jax.random.key(0), 5)
    rows = jax.random.normal(keys[0], (m, d), jnp.bfloat16)
    rows = rows.at[135:].set(jnp.nan)
    params = {
        "w_gate": jax.random.normal(keys[1], (4, d, f), jnp.bfloat16) / 10,
        "w_up": jax.random.normal(keys[2], (4, d, f), jnp.bfloat16) / 10,
        "w_down": jax.random.normal(keys[3], (4, f, d), jnp.bfloat16) / 9,
    }
    cotangent = jax.random.normal(keys[4], (m, d), jnp.float32)
    # With weights / 10 over d=96, gate and up have a std near 1: the
    # clamp at 0.3 and the caps bite.
    cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=d, expert_ffn_size=f, **activation
    )

    def run(be, rows, params):
      def loss(rows, params):
        y = be.expert_ffn(rows, sizes, params, cfg)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

      (_, y), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(
          rows, params
      )
      return y, grads

    be = self._backend(fuse_activation=fuse_activation)
    self.assertEqual(len(be.checkpoint_names(cfg)), 4 if fuse_activation else 3)
    y, (d_rows, d_params) = jax.jit(lambda r, p: run(be, r, p))(rows, params)
    ref = moe_core.get_backend("reference")
    want_y, (want_rows, want_params) = jax.jit(lambda r, p: run(ref, r, p))(
        rows.at[135:].set(0), params
    )
    self.assertClose(y[:135], want_y[:135], "forward", "y")
    np.testing.assert_array_equal(np.asarray(y[135:], np.float32), 0)
    self.assertClose(d_rows[:135], want_rows[:135], "gradient", "d_rows")
    np.testing.assert_array_equal(np.asarray(d_rows[135:], np.float32), 0)
    for name in params:
      self.assertClose(d_params[name], want_params[name], "gradient", name)
      np.testing.assert_array_equal(
          np.asarray(d_params[name][1], np.float32), 0, err_msg=name
      )

  def test_moe_layer_matches_reference(self):
    # Shared expert with its gate, gradients of x and every parameter.
    (case,) = [c for c in cases.LAYER_CASES if c.name == "base_bf16"]
    got = base.compute_layer(
        self._backend(fuse_activation=True), case, jit=True
    )
    want = base.reference_layer(case)
    self.assertClose(got.y, want.y, "forward", "y")
    for name, grad in want.grads.items():
      self.assertClose(got.grads[name], grad, "gradient", name)

  def test_float32_is_not_implemented(self):
    rows = jnp.ones((8, 16), jnp.float32)
    weights = jnp.ones((2, 16, 16), jnp.float32)
    with self.assertRaisesRegex(NotImplementedError, "float32"):
      self._backend().grouped_gemm(rows, weights, jnp.array([4, 4], jnp.int32))


if __name__ == "__main__":
  absltest.main()
