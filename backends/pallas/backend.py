"""PallasBackend: tile-list Pallas kernels; Triton on GPU, interpret on CPU."""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from backends.pallas import kernels
from backends.pallas import ops
from backends.pallas import tiling
from moe_core import operands
from moe_core import precision
from moe_core.kernels import gpu
from moe_core.kernels import tile_backend


class PallasBackend(tile_backend.TileKernelBackend):
  """Grouped GEMMs as Pallas kernels over a tile list; no host sync, no padding.

  Args:
    tiles: block sizes and Triton settings: None (the shape heuristic of
      `tiling.heuristic`), a `tiling.Tiles` for every kernel, a
      `tiling.TileConfig` (per kernel: fwd, dgrad, wgrad) or the dict form of
      either (`tiling.TileConfig.parse`).
    interpret: None: auto, compiled when the program is lowered for a GPU
      (a GPU here, or `moe_core.aot`'s target from any host), interpreted
      otherwise; True: the backend's interpreter, on any platform; False:
      compiled for a GPU, unavailable elsewhere
      (`moe_core.kernels.interpret`). Here True is pallas_call's HLO
      interpreter, and "debug" or a `pltpu.InterpretParams` the
      bounds-checking interpreter (slow: small shapes only). Default None:
      the kernels lower through Triton on a GPU, and the interpreter is
      cheap enough to run them anywhere else.
    fuse_activation: compute the gated activation (clamp and options
      included) in the gate/up kernel's epilogue (for the activations in
      `ops.EPILOGUE_ACTIVATIONS`; others, such as the exact "gelu" or a
      registered one, and any config with `expert_bias`, run unfused:
      `tile_backend.epilogue_computes`). The gate and up outputs then
      exist only inside that op, so the "moe_gate"/"moe_up" checkpoint
      names are not emitted: only "moe_down" is (`checkpoint_names`). Off
      by default, as for mosaic_gpu and triton: opt-in until a GPU
      measurement shows it faster.
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
        interpret=ops.INTERPRETER.parse(interpret),
    )
    self.fuse_activation = fuse_activation

  def availability(self) -> tuple[bool, str]:
    if self.launch.interpreting:
      return True, ""
    if gpu.lowering_platform() == "tpu":
      return False, kernels.ON_TPU
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
