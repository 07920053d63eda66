"""A grouped GEMM from plain XLA ops: loops over group-aligned row tiles.

XLA:CPU lowers `jax.lax.ragged_dot` to a dense masked product (E times the
useful work). Here each group's rows are cut into tiles that start at the
group's first row, in a few tile heights (`levels`, largest first): as many
full tiles of the largest height as fit, then of the next, and the last,
smallest height covers the remainder with one partial tile. The waste is
under one smallest tile per group, not a tile of the largest height.

    group g rows: [ smallest tiles | ... | largest tiles ]
                   ^ o_g + 0        ^ o_g + rem_l        (rem_l: rows left
                                                          for heights < l)

Loops run group by group (each expert's weights are sliced once), and
within a group from the smallest height to the largest. A partial tile
writes past its group's end; every row it spills into belongs to a tile
processed later (a larger height of the same group, or a later group), which
overwrites it, so the forward needs no read-modify-write. Rows past
sum(group_sizes) are zeroed at the end. The weight gradient masks rows
outside the group instead, since it sums rather than overwrites.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DEFAULT_LEVELS = (128, 32, 8)


def _tile_counts(group_sizes, levels):
  """Per level l: tiles [E] of height levels[l], their first row and rows.

  Every level but the last takes floor(remainder / height) full tiles; the
  last takes ceil, so the tiles of a group cover all its rows. The smallest
  height starts at the group's first row and each larger height after the
  rows of the smaller ones, so level l starts at the rows it left over.

  Returns:
    (counts, offsets, sizes): lists over levels of [E] int32: tiles, first
    row relative to the group's start, and rows covered (the last level's
    final tile is partial, so its rows < tiles * height).
  """
  remainder = group_sizes
  counts, offsets, sizes = [], [], []
  for height in levels[:-1]:
    n = remainder // height
    remainder = remainder - n * height
    counts.append(n)
    offsets.append(remainder)
    sizes.append(n * height)
  counts.append((remainder + levels[-1] - 1) // levels[-1])
  offsets.append(jnp.zeros_like(remainder))
  sizes.append(remainder)
  return counts, offsets, sizes


def _for_each_tile(group_sizes, levels, carry, tile_fn, group_start_fn,
                   group_end_fn):
  """Runs tile_fn((carry, state), g, height, row, limit) over every tile.

  Tiles go group-major, smallest height first within a group. A tile covers
  rows [row, row + height); those at or past `limit` belong to another tile
  (only the partial last tile of a group has any).

  group_start_fn(carry, g) -> (carry, group_state) runs before a group's
  tiles and group_end_fn(carry, g, group_state) after them; tile_fn gets
  and returns (carry, group_state).
  """
  counts, offsets, sizes = _tile_counts(group_sizes, levels)
  starts = jnp.cumsum(group_sizes) - group_sizes

  def group_body(g, carry):
    carry, state = group_start_fn(carry, g)
    for level in reversed(range(len(levels))):  # Smallest height first.
      height = levels[level]
      first_row = starts[g] + offsets[level][g]
      limit = first_row + sizes[level][g]

      def tile_body(j, cs, height=height, first_row=first_row, limit=limit):
        return tile_fn(cs, g, height, first_row + j * height, limit)

      carry, state = jax.lax.fori_loop(0, counts[level][g], tile_body,
                                       (carry, state))
    return group_end_fn(carry, g, state)

  return jax.lax.fori_loop(0, group_sizes.shape[0], group_body, carry)


def _pad_rows(x, pad):
  return jnp.pad(x, ((0, pad), (0, 0)))


def _gmm(rows, weights, group_sizes, transpose_rhs, out_dtype, levels):
  """Forward: [M, K] x [E, K, N] ([E, N, K] transposed) -> [M, N]."""
  m = rows.shape[0]
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  pad = max(levels)  # A tile may read and write past row M.
  x = _pad_rows(rows, pad)
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  def group_start(out, g):
    return out, jax.lax.dynamic_index_in_dim(weights, g, keepdims=False)

  def tile(carry, g, height, row, limit):
    del g, limit  # Spilled rows are overwritten by a later tile.
    out, w = carry
    x_tile = jax.lax.dynamic_slice_in_dim(x, row, height)
    y = jax.lax.dot_general(x_tile, w, (contract, ((), ())),
                            preferred_element_type=jnp.float32)
    out = jax.lax.dynamic_update_slice_in_dim(out, y.astype(out_dtype), row,
                                              axis=0)
    return out, w

  def group_end(out, g, w):
    del g, w
    return out

  out = jnp.zeros((m + pad, n), out_dtype)
  out = _for_each_tile(group_sizes, levels, out, tile, group_start, group_end)
  valid = jnp.arange(m)[:, None] < jnp.sum(group_sizes)
  return jnp.where(valid, out[:m], jnp.zeros((), out_dtype))


def _tgmm(lhs, rhs, group_sizes, num_groups, out_dtype, levels):
  """Per-group lhs_g^T @ rhs_g: [M, A] x [M, B] -> [E, A, B].

  Rows outside the tile's share of the group are masked (with where, so NaN in unused rows stays
  out); an empty group gives exact zeros.
  """
  a, b = lhs.shape[1], rhs.shape[1]
  pad = max(levels)
  lhs_p, rhs_p = _pad_rows(lhs, pad), _pad_rows(rhs, pad)

  def group_start(out, g):
    return out, jnp.zeros((a, b), jnp.float32)

  def tile(carry, g, height, row, limit):
    del g
    out, acc = carry
    mine = (row + jnp.arange(height)[:, None]) < limit
    l = jnp.where(mine, jax.lax.dynamic_slice_in_dim(lhs_p, row, height), 0)
    r = jnp.where(mine, jax.lax.dynamic_slice_in_dim(rhs_p, row, height), 0)
    acc += jax.lax.dot_general(l, r, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return out, acc

  def group_end(out, g, acc):
    return jax.lax.dynamic_update_index_in_dim(out, acc.astype(out_dtype), g,
                                               axis=0)

  out = jnp.zeros((num_groups, a, b), out_dtype)
  return _for_each_tile(group_sizes, levels, out, tile, group_start, group_end)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def grouped_gemm(rows, weights, group_sizes, transpose_rhs=False,
                 out_dtype=None, levels=DEFAULT_LEVELS):
  """rows [M, K] x weights [E, K, N] -> [M, N] over ragged groups.

  Args:
    rows: [M, K], sorted by group.
    weights: [E, K, N], or [E, N, K] with `transpose_rhs`.
    group_sizes: [E] int32, sum <= M.
    transpose_rhs: contract with weights[e].T.
    out_dtype: result dtype (rows' by default); accumulation is float32.
    levels: tile heights, largest first, e.g. (128, 32, 8).
  """
  return _gmm(rows, weights, group_sizes, transpose_rhs,
              out_dtype or rows.dtype, levels)


def _fwd(rows, weights, group_sizes, transpose_rhs, out_dtype, levels):
  out = grouped_gemm(rows, weights, group_sizes, transpose_rhs, out_dtype,
                     levels)
  return out, (rows, weights, group_sizes)


def _bwd(transpose_rhs, out_dtype, levels, residuals, dy):
  rows, weights, group_sizes = residuals
  num_groups = weights.shape[0]
  dy = dy.astype(rows.dtype)
  # dX: the same product against the weights the other way round.
  d_rows = _gmm(dy, weights, group_sizes,
                not transpose_rhs, rows.dtype, levels)
  if transpose_rhs:  # weights[g] is [N, K]: dW[g] = dy_g^T x_g.
    d_weights = _tgmm(dy, rows, group_sizes, num_groups, weights.dtype,
                      levels)
  else:  # weights[g] is [K, N]: dW[g] = x_g^T dy_g.
    d_weights = _tgmm(rows, dy, group_sizes, num_groups, weights.dtype,
                      levels)
  return d_rows, d_weights, None


grouped_gemm.defvjp(_fwd, _bwd)
