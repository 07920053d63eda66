"""Every triton kernel and shipped config, compiled for sm_90 and sm_100."""

import os

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp

from backends.testing import triton_aot_compile
from backends.triton import configs
from backends.triton import launch

# No GPU is needed: triton.compile builds the cubin on the host, and
# `triton_aot_compile.compile_kernel` reads its shared memory (Triton's
# metadata) and its registers and stack frame (the cubin's own attributes).
# Each case must fit the target: shared memory <= 227 KiB, registers <= 255
# per thread and within 64K per block, and no more than a few registers
# spilled.

_CAPABILITIES = {90: "sm90", 100: "sm100"}
# The constexpr shapes (DeepSeek-V3's expert GEMMs on a 32-expert slice,
# top-8 routing of 4096 tokens): they set loop bounds and masks, not the
# size of the code.
_GEMM_SHAPE = {"M": 4096, "K": 7168, "N": 2048, "E": 32}
_TGMM_SHAPE = {"M": 4096, "P": 7168, "Q": 2048, "E": 32}
_PERMUTE_SHAPE = {"T": 4096, "K": 8, "D": 7168}
# A stack frame a few registers wide is tolerated: ptxas from triton 3.9
# gives the float32 gmm (held to 168 registers) a 16-byte one. A config
# that does not fit spills kilobytes (a float32 128x128 tile: 17 KB).
_MAX_LOCAL_BYTES = 64
_PERMUTE_KERNELS = (
    "permute",
    "permute_bwd",
    "unpermute",
    "unpermute_bwd_rows",
    "unpermute_bwd_weights",
)
# The kernels of each kind of TABLE, with the constexprs that select the
# variant the backend launches for it.
_KIND_KERNELS = {
    "fwd": (("gmm", {"TRANSPOSE_W": False}),),
    "dgrad": (("gmm", {"TRANSPOSE_W": True}),),
    "gated": (("gmm", {"ACTIVATION": "silu"}),),
    "wgrad": (("tgmm", {}),),
    "permute": tuple((name, {}) for name in _PERMUTE_KERNELS),
}
# Epilogue variants, compiled with the "default" entries only (the main
# loop, which the config shapes, is the same code).
_VARIANTS = {
    "fwd": (("gmm", {"TRANSPOSE_W": False, "HAS_ROW_SCALE": True}),),
    "gated": (
        ("gmm", {"ACTIVATION": "gelu"}),
        ("gmm", {"ACTIVATION": "gelu_tanh"}),
        ("gmm", {"ACTIVATION": "silu", "SWIGLU_LIMIT": 7.0}),
        (
            "gmm",
            {
                "ACTIVATION": "gpt_oss_glu",
                "SWIGLU_ALPHA": 1.702,
                "SWIGLU_LIMIT": 7.0,
            },
        ),
        (
            "gmm",
            {
                "ACTIVATION": "softcapped_silu",
                "GATE_SOFTCAP": 20.0,
                "UP_SOFTCAP": 20.0,
            },
        ),
    ),
    "wgrad": (("tgmm", {"HAS_ROW_SCALE": True}),),
}


def _cases():
  """(name, capability, kind, kernel, dtype, config, constexprs), distinct.

  bfloat16 with every entry of the capability's generation, and the
  epilogue variants with its "default" entries; the GEMMs in float32 with
  the same entries as `configs.choose` fits them for float32 operands
  (several entries fit to one config).
  """
  cases, seen = [], set()
  for capability, generation in _CAPABILITIES.items():
    for (gen, kind, bucket), entry in sorted(configs.TABLE.items()):
      if gen != generation:
        continue
      for dtype in ("bfloat16", "float32"):
        kernels = _KIND_KERNELS[kind]
        if dtype == "bfloat16" and bucket == "default":
          kernels += _VARIANTS.get(kind, ())
        if dtype == "float32" and kind == "permute":
          continue
        config = configs.fit(entry, kind, jnp.dtype(dtype))
        for name, extra in kernels:
          key = (capability, name, dtype, config, tuple(sorted(extra.items())))
          if key in seen:
            continue
          seen.add(key)
          label = "_".join(
              [f"sm{capability}", kind, name, bucket, dtype]
              + [
                  f"{k}_{v}".lower()
                  for k, v in sorted(extra.items())
                  if k != "TRANSPOSE_W"
              ]
          )
          cases.append((label, capability, kind, name, dtype, config, extra))
  return cases


_CASES = _cases()


def _modules():
  """(kernels, permute_kernels), imported here: they import triton."""
  # pylint: disable=g-import-not-at-top
  from backends.triton import kernels
  from backends.triton import permute_kernels
  # pylint: enable=g-import-not-at-top

  return kernels, permute_kernels


class CompileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if os.environ.get("DROPLESS_TRITON_COMPILE") == "0":
      # .ci/run's oldest leg: its triton 3.8.0 is there for the interpreter;
      # the compile is checked on the GPU machine's 3.6.0 and the newest.
      self.skipTest(
          "DROPLESS_TRITON_COMPILE=0: the sm_90/sm_100 compile is checked "
          "on the legs with triton 3.6.0 (the GPU machine's) and 3.9.0"
      )
    try:
      self.kernels, self.permute_kernels = _modules()
    except ImportError as e:
      self.skipTest(f"triton is not installed, nothing to compile: {e}")
    ok, reason = launch.compilable()
    if not ok:
      self.skipTest(reason)

  def test_the_cases_cover_every_kernel(self):
    covered = {name for _, _, _, name, _, _, _ in _CASES}
    self.assertEqual(
        covered,
        set(self.kernels.KERNELS) | set(self.permute_kernels.KERNELS),
    )

  @parameterized.named_parameters(_CASES)
  def test_fits_the_target(self, capability, kind, name, dtype, config, extra):
    if kind == "permute":
      kernel = self.permute_kernels.KERNELS[name]
      signature, constexprs = self.permute_kernels.signature(
          name,
          dtype,
          **_PERMUTE_SHAPE,
          **configs.block_constexprs(kind, config, kernel),
      )
    else:
      kernel = self.kernels.KERNELS[name]
      shape = _TGMM_SHAPE if kind == "wgrad" else _GEMM_SHAPE
      signature, constexprs = self.kernels.signature(
          name,
          dtype,
          dtype,
          **shape,
          **extra,
          **configs.block_constexprs(kind, config),
      )
    info = triton_aot_compile.compile_kernel(
        kernel,
        signature,
        constexprs,
        capability,
        config.num_warps,
        config.num_stages,
    )
    self.assertEqual(info.violations(), [], f"{info} with {config}")
    self.assertLessEqual(
        info.local_bytes,
        _MAX_LOCAL_BYTES,
        f"{name} spills with {config}: {info}",
    )
    self.assertLessEqual(info.shared_bytes, configs.SMEM_BYTES)


if __name__ == "__main__":
  absltest.main()
