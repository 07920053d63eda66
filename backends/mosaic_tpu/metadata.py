"""The visit lists of the mosaic_tpu kernels, built on the device.

Rows are sorted by group and cut into row tiles of `bm`. A segment is a run
of rows (a group, or rows no local group owns); each segment visits every
tile it touches, in row order, so a tile shared by several segments is
visited by each, one after another, and each visit writes only its own
rows. Consecutive visits of one tile keep its output block in VMEM, which
is what lets a visit update a block other visits also write.

  rows     |g0 g0 g0 g0|g0 g1 g1 g1|g1 g1 g3 g3|g3 -- -- --|
  tiles     0           1           2           3
  gmm:     (g0,0) (g0,1) (g1,1) (g1,2) (g3,2) (g3,3) (rest,3)
  tgmm:    (g0,0) (g0,1) (g1,1) (g1,2) (g2,2: empty) (g3,2) (g3,3)

gmm's list covers every row (the rest, past the local groups, is written as
zeros); tgmm's has one visit, owning no rows, for an empty group, so its dW
block is written (as zeros). The list has a static length and a dynamic
count: the kernels' grids run only the used visits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Visits(NamedTuple):
  """A visit list (all int32, on the device).

  Attributes:
    segment: [V] the segment of each visit: for gmm 0 (rows before the local
      groups), 1..E (local group s - 1), E + 1 (rows after); for tgmm
      0..E-1, the local group.
    tile: [V] the row tile (rows tile*bm : tile*bm + bm).
    row_start, row_end: [V] the rows the visit owns; equal for a visit that
      owns none (an empty group's, or an unused one).
    count: [1] the visits used; the rest repeat the last used one's segment
      and tile and own no rows, so a static grid over all of them does the
      same work.
  """

  segment: jax.Array
  tile: jax.Array
  row_start: jax.Array
  row_end: jax.Array
  count: jax.Array

  def scalars(self) -> tuple[jax.Array, ...]:
    """The arrays a kernel takes as scalar prefetch, in its order."""
    return self.segment, self.tile, self.row_start, self.row_end


def _local_bounds(group_sizes, group_offset, num_local):
  """(starts, ends) [num_local] of the local groups' rows."""
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  if group_offset is None and num_local == sizes.shape[0]:
    return starts, ends
  offset = jnp.zeros((), jnp.int32) if group_offset is None else group_offset
  offset = jnp.asarray(offset, jnp.int32).reshape(())
  take = lambda a: jax.lax.dynamic_slice(a, (offset,), (num_local,))
  return take(starts), take(ends)


def _visits(starts, ends, *, num_rows, bm, visit_empty, length) -> Visits:
  """The visit list of segments [starts[s], ends[s]) in row order."""
  num_tiles = num_rows // bm
  starts = jnp.clip(starts, 0, num_rows)
  ends = jnp.clip(ends, starts, num_rows)
  first = starts // bm
  last = (ends - 1) // bm
  counts = jnp.where(ends > starts, last - first + 1, int(visit_empty))
  offsets = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)]
  )
  count = offsets[-1]
  v = jnp.arange(length, dtype=jnp.int32)
  # Unused visits repeat the last used one (they then own no rows).
  used = jnp.minimum(v, jnp.maximum(count - 1, 0))
  segment = jnp.searchsorted(offsets[1:], used, side="right")
  segment = jnp.minimum(segment, starts.shape[0] - 1).astype(jnp.int32)
  tile = jnp.clip(first[segment] + used - offsets[segment], 0, num_tiles - 1)
  row_start = jnp.maximum(starts[segment], tile * bm)
  row_end = jnp.minimum(ends[segment], tile * bm + bm)
  row_end = jnp.where((v < count) & (row_end > row_start), row_end, row_start)
  return Visits(
      segment=segment,
      tile=tile.astype(jnp.int32),
      row_start=row_start.astype(jnp.int32),
      row_end=row_end.astype(jnp.int32),
      count=count.reshape(1),
  )


def visit_list(
    group_sizes: jax.Array,
    num_rows: int,
    bm: int,
    *,
    weight_gradient: bool,
    group_offset: jax.Array | None = None,
    num_local: int | None = None,
) -> Visits:
  """The visit list of gmm, or of tgmm with `weight_gradient`.

  gmm's: every row tile of [0, num_rows), in row order, with segments 0
  (rows before the local groups), 1..E, E + 1 (after); V = num_rows / bm +
  E + 1 entries. tgmm's: each local group's row tiles, one visit for an
  empty group (its dW is then written as zeros), segments 0..E-1; V =
  num_rows / bm + 2 E entries.

  Args:
    group_sizes: [G] int32 rows per group, sum <= num_rows.
    num_rows: rows of the (padded) operand, a multiple of bm.
    bm: rows per tile.
    weight_gradient: tgmm's list (dW), else gmm's.
    group_offset: the first local group (a traced int32 scalar), or None
      for 0: under expert parallelism, the rows of groups
      [group_offset, group_offset + num_local) are computed; gmm writes the
      rest as zeros, tgmm leaves them unread.
    num_local: local groups E (the weights' leading dimension); None for G.
  """
  num_local = group_sizes.shape[0] if num_local is None else num_local
  starts, ends = _local_bounds(group_sizes, group_offset, num_local)
  if weight_gradient:
    length = num_rows // bm + 2 * num_local
  else:
    # The rows before and after the local groups as segments of their own.
    first, last = starts[:1], ends[-1:]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), starts, last])
    ends = jnp.concatenate([first, ends, jnp.full((1,), num_rows, jnp.int32)])
    length = num_rows // bm + num_local + 1
  return _visits(
      starts,
      ends,
      num_rows=num_rows,
      bm=bm,
      visit_empty=weight_gradient,
      length=length,
  )
