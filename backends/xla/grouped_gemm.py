"""A grouped GEMM from plain XLA ops: a batched bulk plus a tile loop.

XLA:CPU lowers `jax.lax.ragged_dot` to a dense masked product (E times the
useful work). This module splits the ragged product in two:

  bulk      the first H rows of every group, gathered into [E, H, K] (zeros
            past a group's end) and multiplied by all E weights in ONE
            batched dot. H is static, a little over the mean group size, so
            for balanced routing the bulk is nearly everything, and the dot
            reads each expert's weights in place (a per-expert slice inside
            a loop would be a copy: 2 MB per expert at D=512, F=1024).
  overflow  rows past H in the groups that have them (hot experts under
            skew), in a loop over only those groups: each group's rows are
            cut into tiles of a few heights (`levels`, largest first) that
            start at the group's first overflow row, the last one partial.

    group g: [ bulk: rows 0..H-1 | largest tiles | ... | smallest tiles ]

The bulk runs only when the routing is balanced enough for it to pay (a
`lax.cond` on the group sizes); otherwise H is 0 and every row takes the tile
loop. The forward assembles the output with one gather from the bulk result
(no zero-filled buffer, no scatter); overflow tiles are then written in place:
full tiles whole, the partial ones merged (read-modify-write; the loop runs in
sequence, so this is race-free). The weight gradient is one batched x^T dy
over the bulk plus per-group sums over the overflow tiles, whose foreign rows
are zeroed with `where` (so NaN in unused rows stays out). A tile that would
run past row M is read at M - height instead (dynamic_slice clamps) and
masked, so no operand is padded. Rows past sum(group_sizes) come out zero.
Loop buffers stay float32: XLA:CPU updates a bfloat16 buffer by
converting all of it to float32 and back, every iteration.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# Overflow tile heights, measured on 2 CPU cores (M=4096, D=512, F=1024;
# bench/grouped_gemm_bench.py): taller tiles amortise per-tile copies,
# shorter ones waste less per group.
DEFAULT_LEVELS = (256, 64, 16)
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
# (bench/grouped_gemm_bench.py).
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


def _balanced(group_sizes, bulk, num_rows):
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


def _with_bulk_if_balanced(fn, group_sizes, bulk, num_rows):
  """fn(bulk) if the routing is balanced enough for it, else fn(0)."""
  if not bulk:
    return fn(0)
  return jax.lax.cond(
      _balanced(group_sizes, bulk, num_rows), lambda: fn(bulk), lambda: fn(0)
  )


def _effective_levels(levels, num_rows):
  """Heights no taller than the rows (a slice may not exceed its operand)."""
  return tuple(sorted({min(h, num_rows) for h in levels}, reverse=True))


def _layout(group_sizes, bulk):
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


def _for_each_overflow_tile(
    group_sizes, bulk, levels, carry, tile_fn, group_start_fn, group_end_fn
):
  """Runs tile_fn over the overflow tiles, group by group.

  tile_fn((carry, state), height, start, limit, partial) -> (carry, state):
  the tile holds rows [start, min(start + height, limit)); `partial` (static)
  is True for the smallest height, whose tiles may hold fewer rows.
  group_start_fn(carry, g) -> (carry, state) runs before a group's tiles,
  group_end_fn((carry, state), g) -> carry after them.
  """
  starts, overflow, ids, num_active = _layout(group_sizes, bulk)
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


def _tile_rows(num_rows, height, start, limit):
  """Where a tile is read, and [height, 1] bool: which of its rows count."""
  read_at = jnp.minimum(start, num_rows - height)  # As dynamic_slice clamps.
  row = read_at + jnp.arange(height)[:, None]
  return read_at, (row >= start) & (row < limit)


def _gather_bulk(x, group_sizes, bulk, dtype):
  """[M, A] -> [E, bulk, A]: each group's first `bulk` rows, zero past it."""
  starts = jnp.cumsum(group_sizes) - group_sizes
  position = jnp.arange(bulk)
  index = jnp.minimum(starts[:, None] + position, x.shape[0] - 1)
  mine = (position < group_sizes[:, None])[..., None]
  return jnp.where(mine, x[index].astype(dtype), 0)


def _assemble_from_bulk(bulk_out, group_sizes, num_rows):
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


def _gmm(
    rows,
    weights,
    group_sizes,
    transpose_rhs,
    out_dtype,
    levels,
    compute_dtype,
    bulk,
):
  """Forward: [M, K] x [E, K, N] ([E, N, K] transposed) -> [M, N]."""
  m = rows.shape[0]
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  cdt = compute_dtype or rows.dtype
  levels = _effective_levels(levels, m)
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  if bulk:
    x_bulk = _gather_bulk(rows, group_sizes, bulk, cdt)
    spec = "ehk,enk->ehn" if transpose_rhs else "ehk,ekn->ehn"
    y_bulk = jnp.einsum(
        spec, x_bulk, weights.astype(cdt), preferred_element_type=jnp.float32
    )
    out = _assemble_from_bulk(y_bulk, group_sizes, m)
  else:
    out = jnp.zeros((m, n), jnp.float32)

  def group_start(out, g):  # Each overflowing expert's weights, once.
    w = jax.lax.dynamic_index_in_dim(weights, g, keepdims=False)
    return out, w.astype(cdt)

  def tile(carry, height, start, limit, partial):
    out, w = carry
    read_at, mine = _tile_rows(m, height, start, limit)
    x = jax.lax.dynamic_slice_in_dim(rows, read_at, height).astype(cdt)
    y = jax.lax.dot_general(
        x, w, (contract, ((), ())), preferred_element_type=jnp.float32
    )
    if partial:
      y = jnp.where(mine, y, jax.lax.dynamic_slice_in_dim(out, read_at, height))
    return jax.lax.dynamic_update_slice_in_dim(out, y, read_at, 0), w

  def group_end(carry, g):
    del g
    return carry[0]

  out = _for_each_overflow_tile(
      group_sizes, bulk, levels, out, tile, group_start, group_end
  )
  return out.astype(out_dtype)


def _tgmm(
    lhs, rhs, group_sizes, num_groups, out_dtype, levels, compute_dtype, bulk
):
  """Per-group lhs_g^T @ rhs_g: [M, A] x [M, B] -> [E, A, B].

  An empty group gives exact zeros; rows past sum(group_sizes) are never
  read unmasked.
  """
  m, a, b = lhs.shape[0], lhs.shape[1], rhs.shape[1]
  cdt = compute_dtype or lhs.dtype
  levels = _effective_levels(levels, m)

  if bulk:
    out = jnp.einsum(
        "eha,ehb->eab",
        _gather_bulk(lhs, group_sizes, bulk, cdt),
        _gather_bulk(rhs, group_sizes, bulk, cdt),
        preferred_element_type=jnp.float32,
    )
  else:
    out = jnp.zeros((num_groups, a, b), jnp.float32)

  def group_start(out, g):
    del g
    return out, jnp.zeros((a, b), jnp.float32)

  def tile(carry, height, start, limit, partial):
    out, acc = carry
    read_at, mine = _tile_rows(m, height, start, limit)
    l = jax.lax.dynamic_slice_in_dim(lhs, read_at, height).astype(cdt)
    r = jax.lax.dynamic_slice_in_dim(rhs, read_at, height).astype(cdt)
    if partial:
      l, r = jnp.where(mine, l, 0), jnp.where(mine, r, 0)
    acc += jax.lax.dot_general(
        l, r, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return out, acc

  def group_end(carry, g):
    out, acc = carry
    total = jax.lax.dynamic_index_in_dim(out, g, keepdims=False) + acc
    return jax.lax.dynamic_update_index_in_dim(out, total, g, axis=0)

  out = _for_each_overflow_tile(
      group_sizes, bulk, levels, out, tile, group_start, group_end
  )
  return out.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def grouped_gemm(
    rows,
    weights,
    group_sizes,
    transpose_rhs=False,
    out_dtype=None,
    levels=DEFAULT_LEVELS,
    compute_dtype=None,
    bulk=None,
):
  """rows [M, K] x weights [E, K, N] -> [M, N] over ragged groups.

  Args:
    rows: [M, K], sorted by group.
    weights: [E, K, N], or [E, N, K] with `transpose_rhs`.
    group_sizes: [E] int32, sum <= M.
    transpose_rhs: contract with weights[e].T.
    out_dtype: result dtype (rows' by default); accumulation is float32.
    levels: overflow tile heights, largest first, e.g. (256, 64, 16).
    compute_dtype: dtype the products run in (None: the operands').
      XLA:CPU multiplies bfloat16 about half as fast as float32.
    bulk: rows per group in the batched bulk; None picks `bulk_rows(M, E)`,
      0 turns the bulk off (everything goes through the tile loop). The
      bulk runs only when the sizes are balanced enough (`_balanced`).
  """
  return _with_bulk_if_balanced(
      lambda b: _gmm(
          rows,
          weights,
          group_sizes,
          transpose_rhs,
          out_dtype or rows.dtype,
          levels,
          compute_dtype,
          b,
      ),
      group_sizes,
      _bulk(bulk, rows.shape[0], weights.shape[0]),
      rows.shape[0],
  )


def _bulk(bulk, num_rows, num_groups):
  return bulk_rows(num_rows, num_groups) if bulk is None else bulk


def _fwd(
    rows,
    weights,
    group_sizes,
    transpose_rhs,
    out_dtype,
    levels,
    compute_dtype,
    bulk,
):
  out = grouped_gemm(
      rows,
      weights,
      group_sizes,
      transpose_rhs,
      out_dtype,
      levels,
      compute_dtype,
      bulk,
  )
  return out, (rows, weights, group_sizes)


def _bwd(transpose_rhs, out_dtype, levels, compute_dtype, bulk, residuals, dy):
  del out_dtype
  rows, weights, group_sizes = residuals
  num_groups = weights.shape[0]
  dy = dy.astype(rows.dtype)

  def grads(bulk):
    # dX: the same product against the weights the other way round.
    d_rows = _gmm(
        dy,
        weights,
        group_sizes,
        not transpose_rhs,
        rows.dtype,
        levels,
        compute_dtype,
        bulk,
    )
    if transpose_rhs:  # weights[g] is [N, K]: dW[g] = dy_g^T x_g.
      d_weights = _tgmm(
          dy,
          rows,
          group_sizes,
          num_groups,
          weights.dtype,
          levels,
          compute_dtype,
          bulk,
      )
    else:  # weights[g] is [K, N]: dW[g] = x_g^T dy_g.
      d_weights = _tgmm(
          rows,
          dy,
          group_sizes,
          num_groups,
          weights.dtype,
          levels,
          compute_dtype,
          bulk,
      )
    return d_rows, d_weights

  d_rows, d_weights = _with_bulk_if_balanced(
      grads, group_sizes, _bulk(bulk, rows.shape[0], num_groups), rows.shape[0]
  )
  return d_rows, d_weights, None


grouped_gemm.defvjp(_fwd, _bwd)
