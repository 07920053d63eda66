"""Grouped GEMM over a tile list as Mosaic GPU kernels (Hopper: TMA + wgmma).

One kernel, `gmm`, does the forward, the dX and the fused gate+up products
(out[a][rows of group g] = epilogue(sum over products (l, r, a) of
lhs[l][rows] @ rhs[r][g])) over the tile list of `backends.pallas.metadata`,
built on the device from `group_sizes`: visits x column blocks are spread
over a persistent grid of one program per SM, each pipelining its blocks
through shared memory with TMA into warpgroup MMAs accumulating in
registers (docs/mosaic_gpu.md, "The kernels", has the design). Over 400
lines because it is one job: the Hopper kernel and the pieces (work items,
pipeline, stores) the Blackwell kernel reuses with its own MMA.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from backends.mosaic_gpu import tiling
from backends.pallas import metadata


def identity(accs):
  """The default epilogue: every accumulator is an output."""
  return tuple(accs)


def _pad2(x, rows, cols):
  pad = ((0, rows - x.shape[0]), (0, cols - x.shape[1]))
  return x if not any(p for _, p in pad) else jnp.pad(x, pad)


def _pad3(w, d1, d2):
  pad = ((0, 0), (0, d1 - w.shape[1]), (0, d2 - w.shape[2]))
  return w if not any(p for _, p in pad) else jnp.pad(w, pad)


def _store_owned_rows(o_smem, o_gmem, tile_row0, row_start, row_end, n0, bn):
  """Copies rows [row_start, row_end) of the tile from SMEM to GMEM.

  o_smem holds the whole [bm, bn] tile whose first row is tile_row0; the
  owned count is written as a sum of power-of-two TMA copies. A visit owns
  a run of rows that need not start or end on a tile boundary, and TMA
  stores need static sizes: the store is a ladder of copies (bm, bm/2, ...,
  1), each issued when that bit of the owned row count is set, so any count
  0..bm is written with at most log2(bm) + 1 copies and no masked stores.
  """
  bm = o_smem.shape[0]
  count = row_end - row_start
  offset = row_start - tile_row0
  chunk = bm
  while chunk >= 1:

    @pl.when((count & chunk) != 0)
    def _(offset=offset, chunk=chunk):
      plgpu.copy_smem_to_gmem(
          o_smem.at[pl.ds(offset, chunk)],
          o_gmem.at[pl.ds(tile_row0 + offset, chunk), pl.ds(n0, bn)],
      )

    offset = offset + (count & chunk)
    chunk //= 2


class WorkItem(NamedTuple):
  """One visit of the tile list x one column block, read in the kernel.

  Attributes:
    n_block: the output column block.
    tile: the row tile (rows tile*bm : tile*bm + bm).
    row_start, row_end: the rows the visit owns.
    computes: a real group that owns rows (else: store zeros).
    weight: the weight matrix to read (clamped for the padding group).
  """

  n_block: jax.Array
  tile: jax.Array
  row_start: jax.Array
  row_end: jax.Array
  computes: jax.Array
  weight: jax.Array


def work_item(loop_info, tile_list_refs, grid_n: int, num_groups: int):
  """The `WorkItem` of a persistent loop index.

  Column blocks are innermost: consecutive work items of a visit share its
  row tile and weight matrix, which then stay in L2.
  """
  group_ref, tile_ref, start_ref, end_ref = tile_list_refs
  flat = loop_info.index[0]
  visit = flat // grid_n
  group = group_ref[visit]
  row_start = start_ref[visit]
  row_end = end_ref[visit]
  return WorkItem(
      n_block=flat % grid_n,
      tile=tile_ref[visit],
      row_start=row_start,
      row_end=row_end,
      # Unused visits and the padding group skip the MMAs: zeros.
      computes=(group < num_groups) & (row_end > row_start),
      weight=jnp.minimum(group, num_groups - 1),
  )


def in_specs(item: WorkItem, tiles, num_lhs, num_rhs, transpose_rhs):
  """The pipeline's block specs: the row blocks, then the weight blocks."""
  bm, bk, bn = tiles.bm, tiles.bk, tiles.bn
  if transpose_rhs:
    rhs = plgpu.BlockSpec(
        (bn, bk), lambda c: (item.n_block, c), delay_release=1
    )
  else:
    rhs = plgpu.BlockSpec(
        (bk, bn), lambda c: (c, item.n_block), delay_release=1
    )
  lhs = plgpu.BlockSpec((bm, bk), lambda c: (item.tile, c), delay_release=1)
  return [lhs] * num_lhs + [rhs] * num_rhs


def store_tiles(o_smems, out_refs, item: WorkItem, bm: int, bn: int):
  """The written SMEM output tiles -> the rows the work item owns in GMEM."""
  plgpu.commit_smem()
  for o_smem, o_gmem in zip(o_smems, out_refs):
    _store_owned_rows(
        o_smem,
        o_gmem,
        item.tile * bm,
        item.row_start,
        item.row_end,
        item.n_block * bn,
        bn,
    )
  # The SMEM tiles are reused by the next work item.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


class BodyOptions(NamedTuple):
  """The static settings of a kernel body, set by `gmm`.

  Attributes:
    num_lhs, num_rhs: how many row and weight operands.
    products: (lhs index, rhs index, accumulator index) triples.
    num_accs: accumulators, one more than the largest index.
    epilogue: the float32 accumulators -> the output tiles.
    tiles: block sizes and pipeline depth.
    num_visits: entries of the tile list.
    grid_n: output column blocks.
    c_steps: blocks of the contraction.
    num_groups: weight matrices (E).
    transpose_rhs: weights [E, Np, Cp] rather than [E, Cp, Np].
  """

  num_lhs: int
  num_rhs: int
  products: tuple[tuple[int, int, int], ...]
  num_accs: int
  epilogue: Callable
  tiles: tiling.Tiles
  num_visits: int
  grid_n: int
  c_steps: int
  num_groups: int
  transpose_rhs: bool

  def split_refs(self, refs):
    """A body's refs -> (tile list, lhs, rhs, the rest: outputs, scratch)."""
    tile_list, refs = refs[:4], refs[4:]
    lhs, refs = refs[: self.num_lhs], refs[self.num_lhs :]
    return tile_list, lhs, refs[: self.num_rhs], refs[self.num_rhs :]


def for_each_work_item(tile_list_refs, options: BodyOptions):
  """Decorator: runs the function on each `WorkItem` of this program."""

  def decorate(fn):
    @plgpu.nd_loop((options.num_visits * options.grid_n,), collective_axes="sm")
    def _(loop_info):
      grid_n, num_groups = options.grid_n, options.num_groups
      fn(work_item(loop_info, tile_list_refs, grid_n, num_groups))

  return decorate


def pipeline(step, item: WorkItem, lhs_refs, rhs_refs, options: BodyOptions):
  """Runs `step` over the work item's [bm, bk] and [bk, bn] blocks in SMEM."""
  plgpu.emit_pipeline(
      step,
      grid=(options.c_steps,),
      in_specs=in_specs(
          item,
          options.tiles,
          options.num_lhs,
          options.num_rhs,
          options.transpose_rhs,
      ),
      max_concurrent_steps=options.tiles.stages,
  )(*lhs_refs, *(ref.at[item.weight] for ref in rhs_refs))


def store_outputs(write, out_refs, item: WorkItem, tiles: tiling.Tiles):
  """write(o_smems) fills [bm, bn] SMEM output tiles; stores the owned rows."""

  def scope(*o_smems):
    write(o_smems)
    store_tiles(o_smems, out_refs, item, tiles.bm, tiles.bn)

  pl.run_scoped(
      scope, *(plgpu.SMEM((tiles.bm, tiles.bn), o.dtype) for o in out_refs)
  )


class Mma(NamedTuple):
  """A tensor-core generation's kernel body and what it asks of the launch.

  Attributes:
    body: body(*refs, options=BodyOptions), one program: refs are the tile
      list, the operands and the outputs (`BodyOptions.split_refs`), then
      the scratch.
    scratch_types: (tiles, num_accs) -> the body's scratch.
    check_tiles: (tiles, num_accs) -> None; raises ValueError for tiles
      the body cannot run.
  """

  body: Callable
  scratch_types: Callable[[tiling.Tiles, int], tuple] = lambda *_: ()
  check_tiles: Callable[[tiling.Tiles, int], None] = lambda *_: None


class Problem(NamedTuple):
  """A gmm call's operands padded to the blocks, and its launch shape."""

  m: int
  n: int
  lhs: list
  rhs: list
  tile_list: metadata.TileMetadata
  out_type: tuple
  num_programs: int
  body_options: BodyOptions


def launch(problem: Problem, mma: Mma, interpret):
  """Runs `mma`'s body over `problem` on the persistent grid: [M, N] each."""
  options = problem.body_options
  mma.check_tiles(options.tiles, options.num_accs)
  kernel = plgpu.kernel(
      functools.partial(mma.body, options=options),
      out_type=problem.out_type,
      scratch_types=mma.scratch_types(options.tiles, options.num_accs),
      grid=(problem.num_programs,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
      interpret=interpret,
  )
  tl = problem.tile_list
  outs = kernel(
      tl.group_ids,
      tl.tile_ids,
      tl.row_starts,
      tl.row_ends,
      *problem.lhs,
      *problem.rhs,
  )
  return tuple(o[: problem.m, : problem.n] for o in outs)


def _gmm_body(*refs, options: BodyOptions):
  """The kernel body of one program (one SM), looping over its work items.

  refs: the tile list, num_lhs row refs [Mp, Cp], num_rhs weight refs [E,
  Cp, Np] ([E, Np, Cp] if transpose_rhs), then the output refs [Mp, Np],
  all in GMEM and padded to the blocks.
  """
  tile_list_refs, lhs_refs, rhs_refs, out_refs = options.split_refs(refs)
  tiles, products = options.tiles, options.products

  @for_each_work_item(tile_list_refs, options)
  def _(item):
    def step(_, *smem):
      lhs_smem = smem[: options.num_lhs]
      rhs_smem = smem[options.num_lhs :]
      for l, r, a in products:
        b = rhs_smem[r]
        if options.transpose_rhs:
          b = b.transpose((1, 0))
        plgpu.wgmma(acc_refs[a], lhs_smem[l], b)
      # At most this step's MMAs in flight: the previous step's are done, so
      # its buffers (released one step late, delay_release=1) are free.
      plgpu.wgmma_wait(len(products))

    acc_refs: list = []

    def acc_scope(*accs):
      acc_refs.extend(accs)

      @pl.when(item.computes)
      def _():
        pipeline(step, item, lhs_refs, rhs_refs, options)

      return tuple(acc[...] for acc in accs)

    accs = pl.run_scoped(
        acc_scope,
        *(plgpu.ACC((tiles.bm, tiles.bn)) for _ in range(options.num_accs)),
    )
    outs = options.epilogue(accs)

    def write(o_smems):
      for o_smem, value in zip(o_smems, outs):
        o_smem[...] = value.astype(o_smem.dtype)

    store_outputs(write, out_refs, item, tiles)


# Hopper: warpgroup MMAs accumulating in registers.
WGMMA = Mma(_gmm_body)


def gmm(
    lhs: Sequence[jax.Array],
    rhs: Sequence[jax.Array],
    group_sizes: jax.Array,
    *,
    tiles: tiling.Tiles,
    products: Sequence[tuple[int, int, int]] = ((0, 0, 0),),
    epilogue: Callable = identity,
    num_outputs: int | None = None,
    transpose_rhs: bool = False,
    out_dtype=None,
    interpret=False,
    num_programs: int | None = None,
    mma: Mma = WGMMA,
) -> tuple[jax.Array, ...]:
  """Grouped products of rows sorted by group with per-group weights.

  Args:
    lhs: row operands, each [M, C], rows sorted by group.
    rhs: weight operands, each [E, C, N] ([E, N, C] if transpose_rhs).
    group_sizes: [E] int32, sum <= M; rows past the sum give zeros.
    tiles: block sizes and pipeline depth (`tiling.Tiles`).
    products: (lhs index, rhs index, accumulator index) triples;
      accumulator a sums lhs[l] @ rhs[r][g] over its products.
    epilogue: accumulators (float32 [bm, bn] each) -> output tiles.
    num_outputs: how many arrays `epilogue` returns (default: one per
      accumulator).
    transpose_rhs: contract with rhs[g] transposed (the dX form).
    out_dtype: output dtype (default lhs[0]'s).
    interpret: False compiles for the GPU; an `InterpretGPUParams` runs
      Mosaic GPU's interpreter (on the CPU).
    num_programs: persistent programs (default: the SM count of the target
      GPU, else the attached one's, else an H100's; 2 under the
      interpreter, where each is a simulated thread).
    mma: the kernel body (`WGMMA`, Hopper's; `kernels_sm100.TCGEN05`).

  Returns:
    num_outputs arrays [M, N] of out_dtype.
  """
  # Pad the operands, build the tile list and size the persistent grid.
  m, c = lhs[0].shape
  num_groups = rhs[0].shape[0]
  n = rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2]
  num_accs = 1 + max(a for _, _, a in products)
  num_outputs = num_accs if num_outputs is None else num_outputs
  out_dtype = jnp.dtype(out_dtype or lhs[0].dtype)
  bm, bk, bn = tiles.bm, tiles.bk, tiles.bn
  mp, cp, np_ = (tiling.padded(d, b) for d, b in ((m, bm), (c, bk), (n, bn)))
  lhs = [_pad2(x, mp, cp) for x in lhs]
  rhs = [_pad3(w, np_, cp) if transpose_rhs else _pad3(w, cp, np_) for w in rhs]
  tile_list = metadata.build(group_sizes, mp, bm)
  num_visits = tile_list.group_ids.shape[0]
  grid_n = np_ // bn
  if num_programs is None:
    num_programs = 2 if interpret is not False else tiling.num_sms()
  problem = Problem(
      m=m,
      n=n,
      lhs=lhs,
      rhs=rhs,
      tile_list=tile_list,
      out_type=tuple(
          jax.ShapeDtypeStruct((mp, np_), out_dtype) for _ in range(num_outputs)
      ),
      num_programs=max(1, min(num_programs, num_visits * grid_n)),
      body_options=BodyOptions(
          num_lhs=len(lhs),
          num_rhs=len(rhs),
          products=tuple(tuple(p) for p in products),
          num_accs=num_accs,
          epilogue=epilogue,
          tiles=tiles,
          num_visits=num_visits,
          grid_n=grid_n,
          c_steps=cp // bk,
          num_groups=num_groups,
          transpose_rhs=transpose_rhs,
      ),
  )
  return launch(problem, mma, interpret)
