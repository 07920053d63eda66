"""Lowers the Mosaic GPU kernels for CUDA on this (CPU) machine via jax.export.

Pallas' Mosaic GPU lowering (layouts, TMA transfers, the pipeline, wgmma
operand shapes) runs in Python at export, so a kernel that would not lower
for Hopper fails here without a GPU; PTX is produced only on the GPU, when
the custom call is compiled (`bench/on_device/gpu_check.py` does that).
Every shipped tile configuration is lowered for each kernel that uses it,
and the backend's whole expert FFN and MoE layer, forward and gradient, at
DeepSeek-V3 expert shapes. The dW in the gradients is the Pallas Triton
kernel, lowered for an abstract H200 (moe_core/testing/cuda_export.py).
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

import moe_core
from backends.mosaic_gpu import backend as mosaic_backend
from backends.mosaic_gpu import ops
from backends.mosaic_gpu import tiling
from moe_core import activations
from moe_core import backend as backend_lib
from moe_core.testing import cuda_export

_MOSAIC_CALL = "mosaic_gpu_v2"
_S = jax.ShapeDtypeStruct


def _custom_calls(fn, *args, generation="sm90") -> list[str]:
  # sm_90 is Mosaic GPU's default target; sm_100 needs an abstract device
  # with that compute capability.
  options = (
      {"abstract_gpu": cuda_export.AbstractGpu()}
      if generation == "sm100"
      else {}
  )
  exported = cuda_export.export_for_cuda(fn, *args, **options)
  text = exported.mlir_module()
  if generation == "sm100":
    # The Blackwell MMA is in the serialized kernel, Hopper's is not.
    self_check = ("tcgen05" in text, "wgmma" in text)
    if self_check != (True, False):
      raise AssertionError(f"sm_100 module: (tcgen05, wgmma) {self_check}")
  return cuda_export.custom_calls(text)


def _launch(tiles, generation="sm90"):
  return ops.Launch(
      tiles=tiling.TileConfig(fwd=tiles, dgrad=tiles), generation=generation
  )


class ShippedTilesLowerTest(parameterized.TestCase):
  """Each entry of tiling.TABLE, in each kernel that uses it."""

  M, C, N, E = 1024, 256, 384, 8

  @parameterized.named_parameters(
      ("_".join(key), tiles)
      for key, tiles in tiling.TABLE.items()
      if key[2] != "two_acc"
  )
  def test_grouped_gemm_lowers(self, tiles):
    generation = self._testMethodName.split("lowers_")[1].split("_")[0]
    m, c, n, e = self.M, self.C, self.N, self.E
    launch = _launch(tiles, generation)
    for transpose_rhs in (False, True):
      with self.subTest(transpose_rhs=transpose_rhs):
        w = _S((e, n, c) if transpose_rhs else (e, c, n), jnp.bfloat16)
        calls = _custom_calls(
            lambda x, w, g, t=transpose_rhs: ops.grouped_gemm(
                x, w, g, t, jnp.bfloat16, launch
            ),
            _S((m, c), jnp.bfloat16),
            w,
            _S((e,), jnp.int32),
            generation=generation,
        )
        self.assertEqual(calls, [_MOSAIC_CALL])

  @parameterized.named_parameters(
      ("_".join(key), tiles)
      for key, tiles in tiling.TABLE.items()
      if key[2] == "two_acc"
  )
  def test_gate_up_lowers(self, tiles):
    generation = self._testMethodName.split("lowers_")[1].split("_")[0]
    m, d, f, e = self.M, self.C, self.N, self.E
    launch = _launch(tiles, generation)
    args = (
        _S((m, d), jnp.bfloat16),
        _S((e, d, f), jnp.bfloat16),
        _S((e, d, f), jnp.bfloat16),
        _S((e,), jnp.int32),
    )
    for name, fn in (
        ("gate_up", lambda x, wg, wu, g: ops.gate_up(x, wg, wu, g, launch)),
        (
            "gated_gate_up",
            lambda x, wg, wu, g: ops.gated_gate_up(
                x, wg, wu, g, "silu", launch
            ),
        ),
    ):
      with self.subTest(name):
        self.assertEqual(
            _custom_calls(fn, *args, generation=generation), [_MOSAIC_CALL]
        )


class EpilogueActivationsLowerTest(parameterized.TestCase):
  """Each gated activation of EPILOGUE_ACTIVATIONS, with the clamp, in the
  fused gate+up kernel's epilogue of both generations.

  Numerics are interpret_test's; this shows the lowering has every op the
  epilogue uses (sigmoid, tanh, min, max) for real GPUs.
  """

  M, D, F, E = 512, 256, 256, 8
  SETTINGS = {
      "silu_clamped": activations.Settings("silu", swiglu_limit=7.0),
      "gelu_tanh_clamped": activations.Settings("gelu_tanh", swiglu_limit=7.0),
      "gpt_oss_glu_clamped": activations.Settings(
          "gpt_oss_glu", swiglu_limit=7.0, swiglu_alpha=1.702
      ),
      "softcapped_silu": activations.Settings(
          "softcapped_silu", gate_softcap=10.0, up_softcap=10.0
      ),
  }

  def test_every_epilogue_activation_has_a_case(self):
    self.assertEqual(
        sorted({s.name for s in self.SETTINGS.values()}),
        sorted(ops.EPILOGUE_ACTIVATIONS),
    )

  def test_what_the_epilogue_cannot_compute_runs_unfused(self):
    # The exact gelu (erfc does not lower) and biased FFNs: all three names,
    # the template's unfused path; asked directly, the op refuses gelu.
    be = mosaic_backend.MosaicGpuBackend(fuse_activation=True)
    base = dict(num_experts=4, top_k=2, hidden_size=64, expert_ffn_size=64)
    for changes in (
        dict(activation="gelu"),
        dict(expert_bias=True, swiglu_limit=7.0),
    ):
      cfg = moe_core.MoEConfig(**base, **changes)
      self.assertEqual(
          be.checkpoint_names(cfg), backend_lib.CHECKPOINT_NAMES, changes
      )
    x = jnp.zeros((8, 8), jnp.bfloat16)
    w = jnp.zeros((1, 8, 8), jnp.bfloat16)
    with self.assertRaisesRegex(
        ValueError, r"to run in the kernel epilogue, got 'gelu'"
    ):
      ops.gated_gate_up(
          x, w, w, jnp.array([8], jnp.int32), "gelu", ops.Launch()
      )

  @parameterized.product(settings=tuple(SETTINGS), generation=("sm90", "sm100"))
  def test_gated_gate_up_lowers(self, settings, generation):
    launch = ops.Launch(generation=generation)
    m, d, f, e = self.M, self.D, self.F, self.E
    calls = _custom_calls(
        lambda x, wg, wu, g: ops.gated_gate_up(
            x, wg, wu, g, self.SETTINGS[settings], launch
        ),
        _S((m, d), jnp.bfloat16),
        _S((e, d, f), jnp.bfloat16),
        _S((e, d, f), jnp.bfloat16),
        _S((e,), jnp.int32),
        generation=generation,
    )
    self.assertEqual(calls, [_MOSAIC_CALL])


class DeepSeekShapesLowerTest(parameterized.TestCase):
  """The backend as it runs (table tiles) at DeepSeek-V3 expert shapes.

  D=7168, F=2048, 256 experts, top-8 of 4096 tokens: M = 32768 rows.
  """

  D, F, E, M = 7168, 2048, 256, 32768

  @parameterized.parameters((False, "sm90"), (True, "sm90"), (True, "sm100"))
  def test_expert_ffn_forward_and_gradient_lower(
      self, fuse_activation, generation
  ):
    be = mosaic_backend.MosaicGpuBackend(
        fuse_activation=fuse_activation, generation=generation
    )
    cfg = moe_core.MoEConfig(
        num_experts=self.E,
        top_k=8,
        hidden_size=self.D,
        expert_ffn_size=self.F,
    )
    params = {
        "w_gate": _S((self.E, self.D, self.F), jnp.bfloat16),
        "w_up": _S((self.E, self.D, self.F), jnp.bfloat16),
        "w_down": _S((self.E, self.F, self.D), jnp.bfloat16),
    }
    rows = _S((self.M, self.D), jnp.bfloat16)
    sizes = _S((self.E,), jnp.int32)

    def loss(rows, params, sizes):
      y = be.expert_ffn(rows, sizes, params, cfg)
      # Squared, so the gradient needs y (a plain sum's would not).
      return jnp.sum(jnp.square(y.astype(jnp.float32)))

    forward = _custom_calls(
        lambda r, p, g: be.expert_ffn(r, g, p, cfg),
        rows,
        params,
        sizes,
        generation=generation,
    )
    # gate+up in one kernel, then down.
    self.assertEqual(forward, [_MOSAIC_CALL] * 2)
    backward = _custom_calls(
        jax.grad(loss, argnums=(0, 1)),
        rows,
        params,
        sizes,
        generation=generation,
    )
    # Forward (2), dX of down and of gate+up (2): Mosaic GPU; dW of down
    # and of gate+up (2): Pallas Triton.
    self.assertEqual(backward.count(_MOSAIC_CALL), 4, backward)
    self.assertEqual(backward.count(cuda_export.TRITON_CALL), 2, backward)

  def test_moe_layer_lowers(self):
    cfg = moe_core.MoEConfig(
        num_experts=16, top_k=4, hidden_size=512, expert_ffn_size=256
    )
    params = moe_core.init_params(jax.random.key(0), cfg, jnp.bfloat16)
    be = mosaic_backend.MosaicGpuBackend(fuse_activation=True)

    def loss(params, x):
      y, _ = moe_core.moe_layer(params, x, cfg, backend=be)
      return jnp.sum(jnp.square(y.astype(jnp.float32)))

    calls = _custom_calls(
        jax.grad(loss, argnums=(0, 1)),
        jax.tree.map(lambda a: _S(a.shape, a.dtype), params),
        _S((256, 512), jnp.bfloat16),
    )
    self.assertEqual(calls.count(_MOSAIC_CALL), 4, calls)


if __name__ == "__main__":
  absltest.main()
