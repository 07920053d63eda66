"""The pallas kernels and ops in interpret mode, against the reference backend.

Shapes are small and tiles are 16-32 rows, so tiles shared by two groups,
empty groups, partial tiles, padded C (the contracted width) and N, and
several C steps and column blocks all occur.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.pallas import backend as pallas_backend
from backends.pallas import kernels
from backends.pallas import ops
from backends.pallas import tiling
from moe_core import backend as backend_lib
from reference import backend as reference

_SMALL = tiling.Tiles(bm=16, bk=16, bn=16)
_MIXED = tiling.TileConfig(
    fwd=tiling.Tiles(bm=32, bk=16, bn=32),
    dgrad=tiling.Tiles(bm=16, bk=32, bn=16),
    wgrad=tiling.Tiles(bm=16, bk=16, bn=32),
)


def _inputs(
    m,
    k,
    n,
    group_sizes,
    dtype="float32",
    transpose_rhs=False,
    seed=0,
    poison=True,
):
  """rows [m, k] (NaN past sum(group_sizes) if poison), weights, dy [m, n]."""
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal((m, k)).astype(np.float32)
  used = sum(group_sizes)
  if poison:
    rows[used:] = np.nan
  shape = (
      (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
  )
  weights = rng.standard_normal(shape).astype(np.float32)
  dy = rng.standard_normal((m, n)).astype(np.float32)
  if poison:
    dy[used:] = np.nan
  return (
      jnp.asarray(rows, dtype),
      jnp.asarray(weights, dtype),
      jnp.asarray(group_sizes, jnp.int32),
      jnp.asarray(dy, dtype),
  )


def _tolerance(dtype):
  return {"float32": 2e-5, "bfloat16": 2e-2}[jnp.dtype(dtype).name]


def _assert_close(test, got, want, dtype, msg=""):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  test.assertTrue(np.all(np.isfinite(got)), f"{msg}: non-finite values")
  scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
  np.testing.assert_allclose(
      got,
      want,
      atol=_tolerance(dtype) * scale,
      rtol=_tolerance(dtype),
      err_msg=msg,
  )


def _reference_gemm_and_grads(rows, weights, group_sizes, dy, transpose_rhs):
  """The reference's output and (d_rows, d_weights), padding rows zeroed."""
  used = int(np.sum(group_sizes))
  clean_rows = rows.at[used:].set(0)
  clean_dy = dy.at[used:].set(0)

  def f(r, w):
    return reference.grouped_gemm(
        r, w, group_sizes, transpose_rhs=transpose_rhs
    )

  out, vjp = jax.vjp(f, clean_rows, weights)
  return (out,) + vjp(clean_dy)


class GroupedGemmOpTest(parameterized.TestCase):
  """ops.grouped_gemm: forward, dX and dW against the reference."""

  @parameterized.named_parameters(
      (
          "shared_tiles_empty_group",
          64,
          32,
          48,
          (10, 0, 23, 31),
          "float32",
          False,
          _SMALL,
      ),
      (
          "padding_rows_odd_dims",
          77,
          40,
          24,
          (5, 17, 0, 20),
          "float32",
          False,
          _SMALL,
      ),
      ("transposed", 40, 24, 40, (7, 13, 0, 9), "float32", True, _SMALL),
      ("bf16", 64, 32, 48, (10, 0, 23, 21), "bfloat16", False, _SMALL),
      ("bf16_transposed", 48, 32, 32, (0, 30, 3, 0), "bfloat16", True, _SMALL),
      (
          "per_kernel_tiles",
          96,
          48,
          64,
          (0, 40, 1, 30, 0),
          "float32",
          False,
          _MIXED,
      ),
      (
          "heuristic_tiles",
          96,
          48,
          64,
          (0, 40, 1, 30, 0),
          "float32",
          False,
          tiling.TileConfig(),
      ),
      ("one_group_all_rows", 33, 16, 16, (33,), "float32", False, _SMALL),
      ("all_groups_empty", 32, 16, 16, (0, 0, 0), "float32", False, _SMALL),
  )
  def test_matches_reference_with_nan_padding(
      self, m, k, n, group_sizes, dtype, transpose_rhs, tiles
  ):
    rows, weights, group_sizes, dy = _inputs(
        m, k, n, group_sizes, dtype, transpose_rhs
    )
    launch = ops.Launch(tiles=tiling.TileConfig.parse(tiles), interpret=True)

    def f(r, w):
      return ops.grouped_gemm(
          r, w, group_sizes, transpose_rhs, jnp.dtype(dtype), launch
      )

    out, vjp = jax.jit(lambda r, w: jax.vjp(f, r, w))(rows, weights)
    d_rows, d_weights = vjp(dy)
    want = _reference_gemm_and_grads(
        rows, weights, group_sizes, dy, transpose_rhs
    )
    used = int(np.sum(group_sizes))
    for name, got, expected in zip(
        ("out", "d_rows", "d_weights"), (out, d_rows, d_weights), want
    ):
      with self.subTest(name):
        self.assertEqual(got.dtype, jnp.dtype(dtype))
        _assert_close(self, got, expected, dtype, name)
    with self.subTest("padding_rows_are_zero"):
      np.testing.assert_array_equal(np.asarray(out[used:], np.float32), 0)
      np.testing.assert_array_equal(np.asarray(d_rows[used:], np.float32), 0)
    with self.subTest("empty_groups_have_zero_d_weights"):
      for g, size in enumerate(np.asarray(group_sizes)):
        if size == 0:
          np.testing.assert_array_equal(np.asarray(d_weights[g], np.float32), 0)

  def test_bf16_in_float32_out(self):
    rows, weights, group_sizes, _ = _inputs(
        48, 32, 40, (20, 0, 28), "bfloat16", poison=False
    )
    out = ops.grouped_gemm(
        rows,
        weights,
        group_sizes,
        False,
        jnp.dtype(jnp.float32),
        ops.Launch(tiling.TileConfig.parse(_SMALL), True),
    )
    self.assertEqual(out.dtype, jnp.float32)
    want = reference.grouped_gemm(
        rows, weights, group_sizes, out_dtype=jnp.float32
    )
    # Products of bf16 inputs are exact in float32: only the sum order
    # differs from the reference.
    _assert_close(self, out, want, "float32")


class KernelTest(parameterized.TestCase):
  """The multi-product forms of the kernels, used by the fused FFN."""

  def test_two_products_two_accumulators(self):
    rows, w1, group_sizes, _ = _inputs(64, 32, 48, (10, 0, 23, 31), seed=1)
    _, w2, _, _ = _inputs(64, 32, 48, (10, 0, 23, 31), seed=2)
    a, b = kernels.gmm(
        [rows],
        [w1, w2],
        group_sizes,
        tiles=_SMALL,
        interpret=True,
        products=((0, 0, 0), (0, 1, 1)),
        num_outputs=2,
    )
    _assert_close(
        self, a, reference.grouped_gemm(rows, w1, group_sizes), "float32"
    )
    _assert_close(
        self, b, reference.grouped_gemm(rows, w2, group_sizes), "float32"
    )

  def test_two_products_one_accumulator(self):
    x1, w1, group_sizes, _ = _inputs(
        64, 32, 48, (10, 0, 23, 31), seed=3, transpose_rhs=True
    )
    x2, w2, _, _ = _inputs(
        64, 32, 48, (10, 0, 23, 31), seed=4, transpose_rhs=True
    )
    (got,) = kernels.gmm(
        [x1, x2],
        [w1, w2],
        group_sizes,
        tiles=_SMALL,
        interpret=True,
        transpose_rhs=True,
        products=((0, 0, 0), (1, 1, 0)),
    )
    used = 64
    want = reference.grouped_gemm(
        x1[:used], w1, group_sizes, transpose_rhs=True
    ) + reference.grouped_gemm(x2[:used], w2, group_sizes, transpose_rhs=True)
    _assert_close(self, got, want, "float32")

  def test_tgmm_two_outputs(self):
    rows, _, group_sizes, dy1 = _inputs(64, 32, 48, (10, 0, 23, 20), seed=5)
    _, _, _, dy2 = _inputs(64, 32, 48, (10, 0, 23, 20), seed=6)
    g1, g2 = kernels.tgmm(
        rows, [dy1, dy2], group_sizes, tiles=_SMALL, interpret=True
    )
    for got, dy in ((g1, dy1), (g2, dy2)):
      want = _reference_gemm_and_grads(
          rows, jnp.zeros((4, 32, 48)), group_sizes, dy, False
      )[2]
      _assert_close(self, got, want, "float32")


# Config fields of each activation case: the plain GLUs by name, the clamp,
# and the registry's GLUs with their options (all in the epilogue but gelu).
_ACTIVATION_CASES = {
    "silu": dict(activation="silu"),
    "gelu": dict(activation="gelu"),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "silu_clamped": dict(activation="silu", swiglu_limit=0.5),
    "gpt_oss_glu_clamped": dict(
        activation="gpt_oss_glu", swiglu_alpha=1.702, swiglu_limit=0.5
    ),
    "softcapped_silu": dict(
        activation="softcapped_silu", gate_softcap=0.6, up_softcap=0.8
    ),
}


class ExpertFfnTest(parameterized.TestCase):
  """The fused gate/up pass, with and without the activation epilogue."""

  @parameterized.product(
      fuse_activation=[False, True],
      activation=[
          "silu",
          "gelu",
          "gelu_tanh",
          "silu_clamped",
          "gpt_oss_glu_clamped",
          "softcapped_silu",
      ],
  )
  def test_ffn_and_grads_match_reference(self, fuse_activation, activation):
    # The limit clamps some gate and up entries at these scales, so the
    # clamp's zero derivative is exercised too.
    cfg = moe_core.MoEConfig(
        num_experts=4,
        top_k=2,
        hidden_size=32,
        expert_ffn_size=48,
        **_ACTIVATION_CASES[activation],
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    rows, _, group_sizes, _ = _inputs(64, 32, 32, (10, 0, 23, 21), seed=7)
    cotangent = jax.random.normal(jax.random.key(1), (64, 32))
    used = 54
    pallas = pallas_backend.PallasBackend(
        tiles=_SMALL, interpret=True, fuse_activation=fuse_activation
    )
    # Fused (its residuals and moe_down named) exactly where asked and the
    # epilogue can: not the exact gelu, which the Triton lowering cannot
    # compute.
    fused = fuse_activation and activation != "gelu"
    self.assertEqual(
        pallas.checkpoint_names(cfg),
        (*backend_lib.FUSED_CHECKPOINT_NAMES, backend_lib.DOWN_NAME)
        if fused
        else backend_lib.CHECKPOINT_NAMES,
    )

    def run(be, r, p):
      return be.expert_ffn(r, group_sizes, p, cfg)

    got, vjp = jax.vjp(lambda r, p: run(pallas, r, p), rows, params)
    got_grads = vjp(cotangent)
    clean = rows.at[used:].set(0)
    want, vjp = jax.vjp(
        lambda r, p: run(reference.ReferenceBackend(), r, p), clean, params
    )
    want_grads = vjp(cotangent.at[used:].set(0))
    _assert_close(self, got, want, "float32", "out")
    np.testing.assert_array_equal(np.asarray(got[used:]), 0)
    _assert_close(self, got_grads[0], want_grads[0], "float32", "d_rows")
    for name in ("w_gate", "w_up", "w_down"):
      _assert_close(
          self, got_grads[1][name], want_grads[1][name], "float32", f"d {name}"
      )

  def test_unfused_pass_keeps_checkpoint_names(self):
    cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=32, expert_ffn_size=48
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    rows, _, group_sizes, _ = _inputs(64, 32, 32, (10, 0, 23, 21), seed=8)
    pallas = pallas_backend.PallasBackend(tiles=_SMALL, interpret=True)
    jaxpr = str(
        jax.make_jaxpr(
            lambda r: pallas.expert_ffn(r, group_sizes, params, cfg)
        )(rows)
    )
    for name in backend_lib.CHECKPOINT_NAMES:
      self.assertIn(f"name={name}", jaxpr)

  @parameterized.parameters(False, True)
  def test_moe_layer_matches_reference(self, fuse_activation):
    cfg = moe_core.MoEConfig(
        num_experts=6,
        top_k=2,
        hidden_size=32,
        expert_ffn_size=48,
        shared_ffn_size=16,
    )
    params = moe_core.init_params(jax.random.key(2), cfg)
    x = jax.random.normal(jax.random.key(3), (2, 20, 32))
    pallas = pallas_backend.PallasBackend(
        tiles=_SMALL, interpret=True, fuse_activation=fuse_activation
    )

    def loss(p, x, be):
      y, _ = moe_core.moe_layer(p, x, cfg, backend=be)
      return jnp.sum(jnp.sin(y)), y

    (_, y), grads = jax.jit(
        jax.value_and_grad(
            lambda p, x: loss(p, x, pallas), argnums=(0, 1), has_aux=True
        )
    )(params, x)
    (_, y_ref), grads_ref = jax.value_and_grad(
        lambda p, x: loss(p, x, "reference"), argnums=(0, 1), has_aux=True
    )(params, x)
    _assert_close(self, y, y_ref, "float32", "y")
    _assert_close(self, grads[1], grads_ref[1], "float32", "dx")
    for name in grads[0]:
      _assert_close(
          self, grads[0][name], grads_ref[0][name], "float32", f"d {name}"
      )


class BackendTest(parameterized.TestCase):

  def test_registered_and_available_on_cpu(self):
    be = moe_core.get_backend("pallas")
    self.assertIsInstance(be, pallas_backend.PallasBackend)
    if jax.default_backend() == "cpu":
      self.assertTrue(be.interpret)
      self.assertEqual(be.availability(), (True, ""))

  def test_compiled_mode_is_unavailable_off_gpu(self):
    if jax.default_backend() == "gpu":
      self.skipTest("compiled mode is available on a GPU")
    ok, why = pallas_backend.PallasBackend(interpret=False).availability()
    self.assertFalse(ok)
    self.assertRegex(
        why,
        r"pallas: the kernels lower through Triton for "
        r"GPUs only, not \w+; pass interpret=True",
    )

  def test_unsupported_dtype_raises_not_implemented(self):
    be = pallas_backend.PallasBackend(interpret=True)
    rows = jnp.zeros((16, 16), jnp.float8_e4m3fn)
    with self.assertRaisesRegex(
        NotImplementedError,
        r"pallas: float8_e4m3fn operands are not " r"supported",
    ):
      be.grouped_gemm(
          rows,
          jnp.zeros((2, 16, 16), jnp.float8_e4m3fn),
          jnp.array([8, 8], jnp.int32),
      )

  def test_epilogue_rejects_an_activation_triton_cannot_lower(self):
    rows, w, group_sizes, _ = _inputs(32, 16, 16, (16, 16), poison=False)
    with self.assertRaisesRegex(
        ValueError,
        r"activation must be one of \('silu', 'gelu_tanh', 'gpt_oss_glu', "
        r"'softcapped_silu'\) to run in the kernel epilogue, got 'gelu'",
    ):
      ops.gated_gate_up(
          rows,
          w,
          w,
          group_sizes,
          "gelu",
          ops.Launch(tiling.TileConfig.parse(_SMALL), True),
      )

  def test_bad_options_raise(self):
    with self.assertRaisesRegex(
        ValueError,
        r"interpret must be None "
        r"\(auto\), True, False, 'debug' or a "
        r"pltpu.InterpretParams, got 'yes'",
    ):
      pallas_backend.PallasBackend(interpret="yes")
    with self.assertRaisesRegex(
        TypeError, r"fuse_activation must be a bool, " r"got int"
    ):
      pallas_backend.PallasBackend(fuse_activation=1)
    with self.assertRaisesRegex(
        ValueError, r"Tiles.bm must be a power of " r"two"
    ):
      pallas_backend.PallasBackend(tiles={"bm": 24})


if __name__ == "__main__":
  absltest.main()
