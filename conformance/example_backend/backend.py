"""ExampleBackend: the smallest backend that passes the conformance suite.

A template: copy this folder, rename the class and `name`, and replace the
body of `_grouped_gemm` by your kernel. Everything else (dispatch, the
expert FFN, combine, the routed block) comes from `moe_core.Backend` and is
built on `_grouped_gemm`; override its hooks only to fuse more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import moe_core


class ExampleBackend(moe_core.Backend):
  """One `jnp.dot` per group, written for reading, not for speed."""

  # The registry name, as in moe_core/registry.py's table.
  name = "example"
  # The operand dtypes it computes in; others raise NotImplementedError
  # before `_grouped_gemm` runs, so "auto" tries the next backend.
  dtypes = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

  def availability(self) -> tuple[bool, str]:
    # A backend for one platform says why not elsewhere, e.g.
    # (False, "example: needs a GPU, found cpu").
    return True, ""

  def _grouped_gemm(self, gemm: moe_core.GemmOperands) -> jax.Array:
    """rows [M, C] x weights [E, C, N] ([E, N, C] if transpose_rhs) -> [M, N].

    The operands are validated already: rows and weights are jax arrays of
    one dtype among `dtypes`, group_sizes is [E] int32 with
    sum(group_sizes) <= M, out_dtype a jnp.dtype. Returns [M, N] of
    out_dtype, zeros in the rows at or past sum(group_sizes).
    """
    rows, weights, group_sizes = gemm.rows, gemm.weights, gemm.group_sizes
    transpose_rhs = gemm.transpose_rhs
    num_rows = rows.shape[0]
    num_groups = weights.shape[0]
    # Group g owns rows [ends[g] - group_sizes[g], ends[g]). searchsorted
    # gives each row its group; the rows at or past sum(group_sizes) get
    # num_groups, which is no group.
    ends = jnp.cumsum(group_sizes)
    group_of_row = jnp.searchsorted(ends, jnp.arange(num_rows), side="right")
    # Unused rows may hold anything, NaN included: zero them before any
    # product, or NaN * 0 would reach the weight gradient.
    used = (group_of_row < num_groups)[:, None]
    rows = jnp.where(used, rows, jnp.zeros((), rows.dtype))

    out_width = weights.shape[1] if transpose_rhs else weights.shape[2]
    out = jnp.zeros((num_rows, out_width), jnp.float32)
    for group in range(num_groups):
      group_weights = weights[group].T if transpose_rhs else weights[group]
      # Every row times this group's weights, accumulated in float32; only
      # the group's own rows keep the result (and pass gradient back).
      product = jnp.dot(rows, group_weights, preferred_element_type=jnp.float32)
      out = jnp.where((group_of_row == group)[:, None], product, out)
    return out.astype(gemm.out_dtype)
