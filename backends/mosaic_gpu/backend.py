"""MosaicGpuBackend: tile-list grouped GEMMs on Hopper's wgmma and TMA."""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from backends.mosaic_gpu import ops
from backends.mosaic_gpu import tiling
from moe_core.kernels import gpu
from moe_core.kernels import tile_backend

# Compute capabilities the kernels are built for and tested on: wgmma on
# sm_90 (kernels.py), tcgen05 on sm_100 (kernels_sm100.py).
SUPPORTED_CAPABILITIES = (90, 100)
# jax 0.10.2's Mosaic GPU interpreter fails on a transposed wgmma operand
# (AttributeError: 'TransposeTransform' object has no attribute 'indices');
# 0.11.2 and 0.12 interpret it. The compiled path is unaffected.
INTERPRETER_TRANSPOSES = tuple(
    int(p) for p in jax.__version__.split(".")[:2]
) >= (0, 11)


def gpu_unavailable_reason(device) -> str:
  """Why `device` cannot run the compiled kernels; "" when it can."""
  if device.platform != "gpu":
    return (
        "mosaic_gpu: the kernels are Mosaic GPU programs for NVIDIA Hopper "
        f"(sm_90) and Blackwell (sm_100) GPUs; this device is "
        f"{device.platform}. "
        "Pass interpret=True to run them in Mosaic GPU's interpreter."
    )
  capability = gpu.probe(device).capability
  if capability not in SUPPORTED_CAPABILITIES:
    supported = map(gpu.capability_text, SUPPORTED_CAPABILITIES)
    return (
        "mosaic_gpu: the kernels use wgmma (sm_90) or tcgen05 (sm_100): "
        f"compute capability {' or '.join(supported)}; "
        f"{device.device_kind} has {gpu.capability_text(capability)}."
    )
  return ""


class MosaicGpuBackend(tile_backend.TileKernelBackend):
  """Grouped GEMMs as Mosaic GPU kernels over a tile list; no host sync.

  Forward and dX run on warpgroup MMAs fed by TMA pipelines
  (`kernels.gmm`); dW runs on the Pallas Triton kernel (`ops`).

  Args:
    tiles: gmm block sizes and pipeline depth: None (the table in
      `tiling.TABLE`, fitted), a `tiling.Tiles` for both kinds, a
      `tiling.TileConfig` (fwd, dgrad) or the dict form of either.
    interpret: None: auto, compiled when the program is lowered for a GPU
      (a GPU here, or `moe_core.aot`'s target from any host), interpreted
      otherwise; True: the backend's interpreter, on any platform; False:
      compiled for a GPU, unavailable elsewhere
      (`moe_core.kernels.interpret`). Here True is Mosaic GPU's
      interpreter (jax >= 0.11), or an `InterpretGPUParams` with its
      settings: it simulates the GPU's threads, slow, for tests at small
      shapes. Default False: off a GPU the backend says to pass
      interpret=True rather than run that slowly unasked.
    generation: "sm90" (Hopper wgmma kernels) or "sm100" (Blackwell
      tcgen05 kernels); None picks, when the program is traced, by the
      GPU it is lowered for (`moe_core.aot`'s target) or else the first
      device's compute capability ("sm90" off a GPU).
    fuse_activation: compute the gated activation (clamp and options
      included) in the gate/up kernel's epilogue (for
      `ops.EPILOGUE_ACTIVATIONS`, without biases); as for `pallas`, the
      "moe_gate"/"moe_up" checkpoint names are then not emitted. Off by
      default, as for pallas and triton: opt-in until a GPU measurement
      shows it faster.
  """

  name: ClassVar[str] = "mosaic_gpu"
  ops: ClassVar[ModuleType] = ops
  # wgmma takes float32 only as TF32, which would not meet the float32
  # contract: float32 raises NotImplementedError, and "auto" falls through.
  dtypes: ClassVar[tuple[jnp.dtype, ...]] = tuple(
      jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16)
  )

  def __init__(
      self,
      *,
      tiles: tiling.TileConfig | tiling.Tiles | dict | None = None,
      interpret: Any = False,
      fuse_activation: bool = False,
      generation: str | None = None,
  ):
    self.check_fuse_activation(fuse_activation)
    if generation is not None:
      tiling.check_generation(generation)
    self.launch = ops.Launch(
        tiles=tiling.TileConfig.parse(tiles),
        interpret=ops.INTERPRETER.parse(interpret),
        generation=generation,
    )
    self.fuse_activation = fuse_activation

  def _repr_options(self) -> dict[str, str]:
    return {
        **super()._repr_options(),
        "generation": repr(self.launch.generation),
    }

  def availability(self) -> tuple[bool, str]:
    if self.launch.interpreting:
      if not INTERPRETER_TRANSPOSES:
        return False, (
            f"mosaic_gpu: jax {jax.__version__}'s Mosaic GPU interpreter "
            "cannot read a transposed wgmma operand (every dX reads the "
            "weights transposed); it can from jax 0.11."
        )
      return True, ""
    device = jax.devices()[0]
    reason = gpu_unavailable_reason(device)
    wanted = self.launch.generation
    if not reason and wanted and tiling.generation(device) != wanted:
      reason = (
          f"mosaic_gpu: built for {wanted}, but "
          f"{device.device_kind} is {tiling.generation(device)}."
      )
    return not reason, reason
