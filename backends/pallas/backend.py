"""PallasBackend: tile-list Pallas kernels; Triton on GPU, interpret on CPU."""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from backends.pallas import ops
from backends.pallas import tiling
from moe_core import operands
from moe_core import precision
from moe_core.kernels import tile_backend


def _resolve_interpret(interpret):
  """None: interpret on the CPU; "debug": the bounds-checking interpreter."""
  if interpret is None:
    # The CPU has no Pallas lowering: run the same kernels interpreted there.
    return jax.default_backend() == "cpu"
  if interpret == "debug":
    # Imported here: only this debug mode needs the TPU interpreter.
    # pylint: disable-next=g-import-not-at-top
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()
  if isinstance(interpret, bool):
    return interpret
  if type(interpret).__name__ == "InterpretParams":
    return interpret
  raise ValueError(
      "interpret must be None (automatic), True, False, 'debug' "
      f"or a pltpu.InterpretParams, got {interpret!r}."
  )


class PallasBackend(tile_backend.TileKernelBackend):
  """Grouped GEMMs as Pallas kernels over a tile list; no host sync, no padding.

  Args:
    tiles: block sizes and Triton settings: None (the shape heuristic of
      `tiling.heuristic`), a `tiling.Tiles` for every kernel, a
      `tiling.TileConfig` (per kernel: fwd, dgrad, wgrad) or the dict form of
      either (`tiling.TileConfig.parse`).
    interpret: None runs the kernels interpreted on the CPU and compiled
      (Triton) on the GPU; True / False force it; "debug" uses the
      bounds-checking interpreter (slow: small shapes only).
    fuse_activation: compute act(gate) * up in the gate/up kernel's epilogue
      (for the activations in `ops.EPILOGUE_ACTIVATIONS`; others, such as the
      exact "gelu", run unfused). The gate and up outputs then exist only
      inside that op, so the "moe_gate"/"moe_up" checkpoint names are not
      emitted: only "moe_down" is (`checkpoint_names`).
  """

  name: ClassVar[str] = "pallas"
  ops: ClassVar[ModuleType] = ops
  # FP8 recipes: the E4M3 data go into the kernel (an FP8 MMA on Hopper),
  # the scales applied there after each K block's product; MXFP8 and NVFP4
  # dequantised per block in the kernel (`ops.quantized_grouped_gemm`).
  precisions: ClassVar[tuple[str, ...]] = precision.RECIPES
  dtypes: ClassVar[tuple[jnp.dtype, ...]] = tuple(
      jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16)
  )

  def __init__(
      self,
      *,
      tiles: tiling.TileConfig | tiling.Tiles | dict | None = None,
      interpret: Any = None,
      fuse_activation: bool = False,
  ):
    self.check_fuse_activation(fuse_activation)
    self.launch = ops.Launch(
        tiles=tiling.TileConfig.parse(tiles),
        interpret=_resolve_interpret(interpret),
    )
    self.fuse_activation = fuse_activation

  def availability(self) -> tuple[bool, str]:
    if self.launch.interpreting:
      return True, ""
    platform = jax.default_backend()
    if platform == "gpu":
      return True, ""
    return False, (
        f"pallas: the kernels lower through Triton for GPUs only, "
        f"not {platform}; pass interpret=True to interpret them."
    )

  def _quantized_grouped_gemm(
      self, q: operands.QuantizedGemmOperands
  ) -> jax.Array:
    """The quantised data into the kernel, scales applied there: [M, N]."""
    return ops.quantized_grouped_gemm(q, self.launch)
