"""Expert FFNs: the families set apart by their experts' activation.

Clamps, GPT-OSS's GLU, soft caps, non-gated FFNs, latent projections and
the norms around the experts. Each function returns the family's
`MoEConfig` fields (its router's among them), as `router_fields.py`'s do.
"""

from __future__ import annotations

from hf_convert import fields
from hf_convert import router_fields

# MuseSparkTopkRouter's norm_topk_prob_eps.
_MUSE_SPARK_NORM_EPSILON = 1e-15


def _silu_only(model_type, c) -> None:
  """Families whose routed experts always run silu, whatever hidden_act."""
  act = fields.activation(getattr(c, "hidden_act", None))
  if act != "silu":
    raise NotImplementedError(
        f"{model_type}'s routed experts always use silu and its shared "
        "expert hidden_act; dropless gives both one activation, so "
        f"hidden_act must be 'silu', got {c.hidden_act!r}."
    )


def _gpt_oss_glu(c) -> dict:
  """GPT-OSS's clamped GLU (up + 1) * g * sigmoid(alpha * g)."""
  return dict(
      activation="gpt_oss_glu",
      swiglu_alpha=fields.number(c, "swiglu_alpha"),
      swiglu_limit=fields.number(c, "swiglu_limit"),
  )


def dbrx(c) -> dict:
  """DBRX keeps its expert settings in ffn_config, its activation too."""
  ffn = c.ffn_config
  # moe_normalize_expert_weights: None (no normalisation) or the p of the
  # p-norm the top-k softmax weights are divided by.
  p = getattr(ffn, "moe_normalize_expert_weights", None)
  act = (getattr(ffn, "ffn_act_fn", None) or {}).get("name")
  return dict(
      num_experts=ffn.moe_num_experts,
      top_k=ffn.moe_top_k,
      expert_ffn_size=ffn.ffn_hidden_size,
      norm_topk_prob=p is not None,
      norm_topk_p=1.0 if p is None else float(p),
      activation=fields.activation(act, "ffn_config.ffn_act_fn['name']"),
  )


def gpt_oss(c) -> dict:
  """Biased logits -> top-k -> softmax over the K (the renormalised
  softmax); the clamped GLU with biases. The privacy filter divides the
  weights by K and multiplies the output by K: the same block."""
  return dict(
      num_experts=c.num_local_experts,
      expert_ffn_size=c.intermediate_size,
      norm_topk_prob=True,
      router_bias=True,
      **_gpt_oss_glu(c),
      expert_bias=True,
  )


def minimax_m3_vl(c) -> dict:
  """MiniMax-M2's router; GPT-OSS's clamped GLU in the routed and the
  shared experts; the scale multiplies the routed sum only."""
  return router_fields.sigmoid_bias(
      c.num_local_experts,
      c.intermediate_size,
      routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
      shared_ffn_size=c.shared_intermediate_size or 0,
      **_gpt_oss_glu(c),
  )


def glm5_next(c) -> dict:
  """The routed and the shared experts both clamp gate and up."""
  _silu_only("glm5_next", c)
  return router_fields.deepseek_v3(
      c, activation="silu", swiglu_limit=fields.number(c, "swiglu_limit")
  )


def hy_v4(c) -> dict:
  """The routed experts clamp; the shared expert (if any) does not."""
  clamp = {}
  if c.swiglu_limit is not None:
    clamp = dict(swiglu_limit=fields.number(c, "swiglu_limit"))
    if c.n_shared_experts:
      clamp["shared_swiglu_clamp"] = False
  return router_fields.deepseek_v3(c, activation="silu", **clamp)


def inkling2(model_type):
  """Inkling 2's soft-capped SwiGLU, under a sigmoid + bias router."""

  def convert(c) -> dict:
    if c.scoring_func != "sigmoid":
      raise NotImplementedError(
          f"{model_type}'s scoring_func must be 'sigmoid' (the one dropless "
          f"has among its ACT2FN choices), got {c.scoring_func!r}."
      )
    # Scores + bias for the choice, always normalised (+1e-20), scaled.
    return router_fields.sigmoid_bias(
        c.n_routed_experts,
        c.moe_intermediate_size,
        norm_epsilon=router_fields.DEEPSEEK_V3_NORM_EPSILON,
        routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
        activation="softcapped_silu",
        gate_softcap=fields.number(c, "mlp_gate_softcap"),
        up_softcap=fields.number(c, "mlp_up_softcap"),
    )

  return convert


def nemotron_h(c) -> dict:
  """Non-gated experts (mlp_hidden_act), optionally on a latent width."""
  act = c.mlp_hidden_act
  if act not in fields.NON_GATED_ACTIVATIONS:
    raise NotImplementedError(
        "mlp_hidden_act must be one of "
        f"{sorted(fields.NON_GATED_ACTIVATIONS)}, got {act!r}."
    )
  # NemotronHMLP falls back to intermediate_size for a width of 0.
  shared = c.moe_shared_expert_intermediate_size or c.intermediate_size
  # moe_latent_size: fc1_latent_proj before the experts, fc2_latent_proj
  # after them; the shared expert sees the block's input. mlp_bias gives
  # the shared expert's and the latent projections' linears biases.
  latent = c.moe_latent_size or 0
  return router_fields.deepseek_v3(
      c,
      shared_width=shared,
      activation=fields.NON_GATED_ACTIVATIONS[act],
      expert_latent_size=latent,
      latent_bias=bool(c.mlp_bias) and bool(latent),
      shared_expert_bias=bool(c.mlp_bias) and bool(shared),
  )


def muse_spark(c) -> dict:
  """DeepSeek-V3's choice (sigmoid + bias, no groups) on logits scaled by
  output_multiplier (a scale of the router's input, as the logits are
  linear in it), normalised with 1e-15; the experts at moe_hidden_size
  between pre_expert_proj (+ its centred RMS norm) and post_expert_proj,
  each expert's output scaled then RMS-normed before its weight."""
  return router_fields.sigmoid_bias(
      c.num_local_experts,
      c.moe_intermediate_size,
      norm_epsilon=_MUSE_SPARK_NORM_EPSILON,
      routed_scaling_factor=fields.number(c, "routed_scaling_factor"),
      router_input_scale=fields.number(c, "output_multiplier"),
      expert_latent_size=c.moe_hidden_size,
      latent_norm=True,
      latent_norm_epsilon=fields.number(c, "rms_norm_eps"),
      post_expert_norm=True,
      post_expert_norm_epsilon=fields.number(c, "post_norm_eps"),
  )
