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
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from backends.te import _te
from moe_core import checks
from moe_core import permute
from moe_core import validation


def _permutation():
  _te.import_te()
  return importlib.import_module("transformer_engine.jax.permutation")


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
  rows, state, group_sizes = _permutation().pure_jax_token_dispatch(
      x, keys.reshape(t, k), num_experts + 2, k
  )
  assignment = state.sorted_indices.astype(jnp.int32)
  position = permute.inverse_permutation(assignment)
  return permute.Dispatched(
      rows=checks.nan_rows(invalid[assignment], rows),
      group_sizes=group_sizes[:num_experts].astype(jnp.int32),
      assignment=assignment,
      position=position,
      invalid=invalid,
      top_k=k,
  )


def combine(
    expert_out: jax.Array,
    dispatched: permute.Dispatched,
    combine_weights: jax.Array,
    kept: jax.Array | None = None,
) -> jax.Array:
  """`moe_core.permute.combine` through `pure_jax_token_combine`.

  y[t] = sum_k combine_weights[t, k] * expert_out[position[t*K + k]] in
  float32 (TE sums in the rows' dtype: they are cast up first, and the sum
  is a full-precision float32 dot, never TF32), returned in expert_out's
  dtype. Rows of dropped copies (kept False) are zeroed first, so they add
  exactly zero even if they hold NaN; an invalid copy's row is made NaN, so
  its token is NaN, as is a token with a NaN weight.

  Args:
    expert_out: [T*K, D] rows in dispatch order.
    dispatched: `dispatch`'s result.
    combine_weights: [T, K] weights.
    kept: optional [T, K] bool.

  Returns:
    [T, D] in expert_out's dtype.
  """
  validation.check_combine(expert_out, dispatched, combine_weights, kept)
  t, k = combine_weights.shape
  sorted_rows = dispatched.assignment
  per_row = expert_out.astype(jnp.float32)
  if kept is not None:
    per_row = jnp.where(kept.reshape(-1)[sorted_rows][:, None], per_row, 0.0)
  per_row = checks.nan_rows(dispatched.invalid[sorted_rows], per_row)
  permutation = _permutation()
  state = permutation.PureJaxPermState(
      sorted_indices=sorted_rows, num_real_tokens=t * k, padding_size=0
  )
  with jax.default_matmul_precision("highest"):
    y = permutation.pure_jax_token_combine(
        per_row, state, combine_weights.astype(jnp.float32), k, t, 1
    )
  return y.reshape(t, -1).astype(expert_out.dtype)
