"""Combine through TE's pure-JAX permutation helper.

`transformer_engine.jax.permutation.pure_jax_token_combine` undoes the sort
of the library's dispatch plan (`moe_core.permute.plan`) and sums each
token's K weighted outputs; the plan and the gather stay the library's
(docs/te.md, "The combine", says why not TE's dispatch or Triton kernels).
TE's helper is the combine kernel of moe_core's permutation ops
(`TEPermutationKernels`), which differentiate it, so forward and reverse
mode, vmap, shard_map and export all work.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp

from backends.te import _te
from moe_core import permute
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


def combine(
    expert_out: jax.Array,
    dispatched: permute.Dispatched,
    combine_weights: jax.Array,
    kept: jax.Array | None,
) -> jax.Array:
  """`moe_core.permute.combine` through `pure_jax_token_combine`, on the
  arguments `Backend.combine` (or `routed_experts`) validated.

  y[t] = sum_k combine_weights[t, k] * expert_out[position[t*K + k]] in
  float32, returned in expert_out's dtype (`TEPermutationKernels.combine`).
  Dropped copies (kept False) add exactly zero even if their rows hold NaN;
  an invalid copy makes its token NaN, as does a NaN weight.

  Args:
    expert_out: [T*K, D] rows in dispatch order.
    dispatched: the `Dispatched` (or its `DispatchPlan`).
    combine_weights: [T, K] weights.
    kept: [T, K] bool, or None (dropless).

  Returns:
    [T, D] in expert_out's dtype.
  """
  return permutation_lib.combine(
      TEPermutationKernels(),
      expert_out,
      combine_weights,
      permutation_lib.Plan.of(dispatched, kept),
      top_k=dispatched.top_k,
  )
