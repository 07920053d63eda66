"""One transformers MoE family as a row of data, and the words rows share.

`Family` is a row of `families.FAMILIES`; the switch names are what its
`lacks` spells (issue 33's table); `FUSED` the experts of most rows.
Notation: E experts, K chosen, F expert width, D model width; "softmax ->
top-k" is a softmax over all E logits then top-k; "top-k -> softmax" is a
softmax over the K best logits (the same weights as softmax -> top-k ->
renormalise); "ds3" is the DeepSeek-V3 router (sigmoid, correction bias for
the choice only, groups scored by their two best biased scores, -inf
outside the chosen groups). "fused" experts are `experts.gate_up_proj`
[E, 2F, D] (gate rows first) and `experts.down_proj` [E, D, F].
"""

from __future__ import annotations

import dataclasses

# Switch names (issue 33's table), as `lacks` spells them.
INPUT_SIDE_WEIGHTS = "routing weight on the expert input"
SWIGLU_CLAMP = "SwiGLU clamp"
GPT_OSS_GLU = "GPT-OSS clamped GLU (up + 1) * g * sigmoid(alpha * g)"
SOFTCAP_SWIGLU = "soft-capped SwiGLU"
NON_GATED_FFN = "non-gated expert FFN"
EXPERT_BIASES = "biases on the expert linears"
ROUTER_BIAS = "router bias on the logits"
SCORE_SQRTSOFTPLUS = "sqrtsoftplus score function"
SPARSEMIXER = "Phi sparsemixer routing"
LOGIT_BIAS_BEFORE_SIGMOID = "correction bias before the sigmoid"
LOGIT_SOFTCAP = "router logit soft-cap"
ROUTER_INPUT_NORM = "router input norm and scale; per-expert output scale"
ZERO_EXPERTS = "zero (skip) experts"
HASH_ROUTING = "routing by token-id hash"
LATENT_PROJECTIONS = "latent projections"
PRODUCT_KEYS = "product-key experts"
ROUTER_MLP_STATE = "MLP router with state across layers"
ZERO_FILLED_GROUPS = "excluded groups filled with 0 under sigmoid + bias"
TOKEN_TYPE_EXPERTS = "expert sets by token type"
CAPACITY_POLICY = "2021-era capacity policy and token dropout"
# Switches found missing while converting (not in issue 33's table).
CLAMP_AFTER_ACTIVATION = "SwiGLU clamp after the activation (act(gate) <= L)"


@dataclasses.dataclass(frozen=True)
class Family:
  """One transformers MoE family.

  Attributes:
    model_type: the config's `model_type` (and the models/ folder name).
    block: the modeling class holding router and experts.
    config: the config class the block is built from (text config for
      multimodal models).
    router: score function, top-k, normalisation, scaling, bias, groups.
    experts: gated or not, activation, biases, weight layout.
    shared: the shared expert and its gate ("-" for none).
    lacks: switches missing from today's `MoEConfig` ("" = supported).
    note: what the converter takes where the block is not self-contained.
  """

  model_type: str
  block: str
  config: str
  router: str
  experts: str
  shared: str
  lacks: tuple[str, ...] = ()
  note: str = ""

  @property
  def supported(self) -> bool:
    return not self.lacks


# The experts of most rows.
FUSED = "fused SwiGLU (hidden_act)"
