"""Router kinds: the `MoEConfig` routing fields of a transformers config.

Each function returns a dict of `MoEConfig` fields (`num_experts` and
`expert_ffn_size` included, as every router kind names them its own way);
`converters.py` maps each family to one. The families here differ from
their router kind by a router switch alone (a soft-cap, zero experts, input
norms, ...).
"""

from __future__ import annotations

from hf_convert import families as families_lib
from hf_convert import fields

# DeepSeek-V3 and its descendants add this to the top-k sum before dividing.
DEEPSEEK_V3_NORM_EPSILON = 1e-20


def softmax(experts, ffn, norm, **extra) -> dict:
  """softmax -> top-k, renormalised iff `norm`."""
  return (
      dict(num_experts=experts, expert_ffn_size=ffn, norm_topk_prob=bool(norm))
      | extra
  )


def sigmoid_bias(experts, ffn, **extra) -> dict:
  """sigmoid -> top-k of the scores plus a correction bias (the choice
  only), the unbiased scores renormalised; `extra` adds to or overrides
  these fields."""
  return (
      dict(
          num_experts=experts,
          expert_ffn_size=ffn,
          score_func="sigmoid",
          correction_bias=True,
          norm_topk_prob=True,
      )
      | extra
  )


def deepseek_v3(c, *, shared_width=None, **extra) -> dict:
  """The DeepSeek-V3 router (sigmoid, bias, groups, norm, scale); `extra`
  adds to or overrides its fields (A.X-K2 drops the groups)."""
  ffn = c.moe_intermediate_size
  if shared_width is None:
    shared_width = ffn * fields.get(
        c, "n_shared_experts", "num_shared_experts", default=0
    )
  return (
      sigmoid_bias(
          fields.get(c, "n_routed_experts", "num_local_experts", "num_experts"),
          ffn,
          norm_topk_prob=bool(c.norm_topk_prob),
          norm_epsilon=DEEPSEEK_V3_NORM_EPSILON,
          routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
          n_group=fields.get(c, "n_group", default=1),
          topk_group=fields.get(c, "topk_group", default=1),
          group_score="sum_top2",
          shared_ffn_size=shared_width,
      )
      | extra
  )


def deepseek_v2(c) -> dict:
  """transformers' DeepSeek-V2 router: never normalises, always scales."""
  if getattr(c, "mlp_bias", False):
    raise NotImplementedError(
        "mlp_bias must be False (dropless experts have no biases), got "
        "mlp_bias=True."
    )
  out = dict(
      num_experts=fields.get(c, "n_routed_experts", "num_experts"),
      expert_ffn_size=c.moe_intermediate_size,
      routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
      shared_ffn_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
  )
  if c.topk_method == "group_limited_greedy":
    # Softmax scores are > 0, so the 0.0 fill of excluded groups acts as
    # dropless' -inf.
    out.update(n_group=c.n_group, topk_group=c.topk_group, group_score="max")
  elif c.topk_method != "greedy":
    raise NotImplementedError(
        "topk_method must be 'greedy' or 'group_limited_greedy' (what "
        f"transformers' DeepSeek-V2 router runs), got {c.topk_method!r}."
    )
  return out


def mistral4(c, norm) -> dict:
  """Softmax scores, groups scored by their two best, excluded groups
  filled with 0.0 (as good as -inf: softmax scores are > 0)."""
  return dict(
      num_experts=fields.get(c, "n_routed_experts", "num_local_experts"),
      expert_ffn_size=c.moe_intermediate_size,
      norm_topk_prob=bool(norm),
      norm_epsilon=DEEPSEEK_V3_NORM_EPSILON,
      routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
      n_group=fields.get(c, "n_group", default=1),
      topk_group=fields.get(c, "topk_group", default=1),
      group_score="sum_top2",
      shared_ffn_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
  )


def axk2(c) -> dict:
  """DeepSeek-V3's router without groups: A.X-K2 fills excluded groups
  with 0.0, which under sigmoid + bias is not -inf."""
  if (c.n_group or 1) > 1:
    raise fields.needs_switch(
        "axk2", families_lib.ZERO_FILLED_GROUPS, f"n_group={c.n_group}"
    )
  return deepseek_v3(c, n_group=1, topk_group=1)


def laguna(c) -> dict:
  """Sigmoid + bias after an optional logit soft-cap (0: none)."""
  cap = getattr(c, "moe_router_logit_softcapping", 0.0) or 0.0
  if getattr(c, "moe_apply_router_weight_on_input", False):
    raise fields.needs_switch(
        "laguna",
        families_lib.INPUT_SIDE_WEIGHTS,
        "moe_apply_router_weight_on_input=True",
    )
  return sigmoid_bias(
      c.num_experts,
      c.moe_intermediate_size,
      routed_scaling_factor=fields.number(c, "moe_routed_scaling_factor"),
      shared_ffn_size=c.shared_expert_intermediate_size or 0,
      router_logit_softcap=float(cap),
  )


def lfm2_moe(c) -> dict:
  """Sigmoid, a correction bias if use_expert_bias, norm (+1e-6) if
  norm_topk_prob."""
  return dict(
      num_experts=c.num_experts,
      expert_ffn_size=c.moe_intermediate_size,
      score_func="sigmoid",
      correction_bias=bool(c.use_expert_bias),
      norm_topk_prob=bool(c.norm_topk_prob),
      norm_epsilon=1e-6 if c.norm_topk_prob else 0.0,
      routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
      activation="silu",
  )


def longcat_flash(c) -> dict:
  """Zero experts return their (weighted) input. With router_bias=True the
  classifier has a bias, but the router's forward never adds it (it
  multiplies by classifier.weight alone), so there is none to convert."""
  return dict(
      num_experts=c.n_routed_experts,
      top_k=c.moe_topk,
      expert_ffn_size=c.expert_ffn_hidden_size,
      correction_bias=True,
      routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
      num_zero_experts=c.zero_expert_num or 0,
      zero_expert_output="identity",
  )


def llama4(c) -> dict:
  """Top-k of the logits, then the sigmoid of each chosen logit (the same
  choice as top-k of sigmoid scores), never renormalised; the weight
  scales the expert's input."""
  return dict(
      num_experts=c.num_local_experts,
      expert_ffn_size=c.intermediate_size,
      score_func="sigmoid",
      routing_weights_on_input=True,
      shared_ffn_size=c.intermediate_size,
  )


def phimoe(c) -> dict:
  """Phi's sparsemixer always takes two experts (its top_k argument is
  unused); inference routing (eval mode), whose jitter threshold is
  router_jitter_noise."""
  return dict(
      num_experts=c.num_local_experts,
      top_k=2,
      expert_ffn_size=c.intermediate_size,
      score_func="sparsemixer",
      sparsemixer_epsilon=fields.number(c, "router_jitter_noise"),
  )


def kolibri1(c) -> dict:
  """The bias moves the logits for the choice; the weights are the sigmoid
  of the unbiased chosen logits, normalised with no epsilon."""
  return sigmoid_bias(
      c.num_experts,
      c.moe_intermediate_size,
      correction_bias_on="logits",
      norm_topk_prob=bool(c.norm_topk_prob),
      shared_ffn_size=c.shared_expert_intermediate_size or 0,
  )


def gemma4(c) -> dict:
  """The decoder layer's MoE half: the router sees the layer's residual
  through its own RMS norm, scale [D] and D**-0.5; the experts see it
  through pre_feedforward_layernorm_2; per_expert_scale multiplies the
  normalised weights. Both norms use rms_norm_eps."""
  return dict(
      num_experts=c.num_experts,
      top_k=c.top_k_experts,
      expert_ffn_size=c.moe_intermediate_size,
      norm_topk_prob=True,
      router_input_norm=True,
      router_input_scale=float(c.hidden_size**-0.5),
      expert_input_norm=True,
      input_norm_epsilon=fields.number(c, "rms_norm_eps"),
      expert_output_scale=True,
      activation=fields.activation(c.hidden_activation, "hidden_activation"),
  )
