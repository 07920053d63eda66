"""Grouped GEMMs as Pallas Mosaic TPU kernels: gmm (forward, dX), tgmm (dW).

Both walk a visit list (`metadata`) that the kernels receive as scalar
prefetch (SMEM), so group sizes stay on the device and the shapes are fixed
under jit; the grid's visit axis is as long as the visits used.

gmm: grid (column block, visit, K step). With the whole K in one step (the
default), a visit's row tile and its group's weight block are each fetched
once for all the visits that share them (Pallas skips the copy of a block
whose index does not change), so the weights cross HBM once per column
block. A visit computes only the row chunks (`Tiles.chunk`) that hold its
rows and writes only its rows, into an output block other visits of the
same tile also write; an epilogue (the activation of the fused gate/up)
and a per-row scale (the routing weights of the down projection) run on the
float32 accumulators.

tgmm: grid (dW row block, dW column block, visit); a group's visits are
consecutive, so its float32 accumulator lives in VMEM from its first visit
to its last, where it is written. Rows outside a visit's group are selected
to zero in both operands before the product: they may hold NaN.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from backends.mosaic_tpu import metadata
from backends.mosaic_tpu import tiling

Epilogue = Callable[[Sequence[jax.Array]], Sequence[jax.Array]]
# The names of the pallas_calls, which the compiled program keeps inside
# its tpu_custom_calls (bench/compile/tpu.py looks for them).
GMM_NAME = "dropless_tpu_gmm"
TGMM_NAME = "dropless_tpu_tgmm"


def identity(accs):
  """The epilogue that writes each accumulator as it is."""
  return tuple(accs)


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
  """How a kernel is launched, besides its tiles.

  Attributes:
    interpret: False (compiled for a TPU), True (Pallas' HLO interpreter)
      or a `pltpu.InterpretParams` (the TPU interpreter, which also checks
      out-of-bounds accesses and races).
    generation: the TPU generation lowered for (its VMEM limit).
    dynamic_grid: the visit axis as long as the visits used (a traced
      grid bound), else the static bound with idle trailing visits.
  """

  interpret: object = False
  generation: str = tiling.DEFAULT_GENERATION
  dynamic_grid: bool = True

  def compiler_params(self, semantics):
    if self.interpret is not False:
      return None
    gen = tiling.GENERATIONS[self.generation]
    return pltpu.CompilerParams(
        dimension_semantics=semantics,
        vmem_limit_bytes=gen.vmem_limit_bytes,
    )


def _precision(dtype):
  """A product's precision: float32 follows jax_default_matmul_precision
  (None; one bf16 pass by default on a TPU, full float32 under "highest");
  bf16 operands are exact in one pass, and Mosaic refuses a bf16 product
  at the float32 precision "highest" asks for ("Bad lhs type")."""
  if jnp.dtype(dtype) == jnp.float32:
    return None
  return lax.Precision.DEFAULT


def _round_up(x: int, b: int) -> int:
  return -(-x // b) * b


def _pad(x: jax.Array, shape) -> jax.Array:
  """x with zeros appended along each axis up to `shape`."""
  pads = [(0, want - have) for have, want in zip(x.shape, shape)]
  return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _row_mask(r0, start, end, rows: int):
  """[rows, 1] bool: which of rows r0, r0 + 1, ... lie in [start, end)."""
  row = r0 + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
  return (row >= start) & (row < end)


def _visit_rows(visits: metadata.Visits, visit, bm: int):
  """(start, end, r0) of `visit`, read from the visit list's SMEM refs: the
  rows [start, end) it owns, and r0 the first row of its tile."""
  start, end = visits.row_start[visit], visits.row_end[visit]
  return start, end, visits.tile[visit] * bm


def _owns_whole_chunk(start, end, first_row, rows: int):
  """Whether rows first_row .. first_row + rows - 1 all lie in [start, end):
  such a chunk needs no row mask (most chunks of a large group), which
  saves the VPU a select over each operand or output block."""
  return (start <= first_row) & (end >= first_row + rows)


def _owned_chunks(tiles: tiling.Tiles, start, end, r0):
  """(first row, rows, owns) of each MXU pass over the tile at r0: the
  first row and the rows static, owns whether it holds rows of [start,
  end)."""
  step = tiles.rows_per_pass
  for c0 in range(0, tiles.bm, step):
    yield c0, step, (start < r0 + c0 + step) & (end > r0 + c0)


def _poison_scalars(poison) -> tuple[jax.Array, ...]:
  """The poison flag as the kernels' extra scalar prefetch: () or an int32
  [1] array."""
  if poison is None:
    return ()
  return (jnp.asarray(poison, jnp.int32).reshape(1),)


def _poisoned_array(poison, x: jax.Array) -> jax.Array:
  """x, all NaN where the bool scalar `poison` (None: never) is set."""
  if poison is None:
    return x
  return jnp.where(poison, jnp.asarray(jnp.nan, x.dtype), x)


def _poisoned(poison_ref, values):
  """values, each all NaN where the SMEM flag poison_ref[0] is set."""
  bad = poison_ref[0] != 0
  return [jnp.where(bad, jnp.asarray(jnp.nan, v.dtype), v) for v in values]


def _grid_visits(visits: metadata.Visits, launch: KernelLaunch):
  if launch.dynamic_grid:
    return visits.count[0]
  return visits.segment.shape[0]


# --- gmm ----------------------------------------------------------------------


def _gmm_kernel(
    *refs,
    num_lhs,
    num_rhs,
    num_outputs,
    products,
    num_accs,
    epilogue,
    tiles,
    k_steps,
    num_local,
    transpose_rhs,
    has_scale,
    has_poison,
):
  """One visit x one column block x one K step of gmm.

  refs: the visit list's four SMEM refs (`metadata.Visits.scalars`), the
  poison flag's [1] SMEM ref if has_poison, num_lhs row blocks [bm, bk],
  num_rhs weight blocks [bk, bn] ([bn, bk] transposed), the row scales
  [bm, 1] if has_scale, the output blocks [bm, bn], then (k_steps > 1) the
  float32 accumulators [bm, bn].
  """
  visits, refs = metadata.Visits(*refs[:4], count=None), refs[4:]
  poison_ref, refs = (refs[0], refs[1:]) if has_poison else (None, refs)
  lhs_refs = refs[:num_lhs]
  rhs_refs = refs[num_lhs : num_lhs + num_rhs]
  rest = refs[num_lhs + num_rhs :]
  scale_ref = rest[0] if has_scale else None
  rest = rest[int(has_scale) :]
  out_refs, acc_refs = rest[:num_outputs], rest[num_outputs:]
  visit, k = pl.program_id(1), pl.program_id(2)
  segment = visits.segment[visit]
  start, end, r0 = _visit_rows(visits, visit, tiles.bm)
  # Segment 0 and E + 1 are rows of no local group: zeros.
  computes = (segment >= 1) & (segment <= num_local)
  contraction = (((1,), (1 if transpose_rhs else 0,)), ((), ()))
  last_step = k == k_steps - 1

  def products_of(c0, rows):
    lhs = [ref[pl.ds(c0, rows), :] for ref in lhs_refs]
    rhs = [ref[...] for ref in rhs_refs]
    accs = [None] * num_accs
    for l, r, a in products:
      term = lax.dot_general(
          lhs[l],
          rhs[r],
          contraction,
          precision=_precision(lhs[l].dtype),
          preferred_element_type=jnp.float32,
      )
      accs[a] = term if accs[a] is None else accs[a] + term
    return accs

  def store(c0, rows, mask, accs):
    if has_scale:
      accs = [acc * scale_ref[pl.ds(c0, rows), :] for acc in accs]
    values = epilogue(accs)
    if has_poison:
      values = _poisoned(poison_ref, values)
    whole = _owns_whole_chunk(start, end, r0 + c0, rows)
    for o_ref, value in zip(out_refs, values):
      block = o_ref.at[pl.ds(c0, rows), :]
      value = value.astype(o_ref.dtype)

      @pl.when(whole)
      def _(block=block, value=value):
        block[...] = value

      @pl.when(jnp.logical_not(whole))
      def _(block=block, value=value):
        # Other visits of this tile write the other rows.
        block[...] = jnp.where(mask, value, block[...])

  for c0, rows, owns in _owned_chunks(tiles, start, end, r0):
    mask = _row_mask(r0 + c0, start, end, rows)

    if k_steps == 1:

      @pl.when(owns & computes)
      def _(c0=c0, rows=rows, mask=mask):
        store(c0, rows, mask, products_of(c0, rows))

    else:

      @pl.when(owns & computes)
      def _(c0=c0, rows=rows, mask=mask):
        accs = products_of(c0, rows)
        for acc_ref, acc in zip(acc_refs, accs):
          block = acc_ref.at[pl.ds(c0, rows), :]
          block[...] = jnp.where(k == 0, acc, block[...] + acc)

        @pl.when(last_step)
        def _():
          store(
              c0,
              rows,
              mask,
              [ref[pl.ds(c0, rows), :] for ref in acc_refs],
          )

    @pl.when(owns & jnp.logical_not(computes) & last_step)
    def _(c0=c0, rows=rows, mask=mask):
      for o_ref in out_refs:
        block = o_ref.at[pl.ds(c0, rows), :]
        if has_poison:
          # A whole float32 block, poisoned and then cast: Mosaic cannot
          # select between bf16 scalars (v5e has no bf16 VPU; v6e and
          # tpu7x refuse the scalar form too).
          (fill,) = _poisoned(poison_ref, [jnp.zeros(block.shape, jnp.float32)])
          fill = fill.astype(o_ref.dtype)
        else:
          fill = jnp.zeros((), o_ref.dtype)
        block[...] = jnp.where(mask, fill, block[...])


def gmm(
    lhs: Sequence[jax.Array],
    rhs: Sequence[jax.Array],
    group_sizes: jax.Array,
    *,
    tiles: tiling.Tiles,
    launch: KernelLaunch,
    transpose_rhs: bool = False,
    products: Sequence[tuple[int, int, int]] = ((0, 0, 0),),
    epilogue: Epilogue = identity,
    num_outputs: int = 1,
    out_dtype=None,
    row_scale: jax.Array | None = None,
    group_offset: jax.Array | None = None,
    poison: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
  """Grouped GEMMs over one visit list: acc[a] += lhs[l] @ rhs[r][group].

  Args:
    lhs: row operands, each [M, K], rows sorted by group.
    rhs: weight operands, each [E, K, N] ([E, N, K] if `transpose_rhs`), E
      the local groups.
    group_sizes: [G] int32 rows per group (G >= E), sum <= M.
    tiles: block sizes (`tiling.choose`).
    launch: interpret mode, generation, grid.
    transpose_rhs: contract with rhs[g].T.
    products: static (lhs, rhs, accumulator) index triples.
    epilogue: float32 accumulators [rows, bn] -> `num_outputs` blocks.
    num_outputs: outputs written.
    out_dtype: the outputs' dtype (lhs[0]'s by default).
    row_scale: [M] float32 or None: row r's accumulators are scaled by it
      before the epilogue (the routing weights in the down projection).
    group_offset: int32 scalar or None (0): the rows of groups
      [group_offset, group_offset + E) are computed against rhs[0:E], the
      others come out as zeros (expert parallelism with every group's rows
      present).
    poison: bool scalar or None: when set, every output is written all NaN
      (the outcome of bad group sizes; no pass over the outputs after).

  Returns:
    `num_outputs` arrays [M, N]; rows of no local group, and rows at or past
    sum(group_sizes), are zeros (NaN under `poison`).
  """
  m, k = lhs[0].shape
  num_local = rhs[0].shape[0]
  n = rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2]
  out_dtype = jnp.dtype(out_dtype or lhs[0].dtype)
  if m == 0 or n == 0 or k == 0 or num_local == 0:
    zeros = jnp.zeros((m, n), out_dtype)
    return tuple(_poisoned_array(poison, zeros) for _ in range(num_outputs))
  bm, bn = tiles.bm, tiles.bn
  bk = _round_up(k, tiling.LANE) if tiles.bk is None else tiles.bk
  mp, kp, np_ = _round_up(m, bm), _round_up(k, bk), _round_up(n, bn)
  k_steps = kp // bk
  lhs = [_pad(x, (mp, kp)) for x in lhs]
  rhs = [
      _pad(w, (num_local, np_, kp) if transpose_rhs else (num_local, kp, np_))
      for w in rhs
  ]
  visits = metadata.visit_list(
      group_sizes,
      mp,
      bm,
      weight_gradient=False,
      group_offset=group_offset,
      num_local=num_local,
  )
  num_accs = 1 + max(a for _, _, a in products)

  def lhs_map(j, v, s, seg, tile, *_):
    del j
    return tile[v], s

  def rhs_map(j, v, s, seg, *_):
    weight = jnp.clip(seg[v] - 1, 0, num_local - 1)
    return (weight, j, s) if transpose_rhs else (weight, s, j)

  def rows_map(j, v, s, seg, tile, *_):
    del s
    return tile[v], j

  rhs_block = (None, bn, bk) if transpose_rhs else (None, bk, bn)
  in_specs = [pl.BlockSpec((bm, bk), lhs_map) for _ in lhs]
  in_specs += [pl.BlockSpec(rhs_block, rhs_map) for _ in rhs]
  operands = [*lhs, *rhs]
  if row_scale is not None:
    in_specs.append(
        pl.BlockSpec((bm, 1), lambda j, v, s, seg, tile, *_: (tile[v], 0))
    )
    operands.append(_pad(row_scale.astype(jnp.float32)[:, None], (mp, 1)))
  kernel = functools.partial(
      _gmm_kernel,
      num_lhs=len(lhs),
      num_rhs=len(rhs),
      num_outputs=num_outputs,
      products=tuple(products),
      num_accs=num_accs,
      epilogue=epilogue,
      tiles=dataclasses.replace(tiles, bk=bk),
      k_steps=k_steps,
      num_local=num_local,
      transpose_rhs=transpose_rhs,
      has_scale=row_scale is not None,
      has_poison=poison is not None,
  )
  scratch = []
  if k_steps > 1:
    scratch = [pltpu.VMEM((bm, bn), jnp.float32) for _ in range(num_accs)]
  itemsize = jnp.dtype(lhs[0].dtype).itemsize
  flops = 2 * m * k * n * len(products)
  bytes_accessed = (
      len(lhs) * m * k * (np_ // bn) + len(rhs) * num_local * k * n
  ) * itemsize + num_outputs * m * n * out_dtype.itemsize
  prefetch = (*visits.scalars(), *_poison_scalars(poison))
  outs = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(np_ // bn, _grid_visits(visits, launch), k_steps),
          in_specs=in_specs,
          out_specs=[pl.BlockSpec((bm, bn), rows_map)] * num_outputs,
          scratch_shapes=scratch,
      ),
      out_shape=[
          jax.ShapeDtypeStruct((mp, np_), out_dtype) for _ in range(num_outputs)
      ],
      compiler_params=launch.compiler_params(
          ("parallel", "arbitrary", "arbitrary")
      ),
      interpret=launch.interpret,
      cost_estimate=pl.CostEstimate(
          flops=flops, transcendentals=0, bytes_accessed=bytes_accessed
      ),
      name=GMM_NAME,
  )(*prefetch, *operands)
  return tuple(o[:m, :n] for o in outs)


# --- tgmm ---------------------------------------------------------------------


def _tgmm_kernel(*refs, num_rhs, tiles, has_poison):
  """One dW block x one visit: acc += lhs_rows^T @ rhs_rows of the group.

  refs: the visit list's four SMEM refs (`metadata.Visits.scalars`), the
  poison flag's [1] SMEM ref if has_poison, the row block [bm, bk],
  num_rhs row blocks [bm, bn], the output blocks [bk, bn] of the visit's
  group, then the float32 accumulators [bk, bn].
  """
  visits, refs = metadata.Visits(*refs[:4], count=None), refs[4:]
  poison_ref, refs = (refs[0], refs[1:]) if has_poison else (None, refs)
  lhs_ref, *refs = refs
  rhs_refs = refs[:num_rhs]
  out_refs = refs[num_rhs : 2 * num_rhs]
  acc_refs = refs[2 * num_rhs :]
  visit, num_visits = pl.program_id(2), pl.num_programs(2)
  segment = visits.segment[visit]
  before = visits.segment[jnp.maximum(visit - 1, 0)]
  after = visits.segment[jnp.minimum(visit + 1, num_visits - 1)]
  start, end, r0 = _visit_rows(visits, visit, tiles.bm)

  @pl.when((visit == 0) | (before != segment))
  def _():
    for acc_ref in acc_refs:
      acc_ref[...] = jnp.zeros_like(acc_ref)

  def accumulate(c0, rows, mask):
    lhs = lhs_ref[pl.ds(c0, rows), :]
    if mask is not None:
      lhs = jnp.where(mask, lhs, jnp.zeros((), lhs.dtype))
    for rhs_ref, acc_ref in zip(rhs_refs, acc_refs):
      rhs = rhs_ref[pl.ds(c0, rows), :]
      if mask is not None:
        rhs = jnp.where(mask, rhs, jnp.zeros((), rhs.dtype))
      acc_ref[...] += lax.dot_general(
          lhs,
          rhs,
          (((0,), (0,)), ((), ())),
          precision=_precision(lhs.dtype),
          preferred_element_type=jnp.float32,
      )

  for c0, rows, owns in _owned_chunks(tiles, start, end, r0):
    whole = _owns_whole_chunk(start, end, r0 + c0, rows)

    @pl.when(owns & whole)
    def _(c0=c0, rows=rows):
      accumulate(c0, rows, None)

    @pl.when(owns & jnp.logical_not(whole))
    def _(c0=c0, rows=rows):
      # Other groups' rows, and rows past the groups, may hold anything
      # (NaN too): select zeros, never multiply by a mask.
      accumulate(c0, rows, _row_mask(r0 + c0, start, end, rows))

  @pl.when((visit == num_visits - 1) | (after != segment))
  def _():
    values = [acc_ref[...] for acc_ref in acc_refs]
    if has_poison:
      values = _poisoned(poison_ref, values)
    for out_ref, value in zip(out_refs, values):
      out_ref[...] = value.astype(out_ref.dtype)


def tgmm(
    lhs: jax.Array,
    rhs: Sequence[jax.Array],
    group_sizes: jax.Array,
    *,
    tiles: tiling.Tiles,
    launch: KernelLaunch,
    num_groups: int,
    out_dtype=None,
    group_offset: jax.Array | None = None,
    poison: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
  """Per-group lhs_g^T @ rhs_g for each rhs: [M, A], [M, B] -> [E, A, B].

  Args:
    lhs: [M, A] rows sorted by group.
    rhs: operands [M, B] with the same rows.
    group_sizes: [G] int32 (G >= num_groups), sum <= M.
    tiles: bm the step over rows, bk x bn the dW block.
    launch: interpret mode, generation, grid.
    num_groups: E, the local groups: [group_offset, group_offset + E).
    out_dtype: the outputs' dtype (lhs's by default).
    group_offset: int32 scalar or None (0).
    poison: bool scalar or None: when set, every block is written all NaN.

  Returns:
    one [E, A, B] per rhs; an empty group's block is zeros; rows at or past
    sum(group_sizes) do not contribute, NaN or not.
  """
  m, a = lhs.shape
  b = rhs[0].shape[1]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if m == 0 or a == 0 or b == 0 or num_groups == 0:
    zeros = jnp.zeros((num_groups, a, b), out_dtype)
    return tuple(_poisoned_array(poison, zeros) for _ in range(len(rhs)))
  bm, ba, bb = tiles.bm, tiles.bk, tiles.bn
  mp, ap, bp = _round_up(m, bm), _round_up(a, ba), _round_up(b, bb)
  visits = metadata.visit_list(
      group_sizes,
      mp,
      bm,
      weight_gradient=True,
      group_offset=group_offset,
      num_local=num_groups,
  )
  kernel = functools.partial(
      _tgmm_kernel,
      num_rhs=len(rhs),
      tiles=tiles,
      has_poison=poison is not None,
  )
  prefetch = (*visits.scalars(), *_poison_scalars(poison))
  itemsize = jnp.dtype(lhs.dtype).itemsize
  outs = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(ap // ba, bp // bb, _grid_visits(visits, launch)),
          in_specs=[pl.BlockSpec((bm, ba), lambda i, j, v, s, t, *_: (t[v], i))]
          + [
              pl.BlockSpec((bm, bb), lambda i, j, v, s, t, *_: (t[v], j))
              for _ in rhs
          ],
          out_specs=[
              pl.BlockSpec((None, ba, bb), lambda i, j, v, s, *_: (s[v], i, j))
              for _ in rhs
          ],
          scratch_shapes=[pltpu.VMEM((ba, bb), jnp.float32) for _ in rhs],
      ),
      out_shape=[
          jax.ShapeDtypeStruct((num_groups, ap, bp), out_dtype) for _ in rhs
      ],
      compiler_params=launch.compiler_params(
          ("parallel", "arbitrary", "arbitrary")
      ),
      interpret=launch.interpret,
      cost_estimate=pl.CostEstimate(
          flops=2 * m * a * b * len(rhs),
          transcendentals=0,
          bytes_accessed=(m * a * (bp // bb) + len(rhs) * m * b * (ap // ba))
          * itemsize
          + len(rhs) * num_groups * a * b * out_dtype.itemsize,
      ),
      name=TGMM_NAME,
  )(*prefetch, _pad(lhs, (mp, ap)), *[_pad(x, (mp, bp)) for x in rhs])
  return tuple(o[:, :a, :b] for o in outs)
