"""The Mosaic GPU kernels as differentiable ops (`moe_core.kernels`).

`grouped_gemm` (y = x @ w[g]), `gate_up` (gate and up in one pass over x,
two accumulators) and `gated_gate_up` (act(gate) * up, the activation in the
epilogue) run their forward and dX on the Mosaic GPU gmm (gate_up's dX one
gmm summing both products) and their dW on the Pallas Triton tgmm
(`backends.pallas.kernels.tgmm`, two outputs for gate_up): tokamax's H100
autotuning data has a Mosaic GPU dW at about 114 TFLOP/s against 500-725
for Triton. Under the Mosaic GPU interpreter it runs under Pallas'
interpreter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from backends.mosaic_gpu import kernels
from backends.mosaic_gpu import kernels_sm100
from backends.mosaic_gpu import tiling
from backends.pallas import ops as pallas_ops
from moe_core.kernels import interpret as interpret_lib
from moe_core.kernels import tile_backend


def interpret_params():
  """Mosaic GPU's interpreter settings, on every supported JAX.

  jax >= 0.11 exports `InterpretGPUParams` from the public module; 0.10.2
  has the same class only in its private one.
  """
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu

  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:
    # pylint: disable-next=g-import-not-at-top
    from jax._src.pallas.mosaic_gpu.interpret import params as private

    params = private.InterpretGPUParams
  return params()


# The backend's `interpret` option (`moe_core.kernels.interpret`): True is
# Mosaic GPU's interpreter with its default settings.
INTERPRETER = interpret_lib.Interpreter(
    default=interpret_params,
    params=(("InterpretGPUParams", "an InterpretGPUParams"),),
)


@dataclasses.dataclass(frozen=True)
class Launch(interpret_lib.InterpretedLaunch):
  """What every op needs besides its arrays (static, hashable).

  Attributes:
    tiles: the caller's gmm tiles per kind; unset kinds use the table.
    interpret: False (compiled for the GPU), Mosaic GPU's
      `InterpretGPUParams` (any platform) or None: auto, decided when a
      kernel is traced (`moe_core.kernels.interpret`).
    generation: "sm90" (wgmma, `kernels`) or "sm100" (tcgen05,
      `kernels_sm100`): which kernel, and the table's key; None follows
      the GPU being lowered for (`tiling.generation()`).
  """

  tiles: tiling.TileConfig = tiling.TileConfig()
  interpret: Any = False
  interpreter: ClassVar[interpret_lib.Interpreter] = INTERPRETER
  generation: str | None = "sm90"

  def kernel_generation(self) -> str:
    """The generation whose kernels run: the given one, or the target's."""
    if self.generation is not None:
      return self.generation
    return tiling.generation() or "sm90"

  def gmm(
      self,
      kind,
      lhs,
      rhs,
      group_sizes,
      *,
      products=((0, 0, 0),),
      num_outputs=None,
      **options,
  ):
    """One Mosaic GPU gmm call with the tiles of `kind` ("fwd"/"dgrad").

    `options`: `kernels.gmm`'s transpose_rhs, epilogue and out_dtype.
    """
    generation = self.kernel_generation()
    num_accs = 1 + max(a for _, _, a in products)
    tiles = tiling.choose(
        self.tiles,
        kind,
        lhs[0].shape[0],
        rhs[0].shape[0],
        lhs[0].dtype,
        num_lhs=len(lhs),
        num_rhs=len(rhs),
        num_accs=num_accs,
        num_outputs=num_accs if num_outputs is None else num_outputs,
        generation_name=generation,
    )
    gmm = kernels_sm100.gmm if generation == "sm100" else kernels.gmm
    return gmm(
        lhs,
        rhs,
        group_sizes,
        tiles=tiles,
        products=products,
        num_outputs=num_outputs,
        interpret=self.kernel_interpret,
        **options,
    )

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    """dW on the Pallas Triton kernel: lhs_g^T rhs_g per group -> [E, C, N].

    With its table's tiles, under Pallas' interpreter where this runs Mosaic
    GPU's.
    """
    return pallas_ops.Launch(interpret=self.interpreting).tgmm(
        lhs, rhs, group_sizes, num_groups=num_groups, out_dtype=out_dtype
    )


# --- The kernels, differentiated by moe_core.kernels ------------------------


@dataclasses.dataclass(frozen=True)
class MosaicKernels(tile_backend.LaunchKernels):
  """The Mosaic GPU gmm and the Pallas Triton tgmm as `GroupedKernels`.

  The gmm sums any products per accumulator in one pass (gate and up read
  the rows once; their dX is one call); tiles follow the call: "fwd" for
  [E, C, N] weights, "dgrad" for transposed ones. `fused_gmm`'s `epilogue`
  (float32 accumulators -> outputs) fuses the activation.
  """

  launch: Launch


# Gated activations the Mosaic GPU lowering computes on the accumulators.
EPILOGUE_ACTIVATIONS = tile_backend.PALLAS_EPILOGUE_ACTIVATIONS

# grouped_gemm(rows, weights, group_sizes, transpose_rhs, out_dtype, launch),
# gate_up(rows, w_gate, w_up, group_sizes, launch) and
# gated_gate_up(rows, w_gate, w_up, group_sizes, activation, launch), the
# activation in the gate/up kernel's epilogue: `tile_backend.TileOps`.
grouped_gemm, gate_up, gated_gate_up = tile_backend.TileOps(
    MosaicKernels, EPILOGUE_ACTIVATIONS
).functions()
