"""A grouped GEMM from plain XLA ops: loops over group-aligned row tiles.

XLA:CPU lowers `jax.lax.ragged_dot` to a dense masked product (E times the
useful work). Here each group's rows are cut into tiles that start at the
group's first row, in a few tile heights (`levels`, largest first): as many
full tiles of the largest height as fit, then of the next, and the smallest
height covers what is left, its last tile partial. The waste is under one
smallest tile per group, not one tile of the largest height.

    group g: [ largest tiles | ... | smallest tiles, the last one partial ]

A loop over groups slices each expert's weights once; inner loops run over
that group's tiles of each height. Full tiles lie inside their group and
are written (or, for the weight gradient, read) whole. Tiles of the
smallest height are masked to their group's rows: the forward merges them
into the output (read-modify-write; the loops run in sequence, so this is
race-free), the weight gradient zeroes foreign rows with `where`, which
also keeps NaN in unused rows out. A tile that would run past row M is read
at M - height instead (dynamic_slice clamps) and masked, so no operand is
ever padded or copied. Rows past sum(group_sizes) are never written and
stay zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Measured on 2 CPU cores (M=4096, D=512, F=1024; bench/grouped_gemm_bench.py):
# taller tiles amortise per-tile copies, shorter ones waste less per group.
DEFAULT_LEVELS = (256, 64, 16)


def _effective_levels(levels, num_rows):
  """Heights no taller than the rows (a slice may not exceed its operand)."""
  return tuple(sorted({min(h, num_rows) for h in levels}, reverse=True))


def _tile_counts(group_sizes, levels):
  """Per level l: tiles [E] of height levels[l], first row and rows covered.

  Every level but the last takes floor(remainder / height) full tiles; the
  last takes ceil, so a group's tiles cover all its rows.

  Returns:
    (counts, offsets, sizes): lists over levels of [E] int32: tiles, first
    row relative to the group's start, and rows covered.
  """
  remainder = group_sizes
  offset = jnp.zeros_like(group_sizes)
  counts, offsets, sizes = [], [], []
  for height in levels[:-1]:
    n = remainder // height
    counts.append(n)
    offsets.append(offset)
    sizes.append(n * height)
    offset = offset + n * height
    remainder = remainder - n * height
  counts.append((remainder + levels[-1] - 1) // levels[-1])
  offsets.append(offset)
  sizes.append(remainder)
  return counts, offsets, sizes


def _for_each_tile(group_sizes, levels, carry, tile_fn, group_start_fn,
                   group_end_fn):
  """Runs tile_fn over every tile, group by group.

  tile_fn((carry, state), g, height, start, limit, partial) -> (carry,
  state): the tile holds rows [start, min(start + height, limit)) of group
  g; `partial` (static) is True for the smallest height, whose tiles may
  hold fewer rows. group_start_fn(carry, g) -> (carry, state) runs before a
  group's tiles, group_end_fn(carry, g, state) -> carry after them.
  """
  counts, offsets, sizes = _tile_counts(group_sizes, levels)
  starts = jnp.cumsum(group_sizes) - group_sizes
  last = len(levels) - 1

  def group_body(g, carry):
    carry = group_start_fn(carry, g)
    for level, height in enumerate(levels):
      first = starts[g] + offsets[level][g]
      limit = first + sizes[level][g]

      def tile_body(j, cs, height=height, first=first, limit=limit,
                    partial=level == last):
        return tile_fn(cs, g, height, first + j * height, limit, partial)

      carry = jax.lax.fori_loop(0, counts[level][g], tile_body, carry)
    return group_end_fn(carry, g)

  return jax.lax.fori_loop(0, group_sizes.shape[0], group_body, carry)


def _tile_rows(num_rows, height, start, limit):
  """Where a tile is read, and [height, 1] bool: which of its rows count."""
  read_at = jnp.minimum(start, num_rows - height)  # As dynamic_slice clamps.
  row = read_at + jnp.arange(height)[:, None]
  return read_at, (row >= start) & (row < limit)


def _gmm(rows, weights, group_sizes, transpose_rhs, out_dtype, levels,
         compute_dtype):
  """Forward: [M, K] x [E, K, N] ([E, N, K] transposed) -> [M, N]."""
  m = rows.shape[0]
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  levels = _effective_levels(levels, m)
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  def group_start(out, g):  # Each expert's weights are sliced once.
    w = jax.lax.dynamic_index_in_dim(weights, g, keepdims=False)
    return out, w.astype(compute_dtype or w.dtype)

  def tile(carry, g, height, start, limit, partial):
    out, w = carry
    del g
    read_at, mine = _tile_rows(m, height, start, limit)
    x = jax.lax.dynamic_slice_in_dim(rows, read_at, height)
    x = x.astype(compute_dtype or x.dtype)
    y = jax.lax.dot_general(x, w, (contract, ((), ())),
                            preferred_element_type=jnp.float32)
    if partial:
      y = jnp.where(mine, y, jax.lax.dynamic_slice_in_dim(out, read_at,
                                                          height))
    return jax.lax.dynamic_update_slice_in_dim(out, y, read_at, 0), w

  def group_end(carry, g):
    del g
    return carry[0]

  # The buffer the loop writes stays float32: XLA:CPU updates a bfloat16
  # buffer by converting all of it to float32 and back, every tile.
  out = jnp.zeros((m, n), jnp.float32)
  out = _for_each_tile(group_sizes, levels, out, tile, group_start, group_end)
  return out.astype(out_dtype)


def _tgmm(lhs, rhs, group_sizes, num_groups, out_dtype, levels,
          compute_dtype):
  """Per-group lhs_g^T @ rhs_g: [M, A] x [M, B] -> [E, A, B].

  An empty group gives exact zeros; rows past sum(group_sizes) are never
  read unmasked.
  """
  m, a, b = lhs.shape[0], lhs.shape[1], rhs.shape[1]
  levels = _effective_levels(levels, m)

  def group_start(out, g):
    del g
    return out, jnp.zeros((a, b), jnp.float32)

  def tile(carry, g, height, start, limit, partial):
    out, acc = carry
    del g
    read_at, mine = _tile_rows(m, height, start, limit)
    l = jax.lax.dynamic_slice_in_dim(lhs, read_at, height)
    r = jax.lax.dynamic_slice_in_dim(rhs, read_at, height)
    if compute_dtype is not None:
      l, r = l.astype(compute_dtype), r.astype(compute_dtype)
    if partial:
      l, r = jnp.where(mine, l, 0), jnp.where(mine, r, 0)
    acc += jax.lax.dot_general(l, r, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return out, acc

  def group_end(carry, g):
    out, acc = carry
    return jax.lax.dynamic_update_index_in_dim(out, acc, g, axis=0)

  out = jnp.zeros((num_groups, a, b), jnp.float32)  # float32: see _gmm.
  out = _for_each_tile(group_sizes, levels, out, tile, group_start, group_end)
  return out.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def grouped_gemm(rows, weights, group_sizes, transpose_rhs=False,
                 out_dtype=None, levels=DEFAULT_LEVELS, compute_dtype=None):
  """rows [M, K] x weights [E, K, N] -> [M, N] over ragged groups.

  Args:
    rows: [M, K], sorted by group.
    weights: [E, K, N], or [E, N, K] with `transpose_rhs`.
    group_sizes: [E] int32, sum <= M.
    transpose_rhs: contract with weights[e].T.
    out_dtype: result dtype (rows' by default); accumulation is float32.
    levels: tile heights, largest first, e.g. (256, 64, 16).
    compute_dtype: dtype the tiles are multiplied in (None: the operands').
      XLA:CPU multiplies bfloat16 about half as fast as float32, and the
      per-expert weight slice is a copy anyway, so converting costs ~nothing.
  """
  return _gmm(rows, weights, group_sizes, transpose_rhs,
              out_dtype or rows.dtype, levels, compute_dtype)


def _fwd(rows, weights, group_sizes, transpose_rhs, out_dtype, levels,
         compute_dtype):
  out = grouped_gemm(rows, weights, group_sizes, transpose_rhs, out_dtype,
                     levels, compute_dtype)
  return out, (rows, weights, group_sizes)


def _bwd(transpose_rhs, out_dtype, levels, compute_dtype, residuals, dy):
  del out_dtype
  rows, weights, group_sizes = residuals
  num_groups = weights.shape[0]
  dy = dy.astype(rows.dtype)
  # dX: the same product against the weights the other way round.
  d_rows = _gmm(dy, weights, group_sizes, not transpose_rhs, rows.dtype,
                levels, compute_dtype)
  if transpose_rhs:  # weights[g] is [N, K]: dW[g] = dy_g^T x_g.
    d_weights = _tgmm(dy, rows, group_sizes, num_groups, weights.dtype,
                      levels, compute_dtype)
  else:  # weights[g] is [K, N]: dW[g] = x_g^T dy_g.
    d_weights = _tgmm(rows, dy, group_sizes, num_groups, weights.dtype,
                      levels, compute_dtype)
  return d_rows, d_weights, None


grouped_gemm.defvjp(_fwd, _bwd)
