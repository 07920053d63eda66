"""Runs a Flax NNX transformer block under one of `moe_core.remat`'s policies.

The policies themselves (what the backward pass keeps of the expert GEMMs)
live in `moe_core/remat.py`; this module keeps its old names as aliases.
"""

from __future__ import annotations

import jax
from flax import nnx

from moe_core import remat as moe_remat

POLICIES = moe_remat.POLICIES
MOE_NAMES = moe_remat.MOE_NAMES
check_policy_name = moe_remat.check_policy_name
policy = moe_remat.policy


def call_block(
    block: nnx.Module, x: jax.Array, positions: jax.Array, name: str
):
  """block(x, positions) under the remat policy `name`.

  The block is split into its graph and state so `jax.checkpoint` sees a
  pure function of arrays; the forward only reads the block's state.
  """
  if name == "none":
    return block(x, positions)
  graphdef, state = nnx.split(block)

  def run(state, x):
    return nnx.merge(graphdef, state)(x, positions)

  return jax.checkpoint(run, policy=policy(name))(state, x)
