"""CpuBackend: the grouped GEMM as native XLA:CPU custom calls (XLA FFI)."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from backends.cpu import kernels
from backends.cpu import library
from backends.cpu import verdicts
from moe_core import operands
from moe_core import precision
from moe_core import quantized_gemm
from moe_core.kernels import kernels_backend


class CpuBackend(kernels_backend.GroupedKernelsBackend):
  """One blocked GEMM per (group, row chunk, column block), threaded.

  The forward, dX and dW are the FFI custom calls `library.TARGETS`, which
  read the group sizes inside the call: no padding, no host round trip, no
  loop of copies. `moe_core.kernels.grouped_matmul` differentiates them
  (grad, jvp, vmap, shard_map, export); `GroupedKernelsBackend` makes them
  the grouped GEMM. The library picks its kernels from the CPU
  (`kernels()`: AMX, AVX-512 with or without BF16, AVX2, else portable
  C++).
  Off the CPU, or without the built library, `availability()` says why and
  "auto" moves on; where this CPU's kernels lose to xla's, so does
  `auto_choice()`.
  """

  name: ClassVar[str] = "cpu"
  dtypes: ClassVar[tuple[jnp.dtype, ...]] = kernels.DTYPES
  # FP8/FP4 recipes as the xla backend computes them: the dequantised
  # values, float32 and exact, through these kernels, scaled per K block.
  precisions: ClassVar[tuple[str, ...]] = precision.RECIPES
  # Custom calls an exported program of this backend holds (jax.export
  # needs them named in disabled_checks: they are ours, not XLA's stable
  # set).
  custom_call_targets: ClassVar[tuple[str, ...]] = library.TARGETS

  def availability(self) -> tuple[bool, str]:
    if not kernels.AVAILABLE:
      return False, kernels.WHY_NOT
    platform = jax.default_backend()
    if platform != "cpu":
      return False, f"cpu: the kernels run on the CPU, not {platform}."
    return True, ""

  def auto_choice(self) -> tuple[bool, str]:
    """Passed over by "auto" where this CPU's kernels lose to xla's: the
    measured verdicts of `verdicts.VERDICTS`, never a timing."""
    return verdicts.auto_choice(self.kernels())

  def kernels(self) -> str:
    """Which kernel set runs here: "amx", "avx512-bf16", "avx512", "avx2",
    "portable", or the test-only "amx-emulated" (docs/cpu.md)."""
    return library.kernels()

  def __repr__(self) -> str:
    return f"CpuBackend(kernels={self.kernels() or 'unavailable'!r})"

  def _quantized_grouped_gemm(
      self, q: operands.QuantizedGemmOperands
  ) -> jax.Array:
    """The float32 custom call on the dequantised blocks, scaled per K."""
    return quantized_gemm.scaled_grouped_gemm(
        q, quantized_gemm.float32_gemm(self._grouped_gemm)
    )

  def grouped_kernels(self) -> kernels.CpuKernels:
    return kernels.CpuKernels()
