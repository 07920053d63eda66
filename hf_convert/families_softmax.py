"""The softmax router families: Mixtral, Qwen, Granite, Gemma 4 and kin.

Rows of `families.FAMILIES` (see `family_row.py` for the notation): the
families that score experts with a softmax, over all E logits or over the
K best (GPT-OSS, JetMoE, Granite), sparsemixer's masked softmaxes included.
"""

from __future__ import annotations

from hf_convert import family_row

_NORM_IF_ASKED = "softmax -> top-k, norm if norm_topk_prob"
_QWEN_SHARED = (
    "shared_expert: shared_expert_intermediate_size, x "
    "sigmoid(shared_expert_gate)"
)


def _gemma(model_type, block, config, where=""):
  """Gemma 4's decoder layer, whose MoE half is the block."""
  return family_row.Family(
      model_type,
      block,
      config,
      "RMS-normed, scaled input -> softmax -> top-k -> norm x "
      "per_expert_scale" + where,
      "fused GeGLU",
      "dense MLP beside it",
      note=(
          "the MoE half of the decoder layer: router.* (proj, scale, "
          "per_expert_scale), experts.* and pre_feedforward_layernorm_2 "
          "from the layer's state dict, on the layer's residual (the input "
          "of pre_feedforward_layernorm); the dense MLP beside it and "
          "post_feedforward_layernorm_2 after it stay outside"
      ),
  )


def _granite_shared(model_type, block, config):
  """A Granite MoE whose decoder layer adds a shared MLP."""
  return family_row.Family(
      model_type,
      block,
      config,
      "top-k logits -> softmax",
      family_row.FUSED,
      "shared_mlp (decoder layer): input_linear [2Fs, D] (gate rows, then "
      "up), output_linear, ungated",
      note=(
          "the shared MLP lives in the decoder layer: pass its tensors as "
          "shared_mlp.* beside the block's"
      ),
  )


ROWS = (
    family_row.Family(
        "aria",
        "AriaTextMoELayer",
        "AriaTextConfig",
        "top-k -> softmax over moe_topk logits",
        "SwiGLU (always silu), gate_up_proj [E, D, 2F], down_proj [E, F, D]",
        "shared_experts: moe_num_shared_experts x intermediate_size, ungated",
    ),
    family_row.Family(
        "cohere2_moe",
        "Cohere2MoeSparseMoeBlock",
        "Cohere2MoeConfig",
        "top-k logits -> softmax, or -> sigmoid (norm if norm_topk_prob)",
        family_row.FUSED,
        "shared_experts: num_shared_experts x intermediate_size, summed or "
        "averaged",
        note=(
            "shared_expert_combination_strategy 'average' (the default) -> "
            "shared_combine='mean', 'sum' -> 'sum'"
        ),
    ),
    family_row.Family(
        "dbrx",
        "DbrxFFN",
        "DbrxConfig",
        "softmax -> top-k, p-norm with moe_normalize_expert_weights",
        "SwiGLU w1 (gate) / v1 (up) / w2 (down) [E*F, D]",
        "-",
        note=(
            "moe_normalize_expert_weights=p -> norm_topk_prob=True, "
            "norm_topk_p=p (None: no normalisation)"
        ),
    ),
    _gemma(
        "diffusion_gemma",
        "DiffusionGemmaDecoderTextLayer",
        "DiffusionGemmaTextConfig",
    ),
    family_row.Family(
        "ernie4_5_moe",
        "Ernie4_5_MoeSparseMoeBlock",
        "Ernie4_5_MoeConfig",
        "softmax + moe_statics correction bias (choice only) -> top-k -> norm "
        "(sum clamped at moe_norm_min)",
        family_row.FUSED,
        "shared_experts: moe_num_shared_experts x moe_intermediate_size, "
        "ungated",
    ),
    family_row.Family(
        "flex_olmo",
        "FlexOlmoSparseMoeBlock",
        "FlexOlmoConfig",
        _NORM_IF_ASKED,
        family_row.FUSED + ", width intermediate_size",
        "-",
    ),
    _gemma(
        "gemma4",
        "Gemma4TextDecoderLayer",
        "Gemma4TextConfig",
        " (router in the decoder layer)",
    ),
    family_row.Family(
        "gpt_oss",
        "GptOssMLP",
        "GptOssConfig",
        "linear with bias -> top-k -> softmax over K",
        "clamped GLU (up + 1) * g * sigmoid(1.702 g), interleaved gate/up, "
        "biases",
        "-",
        note=(
            "params_from_hf(..., model_type='gpt_oss'): the interleaved "
            "columns are not told apart by their shape"
        ),
    ),
    family_row.Family(
        "granitemoe",
        "GraniteMoeMoE",
        "GraniteMoeConfig",
        "top-k logits -> softmax",
        family_row.FUSED,
        "-",
    ),
    _granite_shared(
        "granitemoe_swa", "GraniteMoeSWAMoE", "GraniteMoeSWAConfig"
    ),
    _granite_shared(
        "granitemoehybrid", "GraniteMoeHybridMoE", "GraniteMoeHybridConfig"
    ),
    _granite_shared(
        "granitemoeshared", "GraniteMoeSharedMoE", "GraniteMoeSharedConfig"
    ),
    family_row.Family(
        "hunyuan_v1_moe",
        "HunYuanMoEV1Moe",
        "HunYuanMoEV1Config",
        "gate.wg (float32): softmax -> top-k -> norm",
        family_row.FUSED + ", width intermediate_size",
        "shared_mlp: intermediate_size, ungated",
    ),
    family_row.Family(
        "jamba",
        "JambaSparseMoeBlock",
        "JambaConfig",
        "softmax -> top-k, never normalised",
        family_row.FUSED + ", width intermediate_size",
        "-",
    ),
    family_row.Family(
        "jetmoe",
        "JetMoeMoE",
        "JetMoeConfig",
        "top-k logits -> softmax",
        "SwiGLU input_linear [E, 2F, D] / output_linear; a bias [D] added "
        "after the combine",
        "-",
        note=(
            "output_bias=True (its `bias` [D]); its attention experts "
            "(JetMoeMoA) are attention, out of scope like all attention"
        ),
    ),
    family_row.Family(
        "lara_mini",
        "LaraMiniSparseMoeBlock",
        "LaraMiniConfig",
        _NORM_IF_ASKED,
        family_row.FUSED,
        "shared_expert: shared_expert_intermediate_size, ungated",
    ),
    family_row.Family(
        "longcat_flash",
        "LongcatFlashMoE",
        "LongcatFlashConfig",
        "router.classifier: softmax + e_score_correction_bias (choice only), "
        "never normalised, x routed_scaling_factor",
        family_row.FUSED + ", width expert_ffn_hidden_size",
        "-",
        note=(
            "zero_expert_num identity experts; the classifier's bias "
            "(router_bias=True) is never added by the router's forward"
        ),
    ),
    family_row.Family(
        "mellum",
        "MellumSparseMoeBlock",
        "MellumConfig",
        _NORM_IF_ASKED,
        family_row.FUSED,
        "-",
    ),
    family_row.Family(
        "minimax",
        "MiniMaxSparseMoeBlock",
        "MiniMaxConfig",
        "softmax -> top-k -> norm",
        family_row.FUSED + ", width intermediate_size",
        "-",
    ),
    family_row.Family(
        "mixtral",
        "MixtralSparseMoeBlock",
        "MixtralConfig",
        "softmax -> top-k -> norm",
        family_row.FUSED + ", width intermediate_size",
        "-",
    ),
    family_row.Family(
        "olmoe",
        "OlmoeSparseMoeBlock",
        "OlmoeConfig",
        _NORM_IF_ASKED,
        family_row.FUSED + ", width intermediate_size",
        "-",
    ),
    family_row.Family(
        "openai_privacy_filter",
        "OpenAIPrivacyFilterMLP",
        "OpenAIPrivacyFilterConfig",
        "as gpt_oss (weights / K, output x K: the same)",
        "as gpt_oss, gate and up in halves (not interleaved), float32",
        "-",
        note="params_from_hf(..., model_type='openai_privacy_filter')",
    ),
    family_row.Family(
        "phimoe",
        "PhimoeSparseMoeBlock",
        "PhimoeConfig",
        "sparsemixer (masked softmax with jitter threshold)",
        family_row.FUSED + ", width intermediate_size",
        "-",
        note=(
            "inference routing (eval mode: training samples with Gumbel "
            "noise); always two experts, whatever num_experts_per_tok"
        ),
    ),
    family_row.Family(
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeConfig",
        _NORM_IF_ASKED,
        family_row.FUSED,
        _QWEN_SHARED,
    ),
    family_row.Family(
        "qwen3_5_moe",
        "Qwen3_5MoeSparseMoeBlock",
        "Qwen3_5MoeTextConfig",
        "softmax -> top-k -> norm",
        family_row.FUSED,
        _QWEN_SHARED,
    ),
    family_row.Family(
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        _NORM_IF_ASKED,
        family_row.FUSED,
        "-",
    ),
    family_row.Family(
        "qwen3_next",
        "Qwen3NextSparseMoeBlock",
        "Qwen3NextConfig",
        _NORM_IF_ASKED,
        family_row.FUSED,
        _QWEN_SHARED,
    ),
    family_row.Family(
        "qwen3_omni_moe",
        "Qwen3OmniMoeThinkerTextSparseMoeBlock",
        "Qwen3OmniMoeTextConfig",
        _NORM_IF_ASKED,
        family_row.FUSED,
        "-",
        note="the thinker's text block (the talker's is a Qwen2-MoE block)",
    ),
    family_row.Family(
        "qwen3_vl_moe",
        "Qwen3VLMoeTextSparseMoeBlock",
        "Qwen3VLMoeTextConfig",
        "softmax -> top-k -> norm",
        family_row.FUSED,
        "-",
    ),
    family_row.Family(
        "qwen4_exp",
        "Qwen4ExpTextSparseMoeBlock",
        "Qwen4ExpTextConfig",
        _NORM_IF_ASKED,
        family_row.FUSED,
        _QWEN_SHARED,
    ),
)
