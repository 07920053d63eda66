"""A grouped GEMM from plain XLA ops: a batched bulk plus a tile loop.

XLA:CPU lowers `jax.lax.ragged_dot` to a dense masked product (E times the
useful work), so this module splits the ragged product in two: the bulk, the
first H rows of every group gathered into [E, H, C] (zeros past a group's
end) and multiplied by all E weights in one batched dot, and the overflow,
the rows past H in the groups that have them, in a loop over only those
groups, tile by tile (`layout` decides H and walks the tiles; docs/xla.md
has the design). The bulk runs only when the routing is balanced enough
for it to pay (a `lax.cond` on the group sizes); otherwise H is 0 and every
row takes the tile loop. Rows past sum(group_sizes) come out zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from backends.xla import layout
from moe_core.kernels import grouped_matmul

# Overflow tile heights, measured on 2 CPU cores (M=4096, D=512, F=1024;
# bench/micro/grouped_gemm_bench.py): taller tiles amortise per-tile copies,
# shorter ones waste less per group.
DEFAULT_LEVELS = (256, 64, 16)


@dataclasses.dataclass(frozen=True)
class Loop:
  """How one product is cut into bulk and tiles (static, hashable).

  Attributes:
    levels: overflow tile heights, largest first, e.g. (256, 64, 16).
    compute_dtype: the dtype the products run in (None: the operands').
    bulk: rows per group in the batched bulk; 0 sends every row through
      the tile loop.
  """

  levels: tuple[int, ...]
  compute_dtype: jnp.dtype | None
  bulk: int


def _with_bulk_if_balanced(fn, group_sizes, loop: Loop, num_rows: int):
  """fn(loop) if the routing is balanced enough for its bulk, else the
  same without the bulk (`layout.balanced`, decided on device)."""
  if not loop.bulk:
    return fn(loop)
  return jax.lax.cond(
      layout.balanced(group_sizes, loop.bulk, num_rows),
      lambda: fn(loop),
      lambda: fn(dataclasses.replace(loop, bulk=0)),
  )


def _gmm(rows, weights, group_sizes, transpose_rhs, out_dtype, loop: Loop):
  """Forward: [M, C] x [E, C, N] ([E, N, C] transposed) -> [M, N].

  The output is assembled with one gather from the bulk result (no
  zero-filled buffer, no scatter); overflow tiles are then written in place:
  full tiles whole, the partial ones merged (read-modify-write; the loop
  runs in sequence, so this is race-free).
  """
  m = rows.shape[0]
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  cdt = loop.compute_dtype or rows.dtype
  bulk, levels = loop.bulk, layout.effective_levels(loop.levels, m)
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  if bulk:
    x_bulk = layout.gather_bulk(rows, group_sizes, bulk, cdt)
    spec = "ehc,enc->ehn" if transpose_rhs else "ehc,ecn->ehn"
    y_bulk = jnp.einsum(
        spec, x_bulk, weights.astype(cdt), preferred_element_type=jnp.float32
    )
    out = layout.assemble_from_bulk(y_bulk, group_sizes, m)
  else:
    # The loop's buffer stays float32: XLA:CPU updates a bfloat16 buffer by
    # converting all of it to float32 and back, every iteration.
    out = jnp.zeros((m, n), jnp.float32)

  def group_start(out, g):  # Each overflowing expert's weights, once.
    w = jax.lax.dynamic_index_in_dim(weights, g, keepdims=False)
    return out, w.astype(cdt)

  def tile(carry, height, start, limit, partial):
    out, w = carry
    read_at, mine = layout.tile_rows(m, height, start, limit)
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

  out = layout.for_each_overflow_tile(
      group_sizes, bulk, levels, out, tile, group_start, group_end
  )
  return out.astype(out_dtype)


def _tgmm(lhs, rhs, group_sizes, num_groups, out_dtype, loop: Loop):
  """Per-group lhs_g^T @ rhs_g: [M, A] x [M, B] -> [E, A, B].

  One batched x^T dy over the bulk plus per-group sums over the overflow
  tiles, whose foreign rows are zeroed with `where` (so NaN in unused rows
  stays out). An empty group gives exact zeros; rows past sum(group_sizes)
  are never read unmasked.
  """
  m, a, b = lhs.shape[0], lhs.shape[1], rhs.shape[1]
  cdt = loop.compute_dtype or lhs.dtype
  bulk, levels = loop.bulk, layout.effective_levels(loop.levels, m)

  if bulk:
    out = jnp.einsum(
        "eha,ehb->eab",
        layout.gather_bulk(lhs, group_sizes, bulk, cdt),
        layout.gather_bulk(rhs, group_sizes, bulk, cdt),
        preferred_element_type=jnp.float32,
    )
  else:
    out = jnp.zeros((num_groups, a, b), jnp.float32)

  def group_start(out, g):
    del g
    return out, jnp.zeros((a, b), jnp.float32)

  def tile(carry, height, start, limit, partial):
    out, acc = carry
    read_at, mine = layout.tile_rows(m, height, start, limit)
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

  out = layout.for_each_overflow_tile(
      group_sizes, bulk, levels, out, tile, group_start, group_end
  )
  return out.astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class XlaKernels(grouped_matmul.GroupedKernels):
  """The bulk-and-tile-loop products as `GroupedKernels`.

  `moe_core.kernels.grouped_matmul` differentiates them: forward, dX and dW
  are `_gmm`, `_gmm` transposed and `_tgmm`, each deciding on device
  whether the routing is balanced enough for its batched bulk.

  Attributes:
    levels: overflow tile heights, largest first, e.g. (256, 64, 16).
    compute_dtype: dtype the products run in (None: the operands').
      XLA:CPU multiplies bfloat16 about half as fast as float32.
    bulk: rows per group in the batched bulk; None picks
      `layout.bulk_rows(M, E)`, 0 turns the bulk off (everything goes
      through the tile loop).
  """

  levels: tuple[int, ...] = DEFAULT_LEVELS
  compute_dtype: jnp.dtype | None = None
  bulk: int | None = None

  def _loop(self, num_rows: int, num_groups: int) -> Loop:
    bulk = self.bulk
    if bulk is None:
      bulk = layout.bulk_rows(num_rows, num_groups)
    return Loop(tuple(self.levels), self.compute_dtype, bulk)

  def gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
    return _with_bulk_if_balanced(
        lambda lp: _gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, lp),
        group_sizes,
        self._loop(lhs.shape[0], rhs.shape[0]),
        lhs.shape[0],
    )

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    return _with_bulk_if_balanced(
        lambda lp: _tgmm(lhs, rhs, group_sizes, num_groups, out_dtype, lp),
        group_sizes,
        self._loop(lhs.shape[0], num_groups),
        lhs.shape[0],
    )


def grouped_gemm(
    rows: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    transpose_rhs: bool = False,
    out_dtype=None,
    levels: tuple[int, ...] = DEFAULT_LEVELS,
    compute_dtype=None,
    bulk: int | None = None,
) -> jax.Array:
  """rows [M, C] x weights [E, C, N] -> [M, N] over ragged groups.

  Differentiable in rows and weights, forward and reverse mode (a
  `grouped_matmul` primitive over `XlaKernels`).

  Args:
    rows: [M, C], sorted by group.
    weights: [E, C, N], or [E, N, C] with `transpose_rhs`.
    group_sizes: [E] int32, sum <= M.
    transpose_rhs: contract with weights[e].T.
    out_dtype: result dtype (rows' by default); accumulation is float32.
    levels, compute_dtype, bulk: see `XlaKernels`.
  """
  kernels = XlaKernels(
      tuple(levels),
      None if compute_dtype is None else jnp.dtype(compute_dtype),
      bulk,
  )
  return grouped_matmul.gmm(
      kernels,
      rows,
      weights,
      group_sizes,
      transpose_rhs=transpose_rhs,
      out_dtype=out_dtype or rows.dtype,
  )
