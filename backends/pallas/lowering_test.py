"""Lowers every kernel for CUDA on this (CPU) machine through jax.export.

The Pallas -> Triton lowering runs entirely in Python, so a kernel that would
not lower for the GPU (a block that is not a power of two, an unsupported
primitive, scratch memory, a data-dependent index map) fails here. PTX-level
limits (registers, shared memory) are not checked; tiling_test bounds the
shared memory and accumulator registers of the shipped configurations. Each
config is lowered as the backend runs it: after `tiling.fit_gpu` for the
kernel kind and number of operands. On jax >= 0.11.2 the Triton lowering
needs a GPU to read its compute capability from: the export runs for an
abstract H200 (moe_core/testing/cuda_export.py).
"""

from unittest import mock
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import export
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.pallas import backend as pallas_backend
from backends.pallas import kernels
from backends.pallas import ops
from backends.pallas import tiling
from moe_core import backend as backend_lib
from moe_core import compat
from moe_core import registry
from moe_core.kernels import gpu
from moe_core.testing import cuda_export

_TRITON_CALL = cuda_export.TRITON_CALL
_custom_calls = cuda_export.custom_calls
_S = jax.ShapeDtypeStruct


def _export_for_cuda(fn, *args) -> str:
  return cuda_export.export_for_cuda(fn, *args).mlir_module()


def tearDownModule():
  # jax >= 0.11 warns at each Triton lowering; the log shows how many the
  # export helper swallowed (0 on older jax).
  print(
      f"Pallas Triton deprecation warnings filtered: "
      f"{compat.triton_deprecations_filtered()} (jax {jax.__version__})"
  )


def _shipped(prefix):
  return [
      (name, tiles)
      for name, tiles in tiling.GPU_TILES.items()
      if name.startswith(prefix)
  ]


def _dtype_of(name):
  return jnp.float32 if "f32" in name else jnp.bfloat16


class ShippedTilesLowerTest(parameterized.TestCase):
  """Each shipped GPU configuration, for each kernel that uses it."""

  M, C, N, E = 512, 256, 384, 8

  def assertTritonCalls(self, text, count):
    self.assertEqual(_custom_calls(text), [_TRITON_CALL] * count)

  @parameterized.named_parameters(*_shipped("gmm"))
  def test_gmm_forward_and_dgrad_lower(self, tiles):
    dtype = _dtype_of(self._testMethodName)
    m, c, n, e = self.M, self.C, self.N, self.E
    sizes = _S((e,), jnp.int32)
    for transpose_rhs in (False, True):
      with self.subTest(transpose_rhs=transpose_rhs):
        w = _S((e, n, c) if transpose_rhs else (e, c, n), dtype)
        text = _export_for_cuda(
            lambda x, w, g, t=transpose_rhs: kernels.gmm(
                [x], [w], g, tiles=tiles, interpret=False, transpose_rhs=t
            )[0],
            _S((m, c), dtype),
            w,
            sizes,
        )
        self.assertTritonCalls(text, 1)

  @parameterized.named_parameters(*_shipped("gmm"))
  def test_gmm_fused_pairs_lower(self, tiles):
    dtype = _dtype_of(self._testMethodName)
    m, c, n, e = self.M, self.C, self.N, self.E
    # What the heuristic makes of this config for the two-operand kernels.
    fwd_tiles = tiling.fit_gpu(tiles, "fwd", dtype, num_operands=2)
    dgrad_tiles = tiling.fit_gpu(tiles, "dgrad", dtype, num_operands=2)
    sizes = _S((e,), jnp.int32)
    w = _S((e, c, n), dtype)
    with self.subTest("gate_up"):
      text = _export_for_cuda(
          lambda x, a, b, g: kernels.gmm(
              [x],
              [a, b],
              g,
              tiles=fwd_tiles,
              interpret=False,
              products=((0, 0, 0), (0, 1, 1)),
              num_outputs=2,
          ),
          _S((m, c), dtype),
          w,
          w,
          sizes,
      )
      self.assertTritonCalls(text, 1)
    with self.subTest("dgrad_sum"):
      text = _export_for_cuda(
          lambda x, y, a, b, g: kernels.gmm(
              [x, y],
              [a, b],
              g,
              tiles=dgrad_tiles,
              interpret=False,
              transpose_rhs=True,
              products=((0, 0, 0), (1, 1, 0)),
          )[0],
          _S((m, n), dtype),
          _S((m, n), dtype),
          w,
          w,
          sizes,
      )
      self.assertTritonCalls(text, 1)

  @parameterized.named_parameters(*_shipped("tgmm"))
  def test_tgmm_lowers(self, tiles):
    dtype = _dtype_of(self._testMethodName)
    m, c, n, e = self.M, self.C, self.N, self.E
    for num_rhs in (1, 2):
      with self.subTest(num_rhs=num_rhs):
        fitted = tiling.fit_gpu(tiles, "wgrad", dtype, num_operands=num_rhs)
        text = _export_for_cuda(
            lambda x, g, *ys, t=fitted: kernels.tgmm(
                x, list(ys), g, tiles=t, interpret=False
            ),
            _S((m, c), dtype),
            _S((e,), jnp.int32),
            *[_S((m, n), dtype)] * num_rhs,
        )
        self.assertTritonCalls(text, num_rhs and 1)


class OpsLowerTest(parameterized.TestCase):
  """Forward and backward of each op, heuristic GPU tiles, DeepSeek shapes.

  Every custom call in the program is a Triton kernel: no host callback,
  no device-to-host copy of group_sizes.
  """

  # DeepSeek-V3 expert shapes on a 32-expert slice: D=7168, F=2048.
  M, D, F, E = 2048, 7168, 2048, 32
  LAUNCH = ops.Launch(tiling.TileConfig(), interpret=False)

  @parameterized.product(
      dtype=["bfloat16", "float32"], transpose_rhs=[False, True]
  )
  def test_grouped_gemm_value_and_grad(self, dtype, transpose_rhs):
    m, d, f, e = self.M, self.D, self.F, self.E
    w_shape = (e, f, d) if transpose_rhs else (e, d, f)

    def loss(x, w, g):
      y = ops.grouped_gemm(
          x, w, g, transpose_rhs, jnp.dtype(dtype), self.LAUNCH
      )
      return jnp.sum(jnp.square(y.astype(jnp.float32)))

    text = _export_for_cuda(
        jax.value_and_grad(loss, argnums=(0, 1)),
        _S((m, d), dtype),
        _S(w_shape, dtype),
        _S((e,), jnp.int32),
    )
    # Forward, dX, dW.
    self.assertEqual(_custom_calls(text), [_TRITON_CALL] * 3)

  @parameterized.product(
      fuse_activation=[False, True], activation=["silu", "gelu", "gelu_tanh"]
  )
  def test_expert_ffn_value_and_grad(self, fuse_activation, activation):
    cfg = moe_core.MoEConfig(
        num_experts=self.E,
        top_k=8,
        hidden_size=self.D,
        expert_ffn_size=self.F,
        activation=activation,
    )
    text = self._export_expert_ffn_grad(cfg, fuse_activation, self.M)
    # gate/up forward, down forward, down dX and dW, gate/up dX and dW.
    self.assertEqual(_custom_calls(text), [_TRITON_CALL] * 6)

  @parameterized.named_parameters(
      ("silu_clamped", dict(activation="silu", swiglu_limit=7.0)),
      (
          "gpt_oss_glu_clamped",
          dict(activation="gpt_oss_glu", swiglu_alpha=1.702, swiglu_limit=7.0),
      ),
      (
          "softcapped_silu",
          dict(
              activation="softcapped_silu", gate_softcap=20.0, up_softcap=20.0
          ),
      ),
  )
  def test_epilogue_activations_lower(self, settings):
    # The clamp and the registry's GLUs in the fused epilogue: the Triton
    # lowering has every op they use (min, max, logistic, tanh).
    cfg = moe_core.MoEConfig(
        num_experts=self.E,
        top_k=8,
        hidden_size=self.D,
        expert_ffn_size=self.F,
        **settings,
    )
    be = pallas_backend.PallasBackend(interpret=False, fuse_activation=True)
    self.assertEqual(
        be.checkpoint_names(cfg),
        (*backend_lib.FUSED_CHECKPOINT_NAMES, backend_lib.DOWN_NAME),
    )
    text = self._export_expert_ffn_grad(cfg, True, self.M)
    self.assertEqual(_custom_calls(text), [_TRITON_CALL] * 6)

  def _export_expert_ffn_grad(self, cfg, fuse_activation, num_rows):
    """The CUDA export of value_and_grad of a pallas expert FFN, as text."""
    be = pallas_backend.PallasBackend(
        interpret=False, fuse_activation=fuse_activation
    )
    params = {
        n: _S(s, jnp.bfloat16)
        for n, s in moe_core.param_shapes(cfg).items()
        if n in ("w_gate", "w_up", "w_down")
    }

    def loss(rows, p, g):
      out = be.expert_ffn(rows, g, p, cfg)
      return jnp.sum(jnp.square(out.astype(jnp.float32)))

    return _export_for_cuda(
        jax.value_and_grad(loss, argnums=(0, 1)),
        _S((num_rows, self.D), jnp.bfloat16),
        params,
        _S((self.E,), jnp.int32),
    )

  def test_expert_ffn_at_timed_rows_uses_the_large_tiles(self):
    """bench/gpu_check's M = 32768 rows: 1024 per expert, the large config."""
    m = 32768
    self.assertEqual(
        tiling.heuristic(
            "fwd", m, self.F, self.D, self.E, jnp.bfloat16, interpret=False
        ),
        tiling.GPU_TILES["gmm_bf16_large"],
    )
    cfg = moe_core.MoEConfig(
        num_experts=self.E, top_k=8, hidden_size=self.D, expert_ffn_size=self.F
    )
    text = self._export_expert_ffn_grad(cfg, True, m)
    self.assertEqual(_custom_calls(text), [_TRITON_CALL] * 6)

  def test_moe_layer_value_and_grad(self):
    cfg = moe_core.MoEConfig(
        num_experts=8,
        top_k=2,
        hidden_size=256,
        expert_ffn_size=512,
        shared_ffn_size=256,
    )
    be = pallas_backend.PallasBackend(interpret=False)
    params = {
        n: _S(s, jnp.bfloat16) for n, s in moe_core.param_shapes(cfg).items()
    }

    def loss(p, x):
      y, _ = moe_core.moe_layer(p, x, cfg, backend=be)
      return jnp.sum(jnp.square(y.astype(jnp.float32)))

    text = _export_for_cuda(
        jax.value_and_grad(loss, argnums=(0, 1)),
        params,
        _S((4, 128, 256), jnp.bfloat16),
    )
    self.assertEqual(_custom_calls(text), [_TRITON_CALL] * 6)


class QuantizedLowerTest(parameterized.TestCase):
  """The quantised grouped GEMM through the backend: FP8 into the kernel.

  The rows and weights reach the Triton call as float8_e4m3fn (f8E4M3FN)
  arrays, so the kernel's dot is an FP8 one (a wgmma on Hopper), not a
  float32 product of data upcast outside it.
  """

  M, K, N, E = 1024, 512, 384, 8

  @parameterized.product(
      recipe=["fp8_tensor", "fp8_block"], transpose_rhs=[False, True]
  )
  def test_fp8_operands_go_into_the_triton_call(self, recipe, transpose_rhs):
    be = pallas_backend.PallasBackend(interpret=False)
    m, k, n, e = self.M, self.K, self.N, self.E
    w_shape = (e, n, k) if transpose_rhs else (e, k, n)

    def gemm(rows, weights, group_sizes):
      return be.grouped_gemm(
          rows,
          weights,
          group_sizes,
          transpose_rhs=transpose_rhs,
          precision=recipe,
      )

    text = _export_for_cuda(
        gemm,
        _S((m, k), jnp.bfloat16),
        _S(w_shape, jnp.bfloat16),
        _S((e,), jnp.int32),
    )
    self.assertEqual(_custom_calls(text), [_TRITON_CALL])
    (call,) = [line for line in text.splitlines() if _TRITON_CALL in line]
    # The call's signature: "(operand types) -> result type".
    operand_types = call[call.rindex(" : (") : call.rindex(") -> ")]
    self.assertIn(f"tensor<{m}x{k}xf8E4M3FN>", operand_types)
    w_type = "x".join(map(str, w_shape))
    self.assertIn(f"tensor<{w_type}xf8E4M3FN>", operand_types)
    self.assertIn(f"-> tensor<{m}x{n}xf32>", call)


class TritonDeprecationTest(absltest.TestCase):
  """jax >= 0.11 warns at each Triton lowering; the helper eats and counts it.

  If JAX rewords the warning, compat's exact-message filter stops matching
  and this test fails: update compat.TRITON_DEPRECATION_MESSAGE.
  """

  def test_each_warning_is_counted_and_none_escapes(self):
    tiles = tiling.GPU_TILES["gmm_bf16"]
    args = (
        _S((64, 32), jnp.bfloat16),
        _S((4, 32, 48), jnp.bfloat16),
        _S((4,), jnp.int32),
    )

    def program():  # A new function each time: nothing is reused.
      return lambda x, w, g: kernels.gmm(
          [x], [w], g, tiles=tiles, interpret=False
      )[0]

    def about_triton(shown):
      return [
          str(w.message) for w in shown if "Pallas Triton" in str(w.message)
      ]

    with warnings.catch_warnings(record=True) as shown:
      warnings.simplefilter("always")
      with compat.abstract_gpu_mesh():  # The bare export: what JAX says.
        export.export(
            jax.jit(program()),
            platforms=["cuda"],
            disabled_checks=[
                export.DisabledSafetyCheck.custom_call(_TRITON_CALL)
            ],
        )(*args)
      raised = about_triton(shown)
      del shown[:]
      before = compat.triton_deprecations_filtered()
      _export_for_cuda(program(), *args)
      escaped = about_triton(shown)
    print(
        f"jax {jax.__version__} warned {len(raised)} time(s) for one "
        "Triton kernel"
    )
    self.assertEqual(raised, [compat.TRITON_DEPRECATION_MESSAGE] * len(raised))
    self.assertEqual(escaped, [])
    self.assertEqual(
        compat.triton_deprecations_filtered() - before, len(raised)
    )


class OnATpuTest(absltest.TestCase):
  """On a TPU (or lowering for one), pallas says what it can do there: its
  interpreter, and 'mosaic_tpu' or 'xla' instead. A compiled call raises
  NotImplementedError with that line, not the bare AssertionError of Triton
  parameters reaching Pallas' Mosaic TPU lowering, so "auto" moves on.
  The platform is patched: `gpu.lowering_platform` is where the kernels
  read it (a TPU here, or the abstract TPU of a topology lowered for)."""

  def setUp(self):
    super().setUp()
    patch = mock.patch.object(gpu, "lowering_platform", return_value="tpu")
    patch.start()
    self.addCleanup(patch.stop)
    self.cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=16, expert_ffn_size=32
    )
    self.params = moe_core.init_params(jax.random.key(0), self.cfg)
    self.x = jax.random.normal(jax.random.key(1), (8, 16))

  def test_compiled_is_unavailable_with_one_line_naming_what_to_use(self):
    ok, reason = moe_core.get_backend("pallas", interpret=False).availability()
    self.assertFalse(ok)
    self.assertEqual(reason, kernels.ON_TPU)
    self.assertNotIn("\n", reason)
    for text in ("interpret=True", "'mosaic_tpu'", "'xla'", "TPU"):
      self.assertIn(text, reason)

  def test_interpreted_stays_available(self):
    for interpret in (None, True):
      with self.subTest(interpret=interpret):
        backend = moe_core.get_backend("pallas", interpret=interpret)
        self.assertEqual(backend.availability(), (True, ""))

  def test_compiled_call_raises_not_implemented_with_that_line(self):
    backend = moe_core.get_backend("pallas", interpret=False)
    rows = jnp.ones((8, 16), jnp.bfloat16)
    weights = jnp.ones((2, 16, 32), jnp.bfloat16)
    sizes = jnp.array([3, 5], jnp.int32)
    for fn in (backend.grouped_gemm, jax.jit(backend.grouped_gemm)):
      with self.assertRaises(NotImplementedError) as raised:
        fn(rows, weights, sizes)
      self.assertEqual(str(raised.exception), kernels.ON_TPU)

  def test_auto_moves_on_to_the_next_backend(self):
    compiled = moe_core.get_backend("pallas", interpret=False)
    xla = moe_core.get_backend("xla")
    with mock.patch.object(
        registry, "auto_candidates", return_value=[compiled, xla]
    ):
      y, _ = moe_core.moe_layer(self.params, self.x, self.cfg, backend="auto")
    want, _ = moe_core.moe_layer(self.params, self.x, self.cfg, backend=xla)
    np.testing.assert_array_equal(y, want)


if __name__ == "__main__":
  absltest.main()
