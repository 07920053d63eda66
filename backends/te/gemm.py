"""Grouped GEMMs through TE's `grouped_dense`, held to moe_core's contract."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from backends.te import _te
from moe_core import precision as precision_lib

# moe_core recipe -> the name of TE's ScalingMode member.
SCALING_MODES = {
    ("fp8_tensor", "current"): "CURRENT_TENSOR_SCALING",
    ("fp8_tensor", "delayed"): "DELAYED_TENSOR_SCALING",
    ("mxfp8", "current"): "MXFP8_1D_SCALING",
    ("mxfp8", "delayed"): "MXFP8_1D_SCALING",
}
# The smallest compute capability TE runs each recipe's GEMM on
# (quantize/helper.py: tensor-scaled FP8 on sm_89+, MXFP8 on sm_100+).
MIN_COMPUTE_CAPABILITY = {"fp8_tensor": 89, "mxfp8": 100}
# cuBLAS FP8 GEMMs need the contracted width to be a multiple of 16
# (TE's assert_cublas_requirements). TE's MXFP8 quantiser cannot pad: it
# cuts the weights into blocks of 32 along both C and N (row- and
# column-wise copies), so both must be multiples of 32. `grouped_gemm`
# pads them with zeros.
CONTRACTION_MULTIPLE = {"fp8_tensor": 16, "mxfp8": precision_lib.BLOCK["mxfp8"]}
OUTPUT_MULTIPLE = {"fp8_tensor": 1, "mxfp8": precision_lib.BLOCK["mxfp8"]}
# Rows per group in TE's quantised grouped GEMMs. MXFP8: its scales come in
# swizzled tiles of 128 rows per group, and the cuBLAS grouped path needs
# every group to fill whole tiles (TE's tests skip other sizes). FP8 tensor
# scaling: TE tests its per-group GEMMs with groups of multiples of 32 rows
# only (cuBLAS FP8 wants 16-byte aligned per-group pointers).
GROUP_ALIGN = {"fp8_tensor": 32, "mxfp8": 128}


def _dense():
  _te.import_te()
  return importlib.import_module("transformer_engine.jax.dense")


def _quantize_module():
  _te.import_te()
  return importlib.import_module("transformer_engine.jax.quantize")


def used_rows(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """[M] bool: the rows that belong to a group (before sum(group_sizes))."""
  return jnp.arange(num_rows) < jnp.sum(group_sizes)


def grouped_gemm(
    rows: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool,
    out_dtype,
    quantizer_set=None,
    align: int = 1,
    contraction_multiple: int = 1,
    output_multiple: int = 1,
) -> jax.Array:
  """rows [M, C] x weights [E, C, N] ([E, N, C] if transpose_rhs) -> [M, N].

  One `transformer_engine.jax.dense.grouped_dense` call (cuBLAS, float32
  accumulation), differentiable through TE's VJP. What is done around it,
  and why:
    * TE's kernels require sum(group_sizes) == M (the per-group path checks
      it on the host), while moe_core's rows past the sum are padding that
      may hold anything, NaN included. Those rows are zeroed and given to
      the last group, where a zero row adds nothing to a product or an
      amax; their outputs and row gradients are masked to exact zeros (TE
      does not promise to write them).
    * [E, N, C] weights are transposed here: TE 2.20's grouped_dense VJP
      returns the weight gradient as [E, C, N] when it contracts axis 2.
    * TE multiplies operands of one dtype, so with out_dtype != rows' dtype
      the output cotangent is cast to rows' dtype before TE's backward.
    * `align` > 1 gives every group a multiple of `align` rows (zero rows
      appended to each), as TE's quantised grouped GEMMs need
      (`GROUP_ALIGN`).
    * C and N are padded with zeros to multiples of `contraction_multiple`
      and `output_multiple` (TE's FP8 and MXFP8 quantisers cannot pad);
      zeros change no product, amax or block scale (moe_core pads a last
      block with zeros too), and the padded output columns are dropped.

  Args:
    rows: [M, C] bfloat16 or float16.
    weights: of rows' dtype.
    group_sizes: [E] int32, entries >= 0, sum <= M (sanitised upstream).
    transpose_rhs: weights are [E, N, C] (contract with weights[e].T).
    out_dtype: the output's dtype (TE's preferred_element_type).
    quantizer_set: a TE QuantizerSet (FP8 / MXFP8), or None for none.
    align: rows per group are padded to a multiple of this.
    contraction_multiple: C is padded to a multiple of this.
    output_multiple: N is padded to a multiple of this.

  Returns:
    [M, N] of out_dtype; zeros at and past row sum(group_sizes).
  """
  out_dtype = jnp.dtype(out_dtype)
  num_rows = rows.shape[0]
  group_sizes = group_sizes.astype(jnp.int32)
  used = used_rows(group_sizes, num_rows)
  if transpose_rhs:
    weights = jnp.swapaxes(weights, 1, 2)
  rows = jnp.where(used[:, None], rows, jnp.zeros((), rows.dtype))
  width = weights.shape[2]
  rows = _pad_axis(rows, 1, contraction_multiple)
  weights = _pad_axis(
      _pad_axis(weights, 1, contraction_multiple), 2, output_multiple
  )
  if align > 1:
    rows, te_sizes, gather = _aligned_groups(rows, group_sizes, used, align)
  else:
    te_sizes = group_sizes.at[-1].add(num_rows - jnp.sum(group_sizes))
    gather = None

  def dense(lhs, rhs, sizes, dtype):
    kwargs = {}
    if quantizer_set is not None:
      kwargs["quantizer_set"] = quantizer_set
    return (
        _dense()
        .grouped_dense(
            lhs,
            rhs,
            sizes,
            contracting_dims=((1,), (1,)),
            preferred_element_type=dtype,
            **kwargs,
        )
        .astype(dtype)
    )

  if out_dtype == rows.dtype:
    out = dense(rows, weights, te_sizes, out_dtype)
  else:
    out = _cotangent_in_rows_dtype(dense, out_dtype)(rows, weights, te_sizes)
  if gather is not None:
    out = out[gather]
  out = out[:, :width]
  return jnp.where(used[:, None], out, jnp.zeros((), out.dtype))


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  """x with zeros appended along `axis` up to a multiple of `multiple`."""
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


def _cotangent_in_rows_dtype(dense, out_dtype):
  """dense(rows, weights, sizes, out_dtype), whose VJP runs TE's in rows'
  dtype (TE's backward multiplies the cotangent with same-dtype operands)."""

  @jax.custom_vjp
  def op(rows, weights, sizes):
    return dense(rows, weights, sizes, out_dtype)

  def forward(rows, weights, sizes):
    return op(rows, weights, sizes), (rows, weights, sizes)

  def backward(residuals, d_out):
    rows, weights, sizes = residuals
    _, vjp = jax.vjp(
        lambda r, w: dense(r, w, sizes, jnp.dtype(rows.dtype)), rows, weights
    )
    d_rows, d_weights = vjp(d_out.astype(rows.dtype))
    return d_rows, d_weights, None

  op.defvjp(forward, backward)
  return op


def _aligned_groups(rows, group_sizes, used, align):
  """Rows moved so that each group starts at a multiple of `align`.

  Returns (padded rows [P, C] with zero rows between the groups, sizes [E]
  each a multiple of `align` and summing to P, and the row of the padded
  buffer that holds each input row [M] (for gathering outputs back)).
  P = M + E * (align - 1), rounded up to `align`: the worst case.
  """
  num_rows, num_experts = rows.shape[0], group_sizes.shape[0]
  capacity = -(-(num_rows + num_experts * (align - 1)) // align) * align
  padded_sizes = -(-group_sizes // align) * align
  starts = jnp.cumsum(group_sizes) - group_sizes
  padded_starts = jnp.cumsum(padded_sizes) - padded_sizes
  groups = jnp.minimum(
      precision_lib.row_groups(group_sizes, num_rows), num_experts - 1
  )
  row = jnp.arange(num_rows, dtype=jnp.int32)
  destination = row - starts[groups] + padded_starts[groups]
  destination = jnp.where(used, destination, capacity).astype(jnp.int32)
  padded = (
      jnp.zeros((capacity, rows.shape[1]), rows.dtype)
      .at[destination]
      .set(rows, mode="drop")
  )
  te_sizes = padded_sizes.at[-1].add(capacity - jnp.sum(padded_sizes))
  return padded, te_sizes, jnp.minimum(destination, capacity - 1)


def quantizer_set(recipe: str, num_groups: int, scaling: str = "current"):
  """TE's quantizer set for `recipe` over `num_groups` groups (experts).

  E4M3 forward operands (`fwd_dtype`); `bwd_dtype` E5M2 is what TE would
  quantise gradients to in its own backward, which the te backend does not
  use (its gradients are straight-through, see `TEBackend`). Current
  tensor scaling keeps one scale per group of rows and one per expert's
  weights, MXFP8 one E8M0 scale per 32 elements along the contraction.

  Args:
    recipe: "fp8_tensor" or "mxfp8".
    num_groups: E, the number of groups (TE's n_groups).
    scaling: "current" or "delayed" (fp8_tensor only).
  """
  quantize = _quantize_module()
  mode = getattr(quantize.ScalingMode, SCALING_MODES[(recipe, scaling)])
  return quantize.QuantizerFactory.create_set(
      scaling_mode=mode,
      fwd_dtype=jnp.float8_e4m3fn,
      bwd_dtype=jnp.float8_e5m2,
      n_groups=num_groups,
  )


def non_finite_outputs(
    rows: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool,
    recipe: str,
) -> jax.Array:
  """[M, N] bool: the outputs moe_core's `recipe` makes NaN, from NaN/Inf.

  moe_core.precision turns a NaN or Inf in a scale's block into a NaN
  scale, so everything the scale covers is NaN after dequantisation. TE
  instead falls back to scale 1 for a non-finite amax (tensor scaling),
  which clips an Inf to a finite 448. The te backend makes its outputs NaN
  where the recipe would:
    fp8_tensor: a bad row or weight makes its whole group's rows NaN
      (one scale per group of rows, one per expert's weights);
    mxfp8: a bad row makes that row NaN (its blocks feed every output
      column), a bad weight in column n of expert e makes column n of
      group e NaN.
  Rows past sum(group_sizes) are never bad (they are padding).
  """
  num_rows, num_experts = rows.shape[0], group_sizes.shape[0]
  used = used_rows(group_sizes, num_rows)
  groups = jnp.minimum(
      precision_lib.row_groups(group_sizes, num_rows), num_experts - 1
  )
  bad_row = used & ~jnp.all(jnp.isfinite(rows), axis=1)
  contract_axis = 2 if transpose_rhs else 1
  n = weights.shape[1 if transpose_rhs else 2]
  if recipe == "fp8_tensor":
    bad_group = jax.ops.segment_max(
        bad_row.astype(jnp.int32), groups, num_segments=num_experts
    ).astype(bool)
    bad_expert = ~jnp.all(jnp.isfinite(weights), axis=(1, 2))
    bad = used & (bad_group | bad_expert)[groups]
    return jnp.broadcast_to(bad[:, None], (num_rows, n))
  bad_column = ~jnp.all(jnp.isfinite(weights), axis=contract_axis)  # [E, N]
  return bad_row[:, None] | (used[:, None] & bad_column[groups])
