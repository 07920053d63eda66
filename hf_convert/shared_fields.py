"""Shared experts: the families set apart by how theirs joins the block.

A gate (Qwen), a mean instead of a sum (Cohere 2), or router-weighted
always-on experts (Inkling). Each function returns `MoEConfig` fields;
`shared_ffn_size` of the plain ones is set in `converters.py`.
"""

from __future__ import annotations

from hf_convert import fields
from hf_convert import router_fields

# Cohere 2 MoE's shared_expert_combination_strategy -> shared_combine.
_COHERE_COMBINES = {"sum": "sum", "average": "mean"}


def qwen(c) -> dict:
  """A shared expert scaled by sigmoid(shared_expert_gate), if any."""
  shared = c.shared_expert_intermediate_size or 0
  return dict(shared_ffn_size=shared, shared_expert_gate=bool(shared))


def cohere2_moe(c) -> dict:
  """Shared experts summed with or averaged with the routed output."""
  shared = c.intermediate_size * (c.num_shared_experts or 0)
  combine = c.shared_expert_combination_strategy
  if combine not in _COHERE_COMBINES:
    raise ValueError(
        "shared_expert_combination_strategy must be one of "
        f"{tuple(_COHERE_COMBINES)}, got {combine!r}."
    )
  # Without a shared expert the block adds nothing, so there is no mean.
  extra = dict(shared_combine=_COHERE_COMBINES[combine]) if shared else {}
  if c.expert_selection_fn == "softmax":
    # A softmax over the K best logits is the renormalised top-k softmax.
    routing = dict(norm_topk_prob=True)
  elif c.expert_selection_fn == "sigmoid":
    routing = dict(score_func="sigmoid", norm_topk_prob=bool(c.norm_topk_prob))
  else:
    raise NotImplementedError(
        "expert_selection_fn must be 'softmax' or 'sigmoid', got "
        f"{c.expert_selection_fn!r}."
    )
  return dict(
      num_experts=c.num_experts,
      expert_ffn_size=c.intermediate_size,
      shared_ffn_size=shared,
      **routing,
      **extra,
  )


def inkling(c) -> dict:
  """Its S shared experts are scored by the router beside the E routed ones
  (router [E + S, D]) and weighted with the K chosen: sigmoid weights
  normalised over all K + S, x route_scale, x the router's learned
  global_scale (expert_output_scale, the same for every expert)."""
  shared = c.n_shared_experts or 0
  if not shared:
    raise NotImplementedError(
        "inkling with n_shared_experts=0: its router slices off the last "
        "n_shared_experts logits as the shared ones, and needs >= 1."
    )
  experts = c.n_routed_experts + shared
  top_k = c.num_experts_per_tok + shared
  return router_fields.sigmoid_bias(
      experts,
      c.moe_intermediate_size,
      top_k=top_k,
      num_always_on_experts=shared,
      routed_scaling_factor=fields.number(c, "route_scale"),
      expert_output_scale=True,
  )
