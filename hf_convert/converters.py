"""model_type -> the converter of its config into `MoEConfig` fields.

One table for the families read whole from their config, one for those
read layer by layer. The converters live by the switch that sets their
family apart: `router_fields.py` (router kinds and router switches),
`expert_fields.py` (expert FFNs), `shared_fields.py` (shared experts),
`layer_fields.py` (per-layer settings). `top_k`, `hidden_size` and
`activation` are filled in after, unless a converter sets them.
"""

from __future__ import annotations

from hf_convert import expert_fields
from hf_convert import fields
from hf_convert import layer_fields
from hf_convert import router_fields as routers
from hf_convert import shared_fields


def _softmax(experts_field, ffn_field, norm=None, shared=None):
  """softmax -> top-k over `experts_field` experts of `ffn_field`;
  renormalised always (norm=True) or as norm_topk_prob says (None); a
  shared expert of `shared(c)`'s fields."""

  def convert(c) -> dict:
    return routers.softmax(
        getattr(c, experts_field),
        getattr(c, ffn_field),
        c.norm_topk_prob if norm is None else norm,
        **(shared(c) if shared else {}),
    )

  return convert


def _granite_shared(c) -> dict:
  # The decoder layer's shared_mlp (0: none).
  return dict(shared_ffn_size=c.shared_intermediate_size or 0)


def _sigmoid_scaled(scale_field):
  """sigmoid + bias, norm (+1e-20), x `scale_field`; num_shared_experts
  shared experts of moe_intermediate_size (AFMoE, HY-V3)."""
  return lambda c: routers.sigmoid_bias(
      c.num_experts,
      c.moe_intermediate_size,
      norm_epsilon=routers.DEEPSEEK_V3_NORM_EPSILON,
      routed_scaling_factor=fields.number(c, scale_field),
      shared_ffn_size=c.moe_intermediate_size * (c.num_shared_experts or 0),
  )


CONVERTERS = {
    "afmoe": _sigmoid_scaled("route_scale"),
    "aria": lambda c: dict(
        num_experts=c.moe_num_experts,
        top_k=c.moe_topk,
        expert_ffn_size=c.intermediate_size,
        norm_topk_prob=True,
        activation="silu",
        shared_ffn_size=c.intermediate_size * c.moe_num_shared_experts,
    ),
    # A.X-K1: DeepSeek-V3's block, then an RMS norm of its output.
    "axk1": lambda c: routers.deepseek_v3(
        c,
        output_norm=True,
        output_norm_epsilon=fields.number(c, "rms_norm_eps"),
    ),
    "axk2": routers.axk2,
    "bailing_hybrid": routers.deepseek_v3,
    "beam": lambda c: routers.deepseek_v3(c, shared_width=0),
    "cohere2_moe": shared_fields.cohere2_moe,
    "dbrx": expert_fields.dbrx,
    "deepseek_ocr2": routers.deepseek_v2,
    "deepseek_v2": routers.deepseek_v2,
    "deepseek_v3": routers.deepseek_v3,
    "deepseek_v32": routers.deepseek_v3,
    "dots1": routers.deepseek_v3,
    "dots3_note": lambda c: routers.deepseek_v3(
        c,
        shared_width=c.shared_experts_intermediate_size
        * (c.n_shared_experts or 0),
    ),
    "ernie4_5_moe": lambda c: dict(
        num_experts=c.moe_num_experts,
        top_k=c.moe_k,
        expert_ffn_size=c.moe_intermediate_size,
        correction_bias=True,
        norm_topk_prob=True,
        shared_ffn_size=c.moe_intermediate_size
        * (c.moe_num_shared_experts or 0),
    ),
    "exaone_moe": routers.deepseek_v3,
    "diffusion_gemma": routers.gemma4,
    "flex_olmo": _softmax("num_experts", "intermediate_size"),
    "flint": lambda c: dict(
        num_experts=c.num_experts,
        expert_ffn_size=c.moe_intermediate_size,
        score_func="sigmoid",
        norm_topk_prob=bool(c.norm_topk_prob),
        shared_ffn_size=c.shared_expert_intermediate_size or 0,
    ),
    "gemma4": routers.gemma4,
    "glm4_moe": routers.deepseek_v3,
    "glm4_moe_lite": routers.deepseek_v3,
    "glm4v_moe": routers.deepseek_v3,
    "glm5_next": expert_fields.glm5_next,
    "glm_moe_dsa": routers.deepseek_v3,
    "gpt_oss": expert_fields.gpt_oss,
    "granitemoe": _softmax("num_local_experts", "intermediate_size", True),
    "granitemoe_swa": _softmax(
        "num_local_experts", "intermediate_size", True, _granite_shared
    ),
    "granitemoehybrid": _softmax(
        "num_local_experts", "intermediate_size", True, _granite_shared
    ),
    "granitemoeshared": _softmax(
        "num_local_experts", "intermediate_size", True, _granite_shared
    ),
    "hy_v3": _sigmoid_scaled("router_scaling_factor"),
    "hy_v4": expert_fields.hy_v4,
    "hy_v4_vl": expert_fields.hy_v4,
    "inkling": shared_fields.inkling,
    "inkling2": expert_fields.inkling2("inkling2"),
    "inkling2_loop": expert_fields.inkling2("inkling2_loop"),
    "jamba": _softmax("num_experts", "intermediate_size", False),
    # JetMoE: top-k logits -> softmax, a bias [D] after the combine.
    "jetmoe": lambda c: routers.softmax(
        c.num_local_experts,
        c.intermediate_size,
        True,
        output_bias=True,
        activation=fields.activation(
            c.activation_function, "activation_function"
        ),
    ),
    "kimi_linear": routers.deepseek_v3,
    "kolibri1": routers.kolibri1,
    "laguna": routers.laguna,
    "lara_mini": _softmax(
        "num_experts",
        "moe_intermediate_size",
        shared=lambda c: dict(
            shared_ffn_size=c.shared_expert_intermediate_size or 0
        ),
    ),
    "lfm2_moe": routers.lfm2_moe,
    "llama4": routers.llama4,
    "longcat_flash": routers.longcat_flash,
    "mellum": _softmax("num_experts", "moe_intermediate_size"),
    "mimo_v2_flash": lambda c: routers.deepseek_v3(c, shared_width=0),
    "minimax": _softmax("num_local_experts", "intermediate_size", True),
    "minimax_m2": lambda c: routers.sigmoid_bias(
        c.num_local_experts, c.intermediate_size
    ),
    "minimax_m3_vl": expert_fields.minimax_m3_vl,
    "mistral4": lambda c: routers.mistral4(c, c.norm_topk_prob),
    "mistral_large4": lambda c: routers.mistral4(c, True),
    "mixtral": _softmax("num_local_experts", "intermediate_size", True),
    "muse_spark": expert_fields.muse_spark,
    "nemotron_h": expert_fields.nemotron_h,
    "olmoe": _softmax("num_experts", "intermediate_size"),
    "openai_privacy_filter": expert_fields.gpt_oss,
    "phimoe": routers.phimoe,
    "qwen2_moe": _softmax(
        "num_experts", "moe_intermediate_size", shared=shared_fields.qwen
    ),
    "qwen3_5_moe": _softmax(
        "num_experts", "moe_intermediate_size", True, shared_fields.qwen
    ),
    "qwen3_moe": _softmax("num_experts", "moe_intermediate_size"),
    "qwen3_next": _softmax(
        "num_experts", "moe_intermediate_size", shared=shared_fields.qwen
    ),
    "qwen3_omni_moe": _softmax("num_experts", "moe_intermediate_size"),
    "qwen3_vl_moe": _softmax("num_experts", "moe_intermediate_size", True),
    "qwen4_exp": _softmax(
        "num_experts", "moe_intermediate_size", shared=shared_fields.qwen
    ),
    "solar_open": routers.deepseek_v3,
    "unlimited_ocr": routers.deepseek_v2,
}

# Converters that read per-layer settings take the layer index as well.
PER_LAYER = {
    "deepseek_v4": layer_fields.deepseek_v4,
    "hunyuan_v1_moe": layer_fields.hunyuan,
    "step3p7": layer_fields.step3p7,
}
