"""The example kernel backend's grouped GEMM: two Pallas kernels.

`gmm` (rows [M, C] x weights [E, C, N] -> [M, N]: the forward and dX) and
`tgmm` (per group lhs_g^T @ rhs_g -> [E, A, B]: dW) take rows sorted by
group, and zero the rows outside a group before any product
(`_zero_rows_outside`). Written for reading, not speed. The same kernels
run interpreted (`interpret=True`: the CPU) and lowered through Triton
(the GPU), which shapes them: blocks are powers of two >= 16 (the
wrappers pad the operands to whole blocks), the operands a program reads
at data-dependent offsets (a group's weights or rows) are whole-array
refs sliced with `pl.ds`, and accumulators are float32 loop carries.
`moe_core.kernels.grouped_matmul` makes them differentiable.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from moe_core.kernels import grouped_matmul

# Relative, so that the folder works under any package name (a copy in
# backends/<name>/ may say `from backends.<name> import tiles` instead).
from . import tiles as tiles_lib

# An operand passed whole, sliced inside the kernel.
_WHOLE_ARRAY = pl.BlockSpec()


def _precision(dtype):
  # Triton reads DEFAULT as TF32 for float32 operands; HIGHEST keeps IEEE.
  if jnp.dtype(dtype) == jnp.float32:
    return lax.Precision.HIGHEST
  return lax.Precision.DEFAULT


def _pad_to(x: jax.Array, shape) -> jax.Array:
  """x with zeros appended along each axis up to `shape`."""
  return jnp.pad(x, [(0, want - have) for have, want in zip(x.shape, shape)])


def _round_up(x: int, block: int) -> int:
  return pl.cdiv(x, block) * block


def _group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(starts, ends), each [E] int32: group g owns rows [starts[g], ends[g])."""
  ends = jnp.cumsum(group_sizes).astype(jnp.int32)
  return ends - group_sizes.astype(jnp.int32), ends


def _zero_rows_outside(x, first_row, start, end):
  """x [rows, cols] (rows first_row, first_row + 1, ...) with the rows
  outside [start, end) zeroed, whatever they held.

  Rows at or past sum(group_sizes) belong to no group and may hold
  anything, NaN included, so every kernel zeroes them before any product
  (NaN * 0 is NaN: masking afterwards would let it reach dW).
  """
  row = first_row + lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where((row >= start) & (row < end), x, jnp.zeros((), x.dtype))


def _gmm_kernel(
    starts_ref,
    ends_ref,
    rows_ref,
    weights_ref,
    out_ref,
    *,
    bc: int,
    transpose_rhs: bool,
):
  """Output tile (i, j): out[i*bm : (i+1)*bm, j*bn : (j+1)*bn], [bm, bn].

  starts_ref, ends_ref: [E] int32. rows_ref [Mp, Cp] and weights_ref
  [E, Cp, Np] ([E, Np, Cp] transposed): whole arrays, padded to blocks.
  """
  bm, bn = out_ref.shape
  num_groups = weights_ref.shape[0]
  c_steps = rows_ref.shape[1] // bc
  r0 = pl.program_id(0) * bm
  n0 = pl.program_id(1) * bn
  precision = _precision(rows_ref.dtype)

  def group_step(group, acc):
    start, end = starts_ref[group], ends_ref[group]

    def c_step(step, acc):
      c0 = step * bc
      rows = rows_ref[pl.ds(r0, bm), pl.ds(c0, bc)]
      # Only this group's rows: zeros elsewhere (other groups, unused rows).
      rows = _zero_rows_outside(rows, r0, start, end)
      if transpose_rhs:
        weights = weights_ref[group, pl.ds(n0, bn), pl.ds(c0, bc)]
        dims = (((1,), (1,)), ((), ()))  # rows @ weights.T
      else:
        weights = weights_ref[group, pl.ds(c0, bc), pl.ds(n0, bn)]
        dims = (((1,), (0,)), ((), ()))  # rows @ weights
      return acc + lax.dot_general(
          rows,
          weights,
          dims,
          precision=precision,
          preferred_element_type=jnp.float32,
      )

    # A group that owns no row of this tile (empty ones included) skips
    # its C loop. Both bounds int32: the Triton lowering wants one type.
    owns_rows = (start < end) & (start < r0 + bm) & (end > r0)
    c_end = jnp.where(owns_rows, jnp.int32(c_steps), jnp.int32(0))
    return lax.fori_loop(jnp.int32(0), c_end, c_step, acc)

  acc = lax.fori_loop(
      jnp.int32(0),
      jnp.int32(num_groups),
      group_step,
      jnp.zeros((bm, bn), jnp.float32),
  )
  # Rows of no group got no product: zeros, as gmm promises.
  out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *, bm: int):
  """Tile (a, b) of group g's lhs_g^T @ rhs_g: out[g, a*ba:, b*bb:] [ba, bb].

  starts_ref, ends_ref: [E] int32. lhs_ref [Mp, Ap] and rhs_ref [Mp, Bp]:
  whole arrays, padded to blocks.
  """
  ba, bb = out_ref.shape
  group = pl.program_id(0)
  a0 = pl.program_id(1) * ba
  b0 = pl.program_id(2) * bb
  start, end = starts_ref[group], ends_ref[group]
  precision = _precision(lhs_ref.dtype)

  def row_step(step, acc):
    r0 = step * bm
    lhs = lhs_ref[pl.ds(r0, bm), pl.ds(a0, ba)]
    rhs = rhs_ref[pl.ds(r0, bm), pl.ds(b0, bb)]
    # The first and last blocks hold rows of other groups (or unused
    # ones, maybe NaN): zero them in both operands.
    lhs = _zero_rows_outside(lhs, r0, start, end)
    rhs = _zero_rows_outside(rhs, r0, start, end)
    return acc + lax.dot_general(
        lhs,
        rhs,
        (((0,), (0,)), ((), ())),  # lhs.T @ rhs
        precision=precision,
        preferred_element_type=jnp.float32,
    )

  # The row blocks that hold the group's rows; none for an empty group,
  # whose block stays zero.
  first = start // bm
  last = jnp.where(end > start, pl.cdiv(end, bm), first)
  acc = lax.fori_loop(first, last, row_step, jnp.zeros((ba, bb), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def gmm(
    rows: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: tiles_lib.Tiles,
    transpose_rhs: bool,
    out_dtype,
    interpret: bool,
) -> jax.Array:
  """rows [M, C] x weights [E, C, N] ([E, N, C] transposed) -> [M, N].

  The forward and dX. Each program computes one output tile and loops over
  every group, doing work only for the groups that own rows of its tile.
  Rows at or past sum(group_sizes) come out zero, unread.
  """
  (m, c), num_groups = rows.shape, weights.shape[0]
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  mp, cp, np_ = (
      _round_up(m, tiles.bm),
      _round_up(c, tiles.bc),
      _round_up(n, tiles.bn),
  )
  rows = _pad_to(rows, (mp, cp))
  weights = _pad_to(
      weights, (num_groups, np_, cp) if transpose_rhs else (num_groups, cp, np_)
  )
  out = pl.pallas_call(
      functools.partial(_gmm_kernel, bc=tiles.bc, transpose_rhs=transpose_rhs),
      grid=(mp // tiles.bm, np_ // tiles.bn),
      in_specs=[_WHOLE_ARRAY] * 4,
      out_specs=pl.BlockSpec((tiles.bm, tiles.bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      interpret=interpret,
  )(*_group_bounds(group_sizes), rows, weights)
  return out[:m, :n]


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: tiles_lib.Tiles,
    num_groups: int,
    out_dtype,
    interpret: bool,
) -> jax.Array:
  """Per group lhs_g^T @ rhs_g: [M, A] x [M, B] -> [E, A, B].

  dW. Each program computes one tile of one group's [A, B] block.
  Rows at or past sum(group_sizes) are masked, NaN or not; an empty group
  gives zeros. `tiles`: bm the row step, bc the A block, bn the B block.
  """
  (m, a), b = lhs.shape, rhs.shape[1]
  mp, ap, bp = (
      _round_up(m, tiles.bm),
      _round_up(a, tiles.bc),
      _round_up(b, tiles.bn),
  )
  out = pl.pallas_call(
      functools.partial(_tgmm_kernel, bm=tiles.bm),
      grid=(num_groups, ap // tiles.bc, bp // tiles.bn),
      in_specs=[_WHOLE_ARRAY] * 4,
      # None: the group axis is squeezed, so the kernel sees [ba, bb].
      out_specs=pl.BlockSpec(
          (None, tiles.bc, tiles.bn), lambda g, i, j: (g, i, j)
      ),
      out_shape=jax.ShapeDtypeStruct((num_groups, ap, bp), out_dtype),
      interpret=interpret,
  )(*_group_bounds(group_sizes), _pad_to(lhs, (mp, ap)), _pad_to(rhs, (mp, bp)))
  return out[:, :a, :b]


@dataclasses.dataclass(frozen=True)
class ExampleKernels(grouped_matmul.GroupedKernels):
  """`gmm` and `tgmm` as `GroupedKernels`, tiled by `table`.

  `moe_core.kernels.grouped_matmul` differentiates them: the forward and
  dX are `gmm` (dX against the weights' other layout), dW is `tgmm`.
  Frozen: the kernels are a static parameter of that primitive.
  """

  table: tiles_lib.TileTable
  interpret: bool

  def gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
    """lhs [M, C] x rhs [E, C, N] ([E, N, C] transposed) -> [M, N]."""
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return gmm(
        lhs,
        rhs,
        group_sizes,
        tiles=self.table.choose(lhs.shape[0], lhs.shape[1], n),
        transpose_rhs=transpose_rhs,
        out_dtype=np.dtype(out_dtype),
        interpret=self.interpret,
    )

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    """Per group lhs_g^T rhs_g: [M, A] x [M, B] -> [E, A, B]."""
    return tgmm(
        lhs,
        rhs,
        group_sizes,
        tiles=self.table.choose(lhs.shape[0], lhs.shape[1], rhs.shape[1]),
        num_groups=num_groups,
        out_dtype=np.dtype(out_dtype),
        interpret=self.interpret,
    )
