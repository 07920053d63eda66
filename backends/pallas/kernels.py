"""Pallas kernels of the grouped GEMM: gmm (forward, dX), tgmm (dW), scaled_gmm.

scaled_gmm is gmm's forward on quantised operands (FP8 data in, scales
applied inside). All are written for the Triton lowering (GPU), whose limits
shape them (docs/pallas.md, "The kernels": no data-dependent index maps, no
scratch memory, power-of-two blocks, no read-modify-write of a shared row
tile), and run unchanged in interpret mode (CPU; `interpret` as in
docs/backends.md). Over 400 lines because it is one job: the three kernels
share their padding, owned-row stores and loop bounds.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
import jax.numpy as jnp

from backends.pallas import metadata as metadata_lib
from backends.pallas import tiling
from moe_core import compat
from moe_core.kernels import gpu

Epilogue = Callable[[Sequence[jax.Array]], Sequence[jax.Array]]

# An operand passed whole (its block depends on data, so no index map), in
# the default memory space. Not `pl.no_block_spec`: since jax 0.11 that
# means memory space ANY (a raw HBM ref that a TPU kernel must copy from),
# which the debug interpreter refuses to load from directly; the Triton
# lowering ignores memory spaces (both give byte-identical CUDA exports).
_WHOLE_ARRAY = pl.BlockSpec()


def identity(accs):
  """The epilogue that writes each accumulator as it is."""
  return tuple(accs)


def _precision(dtype):
  # Triton reads DEFAULT as TF32 for float32 operands; HIGHEST keeps IEEE.
  if jnp.dtype(dtype) == jnp.float32:
    return lax.Precision.HIGHEST
  return lax.Precision.DEFAULT


def _compiler_params(tiles: tiling.Tiles, interpret):
  if interpret is False or interpret is True:
    return plt.CompilerParams(
        num_warps=tiles.num_warps, num_stages=tiles.num_stages
    )
  return None  # The debug (TPU) interpreter takes no Triton parameters.


# What pallas does on a TPU and what to use there: its availability()
# there, and the error of a compiled kernel traced for one.
ON_TPU = (
    "pallas: its kernels compile through Triton for NVIDIA GPUs only; on a "
    "TPU it runs its interpreter alone (interpret=True, slow): use "
    "'mosaic_tpu' (Pallas TPU kernels) or 'xla' there."
)


def _pallas_call(kernel, *operands, interpret, **options):
  """`pl.pallas_call(kernel, interpret=interpret, **options)(*operands)`.

  Raises:
    NotImplementedError: compiled (interpret False) in a program lowered for
      a TPU, where the Triton compiler parameters would reach Pallas'
      Mosaic TPU lowering and fail there with a bare AssertionError.
  """
  if interpret is False and gpu.lowering_platform() == "tpu":
    raise NotImplementedError(ON_TPU)
  call = pl.pallas_call(kernel, interpret=interpret, **options)
  if interpret is not False:
    return call(*operands)
  # Outside jit the call lowers the kernel right here, and jax >= 0.11 warns
  # at each Triton lowering that the backend is deprecated: dropless uses it
  # on purpose. Under jit the kernel lowers later, with the caller's
  # program; compat.filter_triton_deprecation() can wrap that lowering.
  with compat.filter_triton_deprecation():
    return call(*operands)


def _pad2(x, rows, cols):
  if x.shape == (rows, cols):
    return x
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def _pad3(w, d1, d2):
  if w.shape[1:] == (d1, d2):
    return w
  return jnp.pad(w, ((0, 0), (0, d1 - w.shape[1]), (0, d2 - w.shape[2])))


def _store_owned_rows(o_ref, value, r0, n0, row_start, row_end, indexed):
  """Stores the rows [row_start, row_end) of value into o_ref[r0:, n0:].

  Two spellings, both a masked Triton store when lowered: slices (GPU, debug
  interpreter) and index arrays (`indexed`: JAX's HLO interpreter, where the
  slice form would pad the whole output on every step; about 10x slower).
  """
  bm, bn = value.shape
  rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
  mask = (rows >= row_start) & (rows < row_end)
  if indexed:
    cols = n0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
    plt.store(o_ref.at[rows, cols], value, mask=mask)
  else:
    plt.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], value, mask=mask)


def _loop_bound(computes, steps: int):
  """`steps` if `computes`, else 0, as an int32 loop bound.

  Both bounds of a dynamic `fori_loop` are int32 on purpose: with a Python
  int lower bound and a traced upper one, the Triton lowering emitted an
  `scf.for` whose bounds differ in type, which XLA's Triton compiler
  rejects (found by compiling for an H100, `moe_core.aot`).
  """
  return jnp.where(computes, jnp.int32(steps), jnp.int32(0))


class _Visit(NamedTuple):
  """This program's visit of the tile list x its column block.

  Attributes:
    row_start, row_end: the rows the visit owns.
    r0, n0: the first row and column of its [bm, bn] output block.
    computes: a real group that owns rows (else: the loop is skipped).
    weight: the weight matrix to read (clamped for the padding group).
  """

  row_start: jax.Array
  row_end: jax.Array
  r0: jax.Array
  n0: jax.Array
  computes: jax.Array
  weight: jax.Array


def _visit(group_ref, tile_ref, start_ref, end_ref, tiles, num_groups):
  """The `_Visit` of program (visit, column block) of a gmm-shaped grid."""
  visit = pl.program_id(0)
  group = group_ref[visit]
  row_start = start_ref[visit]
  row_end = end_ref[visit]
  return _Visit(
      row_start=row_start,
      row_end=row_end,
      r0=pl.multiple_of(tile_ref[visit] * tiles.bm, tiles.bm),
      n0=pl.multiple_of(pl.program_id(1) * tiles.bn, tiles.bn),
      # Unused visits and the padding group (E) skip the loop: zeros.
      computes=(group < num_groups) & (row_end > row_start),
      weight=jnp.minimum(group, num_groups - 1),
  )


def _contraction(transpose_rhs: bool):
  """The dot_general dimensions of a row block x a weight block."""
  return (((1,), (1 if transpose_rhs else 0,)), ((), ()))


def _weight_block(ref, weight, k0, n0, tiles, transpose_rhs):
  """Block (K rows k0:k0+bk, columns n0:n0+bn) of ref[weight]."""
  if transpose_rhs:
    return ref[weight, pl.ds(n0, tiles.bn), pl.ds(k0, tiles.bk)]
  return ref[weight, pl.ds(k0, tiles.bk), pl.ds(n0, tiles.bn)]


class _PaddedOperands(NamedTuple):
  """gmm-shaped operands padded to the blocks, and their tile list.

  Attributes:
    lhs: the row operands, each [Mp, Kp].
    rhs: the weight operands, each [E, Kp, Np] ([E, Np, Kp] transposed).
    meta: the tile list of the padded rows.
    mp, kp, np_: the padded sizes.
  """

  lhs: list
  rhs: list
  meta: metadata_lib.TileMetadata
  mp: int
  kp: int
  np_: int


def _pad_operands(lhs, rhs, group_sizes, tiles, transpose_rhs):
  """Pads lhs (each [M, K]) and rhs (each [E, K, N]) to the blocks.

  An empty K pads to one block of zeros: the kernels' blocks are never
  empty, and the products come out zero.
  """
  m, k = lhs[0].shape
  n = rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2]
  mp, kp, np_ = (
      tiling.padded(d, b)
      for d, b in ((m, tiles.bm), (max(k, 1), tiles.bk), (n, tiles.bn))
  )
  return _PaddedOperands(
      lhs=[_pad2(x, mp, kp) for x in lhs],
      rhs=[
          _pad3(w, np_, kp) if transpose_rhs else _pad3(w, kp, np_) for w in rhs
      ],
      meta=metadata_lib.build(group_sizes, mp, tiles.bm),
      mp=mp,
      kp=kp,
      np_=np_,
  )


def _call_over_visits(
    kernel, p: _PaddedOperands, *operands, tiles, interpret, out_shape, name
):
  """`kernel` on the grid (visit, column block) of `p`'s tile list.

  The kernel's inputs: the tile list (group, tile, row start, row end per
  visit), p.lhs, p.rhs, then `operands`.
  """
  meta = p.meta
  return _pallas_call(
      kernel,
      meta.group_ids,
      meta.tile_ids,
      meta.row_starts,
      meta.row_ends,
      *p.lhs,
      *p.rhs,
      *operands,
      out_shape=out_shape,
      grid=(meta.group_ids.shape[0], p.np_ // tiles.bn),
      interpret=interpret,
      compiler_params=_compiler_params(tiles, interpret),
      name=name,
  )


def _gmm_kernel(
    group_ref,
    tile_ref,
    start_ref,
    end_ref,
    *refs,
    num_lhs,
    num_rhs,
    products,
    num_accs,
    epilogue,
    tiles,
    c_steps,
    num_groups,
    transpose_rhs,
    precision,
    indexed,
):
  """One visit of the tile list x one column block.

  refs: num_lhs row refs [Mp, Cp], num_rhs weight refs [E, Cp, Np] ([E, Np,
  Cp] if transpose_rhs), then the output refs [Mp, Np], padded to the
  blocks. products: static (lhs, rhs, acc) index triples; acc[a] += lhs[l]
  @ rhs[r].
  """
  lhs_refs = refs[:num_lhs]
  rhs_refs = refs[num_lhs : num_lhs + num_rhs]
  out_refs = refs[num_lhs + num_rhs :]
  bm, bk, bn = tiles.bm, tiles.bk, tiles.bn
  v = _visit(group_ref, tile_ref, start_ref, end_ref, tiles, num_groups)

  def c_step(step, accs):
    c0 = pl.multiple_of(step * bk, bk)
    lhs = [ref[pl.ds(v.r0, bm), pl.ds(c0, bk)] for ref in lhs_refs]
    rhs = [
        _weight_block(ref, v.weight, c0, v.n0, tiles, transpose_rhs)
        for ref in rhs_refs
    ]
    accs = list(accs)
    for l, r, a in products:
      accs[a] += lax.dot_general(
          lhs[l],
          rhs[r],
          _contraction(transpose_rhs),
          precision=precision,
          preferred_element_type=jnp.float32,
      )
    return tuple(accs)

  zeros = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(num_accs))
  accs = lax.fori_loop(
      jnp.int32(0), _loop_bound(v.computes, c_steps), c_step, zeros
  )
  for o_ref, value in zip(out_refs, epilogue(accs)):
    _store_owned_rows(
        o_ref,
        value.astype(o_ref.dtype),
        v.r0,
        v.n0,
        v.row_start,
        v.row_end,
        indexed,
    )


def gmm(
    lhs: Sequence[jax.Array],
    rhs: Sequence[jax.Array],
    group_sizes: jax.Array,
    *,
    tiles: tiling.Tiles,
    interpret,
    transpose_rhs: bool = False,
    products: Sequence[tuple[int, int, int]] = ((0, 0, 0),),
    epilogue: Epilogue = identity,
    num_outputs: int = 1,
    out_dtype=None,
) -> tuple[jax.Array, ...]:
  """Grouped GEMMs over one tile list: acc[a] += lhs[l] @ rhs[r][group].

  Args:
    lhs: row operands, each [M, C] sorted by group.
    rhs: weight operands, each [E, C, N] ([E, N, C] if `transpose_rhs`).
    group_sizes: [E] int32, sum <= M.
    tiles: block sizes and launch settings.
    interpret: False (GPU), True (HLO interpreter) or InterpretParams.
    transpose_rhs: contract with rhs[g].T.
    products: static (lhs index, rhs index, accumulator index) triples; the
      number of accumulators is one more than the largest index.
    epilogue: float32 accumulators [bm, bn] -> `num_outputs` output blocks.
    num_outputs: number of outputs.
    out_dtype: output dtype (lhs[0]'s by default).

  Returns:
    `num_outputs` arrays [M, N]; rows past sum(group_sizes) are zero.
  """
  m = lhs[0].shape[0]
  num_groups = rhs[0].shape[0]
  n = rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2]
  out_dtype = jnp.dtype(out_dtype or lhs[0].dtype)
  if m == 0 or n == 0:
    return tuple(jnp.zeros((m, n), out_dtype) for _ in range(num_outputs))
  p = _pad_operands(lhs, rhs, group_sizes, tiles, transpose_rhs)
  kernel = functools.partial(
      _gmm_kernel,
      num_lhs=len(lhs),
      num_rhs=len(rhs),
      products=tuple(products),
      num_accs=1 + max(a for _, _, a in products),
      epilogue=epilogue,
      tiles=tiles,
      c_steps=p.kp // tiles.bk,
      num_groups=num_groups,
      transpose_rhs=transpose_rhs,
      precision=_precision(lhs[0].dtype),
      indexed=interpret is True,
  )
  outs = _call_over_visits(
      kernel,
      p,
      tiles=tiles,
      interpret=interpret,
      out_shape=[
          jax.ShapeDtypeStruct((p.mp, p.np_), out_dtype)
          for _ in range(num_outputs)
      ],
      name="dropless_gmm",
  )
  return tuple(o[:m, :n] for o in outs)


def _tgmm_kernel(
    group_visits_ref,
    tile_ref,
    start_ref,
    end_ref,
    lhs_ref,
    *refs,
    num_rhs,
    tiles,
    precision,
):
  """dW[g][c block, n block] = sum over g's row tiles of lhs^T @ rhs."""
  rhs_refs = refs[:num_rhs]
  out_refs = refs[num_rhs:]
  bm, bk, bn = tiles.bm, tiles.bk, tiles.bn
  group = pl.program_id(0)
  c0 = pl.multiple_of(pl.program_id(1) * bk, bk)
  n0 = pl.multiple_of(pl.program_id(2) * bn, bn)

  def visit_step(visit, accs):
    r0 = pl.multiple_of(tile_ref[visit] * bm, bm)
    rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    # Rows of other groups, or past sum(group_sizes), may hold anything (NaN
    # included): select zeros rather than multiply by a mask.
    mine = (rows >= start_ref[visit]) & (rows < end_ref[visit])
    lhs = lhs_ref[pl.ds(r0, bm), pl.ds(c0, bk)]
    lhs = jnp.where(mine, lhs, jnp.zeros((), lhs.dtype))
    accs = list(accs)
    for i, ref in enumerate(rhs_refs):
      rhs = ref[pl.ds(r0, bm), pl.ds(n0, bn)]
      rhs = jnp.where(mine, rhs, jnp.zeros((), rhs.dtype))
      accs[i] += lax.dot_general(
          lhs,
          rhs,
          (((0,), (0,)), ((), ())),
          precision=precision,
          preferred_element_type=jnp.float32,
      )
    return tuple(accs)

  zeros = tuple(jnp.zeros((bk, bn), jnp.float32) for _ in range(num_rhs))
  # An empty group has no visits: its dW is the zeros it starts from.
  accs = lax.fori_loop(
      group_visits_ref[group], group_visits_ref[group + 1], visit_step, zeros
  )
  for o_ref, acc in zip(out_refs, accs):
    o_ref[...] = acc.astype(o_ref.dtype)


def tgmm(
    lhs: jax.Array,
    rhs: Sequence[jax.Array],
    group_sizes: jax.Array,
    *,
    tiles: tiling.Tiles,
    interpret,
    out_dtype=None,
) -> tuple[jax.Array, ...]:
  """Per-group lhs_g^T @ rhs_g for each rhs: [M, C], [M, N] -> [E, C, N].

  Args:
    lhs: [M, C] rows sorted by group.
    rhs: operands [M, N] with the same rows.
    group_sizes: [E] int32, sum <= M.
    tiles: bm is the reduction step over rows; bk x bn the output block.
    interpret: False (GPU), True (HLO interpreter) or InterpretParams.
    out_dtype: output dtype (lhs's by default).

  Returns:
    one [E, C, N] per rhs; rows past sum(group_sizes) contribute nothing and
    an empty group's block is exactly zero.
  """
  m, c = lhs.shape
  n = rhs[0].shape[1]
  num_groups = group_sizes.shape[0]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if m == 0 or c == 0 or n == 0:
    return tuple(jnp.zeros((num_groups, c, n), out_dtype) for _ in rhs)
  mp, cp, np_ = (
      tiling.padded(d, b)
      for d, b in ((m, tiles.bm), (c, tiles.bk), (n, tiles.bn))
  )
  lhs = _pad2(lhs, mp, cp)
  rhs = [_pad2(r, mp, np_) for r in rhs]
  meta = metadata_lib.build(group_sizes, mp, tiles.bm)
  kernel = functools.partial(
      _tgmm_kernel,
      num_rhs=len(rhs),
      tiles=tiles,
      precision=_precision(lhs.dtype),
  )
  whole = _WHOLE_ARRAY
  block = pl.BlockSpec((None, tiles.bk, tiles.bn), lambda g, i, j: (g, i, j))
  outs = _pallas_call(
      kernel,
      meta.group_visits,
      meta.tile_ids,
      meta.row_starts,
      meta.row_ends,
      lhs,
      *rhs,
      out_shape=[
          jax.ShapeDtypeStruct((num_groups, cp, np_), out_dtype) for _ in rhs
      ],
      grid=(num_groups, cp // tiles.bk, np_ // tiles.bn),
      in_specs=[whole] * (5 + len(rhs)),
      out_specs=[block] * len(rhs),
      interpret=interpret,
      compiler_params=_compiler_params(tiles, interpret),
      name="dropless_tgmm",
  )
  return tuple(o[:, :c, :n] for o in outs)


# --- gmm on quantised operands ----------------------------------------------


class QuantizedScales(NamedTuple):
  """The float32 scales of `scaled_gmm`, laid out for contiguous loads.

  Attributes:
    row_blocks: [KB, M], the rows' block scale of each K block, K-major so a
      row tile's scales of one K step are one contiguous load; or None.
    weight_blocks: [E, KB, N], each expert's scale of each K block and
      output column (a 128x128 block's scale repeated over its columns);
      or None (together with row_blocks).
    rows: [M], a per-row scale applied in the epilogue (the row group's
      per-tensor scale); or None.
    experts: [E], a per-expert scale applied in the epilogue; or None
      (together with rows).
  """

  row_blocks: jax.Array | None = None
  weight_blocks: jax.Array | None = None
  rows: jax.Array | None = None
  experts: jax.Array | None = None


def _dot(lhs, rhs, dims, upcast):
  """lhs . rhs in float32; upcast: both operands to float32 first.

  Without upcast, float8 operands go to the dot as they are: the Triton
  lowering makes a native FP8 MMA of it (Hopper's wgmma), accumulating in
  float32.
  """
  if upcast:
    lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  return lax.dot_general(
      lhs,
      rhs,
      dims,
      precision=_precision(lhs.dtype),
      preferred_element_type=jnp.float32,
  )


def _scaled_gmm_kernel(
    group_ref,
    tile_ref,
    start_ref,
    end_ref,
    lhs_ref,
    rhs_ref,
    *refs,
    block_scales,
    tensor_scales,
    dequantize_first,
    upcast,
    tiles,
    k_steps,
    num_groups,
    transpose_rhs,
    indexed,
):
  """One visit x one column block of `scaled_gmm`; bk is the scale block.

  refs: [KB, Mp] row and [E, KB, Np] weight block scales (if block_scales),
  [Mp] row and [E] expert scales (if tensor_scales), then the output [Mp,
  Np] float32.
  """
  refs = list(refs)
  if block_scales:
    row_block_ref, weight_block_ref = refs.pop(0), refs.pop(0)
  if tensor_scales:
    row_scale_ref, expert_scale_ref = refs.pop(0), refs.pop(0)
  (o_ref,) = refs
  bm, bk, bn = tiles.bm, tiles.bk, tiles.bn
  v = _visit(group_ref, tile_ref, start_ref, end_ref, tiles, num_groups)
  dims = _contraction(transpose_rhs)

  def k_step(step, acc):
    k0 = pl.multiple_of(step * bk, bk)
    lhs = lhs_ref[pl.ds(v.r0, bm), pl.ds(k0, bk)]
    rhs = _weight_block(rhs_ref, v.weight, k0, v.n0, tiles, transpose_rhs)
    if not block_scales:
      return acc + _dot(lhs, rhs, dims, upcast)
    # One K step is one scale block: a scale per row and one per column.
    row_scales = row_block_ref[step, pl.ds(v.r0, bm)][:, None]
    column_scales = weight_block_ref[v.weight, step, pl.ds(v.n0, bn)]
    if dequantize_first:
      # Formats without an MMA of their own: dequantise the tiles, then a
      # float32 product.
      lhs = lhs.astype(jnp.float32) * row_scales
      column_scales = (
          column_scales[:, None] if transpose_rhs else column_scales[None, :]
      )
      rhs = rhs.astype(jnp.float32) * column_scales
      return acc + _dot(lhs, rhs, dims, False)
    partial = _dot(lhs, rhs, dims, upcast)
    return acc + partial * row_scales * column_scales[None, :]

  acc = jnp.zeros((bm, bn), jnp.float32)
  acc = lax.fori_loop(
      jnp.int32(0), _loop_bound(v.computes, k_steps), k_step, acc
  )
  if tensor_scales:
    row_scales = row_scale_ref[pl.ds(v.r0, bm)][:, None]
    acc = acc * row_scales * expert_scale_ref[v.weight]
  # The padding group's visits store zeros even when the expert scale they
  # would borrow is NaN.
  acc = jnp.where(v.computes, acc, 0.0)
  _store_owned_rows(o_ref, acc, v.r0, v.n0, v.row_start, v.row_end, indexed)


def _pad_last(x, size, value):
  """x padded along its last axis to `size` with `value`."""
  pad = size - x.shape[-1]
  if pad == 0:
    return x
  widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
  return jnp.pad(x, widths, constant_values=value)


def scaled_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    scales: QuantizedScales,
    *,
    tiles: tiling.Tiles,
    interpret,
    transpose_rhs: bool = False,
    dequantize_first: bool = False,
) -> jax.Array:
  """The grouped GEMM of quantised operands, scales applied in the kernel.

  out[r] = sum over K blocks kb of (lhs[r, kb] . rhs[g, kb, :]) x the
  block scales of (r, kb) and (g, kb, column), times the row's and the
  expert's tensor scale; g is row r's group. The scales are applied after
  each block's product (FP8: the operands go to the MMA as they are) or,
  with `dequantize_first`, to the operand tiles before it (formats the
  hardware cannot multiply).

  Args:
    lhs: [M, K] float8_e4m3fn rows sorted by group (float32 works too).
    rhs: [E, K, N] of lhs's dtype ([E, N, K] if `transpose_rhs`).
    group_sizes: [E] int32, sum <= M.
    scales: `QuantizedScales`; with block scales, K is a multiple of
      tiles.bk, the width of one scale block.
    tiles: block sizes; bk is the scale block when there are block scales.
    interpret: False (GPU), True (HLO interpreter) or InterpretParams. When
      interpreting, the operands are upcast to float32 in the kernel before
      each product (the CPU has no FP8 dot).
    transpose_rhs: contract with rhs[g].T.
    dequantize_first: apply the block scales to the operand tiles, in
      float32, before the product.

  Returns:
    [M, N] float32; rows past sum(group_sizes) are zero.
  """
  m, k = lhs.shape
  num_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_scales = scales.row_blocks is not None
  tensor_scales = scales.rows is not None
  if block_scales and k % tiles.bk:
    raise ValueError(
        "scaled_gmm with block scales needs K to be a multiple of the scale "
        f"block tiles.bk, got K={k}, {tiles.bk=}."
    )
  if m == 0 or n == 0:
    return jnp.zeros((m, n), jnp.float32)
  p = _pad_operands([lhs], [rhs], group_sizes, tiles, transpose_rhs)
  scale_operands = []
  if block_scales:
    scale_operands += [
        _pad_last(scales.row_blocks, p.mp, 1.0),
        _pad_last(scales.weight_blocks, p.np_, 1.0),
    ]
  if tensor_scales:
    scale_operands += [_pad_last(scales.rows, p.mp, 1.0), scales.experts]
  kernel = functools.partial(
      _scaled_gmm_kernel,
      block_scales=block_scales,
      tensor_scales=tensor_scales,
      dequantize_first=dequantize_first,
      upcast=interpret is not False,
      tiles=tiles,
      k_steps=p.kp // tiles.bk,
      num_groups=num_groups,
      transpose_rhs=transpose_rhs,
      indexed=interpret is True,
  )
  out = _call_over_visits(
      kernel,
      p,
      *scale_operands,
      tiles=tiles,
      interpret=interpret,
      out_shape=jax.ShapeDtypeStruct((p.mp, p.np_), jnp.float32),
      name="dropless_scaled_gmm",
  )
  return out[:m, :n]
