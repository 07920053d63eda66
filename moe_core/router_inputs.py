"""The router's optional inputs: one record for route's and its checks'."""

from __future__ import annotations

import dataclasses

import jax

# The router's optional parameters besides `router` and `correction_bias`,
# each present iff the config field of the same role says so: name -> that
# field (`MoEConfig`).
ROUTER_EXTRAS = {
    "router_bias": "router_bias",
    "router_norm_scale": "router_input_norm",
    "expert_output_scale": "expert_output_scale",
    "hash_table": "hash_vocab_size",
}


def router_extras(params: dict) -> dict:
  """The `ROUTER_EXTRAS` that a block's params hold, as route's keywords."""
  return {name: params[name] for name in ROUTER_EXTRAS if name in params}


@dataclasses.dataclass(frozen=True)
class RouterInputs:
  """The keywords `routing.route` and `routing.router_scores` take after
  x, router, cfg and correction_bias; each required iff its config field
  says so (`validation.check_route`).

  Both functions (and `Backend.route`) take these as keywords, `**extras`,
  and read them through `RouterInputs(**extras)`, so that an unknown
  keyword raises TypeError there as it did when each listed them.

  Attributes:
    router_bias: [E], added to the logits; required iff `cfg.router_bias`.
    router_norm_scale: [D], the router input norm's learned scale;
      required iff `cfg.router_input_norm`.
    expert_output_scale: [E], multiplies each chosen expert's combine
      weight; required iff `cfg.expert_output_scale`.
    hash_table: [V, K] int32 expert ids per token id; required iff
      `cfg.hash_vocab_size` (the choice's, not used for the scores).
    token_ids: [T] int token ids; required iff `cfg.hash_vocab_size`.
  """

  router_bias: jax.Array | None = None
  router_norm_scale: jax.Array | None = None
  expert_output_scale: jax.Array | None = None
  hash_table: jax.Array | None = None
  token_ids: jax.Array | None = None
