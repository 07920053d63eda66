"""Runs a Flax NNX block under one of `moe_core.remat`'s policies.

The policies (what the backward pass keeps of the expert GEMMs) are pure
JAX and live in `moe_core/remat.py`; this module applies one to an
`nnx.Module`, which `jax.checkpoint` cannot take as it is.
"""

from __future__ import annotations

import jax
from flax import nnx

from moe_core import remat as moe_remat


def call_block(
    block: nnx.Module, x: jax.Array, positions: jax.Array, name: str
):
  """block(x, positions) under the remat policy `name`.

  The block is split into its graph and state so `jax.checkpoint` sees a
  pure function of arrays; the forward only reads the block's state.

  Args:
    block: an nnx.Module called as `block(x, positions)`.
    x: the block's input, e.g. [B, T, D].
    positions: token positions [T].
    name: one of `moe_core.remat.POLICIES`; "none" calls the block as is.

  Returns:
    Whatever the block returns.
  """
  if name == "none":
    return block(x, positions)
  graphdef, state = nnx.split(block)

  def run(state, x):
    return nnx.merge(graphdef, state)(x, positions)

  return jax.checkpoint(run, policy=moe_remat.policy(name))(state, x)
