"""The pallas kernels tied into differentiable ops with jax.custom_vjp.

grouped_gemm   y = x @ w[g]              dX: gmm(dy, w^T)   dW: tgmm(x, dy)
gate_up        gate, up = x @ wg[g], x @ wu[g] in one pass over x
                                          dX: one gmm summing both products
                                          dW: one tgmm, two outputs
gated_gate_up  h = act(x @ wg[g]) * (x @ wu[g]), the activation in the
               epilogue; the same backward after the activation's VJP.
quantized_grouped_gemm
               the forward of a quantised grouped GEMM (moe_core.precision),
               scales applied in the kernel; its gradients are the caller's
               (straight-through, moe_core.quantized_gemm).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from backends.pallas import kernels
from backends.pallas import tiling
from moe_core import ffn
from moe_core import operands
from moe_core import precision


@dataclasses.dataclass(frozen=True)
class Launch:
  """What every op needs besides its arrays (static, hashable).

  Attributes:
    tiles: per-kernel tiles; unset kernels use `tiling.heuristic`.
    interpret: False (GPU), True (HLO interpreter) or InterpretParams.
  """

  tiles: tiling.TileConfig = tiling.TileConfig()
  interpret: Any = False

  @property
  def interpreting(self) -> bool:
    return self.interpret is not False

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


# --- grouped_gemm -------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def grouped_gemm(
    rows, weights, group_sizes, transpose_rhs: bool, out_dtype, launch: Launch
):
  """rows [M, C] x weights [E, C, N] ([E, N, C] transposed) -> [M, N].

  Rows past sum(group_sizes) come out as zeros and get zero gradient.
  """
  return _gmm(
      rows, weights, group_sizes, transpose_rhs, out_dtype, launch, "fwd"
  )


def _gmm(rows, weights, group_sizes, transpose_rhs, out_dtype, launch, kind):
  """One gmm kernel call, with the tiles of `kind` ("fwd" or "dgrad")."""
  m, c = rows.shape
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  tiles = launch.choose(kind, m, c, n, weights.shape[0], rows.dtype)
  (out,) = kernels.gmm(
      [rows],
      [weights],
      group_sizes,
      tiles=tiles,
      interpret=launch.interpret,
      transpose_rhs=transpose_rhs,
      out_dtype=out_dtype,
  )
  return out


def _grouped_gemm_fwd(
    rows, weights, group_sizes, transpose_rhs, out_dtype, launch
):
  out = _gmm(
      rows, weights, group_sizes, transpose_rhs, out_dtype, launch, "fwd"
  )
  return out, (rows, weights, group_sizes)


def _grouped_gemm_bwd(transpose_rhs, out_dtype, launch, residuals, dy):
  del out_dtype
  rows, weights, group_sizes = residuals
  dy = dy.astype(rows.dtype)
  m = rows.shape[0]
  num_groups = weights.shape[0]
  # dX: the forward kernel reading the weights the other way round, so
  # [M, N] x [E, N, C] -> [M, C] (contracting N) with the dgrad tiles.
  d_rows = _gmm(
      dy, weights, group_sizes, not transpose_rhs, rows.dtype, launch, "dgrad"
  )
  # dW[g] = lhs_g^T rhs_g: x_g^T dy_g for weights[g] [C, N], dy_g^T x_g for
  # the transposed layout [N, C].
  lhs, rhs = (dy, rows) if transpose_rhs else (rows, dy)
  tiles = launch.choose(
      "wgrad", m, lhs.shape[1], rhs.shape[1], num_groups, rows.dtype
  )
  (d_weights,) = kernels.tgmm(
      lhs,
      [rhs],
      group_sizes,
      tiles=tiles,
      interpret=launch.interpret,
      out_dtype=weights.dtype,
  )
  return d_rows, d_weights, None


grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)


# --- gate and up projections in one pass ------------------------------------


def _gate_up_kernel(
    rows, w_gate, w_up, group_sizes, launch, epilogue, num_outputs
):
  m, d = rows.shape
  f = w_gate.shape[2]
  tiles = launch.choose(
      "fwd", m, d, f, w_gate.shape[0], rows.dtype, num_operands=2
  )
  return kernels.gmm(
      [rows],
      [w_gate, w_up],
      group_sizes,
      tiles=tiles,
      interpret=launch.interpret,
      products=((0, 0, 0), (0, 1, 1)),
      epilogue=epilogue,
      num_outputs=num_outputs,
      out_dtype=rows.dtype,
  )


def _gate_up_bwd_from(rows, w_gate, w_up, group_sizes, launch, d_gate, d_up):
  """Cotangents of (rows, w_gate, w_up, group_sizes) given dgate and dup."""
  m, d = rows.shape
  f = w_gate.shape[2]
  num_groups = w_gate.shape[0]
  d_gate = d_gate.astype(rows.dtype)
  d_up = d_up.astype(rows.dtype)
  # dX = dgate @ wg[g]^T + dup @ wu[g]^T, both products in one accumulator.
  tiles = launch.choose(
      "dgrad", m, f, d, num_groups, rows.dtype, num_operands=2
  )
  (d_rows,) = kernels.gmm(
      [d_gate, d_up],
      [w_gate, w_up],
      group_sizes,
      tiles=tiles,
      interpret=launch.interpret,
      transpose_rhs=True,
      products=((0, 0, 0), (1, 1, 0)),
      out_dtype=rows.dtype,
  )
  tiles = launch.choose(
      "wgrad", m, d, f, num_groups, rows.dtype, num_operands=2
  )
  d_w_gate, d_w_up = kernels.tgmm(
      rows,
      [d_gate, d_up],
      group_sizes,
      tiles=tiles,
      interpret=launch.interpret,
      out_dtype=w_gate.dtype,
  )
  return d_rows, d_w_gate, d_w_up, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def gate_up(rows, w_gate, w_up, group_sizes, launch: Launch):
  """(rows @ w_gate[g], rows @ w_up[g]), each [M, F], in one pass over rows.

  Args:
    rows: [M, D] sorted by group.
    w_gate, w_up: [E, D, F] of rows' dtype.
    group_sizes: [E] int32.
    launch: tiles and interpret mode.
  """
  return _gate_up_kernel(
      rows, w_gate, w_up, group_sizes, launch, kernels.identity, 2
  )


def _gate_up_fwd(rows, w_gate, w_up, group_sizes, launch):
  out = gate_up(rows, w_gate, w_up, group_sizes, launch)
  return out, (rows, w_gate, w_up, group_sizes)


def _gate_up_bwd(launch, residuals, cotangents):
  rows, w_gate, w_up, group_sizes = residuals
  d_gate, d_up = cotangents
  return _gate_up_bwd_from(
      rows, w_gate, w_up, group_sizes, launch, d_gate, d_up
  )


gate_up.defvjp(_gate_up_fwd, _gate_up_bwd)


# --- the activation fused in the epilogue -----------------------------------

# Activations the Triton lowering can compute in the epilogue. The exact
# "gelu" needs erf, which the Triton lowering of jax 0.10 lacks.
EPILOGUE_ACTIVATIONS = ("silu", "gelu_tanh")


def _gated_epilogue(activation, with_inputs):
  act = ffn.activation(activation)

  def epilogue(accs):
    gate, up = accs
    h = act(gate) * up  # On the float32 accumulators.
    return (h, gate, up) if with_inputs else (h,)

  return epilogue


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def gated_gate_up(
    rows, w_gate, w_up, group_sizes, activation: str, launch: Launch
):
  """act(rows @ w_gate[g]) * (rows @ w_up[g]): [M, D] -> [M, F], one pass.

  The activation runs on the float32 accumulators in the kernel's epilogue;
  only h is written. Under differentiation the kernel also writes gate and
  up, the residuals of the activation's gradient.

  Args:
    rows, w_gate, w_up, group_sizes, launch: as for `gate_up`.
    activation: one of EPILOGUE_ACTIVATIONS.
  """
  if activation not in EPILOGUE_ACTIVATIONS:
    raise ValueError(
        f"activation must be one of {EPILOGUE_ACTIVATIONS} to "
        f"run in the kernel epilogue, got {activation!r}."
    )
  (h,) = _gate_up_kernel(
      rows,
      w_gate,
      w_up,
      group_sizes,
      launch,
      _gated_epilogue(activation, False),
      1,
  )
  return h


def _gated_fwd(rows, w_gate, w_up, group_sizes, activation, launch):
  h, gate, up = _gate_up_kernel(
      rows,
      w_gate,
      w_up,
      group_sizes,
      launch,
      _gated_epilogue(activation, True),
      3,
  )
  return h, (rows, w_gate, w_up, group_sizes, gate, up)


def _gated_bwd(activation, launch, residuals, d_h):
  rows, w_gate, w_up, group_sizes, gate, up = residuals
  _, act_vjp = jax.vjp(
      lambda g, u: ffn.gated(g.astype(jnp.float32), u, activation), gate, up
  )
  d_gate, d_up = act_vjp(d_h.astype(jnp.float32))
  return _gate_up_bwd_from(
      rows, w_gate, w_up, group_sizes, launch, d_gate, d_up
  )


gated_gate_up.defvjp(_gated_fwd, _gated_bwd)


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
      interpret=launch.interpret,
      transpose_rhs=q.transpose_rhs,
      dequantize_first=q.recipe in ("mxfp8", "nvfp4"),
  )
  return out[:, :n]
