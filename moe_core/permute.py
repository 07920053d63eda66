"""Stages 2 and 4: sort token copies by expert (dispatch), undo it (combine)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_core import checks
from moe_core import index_ops
from moe_core import validation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """Where `dispatch` puts each token copy, without moving any data.

  With T tokens and K choices, there are M = T*K copies, one per
  (token, choice) assignment, numbered a = t*K + k.

  Attributes:
    group_sizes: [E] int32, rows per expert; sum(group_sizes) <= M.
    assignment: [M] int32, the assignment a held by each sorted row: by
      expert (stable, so by token within an expert), then the copies
      dropped by capacity, then the invalid ones.
    position: [M] int32, the inverse: the sorted row of assignment a.
    invalid: [M] bool in assignment order: the copy's expert id was out of
      [0, E) (possible only for traced ids: concrete ones raise). `combine`
      makes such a token's output NaN. sum(group_sizes) + dropped +
      sum(invalid) = M.
    top_k: K, static: combine checks its weights are [T, K] = [M / K, K].
  """

  group_sizes: jax.Array
  assignment: jax.Array
  position: jax.Array
  invalid: jax.Array
  top_k: int = dataclasses.field(default=1, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatched:
  """Token copies grouped by expert, and what `combine` needs to undo it.

  Attributes:
    rows: [M, D] copies in the plan's order: the dropped copies' rows come
      past sum(group_sizes), the invalid copies' last, as rows of NaN.
    group_sizes, assignment, position, invalid, top_k: the `DispatchPlan`'s.
  """

  rows: jax.Array
  group_sizes: jax.Array
  assignment: jax.Array
  position: jax.Array
  invalid: jax.Array
  top_k: int = dataclasses.field(default=1, metadata=dict(static=True))

  @classmethod
  def of(cls, rows: jax.Array, plan: DispatchPlan) -> Dispatched:
    """The plan's fields with `rows` [M, D] gathered in its order."""
    return cls(rows=rows, **_plan_fields(plan))

  @property
  def plan(self) -> DispatchPlan:
    return DispatchPlan(**_plan_fields(self))


def _plan_fields(record) -> dict:
  return {
      f.name: getattr(record, f.name) for f in dataclasses.fields(DispatchPlan)
  }


def dispatch(
    x: jax.Array,
    expert_ids: jax.Array,
    num_experts: int,
    kept: jax.Array | None = None,
) -> Dispatched:
  """Groups token copies by expert so each expert's rows are contiguous.

  `plan` then `gather`, validated once.

  Args:
    x: [T, D] activations.
    expert_ids: [T, K] int32 chosen experts.
    num_experts: E, the length of `group_sizes`.
    kept: optional [T, K] bool; False copies are sorted past every group.

  Returns:
    `Dispatched` with rows [T*K, D]. Concrete ids outside [0, E) raise
    ValueError; traced ones are marked `invalid` (docs/api.md, "Guarantees").
  """
  validation.check_dispatch(x, expert_ids, num_experts, kept)
  return gather_unchecked(x, plan_unchecked(expert_ids, num_experts, kept))


def plan(
    expert_ids: jax.Array, num_experts: int, kept: jax.Array | None = None
) -> DispatchPlan:
  """`dispatch`'s sort alone: expert_ids [T, K] -> `DispatchPlan` of M = T*K.

  A backend with its own data movement takes this plan and gathers (and
  combines) the rows itself. Arguments and errors as `dispatch`'s.
  """
  validation.check_plan(expert_ids, num_experts, kept)
  return plan_unchecked(expert_ids, num_experts, kept)


def plan_unchecked(
    expert_ids: jax.Array, num_experts: int, kept: jax.Array | None
) -> DispatchPlan:
  """`plan` on arguments a public entry point has validated."""
  keys, invalid = sort_keys(expert_ids, num_experts, kept)
  assignment = jnp.argsort(keys, stable=True).astype(jnp.int32)
  # Counts only the experts' keys (not those of dropped or invalid copies).
  group_sizes = index_ops.count(keys, num_experts)
  return DispatchPlan(
      group_sizes=group_sizes,
      assignment=assignment,
      position=inverse_permutation(assignment),
      invalid=invalid,
      top_k=expert_ids.shape[1],
  )


def gather_unchecked(x: jax.Array, plan: DispatchPlan) -> Dispatched:
  """x [T, D] -> `Dispatched` with rows [M, D] in the plan's order: each
  copy's token row, NaN for an invalid copy. The inputs are validated."""
  rows = x[plan.assignment // plan.top_k]
  rows = checks.nan_rows(sorted_flags(plan)[1], rows)
  return Dispatched.of(rows, plan)


def sorted_flags(plan: DispatchPlan | Dispatched) -> tuple[jax.Array, ...]:
  """(live, invalid), each [M] bool in the plan's sorted order: whether the
  row's copy is kept with a valid expert id, and whether its id is invalid.

  No gather: the sort puts the experts' copies first (sum(group_sizes)
  rows), then the dropped ones, then the invalid ones (`sort_keys`). A
  gather of single flags runs one element at a time on a TPU (0.3 ms for
  32,768 copies); these are two compares with an iota.
  """
  m = plan.assignment.shape[0]
  row = jnp.arange(m, dtype=jnp.int32)
  live = row < jnp.sum(plan.group_sizes)
  invalid = row >= m - jnp.sum(plan.invalid.astype(jnp.int32))
  return live, invalid


def sort_keys(
    expert_ids: jax.Array, num_experts: int, kept: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """Each copy's sort key, and whether its id is invalid.

  Keys order the copies as `dispatch` groups them: experts 0..E-1, then
  copies dropped by capacity (key E), then invalid ones (id outside [0, E):
  key E+1). Concrete invalid ids raise ValueError (`checks`).

  Args:
    expert_ids: [T, K] chosen experts.
    num_experts: E.
    kept: optional [T, K] bool.

  Returns:
    (keys [T*K] int32, invalid [T*K] bool), in assignment order t*K + k.
  """
  flat_ids = expert_ids.reshape(-1).astype(jnp.int32)
  invalid = checks.flag_bad_expert_ids(flat_ids, num_experts)
  keys = flat_ids
  if kept is not None:
    keys = jnp.where(kept.reshape(-1), keys, num_experts)
  return jnp.where(invalid, num_experts + 1, keys), invalid


def inverse_permutation(assignment: jax.Array) -> jax.Array:
  """[M] int32 `position` of an [M] permutation: position[assignment[i]] = i."""
  return index_ops.inverse_permutation(assignment)


def combine(
    expert_out: jax.Array,
    dispatched: Dispatched,
    combine_weights: jax.Array,
    kept: jax.Array | None = None,
) -> jax.Array:
  """Weighted un-permute: expert_out [M, D] rows -> [T, D] in token order.

  y[t] = sum_k combine_weights[t, k] * expert_out[position[t*K + k]],
  summed in float32 and returned in expert_out's dtype. Dropped copies
  (kept False) contribute exactly zero, even if their rows hold NaN; an
  invalid copy (`dispatched.invalid`) or a NaN weight makes its token's row
  NaN.
  """
  validation.check_combine(expert_out, dispatched, combine_weights, kept)
  return combine_unchecked(expert_out, dispatched, combine_weights, kept)


def combine_unchecked(
    expert_out: jax.Array,
    dispatched: Dispatched | DispatchPlan,
    combine_weights: jax.Array,
    kept: jax.Array | None,
) -> jax.Array:
  """`combine` on arguments a public entry point has validated."""
  t, k = combine_weights.shape
  per_copy = expert_out[dispatched.position].reshape(t, k, -1)
  per_copy = per_copy.astype(jnp.float32)
  if kept is not None:
    per_copy = jnp.where(kept[..., None], per_copy, 0.0)
  per_copy = checks.nan_rows(dispatched.invalid.reshape(t, k), per_copy)
  y = jnp.einsum(
      "tk,tkd->td",
      combine_weights.astype(jnp.float32),
      per_copy,
      precision=jax.lax.Precision.HIGHEST,
  )
  return y.astype(expert_out.dtype)
