"""The permutation's data movement as a JAX primitive over a backend's kernels.

`moe_core.permute` plans the permutation (the sort); a backend with its own
gather kernels (`PermutationKernels`) moves the data through five ops that
are each other's transposes (gather x [T, D] -> rows [A, D], scatter,
combine rows [A, D] with weights [T, K] -> [T, D], spread and row_dots, for
T tokens, K choices and A = T*K copies; `PermutationKernels` defines each),
so forward and reverse mode, vmap, shard_map and export all work with the
backend's kernels doing every step.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import jax
from jax.interpreters import ad
import jax.numpy as jnp

from moe_core import index_ops
from moe_core import permute
from moe_core.kernels import primitive


class Plan(NamedTuple):
  """Where each copy goes: the arrays `moe_core.permute.dispatch` computes.

  Attributes:
    assignment: [A] int32, the copy a held by each sorted row.
    position: [A] int32, the inverse: the sorted row of copy a.
    kept: [A] int8 in copy order, 1 if the copy counts (0: dropped).
    invalid: [A] int8 in copy order, 1 if its expert id was out of range.
    live_sorted: [A] int8 in sorted order, 1 if the row's copy counts and
      its id is valid (`moe_core.permute.sorted_flags`: no gather).
    invalid_sorted: [A] int8 in sorted order, 1 if the row's id is invalid.
  """

  assignment: jax.Array
  position: jax.Array
  kept: jax.Array
  invalid: jax.Array
  live_sorted: jax.Array
  invalid_sorted: jax.Array

  @classmethod
  def of(cls, plan, kept: jax.Array | None) -> Plan:
    """The kernels' form of a `moe_core.permute.DispatchPlan` (or a
    `Dispatched`) and its kept [T, K] bool (None: dropless)."""
    num_copies = plan.position.shape[0]
    kept_flags = (
        jnp.ones((num_copies,), jnp.int8)
        if kept is None
        else kept.reshape(-1).astype(jnp.int8)
    )
    live, invalid = permute.sorted_flags(plan)
    return cls(
        assignment=plan.assignment,
        position=plan.position,
        kept=kept_flags,
        invalid=plan.invalid.astype(jnp.int8),
        live_sorted=live.astype(jnp.int8),
        invalid_sorted=invalid.astype(jnp.int8),
    )


class PermutationKernels(abc.ABC):
  """A backend's permutation kernels; `moe_core.kernels.permutation`
  differentiates them.

  Subclasses are hashable and compare by value (frozen dataclasses): an
  instance is a static parameter of the primitive. Each method gets the
  plan's arrays and `top_k` (K) and must follow these definitions exactly,
  sums in float32. With T tokens, K choices, A = T*K copies a = t*K + k and
  the plan's `assignment` (the copy in each sorted row i) and `position`
  (its inverse):

    gather    x [T, D] -> rows [A, D]        rows[i] = x[a // K]
    scatter   rows [A, D] -> x [T, D]        x[t] = sum_k rows[position[tK+k]]
    combine   rows [A, D], w [T, K] -> [T, D]  y[t] = sum_k w[t,k] v[t,k]
    spread    dy [T, D], w [T, K] -> [A, D]  d_rows[i] = w[a] dy[a // K]
    row_dots  dy [T, D], rows [A, D] -> [T, K]  d_w[t,k] = <dy[t], v[t,k]>

  with v[t, k] = rows[position[t*K + k]] for a kept copy and 0 for a dropped
  one. An invalid copy (an expert id out of range) is NaN in gather's and
  combine's and row_dots' values when `nan_invalid` (the contract of
  `moe_core.permute`: its token comes out NaN) and 0 otherwise; scatter and
  spread always skip it. The defaults here are plain JAX gathers and sums; a
  backend overrides those it has kernels for.
  """

  def gather(self, x, plan: Plan, *, top_k: int, nan_invalid: bool):
    """x [T, D] -> rows [A, D] in x's dtype."""
    rows = x[plan.assignment // top_k]
    bad = (plan.invalid_sorted != 0)[:, None]
    return jnp.where(bad, _fill(nan_invalid, x.dtype), rows)

  def scatter(self, rows, plan: Plan, *, top_k: int):
    """rows [A, D] -> x [T, D] in rows' dtype: each token's copies summed."""
    per_copy = self._per_copy(rows, plan, top_k, mask_dropped=False)
    return jnp.sum(per_copy, axis=1).astype(rows.dtype)

  def combine(self, rows, weights, plan: Plan, *, top_k: int, nan_invalid):
    """rows [A, D], weights [T, K] -> y [T, D] in rows' dtype."""
    v = self._values(rows, plan, top_k, nan_invalid)
    y = jnp.einsum(
        "tk,tkd->td",
        weights.astype(jnp.float32),
        v,
        precision=jax.lax.Precision.HIGHEST,
    )
    return y.astype(rows.dtype)

  def spread(self, dy, weights, plan: Plan, *, top_k: int):
    """dy [T, D], weights [T, K] -> d_rows [A, D] in dy's dtype."""
    a = plan.assignment
    live = (plan.live_sorted != 0)[:, None]
    # w[a] moved into sorted order by a sort, not a gather of single
    # weights (`index_ops.permute_values`).
    flat = weights.astype(jnp.float32).reshape(-1)
    w = index_ops.permute_values(flat, plan.position, a)[:, None]
    d_rows = w * dy[a // top_k].astype(jnp.float32)
    return jnp.where(live, d_rows, 0.0).astype(dy.dtype)

  def row_dots(self, dy, rows, plan: Plan, *, top_k: int, nan_invalid):
    """dy [T, D], rows [A, D] -> d_w [T, K] float32."""
    v = self._values(rows, plan, top_k, nan_invalid)
    return jnp.einsum(
        "td,tkd->tk",
        dy.astype(jnp.float32),
        v,
        precision=jax.lax.Precision.HIGHEST,
    )

  def _per_copy(self, rows, plan, top_k, *, mask_dropped):
    """[T, K, D] float32: each copy's row, 0 where invalid (or dropped)."""
    t = plan.position.shape[0] // top_k
    v = rows[plan.position].astype(jnp.float32).reshape(t, top_k, -1)
    skip = plan.invalid != 0
    if mask_dropped:
      skip = skip | (plan.kept == 0)
    return jnp.where(skip.reshape(t, top_k, 1), 0.0, v)

  def _values(self, rows, plan, top_k, nan_invalid):
    """v [T, K, D] float32: kept copies' rows, 0 dropped, NaN/0 invalid."""
    t = plan.position.shape[0] // top_k
    v = self._per_copy(rows, plan, top_k, mask_dropped=True)
    bad = (plan.invalid != 0).reshape(t, top_k, 1)
    return jnp.where(bad, _fill(nan_invalid, jnp.float32), v)


def _fill(nan_invalid: bool, dtype):
  return jnp.asarray(jnp.nan if nan_invalid else 0.0, dtype)


# --- The primitive -----------------------------------------------------------

# op -> the number of data operands (the plan's arrays follow them).
_ARITY = {"gather": 1, "scatter": 1, "combine": 2, "spread": 2, "row_dots": 2}
# op -> the data operand whose value an invalid copy replaces by NaN.
_NAN_OPERAND = {"gather": 0, "combine": 0, "row_dots": 1}


def _call_kernels(*operands, kernels, op, top_k, nan_invalid):
  data, plan = operands[: _ARITY[op]], Plan(*operands[_ARITY[op] :])
  if op in ("scatter", "spread"):
    out = getattr(kernels, op)(*data, plan, top_k=top_k)
  else:
    out = getattr(kernels, op)(
        *data, plan, top_k=top_k, nan_invalid=nan_invalid
    )
  return [out]


def _out_shapes(avals, *, kernels, op, top_k, nan_invalid):
  del kernels, nan_invalid
  num_copies = avals[_ARITY[op]].shape[0]
  tokens = num_copies // top_k
  first = avals[0]
  if op == "gather":
    return [((num_copies, first.shape[1]), first.dtype)]
  if op in ("scatter", "combine"):
    return [((tokens, first.shape[1]), first.dtype)]
  if op == "spread":
    return [((num_copies, first.shape[1]), first.dtype)]
  return [((tokens, top_k), jnp.dtype(jnp.float32))]  # row_dots


permutation_p = primitive.kernel_primitive(
    "dropless_permutation", _call_kernels, _out_shapes
)


def _bind(kernels, op, data, plan, *, top_k, nan_invalid=False):
  operands = primitive.match_variance(tuple(data) + tuple(plan))
  (out,) = permutation_p.bind(
      *operands,
      kernels=kernels,
      op=op,
      top_k=int(top_k),
      nan_invalid=bool(nan_invalid) and op in _NAN_OPERAND,
  )
  return out


# --- The public entry points -------------------------------------------------


def _check(kernels):
  if not isinstance(kernels, PermutationKernels):
    raise TypeError(
        "kernels must be a PermutationKernels, got "
        f"{type(kernels).__name__}."
    )


def gather(kernels, x, plan: Plan, *, top_k: int, nan_invalid: bool = True):
  """x [T, D] -> rows [A, D]: each copy's token row, NaN if invalid."""
  _check(kernels)
  return _bind(
      kernels, "gather", (x,), plan, top_k=top_k, nan_invalid=nan_invalid
  )


def combine(
    kernels, rows, weights, plan: Plan, *, top_k: int, nan_invalid=True
):
  """rows [A, D], weights [T, K] float32 -> y [T, D] in rows' dtype."""
  _check(kernels)
  return _bind(
      kernels,
      "combine",
      (rows, weights.astype(jnp.float32)),
      plan,
      top_k=top_k,
      nan_invalid=nan_invalid,
  )


# --- Differentiation ---------------------------------------------------------


def _is_zero(t):
  return type(t) is ad.Zero


def _jvp(primals, tangents, *, kernels, op, top_k, nan_invalid):
  """Tangents through the ops' transposes (see `_transpose`).

  The NaN of an invalid copy is a constant: the derivative terms that pass
  through its value keep `nan_invalid`, those that replace the value by a
  tangent do not.
  """
  n = _ARITY[op]
  data, plan = primals[:n], primals[n:]
  d_data = tangents[:n]
  (out,) = permutation_p.bind(
      *primals, kernels=kernels, op=op, top_k=top_k, nan_invalid=nan_invalid
  )
  terms = []
  for i in range(n):
    if _is_zero(d_data[i]):
      continue
    args = list(data)
    args[i] = d_data[i]
    # A tangent replacing the NaN-bearing operand carries no NaN.
    nan = nan_invalid and _NAN_OPERAND.get(op) != i
    terms.append(_bind(kernels, op, args, plan, top_k=top_k, nan_invalid=nan))
  if not terms:
    return [out], [ad.Zero(jax.typeof(out).to_tangent_aval())]
  tangent = terms[0]
  for term in terms[1:]:
    tangent = tangent + term
  return [out], [tangent.astype(out.dtype)]


# (op, its linear data operand) -> (the op that is its transpose, whether the
# cotangent comes first among that op's data operands, what the cotangent is
# cast to first: the linear operand's dtype, the other operand's or nothing,
# whether NaN for invalid copies carries over). Gather and scatter are each
# other's transpose; combine, spread and row_dots transpose into one another.
_TRANSPOSE = {
    ("gather", 0): ("scatter", True, "linear", False),
    ("scatter", 0): ("gather", True, "linear", False),
    ("combine", 0): ("spread", True, "linear", False),  # rows
    ("combine", 1): ("row_dots", True, "other", True),  # weights
    ("spread", 0): ("combine", True, "linear", False),  # dy
    ("spread", 1): ("row_dots", False, "other", False),  # weights
    ("row_dots", 0): ("combine", False, None, True),  # dy
    ("row_dots", 1): ("spread", False, None, False),  # rows
}


def _transpose(cotangents, *operands, kernels, op, top_k, nan_invalid):
  """gather <-> scatter; combine's are spread (rows) and row_dots (weights);
  spread's are combine and row_dots; row_dots' are combine and spread."""
  (ct,) = cotangents
  n = _ARITY[op]
  data, plan = operands[:n], operands[n:]
  results = [None] * len(operands)
  if _is_zero(ct):
    return results
  linear = [ad.is_undefined_primal(x) for x in data]
  if sum(linear) != 1:
    raise ValueError(
        f"permutation {op!r} is transposed with respect to one data operand, "
        f"got {sum(linear)} undefined."
    )
  (i,) = [j for j, is_linear in enumerate(linear) if is_linear]
  if nan_invalid and _NAN_OPERAND.get(op) == i:
    raise ValueError(
        f"permutation {op!r} with NaN for invalid copies is not linear in "
        f"operand {i}."
    )
  aval = data[i].aval

  other = data[1 - i] if n == 2 else None
  target, ct_first, cast_to, keeps_nan = _TRANSPOSE[(op, i)]
  if cast_to == "linear":
    ct = ct.astype(aval.dtype)
  elif cast_to == "other":
    ct = ct.astype(other.dtype)
  if other is None:
    transposed_data = (ct,)
  else:
    transposed_data = (ct, other) if ct_first else (other, ct)
  result = _bind(
      kernels,
      target,
      transposed_data,
      plan,
      top_k=top_k,
      nan_invalid=keeps_nan and nan_invalid,
  )
  results[i] = result.astype(aval.dtype)
  return results


ad.primitive_jvps[permutation_p] = _jvp
ad.primitive_transposes[permutation_p] = _transpose
