"""TE's grouped GEMMs as moe_core kernels, held to moe_core's contract."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp

from backends.te import _te
from moe_core import precision as precision_lib
from moe_core.kernels import grouped_matmul
from moe_core.kernels import primitive

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
  _cpp_extensions()
  return importlib.import_module("transformer_engine.jax.dense")


def _quantize_module():
  _te.import_te()
  return importlib.import_module("transformer_engine.jax.quantize")


def used_rows(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """[M] bool: the rows that belong to a group (before sum(group_sizes))."""
  return jnp.arange(num_rows) < jnp.sum(group_sizes)


def _cpp_extensions():
  _te.import_te()
  # TE's primitives lower through custom_partitioning, which needs the
  # program's devices; moe_core's kernel primitives hide them from JAX's
  # check for such primitives, so they are marked too (on first use only:
  # no other backend's program changes unless te traces in it).
  _te.lowering_needs_devices(
      grouped_matmul.grouped_matmul_p, primitive.opaque_kernel_p
  )
  return importlib.import_module("transformer_engine.jax.cpp_extensions")


def _whole_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """group_sizes with the rows past their sum added to the last group.

  TE's kernels require sum(group_sizes) == M (the per-group path checks it
  on the host); moe_core's rows past the sum are padding, which the
  callers zero, so the last group's products gain exact zeros.
  """
  return group_sizes.at[-1].add(num_rows - jnp.sum(group_sizes))


def _ragged(x: jax.Array, group_sizes: jax.Array | None):
  """x as the grouped operand TE's grouped GEMM takes (unquantised).

  What `grouped_dense` makes of an operand with its no-op quantizer set
  (`grouped_quantize` with no quantizer): rows ragged by `group_sizes`,
  or, with None, a weight tensor [E, ...] whose leading axis is the group.
  """
  return _cpp_extensions().grouped_quantize(x, None, group_sizes)


@dataclasses.dataclass(frozen=True)
class TEKernels(grouped_matmul.GroupedKernels):
  """TE's unquantised grouped GEMM as moe_core's `GroupedKernels`.

  Each product is one call of `transformer_engine.jax.cpp_extensions.
  grouped_gemm`, the raw (non-differentiable) op that `grouped_dense`'s
  forward and backward rules call, with the contracting dimensions they
  use:

    gmm              lhs [M, C] x rhs [E, C, N]: ((1,), (1,)), the forward;
    gmm, transposed  lhs [M, C] x rhs [E, N, C]: ((1,), (2,)), the dgrad
                     (the kernel contracted on its last axis);
    tgmm             lhs [M, A] x rhs [M, B] -> [E, A, B]: ((0,), (0,)),
                     the wgrad (both operands ragged by the groups).

  `moe_core.kernels.grouped_matmul` differentiates them (in both
  directions, to any order), so TE's `grouped_dense` VJP, which forward
  mode cannot go through, is not used. cuBLAS accumulates in float32; the
  kernel (per-group loop or cuBLAS's grouped GEMM) is TE's choice at
  trace time (`_te.grouped_gemm_path`). Rows past sum(group_sizes) are
  zeroed and given to the last group (TE needs the sizes to sum to M);
  gmm's outputs there are masked to exact zeros, as TE does not promise
  to write them.
  """

  def gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
    num_rows = lhs.shape[0]
    used = used_rows(group_sizes, num_rows)[:, None]
    lhs = jnp.where(used, lhs, jnp.zeros((), lhs.dtype))
    out = _cpp_extensions().grouped_gemm(
        _ragged(lhs, _whole_sizes(group_sizes, num_rows)),
        _ragged(rhs, None),
        contracting_dims=((1,), (2,) if transpose_rhs else (1,)),
        preferred_element_type=out_dtype,
    )
    return jnp.where(used, out.astype(out_dtype), jnp.zeros((), out_dtype))

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    del num_groups  # group_sizes' length.
    num_rows = lhs.shape[0]
    used = used_rows(group_sizes, num_rows)[:, None]
    zero = jnp.zeros((), lhs.dtype)
    sizes = _whole_sizes(group_sizes, num_rows)
    # Both operands are zeroed past the groups: a NaN there would survive
    # a product with the other's zero.
    out = _cpp_extensions().grouped_gemm(
        _ragged(jnp.where(used, lhs, zero), sizes),
        _ragged(jnp.where(used, rhs, zero), sizes),
        contracting_dims=((0,), (0,)),
        preferred_element_type=out_dtype,
    )
    return out.astype(out_dtype)


def grouped_gemm(
    rows: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool,
    out_dtype,
) -> jax.Array:
  """rows [M, C] x weights [E, C, N] ([E, N, C] if transpose_rhs) -> [M, N].

  TE's grouped GEMM through `TEKernels`: differentiable in both
  directions, under vmap, inside shard_map(check_vma=True) and exportable.
  Rows at or past sum(group_sizes) come out zero with zero gradient.

  Args:
    rows: [M, C] bfloat16 or float16.
    weights: of rows' dtype.
    group_sizes: [E] int32, entries >= 0, sum <= M (sanitised upstream).
    transpose_rhs: weights are [E, N, C] (contract with weights[e].T).
    out_dtype: the output's dtype (TE's preferred_element_type).
  """
  return grouped_matmul.gmm(
      TEKernels(),
      rows,
      weights,
      group_sizes.astype(jnp.int32),
      transpose_rhs=transpose_rhs,
      out_dtype=jnp.dtype(out_dtype),
  )


def quantized_grouped_gemm(
    rows: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool,
    out_dtype,
    recipe: str,
    scaling: str = "current",
) -> jax.Array:
  """The forward of a quantised grouped GEMM through TE's quantizer sets.

  One `transformer_engine.jax.dense.grouped_dense` call with the recipe's
  quantizer set (TE quantises both operands itself), run as one device's
  kernel (`moe_core.kernels.primitive.call_kernel`): vmap, shard_map and
  export take it like the unquantised kernels. Not differentiable: the te
  backend calls it as the primal of `quantized_gemm.straight_through`,
  whose derivatives are the unquantised `grouped_gemm`'s.

  Args:
    rows, weights, group_sizes, transpose_rhs, out_dtype: as `grouped_gemm`.
    recipe: "fp8_tensor" or "mxfp8".
    scaling: "current" or "delayed" (fp8_tensor only; see `quantizer_set`).

  Returns:
    [M, N] of out_dtype; zeros at and past row sum(group_sizes).
  """
  (out,) = primitive.call_kernel(
      _quantized_dense,
      rows,
      weights,
      group_sizes.astype(jnp.int32),
      transpose_rhs=bool(transpose_rhs),
      out_dtype=jnp.dtype(out_dtype),
      recipe=recipe,
      scaling=scaling,
  )
  return out


def _quantized_dense(
    rows, weights, group_sizes, *, transpose_rhs, out_dtype, recipe, scaling
):
  """`quantized_grouped_gemm`'s kernel: (out [M, N],).

  What is done around grouped_dense, and why:
    * Rows past sum(group_sizes) are zeroed and given to the last group
      (`_whole_sizes`), where a zero row adds nothing to a product or an
      amax; their outputs are masked to exact zeros.
    * `GROUP_ALIGN[recipe]` > 1 gives every group a multiple of that many
      rows (zero rows appended to each), as TE's quantised grouped GEMMs
      need.
    * C and N are padded with zeros to multiples of
      `CONTRACTION_MULTIPLE` and `OUTPUT_MULTIPLE` (TE's FP8 and MXFP8
      quantisers cannot pad); zeros change no product, amax or block scale
      (moe_core pads a last block with zeros too), and the padded output
      columns are dropped.
    * [E, N, C] weights are transposed to [E, C, N]: the quantizer set
      quantises the weights along axis 1 as the contraction.
  """
  num_rows = rows.shape[0]
  used = used_rows(group_sizes, num_rows)
  if transpose_rhs:
    weights = jnp.swapaxes(weights, 1, 2)
  rows = jnp.where(used[:, None], rows, jnp.zeros((), rows.dtype))
  width = weights.shape[2]
  rows = _pad_axis(rows, 1, CONTRACTION_MULTIPLE[recipe])
  weights = _pad_axis(
      _pad_axis(weights, 1, CONTRACTION_MULTIPLE[recipe]),
      2,
      OUTPUT_MULTIPLE[recipe],
  )
  align = GROUP_ALIGN[recipe]
  rows, te_sizes, gather = _aligned_groups(rows, group_sizes, used, align)
  out = _dense().grouped_dense(
      rows,
      weights,
      te_sizes,
      contracting_dims=((1,), (1,)),
      preferred_element_type=out_dtype,
      quantizer_set=quantizer_set(recipe, weights.shape[0], scaling),
  )
  out = out.astype(out_dtype)[gather][:, :width]
  return (jnp.where(used[:, None], out, jnp.zeros((), out_dtype)),)


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  """x with zeros appended along `axis` up to a multiple of `multiple`."""
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


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
  groups = precision_lib.row_groups(group_sizes, num_rows, clamp_tail=True)
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
  groups = precision_lib.row_groups(group_sizes, num_rows, clamp_tail=True)
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
