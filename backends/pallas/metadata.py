"""The tile list shared by the gmm (forward, dX) and tgmm (dW) kernels.

Rows are sorted by group; row tiles are `bm` rows. A tile that holds rows of
several groups is visited once per group, and each visit owns only its
group's rows (the kernels mask the rest), so no two visits write one row and
no atomics are needed. The rows at or past sum(group_sizes) form one extra
group, numbered E, whose visits write zeros; `TileMetadata` draws an example.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from backends.pallas import tiling


class TileMetadata(NamedTuple):
  """The tile list of rows sorted by group (all int32, on device).

  Attributes:
    group_ids: [V] group of each visit; E for the rows past
      sum(group_sizes) (written as zeros) and for unused visits.
    tile_ids: [V] row tile of each visit (rows tile*bm : tile*bm + bm).
    row_starts: [V] first row the visit owns.
    row_ends: [V] one past the last row it owns; == row_starts when unused.
    group_visits: [E + 2] CSR offsets: group e's visits are
      group_visits[e] : group_visits[e + 1] (e = E: the padding rows).

  For example, with group 2 empty:

    rows   |g0 g0 g0 g0|g0 g1 g1 g1|g1 g1 g3 g3|g3 pad pad pad|
    tiles   0           1           2           3
    visits  (g0,t0) (g0,t1) (g1,t1) (g1,t2) (g3,t2) (g3,t3) (E,t3) unused...

  Visits are ordered by group, then by tile, so a group's visits are
  contiguous: the tgmm kernel for group e walks visits
  group_visits[e] : group_visits[e + 1]. The list has a static length (row
  tiles + E, enough for every boundary); the unused visits at its end own no
  rows and do nothing.
  """

  group_ids: jax.Array
  tile_ids: jax.Array
  row_starts: jax.Array
  row_ends: jax.Array
  group_visits: jax.Array


def build(group_sizes: jax.Array, num_rows: int, bm: int) -> TileMetadata:
  """The tile list for `num_rows` rows (a multiple of bm) in row tiles of bm.

  Args:
    group_sizes: [E] int32 rows per group; groups past row `num_rows` are
      cut there (the contract is sum(group_sizes) <= num_rows).
    num_rows: rows of the (padded) buffer; a multiple of `bm`.
    bm: rows per tile.

  Returns:
    `TileMetadata` with V = num_rows / bm + E visits.
  """
  if num_rows % bm:
    raise ValueError(
        f"num_rows must be a multiple of bm, got {num_rows=}, " f"{bm=}."
    )
  num_groups = group_sizes.shape[0]
  num_visits = tiling.num_visits(num_rows, bm, num_groups)
  # Group ends, clipped to the buffer; then the padding group up to the end.
  ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, num_rows)
  ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  first_tile = starts // bm
  last_tile = (ends - 1) // bm
  visits = jnp.where(ends > starts, last_tile - first_tile + 1, 0)
  group_visits = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), jnp.cumsum(visits).astype(jnp.int32)]
  )

  v = jnp.arange(num_visits, dtype=jnp.int32)
  # The group of visit v: the last group whose visits start at or before v.
  group = jnp.searchsorted(group_visits[1:], v, side="right").astype(jnp.int32)
  used = v < group_visits[-1]
  group = jnp.where(used, group, num_groups)
  tile = first_tile[group] + v - group_visits[group]
  row_starts = jnp.maximum(starts[group], tile * bm)
  row_ends = jnp.minimum(ends[group], tile * bm + bm)
  zero = jnp.zeros_like(v)
  return TileMetadata(
      group_ids=group,
      tile_ids=jnp.where(used, tile, zero),
      row_starts=jnp.where(used, row_starts, zero),
      row_ends=jnp.where(used, row_ends, zero),
      group_visits=group_visits,
  )
