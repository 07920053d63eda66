"""The pallas kernels as differentiable ops (`moe_core.kernels`).

grouped_gemm   y = x @ w[g]              dX: gmm(dy, w^T)   dW: tgmm(x, dy)
gate_up        gate, up = x @ wg[g], x @ wu[g] in one pass over x
                                          dX: one gmm summing both products
                                          dW: one tgmm, two outputs
gated_gate_up  h = act(x @ wg[g]) * (x @ wu[g]), the activation in the
               epilogue; the same derivatives through the activation's.
Forward and reverse mode alike: `PallasKernels` are the raw kernels,
`moe_core.kernels.grouped_matmul` their derivatives; the three functions
are `moe_core.kernels.tile_backend.TileOps`' on them.
quantized_grouped_gemm
               the forward of a quantised grouped GEMM (moe_core.precision),
               scales applied in the kernel; its gradients are the caller's
               (straight-through, moe_core.quantized_gemm).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from backends.pallas import kernels
from backends.pallas import tiling
from moe_core import operands
from moe_core import precision
from moe_core.kernels import interpret as interpret_lib
from moe_core.kernels import tile_backend


def _debug_interpreter():
  """The bounds-checking interpreter's settings (interpret="debug")."""
  # Imported here: only this debug mode needs the TPU interpreter.
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu

  return pltpu.InterpretParams()


# The backend's `interpret` option (`moe_core.kernels.interpret`): True is
# pallas_call's HLO interpreter; "debug" or a pltpu.InterpretParams the
# interpreter that raises on out-of-bounds accesses (slow: small shapes).
INTERPRETER = interpret_lib.Interpreter(
    names=(("debug", _debug_interpreter),),
    params=(("InterpretParams", "a pltpu.InterpretParams"),),
)


@dataclasses.dataclass(frozen=True)
class Launch(interpret_lib.InterpretedLaunch):
  """What every op needs besides its arrays (static, hashable).

  Attributes:
    tiles: per-kernel tiles; unset kernels use `tiling.heuristic`.
    interpret: False (GPU), True (HLO interpreter), an InterpretParams or
      None: auto, decided when a kernel is traced
      (`moe_core.kernels.interpret`).
  """

  tiles: tiling.TileConfig = tiling.TileConfig()
  interpret: Any = False
  interpreter: ClassVar[interpret_lib.Interpreter] = INTERPRETER

  def choose(self, kind: str, *shape, num_operands: int = 1) -> tiling.Tiles:
    """The tiles of one kernel call.

    Args:
      kind: "fwd", "dgrad" or "wgrad".
      *shape: m, c, n, num_groups, dtype, as for `tiling.heuristic`.
      num_operands: products per step (2 for the fused gate/up pass).
    """
    return tiling.choose(
        self.tiles,
        kind,
        *shape,
        interpret=self.interpreting,
        num_operands=num_operands,
    )

  def gmm(
      self,
      kind,
      *operands,
      transpose_rhs=False,
      products=((0, 0, 0),),
      **options,
  ):
    """One `kernels.gmm` call with the tiles of `kind` ("fwd"/"dgrad").

    `operands`: its lhs, rhs and group_sizes; `options`: its epilogue,
    num_outputs and out_dtype.
    """
    lhs, rhs, _ = operands
    m, c = lhs[0].shape
    n = rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2]
    tiles = self.choose(
        kind, m, c, n, rhs[0].shape[0], lhs[0].dtype, num_operands=len(products)
    )
    return kernels.gmm(
        *operands,
        tiles=tiles,
        interpret=self.kernel_interpret,
        transpose_rhs=transpose_rhs,
        products=products,
        **options,
    )

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    """One `kernels.tgmm` call with the "wgrad" tiles."""
    tiles = self.choose(
        "wgrad",
        lhs.shape[0],
        lhs.shape[1],
        rhs[0].shape[1],
        num_groups,
        lhs.dtype,
        num_operands=len(rhs),
    )
    return kernels.tgmm(
        lhs,
        rhs,
        group_sizes,
        tiles=tiles,
        interpret=self.kernel_interpret,
        out_dtype=out_dtype,
    )


# --- The kernels, differentiated by moe_core.kernels ------------------------


@dataclasses.dataclass(frozen=True)
class PallasKernels(tile_backend.LaunchKernels):
  """The tile-list gmm and tgmm kernels as `GroupedKernels`.

  `kernels.gmm` sums any products per accumulator in one pass, so the gate
  and up projections read the rows once and their dX is one call; the
  tiles follow the call: "fwd" for a product against [E, C, N] weights,
  "dgrad" against transposed ones, "wgrad" for tgmm. `fused_gmm`'s
  `epilogue` (float32 accumulators -> outputs) fuses the activation.
  """

  launch: Launch


# Gated activations the Triton lowering computes in the epilogue.
EPILOGUE_ACTIVATIONS = tile_backend.PALLAS_EPILOGUE_ACTIVATIONS

# grouped_gemm(rows, weights, group_sizes, transpose_rhs, out_dtype, launch),
# gate_up(rows, w_gate, w_up, group_sizes, launch) and
# gated_gate_up(rows, w_gate, w_up, group_sizes, activation, launch), the
# activation in the gate/up kernel's epilogue: `tile_backend.TileOps`.
grouped_gemm, gate_up, gated_gate_up = tile_backend.TileOps(
    PallasKernels, EPILOGUE_ACTIVATIONS
).functions()


# --- grouped GEMM on quantised operands ---------------------------------------

# FP8 MMAs (Hopper's wgmma) take at least 32 elements of K per step.
_MIN_FP8_BK = 32


def _as_e4m3(data):
  """E4M3 data as it is; E2M1 data cast to E4M3, which holds it exactly.

  The Triton lowering has no 4-bit type: NVFP4 elements travel as bytes.
  """
  if data.dtype == jnp.float8_e4m3fn:
    return data
  return data.astype(jnp.float32).astype(jnp.float8_e4m3fn)


def _contract_major_scales(q_weights, transpose_rhs):
  """The weights' scales [E, KB, NB or N] float32, K blocks first."""
  scales = q_weights.scales.astype(jnp.float32)
  return jnp.swapaxes(scales, 1, 2) if transpose_rhs else scales


def _scales(q: operands.QuantizedGemmOperands) -> kernels.QuantizedScales:
  """The scales of `q` in the layout of `kernels.scaled_gmm`."""
  rows, weights = q.rows, q.weights
  num_rows, num_groups = rows.data.shape[0], weights.data.shape[0]
  if q.recipe == "fp8_tensor":
    return kernels.QuantizedScales(
        rows=(rows.scales * rows.tensor_scale).reshape(num_rows),
        experts=weights.scales.reshape(num_groups),
    )
  weight_blocks = _contract_major_scales(weights, q.transpose_rhs)
  if q.recipe == "fp8_block":
    # One scale per 128 output columns: repeated over its columns, so any
    # bn loads its scales as one contiguous vector.
    weight_blocks = jnp.repeat(weight_blocks, weights.block_size, axis=2)
  block_scales = kernels.QuantizedScales(
      row_blocks=rows.scales.astype(jnp.float32).T,
      weight_blocks=weight_blocks,
  )
  if q.recipe == "nvfp4":
    return block_scales._replace(
        rows=rows.tensor_scale.reshape(num_rows),
        experts=weights.tensor_scale.reshape(num_groups),
    )
  return block_scales


def _quantized_tiles(q, launch: Launch, m, k, n) -> tiling.Tiles:
  """The forward tiles, with bk the recipe's scale block if it has one."""
  tiles = launch.choose(
      "fwd", m, k, n, q.weights.data.shape[0], jnp.float8_e4m3fn
  )
  if q.recipe in precision.BLOCK:
    return dataclasses.replace(tiles, bk=precision.BLOCK[q.recipe])
  if not launch.interpreting:
    return dataclasses.replace(tiles, bk=max(tiles.bk, _MIN_FP8_BK))
  return tiles


def quantized_grouped_gemm(
    q: operands.QuantizedGemmOperands, launch: Launch
) -> jax.Array:
  """The grouped GEMM of quantised operands: [M, N] float32.

  The E4M3 data go into the kernel; the scales are applied there.
  "fp8_tensor": one FP8 product over all of K, times the row group's and
  the expert's scale in the epilogue. "fp8_block": K steps of 128, each
  product times the rows' 1x128 tile scales and the expert's 128x128 block
  scales. "mxfp8" (K steps of 32) and "nvfp4" (16; E2M1 data carried as
  E4M3): each tile dequantised with its block scales in the kernel, then a
  float32 product; nvfp4's tensor scales in the epilogue. Equal to
  `quantized_gemm.dequantized_grouped_gemm` up to float32 rounding.

  Not differentiable on its own: `Backend._quantized_gemm` gives it
  straight-through gradients.

  Args:
    q: operands from `precision.quantize_grouped_rows` and
      `quantize_grouped_weights`; rows at or past sum(q.group_sizes) hold
      zeros.
    launch: tiles and interpret mode.
  """
  if q.recipe not in precision.QUANTIZED_RECIPES:
    raise NotImplementedError(f"pallas: no quantised GEMM for {q.recipe!r}.")
  lhs = _as_e4m3(q.rows.data)
  rhs = _as_e4m3(q.weights.data)
  m, k = lhs.shape
  n_axis = 1 if q.transpose_rhs else 2
  # fp8_block's 128x128 weight blocks pad the output width too.
  n = q.weights.block_axis_size or rhs.shape[n_axis]
  out = kernels.scaled_gmm(
      lhs,
      rhs,
      q.group_sizes,
      _scales(q),
      tiles=_quantized_tiles(q, launch, m, k, n),
      interpret=launch.kernel_interpret,
      transpose_rhs=q.transpose_rhs,
      dequantize_first=q.recipe in ("mxfp8", "nvfp4"),
  )
  return out[:, :n]
