"""Per-layer families: their `MoEConfig` depends on the decoder layer.

HunYuan's per-layer expert counts, Step-3.7's per-layer clamps and
DeepSeek-V4's hash and scored layers. Each function takes the config and
`layer_idx` (None, or already checked to be in [0, num_hidden_layers)).
"""

from __future__ import annotations

from hf_convert import families as families_lib
from hf_convert import fields
from hf_convert import router_fields

# DeepSeek-V4's scoring_func (an ACT2FN name) -> dropless score function.
_DEEPSEEK_V4_SCORES = {"sqrtsoftplus": "sqrtsoftplus", "sigmoid": "sigmoid"}
# Its mlp_layer_types: hash-routed and scored MoE layers (transformers'
# DEEPSEEK_V4_MLP_LAYER_TYPES).
_DEEPSEEK_V4_LAYER_TYPES = ("hash_moe", "moe")


def hunyuan(c, layer_idx) -> dict:
  """num_experts and moe_topk: an int, or a list with one per layer."""
  counts = {}
  for name in ("num_experts", "moe_topk"):
    value = getattr(c, name)
    if not isinstance(value, int):
      if layer_idx is None:
        raise ValueError(
            f"layer_idx must be given: hunyuan_v1_moe's {name} is per layer "
            f"({value}); got layer_idx=None."
        )
      value = fields.of_layer(value, name, layer_idx)
    counts[name] = value
  return dict(
      num_experts=counts["num_experts"],
      top_k=counts["moe_topk"],
      expert_ffn_size=c.intermediate_size,
      norm_topk_prob=True,
      shared_ffn_size=c.intermediate_size,
  )


def step3p7(c, layer_idx) -> dict:
  """Unclamped layers; a clamp after the activation is refused."""
  for name in ("swiglu_limits", "swiglu_limits_shared"):
    limit = fields.layer_value(c, name, layer_idx)
    if limit:
      raise fields.needs_switch(
          "step3p7",
          families_lib.CLAMP_AFTER_ACTIVATION,
          f"{name}[{layer_idx}]={limit}",
      )
  return router_fields.sigmoid_bias(
      c.num_local_experts,
      c.moe_intermediate_size,
      routed_scaling_factor=fields.number(c, "moe_router_scaling_factor"),
      shared_ffn_size=c.share_expert_dim,
  )


def deepseek_v4(c, layer_idx) -> dict:
  """A hash layer or a scored one, as mlp_layer_types says."""
  if c.scoring_func not in _DEEPSEEK_V4_SCORES:
    raise NotImplementedError(
        "deepseek_v4's scoring_func must be one of "
        f"{sorted(_DEEPSEEK_V4_SCORES)}, got {c.scoring_func!r}."
    )
  types = c.mlp_layer_types
  if layer_idx is None and len(set(types)) > 1:
    raise ValueError(
        "layer_idx must be given: deepseek_v4's mlp_layer_types differ "
        f"across layers ({types}); got layer_idx=None."
    )
  index = 0 if layer_idx is None else layer_idx
  kind = fields.of_layer(types, "mlp_layer_types", index)
  if kind not in _DEEPSEEK_V4_LAYER_TYPES:
    # Not guessed: any other kind would have been read as a scored layer.
    raise ValueError(
        f"hf_config.mlp_layer_types[{index}] must be one of "
        f"{_DEEPSEEK_V4_LAYER_TYPES} (deepseek_v4's MoE layers), got "
        f"{kind!r}."
    )
  hashed = kind == "hash_moe"
  # Hash layers take their experts from tid2eid [vocab_size, K] and have no
  # correction bias; both kinds normalise (+1e-20) and scale. The routed
  # and the shared experts (one, of intermediate_size) clamp alike;
  # mlp_bias gives the shared expert's linears biases (not the routed ones).
  return router_fields.sigmoid_bias(
      c.num_local_experts,
      c.intermediate_size,
      score_func=_DEEPSEEK_V4_SCORES[c.scoring_func],
      correction_bias=not hashed,
      hash_vocab_size=c.vocab_size if hashed else 0,
      norm_epsilon=router_fields.DEEPSEEK_V3_NORM_EPSILON,
      routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
      shared_ffn_size=c.intermediate_size,
      shared_expert_bias=bool(c.mlp_bias),
      swiglu_limit=fields.number(c, "swiglu_limit"),
  )
