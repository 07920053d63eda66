"""Grouped GEMMs on quantised operands, shared by the backends.

`Backend.grouped_gemm(..., precision=recipe)` quantises both operands once
(`moe_core.precision`) and hands a backend `QuantizedGemmOperands`; this
module holds what every backend needs around that: `straight_through` (the
forward GEMM on quantised operands with the unquantised GEMM's derivatives,
the usual straight-through estimator), `scaled_grouped_gemm` (the product
with the scales applied the way a GPU kernel applies them, on a backend's
own float32 grouped GEMM) and `dequantized_grouped_gemm` (dequantise both
operands, then multiply: the reference's definition).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from moe_core import operands
from moe_core import precision

# A backend's own grouped GEMM: rows [M, C] x weights [E, C, N] -> [M, N],
# both float32, with the group sizes; returns float32.
GemmFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def straight_through(
    quantized_forward: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    unquantized: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    rows: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
  """quantized_forward(rows, weights, group_sizes), with unquantized's
  derivatives.

  Both functions take (rows [M, C], weights, group_sizes [E]) and return
  [M, N]; `unquantized` is the backend's plain grouped GEMM, whose
  derivatives (zero for rows past sum(group_sizes)) are the op's. A custom
  JVP, not a VJP: its tangent is unquantized's, which JAX transposes for
  reverse mode (the straight-through gradient) and pushes forward for
  jvp, linearize and Hessians. `quantized_forward` is never differentiated
  (it may be a kernel without derivatives, as Transformer Engine's is):
  every derivative, of any order, is unquantized's.

  Gradients are thus computed in the activation dtype from the unquantised
  operands (the quantiser's derivative taken as 1): what Transformer
  Engine's recipes do for the weights they keep in high precision, and the
  simplest choice whose error does not compound with the forward's.
  """

  @jax.custom_jvp
  def op(rows, weights, group_sizes):
    return quantized_forward(rows, weights, group_sizes)

  @op.defjvp
  def op_jvp(primals, tangents):
    rows, weights, group_sizes = primals
    d_rows, d_weights, _ = tangents
    # The primal comes from `op` itself, not from quantized_forward: a
    # derivative of this rule (a Hessian) then goes through the rule again
    # instead of differentiating the quantised forward.
    out = op(rows, weights, group_sizes)
    _, d_out = jax.jvp(
        lambda r, w: unquantized(r, w, group_sizes),
        (rows, weights),
        (d_rows, d_weights),
    )
    return out, d_out.astype(out.dtype)

  return op(rows, weights, group_sizes)


def _contract_major(q_weights) -> tuple[jax.Array, jax.Array]:
  """(data [E, K, N], scales [E, KB, NB or N or 1]), contraction first.

  Quantised weights of the dgrad layout [E, N, K] are swapped to [E, K, N],
  data and scales alike (the scales have one entry per block).
  """
  data, scales = q_weights.data, q_weights.scales
  if q_weights.axis == 2:
    data = jnp.swapaxes(data, 1, 2)
    scales = jnp.swapaxes(scales, 1, 2)
  return data, scales


def float32_gemm(
    grouped_gemm: Callable[[operands.GemmOperands], jax.Array],
) -> GemmFn:
  """A backend's `_grouped_gemm` as the GemmFn the functions here take.

  (rows [M, K], weights [E, K, N], group_sizes [E]) -> [M, N] float32,
  weights not transposed.
  """

  def gemm(rows, weights, group_sizes):
    return grouped_gemm(
        operands.GemmOperands(
            rows=rows,
            weights=weights,
            group_sizes=group_sizes,
            transpose_rhs=False,
            out_dtype=jnp.dtype(jnp.float32),
        )
    )

  return gemm


def dequantized_grouped_gemm(
    q: operands.QuantizedGemmOperands, gemm: GemmFn
) -> jax.Array:
  """Dequantise both operands to float32, then `gemm`: [M, N] float32.

  The definition every other way of multiplying must match up to float32
  rounding.
  """
  rows = precision.dequantize(q.rows)
  weights = precision.dequantize(q.weights)
  if q.transpose_rhs:
    weights = jnp.swapaxes(weights, 1, 2)
  return gemm(rows, weights, q.group_sizes)


def scaled_grouped_gemm(
    q: operands.QuantizedGemmOperands, gemm: GemmFn
) -> jax.Array:
  """The grouped GEMM with the scales applied per K block: [M, N] float32.

  "fp8_tensor": one product of the raw E4M3 values (exact in float32),
  times the row group's scale and the expert's. "fp8_block": one product
  per 128-wide K block, times the row's 1x128 tile scale and the expert's
  128x128 block scale for each output column. "mxfp8", "nvfp4": the blocks
  (32 and 16 wide) are too narrow for a product each; both operands are
  dequantised per block (in the kernel, on hardware without these formats)
  and multiplied once.

  `gemm` is a backend's own float32 grouped GEMM (the `xla` backend's;
  `pallas` does the same inside its kernel).
  """
  recipe = q.recipe
  if recipe in ("mxfp8", "nvfp4"):
    return dequantized_grouped_gemm(q, gemm)
  num_rows, size = q.rows.data.shape[0], q.rows.size
  # Rows past the sum take the last group's scales: their output is zero
  # whatever scale they pick up, as their quantised data is.
  groups = precision.row_groups(q.group_sizes, num_rows, clamp_tail=True)
  rows = q.rows.data.astype(jnp.float32)
  w_data, w_scales = _contract_major(q.weights)
  w_data = w_data.astype(jnp.float32)
  # 128x128 weight blocks pad the output width too: the true N.
  n = q.weights.block_axis_size or w_data.shape[2]
  w_data = w_data[:, :, :n]
  if recipe == "fp8_tensor":
    product = gemm(rows[:, :size], w_data[:, :size, :], q.group_sizes)
    row_scale = (q.rows.scales * q.rows.tensor_scale).reshape(num_rows, 1)
    expert_scale = w_scales.reshape(-1)[groups][:, None]
    return product * row_scale * expert_scale
  if recipe != "fp8_block":
    raise NotImplementedError(f"scaled_grouped_gemm: recipe {recipe!r}.")
  block = precision.BLOCK[recipe]
  out = jnp.zeros((num_rows, n), jnp.float32)
  for kb in range(rows.shape[1] // block):
    k = slice(kb * block, (kb + 1) * block)
    product = gemm(rows[:, k], w_data[:, k, :], q.group_sizes)
    # The expert's scale of each (K block, N block), per row and column.
    column_scales = jnp.repeat(w_scales[:, kb, :], block, axis=-1)[:, :n]
    out += product * q.rows.scales[:, kb, None] * column_scales[groups]
  return out
