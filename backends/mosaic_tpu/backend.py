"""MosaicTpuBackend: grouped GEMMs as Pallas Mosaic TPU kernels."""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from backends.mosaic_tpu import ops
from backends.mosaic_tpu import tiling
from moe_core import precision as precision_lib
from moe_core.kernels import tile_backend


class MosaicTpuBackend(tile_backend.PermutingTileBackend):
  """Grouped GEMMs over a visit list as Mosaic TPU kernels; no host sync.

  Forward and dX run one gmm kernel (gate and up in one pass, the gated
  activation in its epilogue, the routing weights in the down projection's),
  dW one tgmm kernel (`kernels`); dispatch and combine are gathers in both
  directions (`ops.TpuPermutationKernels`). Tiles come from the table of
  the TPU generation lowered for (`tiling.TABLE`), fitted to each call.

  Args:
    tiles: None (the generation's table, fitted to each call's shape and
      VMEM), a `tiling.Tiles` for every kernel, a `tiling.TileConfig` (fwd,
      dgrad, wgrad) or the dict form of either.
    interpret: None: auto, compiled when the program is lowered for a TPU
      (a TPU here, or `moe_core.aot`'s TPU target from any host),
      interpreted otherwise; True: Pallas' HLO interpreter on any
      platform; "debug" or a `pltpu.InterpretParams`: the TPU interpreter,
      which also raises on out-of-bounds accesses and races (slow: small
      shapes); False: compiled, unavailable off a TPU
      (`moe_core.kernels.interpret`).
    generation: "v5e", "v5p", "v6e" or "tpu7x", whose tile table and VMEM
      apply; None: the TPU lowered for (v5e off a TPU), and on a TPU of
      none of these (v2, v3, v4) the backend is unavailable and its
      compiled kernels raise NotImplementedError, so "auto" runs `xla`.
    fuse_activation: compute the gated activation (clamp and options
      included) in the gate/up kernel's epilogue (`ops.EPILOGUE_ACTIVATIONS`,
      without biases); only "moe_down" is then a checkpoint name. On by
      default: on the TPU it saves writing and reading gate and up.
    fuse_routing_weights: multiply each row by its combine weight in the
      down GEMM's epilogue and combine with unit weights (dropless configs
      of the unquantised recipe; others run the unfused path). On by
      default.
  """

  name: ClassVar[str] = "mosaic_tpu"
  ops: ClassVar[ModuleType] = ops
  dtypes: ClassVar[tuple[jnp.dtype, ...]] = ops.DTYPES
  # Bad group sizes' NaN is written by the kernels (`kernels.gmm`'s poison).
  poisons_in_kernels: ClassVar[bool] = True
  # Dispatch, combine and the routing weights in the down GEMM's epilogue
  # (dropless configs of the unquantised recipe): `PermutingTileBackend`'s,
  # gathers both ways on `ops.TpuPermutationKernels`.

  def __init__(
      self,
      *,
      tiles: tiling.TileConfig | tiling.Tiles | dict | None = None,
      interpret: Any = None,
      generation: str | None = None,
      fuse_activation: bool = True,
      fuse_routing_weights: bool = True,
  ):
    tile_backend.check_bool_options(
        fuse_activation=fuse_activation,
        fuse_routing_weights=fuse_routing_weights,
    )
    if generation is not None:
      tiling.check_generation(generation)
    self.launch = ops.Launch(
        tiles=tiling.TileConfig.parse(tiles),
        interpret=ops.INTERPRETER.parse(interpret),
        generation=generation,
    )
    self.fuse_activation = fuse_activation
    self.fuse_routing_weights = fuse_routing_weights
    self.permutation_kernels = ops.TpuPermutationKernels()

  def _repr_options(self) -> dict[str, str]:
    return {
        **super()._repr_options(),
        "generation": repr(self.launch.generation),
        "fuse_routing_weights": str(self.fuse_routing_weights),
    }

  def availability(self) -> tuple[bool, str]:
    if self.launch.interpreting:
      return True, ""
    platform = jax.default_backend()
    if platform == "tpu":
      # A generation the table lacks would get another chip's tiles, which
      # XLA's compiler then refuses: unavailable, so "auto" moves on.
      unknown = self.launch.generation is None and tiling.unknown_tpu(
          tiling.lowering_tpu_kind()
      )
      return (False, unknown) if unknown else (True, "")
    return False, (
        "mosaic_tpu: the kernels compile for TPUs only, not "
        f"{platform}; pass interpret=True to interpret them."
    )

  def _check_precision(self, recipe) -> str:
    recipe = precision_lib.check_recipe(recipe)
    if recipe not in self.precisions:
      raise NotImplementedError(
          f"{self.name}: precision {recipe!r} is not supported (supported: "
          f"{list(self.precisions)}); backend 'xla' runs it on a TPU "
          "(lax.ragged_dot on the dequantised or scaled operands)."
      )
    return recipe
