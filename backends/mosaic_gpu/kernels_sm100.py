"""The grouped GEMM of `kernels.gmm` for Blackwell (sm_100: tcgen05 + TMEM).

Same contract, tile list and store path as `kernels.gmm`; only the MMA
differs. Hopper's `wgmma` accumulates in the registers of the warpgroup;
sm_100 has no `wgmma` and its tensor cores (`tcgen05.mma`) accumulate in
tensor memory (TMEM) instead, asynchronously: an MMA is issued by one
thread, and its completion is observed through a barrier that orders the
tensor core (`tcgen05_commit_arrive`). One warpgroup per CTA does
everything (no 2-CTA MMA, no warp specialisation); docs/mosaic_gpu.md
("Blackwell") has the per-step pipeline and the TMEM layout.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from backends.mosaic_gpu import kernels
from backends.mosaic_gpu import tiling

# Lanes (rows) of tensor memory, and its float32 columns per SM.
TMEM_LANES = 128
TMEM_COLUMNS = 512


def tmem_columns(tiles: tiling.Tiles, num_accs: int) -> int:
  """float32 TMEM columns the accumulators of one program use."""
  row_blocks = max(1, tiles.bm // TMEM_LANES)
  # An M = 64 accumulator spreads its 64 rows over half of the lanes of
  # bn / 2 columns; count the full width to stay conservative.
  return num_accs * row_blocks * tiles.bn


def check_tiles(tiles: tiling.Tiles, num_accs: int) -> None:
  """Raises ValueError for tiles the tcgen05 kernel cannot run."""
  if tiles.bm not in (64, 128, 256):
    raise ValueError(
        f"The sm_100 kernel needs bm in (64, 128, 256), got bm={tiles.bm}."
    )
  if tiles.stages < 2:
    raise ValueError(
        "The sm_100 kernel releases SMEM blocks one step late and needs "
        f"stages >= 2, got stages={tiles.stages}."
    )
  used = tmem_columns(tiles, num_accs)
  if used > TMEM_COLUMNS:
    raise ValueError(
        f"{num_accs} accumulator(s) of [{tiles.bm}, {tiles.bn}] float32 need "
        f"{used} TMEM columns; an SM has {TMEM_COLUMNS}. Use a smaller bn."
    )


def _scratch_types(tiles: tiling.Tiles, num_accs: int) -> tuple:
  """The TMEM accumulators, the `mma_done` barrier pair, `tmem_free`."""
  rows = min(tiles.bm, TMEM_LANES)
  return (
      *(
          plgpu.TMEM((rows, tiles.bn), jnp.float32)
          for _ in range(num_accs * (tiles.bm // rows))
      ),
      plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
      plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
  )


def _gmm_body(*refs, options: kernels.BodyOptions):
  """The kernel body of one program (one SM), looping over its work items.

  refs: the tile list, num_lhs row refs [Mp, Cp], num_rhs weight refs [E,
  Cp, Np] ([E, Np, Cp] if transpose_rhs), the output refs [Mp, Np] (all
  GMEM, padded to the blocks), then the scratch (`_scratch_types`): the
  TMEM accumulators (num_accs x row blocks, each [rows, bn] float32,
  accumulator-major), the `mma_done` barrier pair and the `tmem_free`
  barrier.
  """
  tiles, products, num_accs = options.tiles, options.products, options.num_accs
  bm, bn = tiles.bm, tiles.bn
  rows = min(bm, TMEM_LANES)
  row_blocks = bm // rows
  tile_list_refs, lhs_refs, rhs_refs, rest = options.split_refs(refs)
  num_outputs = len(rest) - num_accs * row_blocks - 2
  out_refs = rest[:num_outputs]
  acc_tmems = rest[num_outputs : num_outputs + num_accs * row_blocks]
  mma_done, tmem_free = rest[num_outputs + num_accs * row_blocks :]

  def acc_tmem(a, h):
    return acc_tmems[a * row_blocks + h]

  # The first product into each accumulator overwrites it at step 0; the
  # others add to it.
  first_into = {}
  for i, (_, _, a) in enumerate(products):
    first_into.setdefault(a, i)

  @kernels.for_each_work_item(tile_list_refs, options)
  def _(item):
    def step(indices, *smem):
      (c,) = indices
      lhs_smem = smem[: options.num_lhs]
      rhs_smem = smem[options.num_lhs :]
      for i, (l, r, a) in enumerate(products):
        b = rhs_smem[r].T if options.transpose_rhs else rhs_smem[r]
        accumulate = c > 0 if first_into[a] == i else True
        for h in range(row_blocks):
          x = lhs_smem[l]
          if row_blocks > 1:
            x = x.at[pl.ds(h * rows, rows)]
          plgpu.tcgen05_mma(acc_tmem(a, h), x, b, accumulate=accumulate)
      # One commit tracks every MMA issued so far by this thread.
      plgpu.tcgen05_commit_arrive(mma_done.at[lax.rem(c, 2)])

      # Step c - 1's MMAs done: its buffers may be refilled after this step.
      @pl.when(c > 0)
      def _():
        plgpu.barrier_wait(mma_done.at[lax.rem(c + 1, 2)])

    @pl.when(item.computes)
    def _():
      kernels.pipeline(step, item, lhs_refs, rhs_refs, options)
      # The last step's commit covers all the MMAs of this work item.
      plgpu.barrier_wait(mma_done.at[(options.c_steps - 1) % 2])

    def write_outputs(o_smems):
      def write(h, accs):
        outs = options.epilogue(tuple(accs))
        for o_smem, value in zip(o_smems, outs):
          dst = o_smem if row_blocks == 1 else o_smem.at[pl.ds(h * rows, rows)]
          dst[...] = value.astype(o_smem.dtype)

      @pl.when(item.computes)
      def _():
        for h in range(row_blocks):
          write(
              h,
              [plgpu.async_load_tmem(acc_tmem(a, h)) for a in range(num_accs)],
          )
        # The next work item's MMAs overwrite TMEM: every lane's load must
        # be done, and ordered before the tensor core, first.
        plgpu.wait_load_tmem()
        plgpu.barrier_arrive(tmem_free)
        plgpu.barrier_wait(tmem_free)

      @pl.when(jnp.logical_not(item.computes))
      def _():
        zeros = jnp.zeros((rows, bn), jnp.float32)
        for h in range(row_blocks):
          write(h, [zeros] * num_accs)

    kernels.store_outputs(write_outputs, out_refs, item, tiles)


# Blackwell: tcgen05 MMAs accumulating in tensor memory.
TCGEN05 = kernels.Mma(_gmm_body, _scratch_types, check_tiles)


def gmm(
    lhs: Sequence[jax.Array],
    rhs: Sequence[jax.Array],
    group_sizes: jax.Array,
    **options,
) -> tuple[jax.Array, ...]:
  """Grouped products of rows sorted by group with per-group weights (sm_100).

  `kernels.gmm` on Blackwell's tcgen05 tensor cores (`TCGEN05`), with its
  arguments and these differences:
    tiles: bm in (64, 128, 256), stages >= 2, and the accumulators must fit
      TMEM (`check_tiles`).
    epilogue: gets the accumulators one TMEM row block at a time (float32
      [min(bm, 128), bn] each) and gives output row blocks; rows must be
      independent.

  Returns:
    num_outputs arrays [M, N] of out_dtype.
  """
  return kernels.gmm(lhs, rhs, group_sizes, mma=TCGEN05, **options)
