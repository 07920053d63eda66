"""Rematerialisation policies keyed on the MoE expert GEMMs' checkpoint names.

`moe_core`'s `Backend.expert_ffn` tags its grouped-GEMM outputs with
`jax.ad_checkpoint.checkpoint_name` ("moe_gate", "moe_up", "moe_down"; see
`moe_core.backend.CHECKPOINT_NAMES`). Run a block under `jax.checkpoint`
with one of the `POLICIES` (`policy(name)` says what each keeps), and what
the backward pass keeps is a choice between memory and recomputation.
"""

from __future__ import annotations

import jax

from moe_core import backend as backend_lib

POLICIES = ("none", "full", "save_moe", "recompute_moe", "offload_moe")
# The expert FFN's outputs, and h where a fused op computes it.
MOE_NAMES = tuple(backend_lib.CHECKPOINT_NAMES) + (backend_lib.HIDDEN_NAME,)


def check_policy_name(name: str) -> None:
  if name not in POLICIES:
    raise ValueError(f"remat must be one of {POLICIES}, got {name!r}.")


def policy(name: str):
  """The `jax.checkpoint` policy for `name` (None for "none").

  The policies:

    none           no remat: every intermediate is saved (fastest, most
                   memory).
    full           save nothing inside a block; recompute it in the backward.
    save_moe       recompute the block but keep the expert GEMM outputs.
    recompute_moe  keep every other matmul output (dots_saveable), recompute
                   the expert GEMMs and the elementwise work.
    offload_moe    like save_moe, but the expert GEMM outputs are moved to
                   pinned host memory in the forward and back in the
                   backward.

  On the CPU, "device" and "pinned_host" memory are the same RAM: offload_moe
  runs (jax 0.10.2 lowers the transfers) and gives the same numbers, but
  saves no memory; it pays off on GPU/TPU. Backends that override
  `_routed_experts` without calling `expert_ffn` (the reference oracle) carry
  no names, so for them save_moe behaves like full.
  """
  check_policy_name(name)
  policies = jax.checkpoint_policies
  if name == "none":
    return None
  if name == "full":
    return policies.nothing_saveable
  if name == "save_moe":
    return policies.save_only_these_names(*MOE_NAMES)
  if name == "recompute_moe":
    # Not save_anything_except_these_names: it refuses the named value but
    # still saves the same array as its producer's output, so nothing is
    # recomputed. Saving only dot_general outputs (and other names) leaves
    # the expert GEMMs (custom_vjp loops, ragged_dot, pallas_call) out.
    return policies.save_from_both_policies(
        policies.dots_saveable, policies.save_any_names_but_these(*MOE_NAMES)
    )
  return policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=MOE_NAMES,
      offload_src="device",
      offload_dst="pinned_host",
  )
