"""Where the xla grouped GEMM reads its rows: the bulk and the overflow tiles.

`grouped_gemm.py` multiplies each group's first H rows in one batched dot
(the bulk) and the rest (the overflow) tile by tile, the tiles of each group
largest first (docs/xla.md draws it); this module decides H, whether the
bulk pays for given group sizes, and walks the overflow tiles. A tile that
would run past row M is read at M - height instead (as dynamic_slice
clamps) and masked, so no operand is padded.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# The bulk covers mean + BULK_SIGMAS * sqrt(mean) rows per group (a
# multinomial's spread), rounded up to BULK_QUANTUM, and is skipped when it
# would hold more than MAX_BULK_PADDING times the real rows (few tokens
# spread over many experts).
BULK_SIGMAS = 2.0
BULK_QUANTUM = 8
MAX_BULK_PADDING = 2.0
# At run time the bulk is used only for balanced routing: its zero padding
# at most BALANCED_PADDING of M beyond the E * H - M rows it holds by design
# (mean + 2 sigma per group: 25% of M at E=64, M=4096), and its overflow at
# most BALANCED_OVERFLOW of M. Under heavy skew (Zipf) most of the bulk
# would be padding, and the tile loop alone is faster
# (bench/micro/grouped_gemm_bench.py).
BALANCED_PADDING = 0.25
BALANCED_OVERFLOW = 0.1


def bulk_rows(num_rows: int, num_groups: int) -> int:
  """H, the rows per group the batched bulk covers (0: no bulk)."""
  mean = num_rows / num_groups
  height = BULK_QUANTUM * math.ceil(
      (mean + BULK_SIGMAS * math.sqrt(mean)) / BULK_QUANTUM
  )
  height = min(height, num_rows)
  if num_groups * height > MAX_BULK_PADDING * num_rows:
    return 0
  return height


def balanced(group_sizes: jax.Array, bulk: int, num_rows: int) -> jax.Array:
  """Scalar bool: does a bulk of `bulk` rows per group pay for these sizes?"""
  in_bulk = jnp.minimum(group_sizes, bulk).sum()
  capacity = group_sizes.shape[0] * bulk
  padding = capacity - in_bulk
  overflow = group_sizes.sum() - in_bulk
  # Only padding beyond the bulk's designed share counts against it: a
  # threshold below E * H - M would refuse every multinomial routing at
  # E=64 (measured: the tile loop alone is 1.5x slower there).
  designed = max(capacity - num_rows, 0)
  return (padding <= designed + BALANCED_PADDING * num_rows) & (
      overflow <= BALANCED_OVERFLOW * num_rows
  )


def effective_levels(levels: tuple[int, ...], num_rows: int) -> tuple[int, ...]:
  """Heights no taller than the rows (a slice may not exceed its operand)."""
  return tuple(sorted({min(h, num_rows) for h in levels}, reverse=True))


def _overflow_groups(group_sizes, bulk):
  """Group starts [E], and the overflow: sizes [E], active ids, count."""
  starts = jnp.cumsum(group_sizes) - group_sizes
  overflow = jnp.maximum(group_sizes - bulk, 0)
  active = overflow > 0
  # Active groups first, in group order; the loop visits only those.
  ids = jnp.argsort(~active, stable=True).astype(jnp.int32)
  return starts, overflow, ids, active.sum()


def _tile_counts(sizes, levels):
  """Per level l: tiles [E] of height levels[l], first row and rows covered.

  Every level but the last takes floor(remainder / height) full tiles; the
  last takes ceil, so a group's tiles cover all its rows.

  Returns:
    (counts, offsets, covered): lists over levels of [E] int32: tiles, first
    row relative to the group's overflow start, and rows covered.
  """
  remainder = sizes
  offset = jnp.zeros_like(sizes)
  counts, offsets, covered = [], [], []
  for height in levels[:-1]:
    n = remainder // height
    counts.append(n)
    offsets.append(offset)
    covered.append(n * height)
    offset = offset + n * height
    remainder = remainder - n * height
  counts.append((remainder + levels[-1] - 1) // levels[-1])
  offsets.append(offset)
  covered.append(remainder)
  return counts, offsets, covered


def for_each_overflow_tile(
    group_sizes, bulk, levels, carry, tile_fn, group_start_fn, group_end_fn
):
  """Runs tile_fn over the overflow tiles, group by group.

  tile_fn((carry, state), height, start, limit, partial) -> (carry, state):
  the tile holds rows [start, min(start + height, limit)); `partial` (static)
  is True for the smallest height, whose tiles may hold fewer rows.
  group_start_fn(carry, g) -> (carry, state) runs before a group's tiles,
  group_end_fn((carry, state), g) -> carry after them.
  """
  starts, overflow, ids, num_active = _overflow_groups(group_sizes, bulk)
  counts, offsets, covered = _tile_counts(overflow, levels)
  last = len(levels) - 1

  def group_body(i, carry):
    g = ids[i]
    carry = group_start_fn(carry, g)
    for level, height in enumerate(levels):
      first = starts[g] + bulk + offsets[level][g]
      limit = first + covered[level][g]

      def tile_body(
          j, cs, height=height, first=first, limit=limit, partial=level == last
      ):
        return tile_fn(cs, height, first + j * height, limit, partial)

      carry = jax.lax.fori_loop(0, counts[level][g], tile_body, carry)
    return group_end_fn(carry, g)

  return jax.lax.fori_loop(0, num_active, group_body, carry)


def tile_rows(num_rows, height, start, limit):
  """Where a tile is read, and [height, 1] bool: which of its rows count."""
  read_at = jnp.minimum(start, num_rows - height)  # As dynamic_slice clamps.
  row = read_at + jnp.arange(height)[:, None]
  return read_at, (row >= start) & (row < limit)


def gather_bulk(x, group_sizes, bulk, dtype):
  """[M, A] -> [E, bulk, A]: each group's first `bulk` rows, zero past it."""
  starts = jnp.cumsum(group_sizes) - group_sizes
  position = jnp.arange(bulk)
  index = jnp.minimum(starts[:, None] + position, x.shape[0] - 1)
  mine = (position < group_sizes[:, None])[..., None]
  return jnp.where(mine, x[index].astype(dtype), 0)


def assemble_from_bulk(bulk_out, group_sizes, num_rows):
  """[E, H, N] -> [M, N]: row r of group g at position p < H, else zero."""
  num_groups, bulk = bulk_out.shape[:2]
  ends = jnp.cumsum(group_sizes)
  row = jnp.arange(num_rows)
  group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_groups - 1)
  position = row - (ends - group_sizes)[group]
  from_bulk = (row < ends[-1]) & (position < bulk)
  flat = bulk_out.reshape(num_groups * bulk, -1)
  picked = flat[jnp.where(from_bulk, group * bulk + position, 0)]
  return jnp.where(from_bulk[:, None], picked, 0.0)
