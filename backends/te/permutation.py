"""Dispatch and combine through TE's pure-JAX permutation helpers.

`transformer_engine.jax.permutation.pure_jax_token_dispatch` sorts the
token copies by expert with a stable argsort and gathers them;
`pure_jax_token_combine` undoes the sort and sums each token's K weighted
outputs. TE's Triton kernels (`token_dispatch`, `token_combine`) are not
used: they need `triton`, so they can neither run nor be lowered where it is
missing (the CPU CI); they leave the rows they do not write uninitialised;
and `token_combine` needs TE's row_id_map, which `moe_core.Dispatched` does
not carry.

Both helpers take plain expert ids, so the contract's other cases ride on
the ids: a copy dropped by capacity gets the pseudo-expert E and an invalid
one (id outside [0, E)) E + 1, exactly the keys `moe_core.permute.dispatch`
sorts by. The result is then `permute.dispatch`'s, field for field.

Both helpers are wrapped in a custom VJP of TE's (`_sort_activations`),
which forward mode cannot go through, so neither is ever differentiated:
the combine is the kernel of moe_core's permutation ops
(`TEPermutationKernels`), which differentiate it, and the dispatch a custom
JVP whose tangent is moe_core's gather. Forward and reverse mode, vmap,
shard_map and export then all work.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp

from backends.te import _te
from moe_core import checks
from moe_core import permute
from moe_core import validation
from moe_core.kernels import permutation as permutation_lib


def _permutation():
  _te.import_te()
  return importlib.import_module("transformer_engine.jax.permutation")


@dataclasses.dataclass(frozen=True)
class TEPermutationKernels(permutation_lib.PermutationKernels):
  """`pure_jax_token_combine` as the combine of moe_core's permutation ops.

  `moe_core.kernels.permutation` differentiates it (its transposes, spread
  and row_dots, and the other ops are the library's plain JAX gathers), so
  TE's custom VJP around the helper, which forward mode cannot go through,
  is never differentiated.
  """

  def combine(self, rows, weights, plan, *, top_k, nan_invalid):
    """rows [A, D], weights [T, K] -> y [T, D] in rows' dtype.

    TE sums in the rows' dtype: they are cast up first, and the sum is a
    full-precision float32 dot, never TF32. Rows of dropped copies are
    zeroed first, so they add exactly zero even if they hold NaN; an
    invalid copy's row is NaN (`nan_invalid`) or zero.
    """
    num_copies = plan.assignment.shape[0]
    tokens = num_copies // top_k
    sorted_rows = plan.assignment
    invalid = (plan.invalid != 0)[sorted_rows][:, None]
    skip = (plan.kept == 0)[sorted_rows][:, None] | invalid
    per_row = jnp.where(skip, 0.0, rows.astype(jnp.float32))
    fill = jnp.nan if nan_invalid else 0.0
    per_row = jnp.where(invalid, jnp.float32(fill), per_row)
    te_permutation = _permutation()
    state = te_permutation.PureJaxPermState(
        sorted_indices=sorted_rows, num_real_tokens=num_copies, padding_size=0
    )
    with jax.default_matmul_precision("highest"):
      y = te_permutation.pure_jax_token_combine(
          per_row, state, weights.astype(jnp.float32), top_k, tokens, 1
      )
    return y.reshape(tokens, -1).astype(rows.dtype)


def dispatch(
    x: jax.Array,
    expert_ids: jax.Array,
    num_experts: int,
    kept: jax.Array | None = None,
) -> permute.Dispatched:
  """`moe_core.permute.dispatch` through `pure_jax_token_dispatch`.

  Args:
    x: [T, D] activations.
    expert_ids: [T, K] int32 chosen experts.
    num_experts: E.
    kept: optional [T, K] bool; False copies are sorted past every group.

  Returns:
    `Dispatched`: rows [T*K, D] (invalid copies last, as NaN rows),
    group_sizes [E], assignment, position, invalid.
  """
  validation.check_dispatch(x, expert_ids, num_experts, kept)
  t, k = expert_ids.shape
  # The keys of permute.dispatch, as TE's expert ids over E + 2 experts.
  keys, invalid = permute.sort_keys(expert_ids, num_experts, kept)
  rows, assignment, group_sizes = _dispatch(
      x, keys.reshape(t, k), num_experts + 2
  )
  return permute.Dispatched(
      rows=checks.nan_rows(invalid[assignment], rows),
      group_sizes=group_sizes[:num_experts],
      assignment=assignment,
      position=permute.inverse_permutation(assignment),
      invalid=invalid,
      top_k=k,
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _dispatch(x, keys, num_keys):
  """TE's dispatch of x [T, D] by keys [T, K] into num_keys groups.

  Returns (rows [T*K, D], assignment [T*K] int32, group_sizes [num_keys]
  int32). A custom JVP: the primal is TE's helper, whose custom VJP is
  never differentiated; the tangent is moe_core's gather of the tangent
  rows (`moe_core.kernels.permutation`), which reverse mode transposes
  into its scatter.
  """
  rows, state, group_sizes = _permutation().pure_jax_token_dispatch(
      x, keys, num_keys, keys.shape[1]
  )
  return (
      rows,
      state.sorted_indices.astype(jnp.int32),
      group_sizes.astype(jnp.int32),
  )


@_dispatch.defjvp
def _dispatch_jvp(num_keys, primals, tangents):
  x, keys = primals
  d_x, _ = tangents
  # The primal from _dispatch itself: a derivative of this rule goes
  # through the rule again, never through TE's custom VJP.
  rows, assignment, group_sizes = out = _dispatch(x, keys, num_keys)
  num_copies = assignment.shape[0]
  plan = permutation_lib.Plan(
      assignment=assignment,
      position=permute.inverse_permutation(assignment),
      kept=jnp.ones((num_copies,), jnp.int8),
      # Invalid copies' rows are made NaN by the caller (a constant, with
      # zero tangent); the gather moves every copy's tangent.
      invalid=jnp.zeros((num_copies,), jnp.int8),
  )
  d_rows = permutation_lib.gather(
      TEPermutationKernels(), d_x, plan, top_k=keys.shape[1], nan_invalid=False
  )
  # float0 zeros typed like the primals (mesh variance included).
  integer_tangents = jax.custom_derivatives.zero_from_primal(
      (assignment, group_sizes)
  )
  return out, (d_rows.astype(rows.dtype), *integer_tangents)


def combine(
    expert_out: jax.Array,
    dispatched: permute.Dispatched,
    combine_weights: jax.Array,
    kept: jax.Array | None = None,
) -> jax.Array:
  """`moe_core.permute.combine` through `pure_jax_token_combine`.

  y[t] = sum_k combine_weights[t, k] * expert_out[position[t*K + k]] in
  float32, returned in expert_out's dtype (`TEPermutationKernels.combine`).
  Dropped copies (kept False) add exactly zero even if their rows hold NaN;
  an invalid copy makes its token NaN, as does a NaN weight.

  Args:
    expert_out: [T*K, D] rows in dispatch order.
    dispatched: `dispatch`'s result.
    combine_weights: [T, K] weights.
    kept: optional [T, K] bool.

  Returns:
    [T, D] in expert_out's dtype.
  """
  validation.check_combine(expert_out, dispatched, combine_weights, kept)
  num_copies = dispatched.assignment.shape[0]
  plan = permutation_lib.Plan(
      assignment=dispatched.assignment,
      position=dispatched.position,
      kept=(
          jnp.ones((num_copies,), jnp.int8)
          if kept is None
          else kept.reshape(-1).astype(jnp.int8)
      ),
      invalid=dispatched.invalid.astype(jnp.int8),
  )
  return permutation_lib.combine(
      TEPermutationKernels(),
      expert_out,
      combine_weights,
      plan,
      top_k=dispatched.top_k,
  )
