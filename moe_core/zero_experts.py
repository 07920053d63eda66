"""Zero experts: router choices that run no FFN (LongCat-Flash, Zaya)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_core import config as config_lib
from moe_core import routing_aux


def split_zero_experts(
    aux: routing_aux.MoEAux, cfg: config_lib.MoEConfig
) -> tuple[routing_aux.MoEAux, jax.Array]:
  """(the choice of the E routed experts, [T, K] zero-expert weights).

  With `cfg.num_zero_experts`, ids E..E+Z-1 are experts that run no FFN.
  The first result is `aux` with those copies not kept (their ids folded
  into [0, E), their weights 0), for `Backend.routed_experts`; the second
  holds their combine weights (0 for the other copies, NaN where the token
  is invalid), with which `zero_expert_output` adds the experts' input
  ("identity") or nothing ("zero").
  """
  zero = aux.expert_ids >= cfg.num_experts
  routed = dataclasses.replace(
      aux,
      expert_ids=jnp.where(
          zero, aux.expert_ids % cfg.num_experts, aux.expert_ids
      ),
      combine_weights=jnp.where(zero, 0.0, aux.combine_weights),
      kept=aux.kept & ~zero,
  )
  return routed, jnp.where(zero, aux.combine_weights, 0.0)


def rejoin_zero_experts(
    aux: routing_aux.MoEAux,
    routed: routing_aux.MoEAux,
    cfg: config_lib.MoEConfig,
) -> routing_aux.MoEAux:
  """`routed` (`split_zero_experts`' first result, as the expert stage
  returned it) with `aux`'s zero-expert copies put back: their ids, weights
  and kept."""
  zero = aux.expert_ids >= cfg.num_experts
  return dataclasses.replace(
      routed,
      expert_ids=aux.expert_ids,
      combine_weights=jnp.where(
          zero, aux.combine_weights, routed.combine_weights
      ),
      kept=jnp.where(zero, aux.kept, routed.kept),
  )


def zero_expert_output(
    zero_weights: jax.Array, expert_tokens: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array | None:
  """[T, D] what the zero experts add (in the tokens' dtype), or None.

  "identity": sum_k zero_weights[:, k] * tokens (float32 sum); "zero":
  nothing, except that a NaN weight (an invalid token) still makes its
  row NaN.
  """
  if not cfg.num_zero_experts:
    return None
  total = jnp.sum(zero_weights, axis=-1, keepdims=True)
  if cfg.zero_expert_output == "identity":
    out = total * expert_tokens.astype(jnp.float32)
  else:
    out = jnp.broadcast_to(total * 0.0, expert_tokens.shape)
  return out.astype(expert_tokens.dtype)
