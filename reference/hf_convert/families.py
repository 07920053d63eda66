"""Every transformers 5.24.0 family with a sparse MoE block, as data.

One `Family` row per `model_type` whose `modeling_<type>.py` holds a routed
block (a router plus routed experts). Read from the modeling files; the
converter (`convert.py`), the parity test (`hf_families_parity_test.py`) and
docs/hf_families.md all read this table. `lacks` names the switches of
issue 33 that today's `MoEConfig` does not have; a family whose `lacks` is
empty is converted exactly (some only for part of their config space: the
converter refuses the rest with the switch it needs).

Notation: E experts, K chosen, F expert width, D model width; "softmax ->
top-k" is a softmax over all E logits then top-k; "top-k -> softmax" is a
softmax over the K best logits (the same weights as softmax -> top-k ->
renormalise); "ds3" is the DeepSeek-V3 router (sigmoid, correction bias for
the choice only, groups scored by their two best biased scores, -inf
outside the chosen groups). "fused" experts are `experts.gate_up_proj`
[E, 2F, D] (gate rows first) and `experts.down_proj` [E, D, F]. Over 400
lines because it is the 75-row table itself: data, one row per family.
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


_DS3 = (
    "ds3: sigmoid + correction bias, groups (sum top-2), norm if "
    "norm_topk_prob (+1e-20), x routed_scaling_factor"
)
_DS2 = (
    "DeepSeek-V2: softmax -> top-k (greedy or group max, 0-fill), never "
    "normalised, x routed_scaling_factor"
)
_FUSED = "fused SwiGLU (hidden_act)"
_GEMMA_NOTE = (
    "the MoE half of the decoder layer: router.* (proj, scale, "
    "per_expert_scale), experts.* and pre_feedforward_layernorm_2 from the "
    "layer's state dict, on the layer's residual (the input of "
    "pre_feedforward_layernorm); the dense MLP beside it and "
    "post_feedforward_layernorm_2 after it stay outside"
)
_DS_SHARED = (
    "shared_experts: SwiGLU, n_shared_experts x moe_intermediate_size, ungated"
)

FAMILIES: tuple[Family, ...] = (
    Family(
        "afmoe",
        "AfmoeSparseMoeBlock",
        "AfmoeConfig",
        "sigmoid + expert_bias (choice only), norm (+1e-20), x route_scale",
        _FUSED,
        "shared_experts: num_shared_experts x moe_intermediate_size, ungated",
    ),
    Family(
        "aria",
        "AriaTextMoELayer",
        "AriaTextConfig",
        "top-k -> softmax over moe_topk logits",
        "SwiGLU (always silu), gate_up_proj [E, D, 2F], down_proj [E, F, D]",
        "shared_experts: moe_num_shared_experts x intermediate_size, ungated",
    ),
    Family(
        "axk1",
        "AXK1MoE",
        "AXK1Config",
        _DS3,
        _FUSED,
        _DS_SHARED,
        note=(
            "output_norm=True, output_norm_epsilon=rms_norm_eps: its "
            "post_mlp_layernorm (weight -> output_norm_scale) normalises the "
            "routed plus shared output"
        ),
    ),
    Family(
        "axk2",
        "AXK2MoE",
        "AXK2Config",
        "ds3; with groups, excluded groups filled with 0.0",
        _FUSED,
        _DS_SHARED,
        note=(
            "supported with n_group None or 1 (A.X-K2-Light, the default); "
            "groups need: "
        )
        + ZERO_FILLED_GROUPS,
    ),
    Family(
        "bailing_hybrid",
        "BailingHybridMoE",
        "BailingHybridConfig",
        _DS3,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "beam",
        "BeamMoE",
        "BeamConfig",
        _DS3 + " (scale after the combine)",
        _FUSED + ", activation in float32",
        "-",
    ),
    Family(
        "cohere2_moe",
        "Cohere2MoeSparseMoeBlock",
        "Cohere2MoeConfig",
        "top-k logits -> softmax, or -> sigmoid (norm if norm_topk_prob)",
        _FUSED,
        "shared_experts: num_shared_experts x intermediate_size, summed or "
        "averaged",
        note=(
            "shared_expert_combination_strategy 'average' (the default) -> "
            "shared_combine='mean', 'sum' -> 'sum'"
        ),
    ),
    Family(
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
    Family(
        "deepseek_ocr2",
        "DeepseekOcr2TextMoe",
        "DeepseekOcr2TextConfig",
        _DS2,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "deepseek_v2",
        "DeepseekV2Moe",
        "DeepseekV2Config",
        _DS2,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "deepseek_v3",
        "DeepseekV3MoE",
        "DeepseekV3Config",
        _DS3,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "deepseek_v32",
        "DeepseekV32MoE",
        "DeepseekV32Config",
        _DS3,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "deepseek_v4",
        "DeepseekV4SparseMoeBlock",
        "DeepseekV4Config",
        "sqrtsoftplus (scoring_func) + bias, norm, scale; hash layers route "
        "by token id",
        "fused SwiGLU with clamp (swiglu_limit), width intermediate_size",
        "shared_experts: one SwiGLU of intermediate_size, the same clamp",
        note=(
            "layer by layer (moe_config_from_hf(..., layer_idx=i)): a "
            "'hash_moe' layer of mlp_layer_types routes by gate.tid2eid "
            "(hash_vocab_size=vocab_size; moe_layer then needs "
            "token_ids=input_ids), a 'moe' layer by sqrtsoftplus + bias; "
            "mlp_bias=True: shared_expert_bias (shared_experts.*.bias)"
        ),
    ),
    Family(
        "diffusion_gemma",
        "DiffusionGemmaDecoderTextLayer",
        "DiffusionGemmaTextConfig",
        "RMS-normed, scaled input -> softmax -> top-k -> norm x "
        "per_expert_scale",
        "fused GeGLU",
        "dense MLP beside it",
        note=_GEMMA_NOTE,
    ),
    Family("dots1", "Dots1MoE", "Dots1Config", _DS3, _FUSED, _DS_SHARED),
    Family(
        "dots3_note",
        "Dots3NoteTextMoE",
        "Dots3NoteTextConfig",
        _DS3,
        _FUSED,
        "shared_experts: n_shared_experts x shared_experts_intermediate_size, "
        "ungated",
    ),
    Family(
        "ernie4_5_moe",
        "Ernie4_5_MoeSparseMoeBlock",
        "Ernie4_5_MoeConfig",
        "softmax + moe_statics correction bias (choice only) -> top-k -> norm "
        "(sum clamped at moe_norm_min)",
        _FUSED,
        "shared_experts: moe_num_shared_experts x moe_intermediate_size, "
        "ungated",
    ),
    Family(
        "ernie4_5_vl_moe",
        "Ernie4_5_VLMoeMoeBlock",
        "Ernie4_5_VLMoeTextConfig",
        "as ernie4_5_moe, one text and one vision expert set",
        _FUSED,
        "shared_experts, ungated",
        (TOKEN_TYPE_EXPERTS,),
    ),
    Family(
        "exaone_moe",
        "ExaoneMoeSparseMoEBlock",
        "ExaoneMoeConfig",
        _DS3,
        _FUSED,
        "shared_experts: num_shared_experts x moe_intermediate_size, ungated",
    ),
    Family(
        "flex_olmo",
        "FlexOlmoSparseMoeBlock",
        "FlexOlmoConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED + ", width intermediate_size",
        "-",
    ),
    Family(
        "flint",
        "FlintSparseMoeBlock",
        "FlintConfig",
        "sigmoid -> top-k (no bias), norm if norm_topk_prob",
        _FUSED,
        "shared_expert: shared_expert_intermediate_size, ungated",
    ),
    Family(
        "gemma4",
        "Gemma4TextDecoderLayer",
        "Gemma4TextConfig",
        "RMS-normed, scaled input -> softmax -> top-k -> norm x "
        "per_expert_scale (router in the decoder layer)",
        "fused GeGLU",
        "dense MLP beside it",
        note=_GEMMA_NOTE,
    ),
    Family("glm4_moe", "Glm4MoeMoE", "Glm4MoeConfig", _DS3, _FUSED, _DS_SHARED),
    Family(
        "glm4_moe_lite",
        "Glm4MoeLiteMoE",
        "Glm4MoeLiteConfig",
        _DS3,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "glm4v_moe",
        "Glm4vMoeTextMoE",
        "Glm4vMoeTextConfig",
        _DS3,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "glm5_next",
        "Glm5NextTextMoE",
        "Glm5NextTextConfig",
        _DS3,
        "fused SwiGLU (always silu) with clamp (swiglu_limit)",
        _DS_SHARED + ", SwiGLU (hidden_act) with the same clamp",
        note="supported with hidden_act='silu' (the default)",
    ),
    Family(
        "glm_moe_dsa",
        "GlmMoeDsaMoE",
        "GlmMoeDsaConfig",
        _DS3,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
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
    Family(
        "granitemoe",
        "GraniteMoeMoE",
        "GraniteMoeConfig",
        "top-k logits -> softmax",
        _FUSED,
        "-",
    ),
    Family(
        "granitemoe_swa",
        "GraniteMoeSWAMoE",
        "GraniteMoeSWAConfig",
        "top-k logits -> softmax",
        _FUSED,
        "shared_mlp (decoder layer): input_linear [2Fs, D] (gate rows, then "
        "up), output_linear, ungated",
        note=(
            "the shared MLP lives in the decoder layer: pass its tensors as "
            "shared_mlp.* beside the block's"
        ),
    ),
    Family(
        "granitemoehybrid",
        "GraniteMoeHybridMoE",
        "GraniteMoeHybridConfig",
        "top-k logits -> softmax",
        _FUSED,
        "shared_mlp (decoder layer): input_linear [2Fs, D] (gate rows, then "
        "up), output_linear, ungated",
        note=(
            "the shared MLP lives in the decoder layer: pass its tensors as "
            "shared_mlp.* beside the block's"
        ),
    ),
    Family(
        "granitemoeshared",
        "GraniteMoeSharedMoE",
        "GraniteMoeSharedConfig",
        "top-k logits -> softmax",
        _FUSED,
        "shared_mlp (decoder layer): input_linear [2Fs, D] (gate rows, then "
        "up), output_linear, ungated",
        note=(
            "the shared MLP lives in the decoder layer: pass its tensors as "
            "shared_mlp.* beside the block's"
        ),
    ),
    Family(
        "hunyuan_v1_moe",
        "HunYuanMoEV1Moe",
        "HunYuanMoEV1Config",
        "gate.wg (float32): softmax -> top-k -> norm",
        _FUSED + ", width intermediate_size",
        "shared_mlp: intermediate_size, ungated",
    ),
    Family(
        "hy_v3",
        "HYV3MoE",
        "HYV3Config",
        "sigmoid + e_score_correction_bias (block buffer), norm (+1e-20), x "
        "router_scaling_factor",
        _FUSED,
        "shared_experts: num_shared_experts x moe_intermediate_size, ungated",
    ),
    Family(
        "hy_v4",
        "HYV4MoE",
        "HYV4Config",
        _DS3,
        "fused SwiGLU (always silu) with clamp (swiglu_limit)",
        _DS_SHARED + ", not clamped",
        note=(
            "swiglu_limit clamps the routed experts; its shared expert is "
            "not clamped: shared_swiglu_clamp=False"
        ),
    ),
    Family(
        "hy_v4_vl",
        "HYV4VLMoE",
        "HYV4VLTextConfig",
        _DS3,
        "fused SwiGLU (always silu) with clamp (swiglu_limit)",
        _DS_SHARED + ", not clamped",
        note=(
            "swiglu_limit clamps the routed experts; its shared expert is "
            "not clamped: shared_swiglu_clamp=False"
        ),
    ),
    Family(
        "inkling",
        "InklingMoE",
        "InklingTextConfig",
        "sigmoid over E routed + S shared logits, bias for the choice; the K "
        "chosen and the S shared weights normalised together (softmax of "
        "log-sigmoid), x route_scale x global_scale",
        _FUSED,
        "shared_experts: SwiGLU, each scaled by its router weight",
        note=(
            "num_always_on_experts=S: its S shared experts are dropless' "
            "last S experts (num_experts = E + S, top_k = K + S), always "
            "chosen and weighed by the router with the K; gate.global_scale "
            "-> expert_output_scale"
        ),
    ),
    Family(
        "inkling2",
        "Inkling2SparseMoeBlock",
        "Inkling2TextConfig",
        "scoring_func (sigmoid by default) + bias (choice only), norm "
        "(+1e-20), x routed_scaling_factor",
        "soft-capped SwiGLU: softcap(g) * sigmoid(g) * softcap(u) "
        "(mlp_gate_softcap, mlp_up_softcap)",
        "-",
        note="supported with scoring_func='sigmoid' (the default)",
    ),
    Family(
        "inkling2_loop",
        "Inkling2LoopSparseMoeBlock",
        "Inkling2LoopTextConfig",
        "as inkling2",
        "as inkling2",
        "-",
        note="supported with scoring_func='sigmoid' (the default)",
    ),
    Family(
        "jamba",
        "JambaSparseMoeBlock",
        "JambaConfig",
        "softmax -> top-k, never normalised",
        _FUSED + ", width intermediate_size",
        "-",
    ),
    Family(
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
    Family(
        "kimi_linear",
        "KimiLinearMoE",
        "KimiLinearConfig",
        _DS3,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "kolibri1",
        "Kolibri1SparseMoeBlock",
        "Kolibri1Config",
        "logits + e_score_correction_bias -> top-k; sigmoid of the chosen "
        "(unbiased) logits, norm if norm_topk_prob",
        _FUSED,
        "shared_experts: shared_expert_intermediate_size, ungated",
    ),
    Family(
        "laguna",
        "LagunaSparseMoeBlock",
        "LagunaConfig",
        "optional logit soft-cap, sigmoid + e_score_correction_bias, norm, x "
        "moe_routed_scaling_factor",
        _FUSED,
        "shared_experts: shared_expert_intermediate_size, ungated",
    ),
    Family(
        "lara_mini",
        "LaraMiniSparseMoeBlock",
        "LaraMiniConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED,
        "shared_expert: shared_expert_intermediate_size, ungated",
    ),
    Family(
        "lfm2_moe",
        "Lfm2MoeSparseMoeBlock",
        "Lfm2MoeConfig",
        "sigmoid (+ expert_bias if use_expert_bias) -> top-k, norm if "
        "norm_topk_prob (+1e-6), x routed_scaling_factor",
        "fused SwiGLU (always silu)",
        "-",
    ),
    Family(
        "llama4",
        "Llama4TextMoe",
        "Llama4TextConfig",
        "top-k logits -> sigmoid (no renormalisation); the weight scales the "
        "expert's input",
        "SwiGLU, gate_up_proj [E, D, 2F]",
        "shared_expert: intermediate_size, ungated",
    ),
    Family(
        "longcat_flash",
        "LongcatFlashMoE",
        "LongcatFlashConfig",
        "router.classifier: softmax + e_score_correction_bias (choice only), "
        "never normalised, x routed_scaling_factor",
        _FUSED + ", width expert_ffn_hidden_size",
        "-",
        note=(
            "zero_expert_num identity experts; the classifier's bias "
            "(router_bias=True) is never added by the router's forward"
        ),
    ),
    Family(
        "mellum",
        "MellumSparseMoeBlock",
        "MellumConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED,
        "-",
    ),
    Family(
        "mimo_v2_flash",
        "MiMoV2FlashMoE",
        "MiMoV2FlashConfig",
        _DS3,
        _FUSED,
        "-",
    ),
    Family(
        "minimax",
        "MiniMaxSparseMoeBlock",
        "MiniMaxConfig",
        "softmax -> top-k -> norm",
        _FUSED + ", width intermediate_size",
        "-",
    ),
    Family(
        "minimax_m2",
        "MiniMaxM2SparseMoeBlock",
        "MiniMaxM2Config",
        "sigmoid + e_score_correction_bias (block buffer), norm (no epsilon)",
        _FUSED + ", width intermediate_size",
        "-",
    ),
    Family(
        "minimax_m3_vl",
        "MiniMaxM3VLSparseMoeBlock",
        "MiniMaxM3VLTextConfig",
        "as minimax_m2, x routed_scaling_factor (after the combine)",
        "GPT-OSS clamped GLU with gate and up chunked (not interleaved)",
        "shared_experts: shared_intermediate_size, the same clamped GLU "
        "(gate_up_proj [2Fs, D], gate rows first)",
    ),
    Family(
        "mistral4",
        "Mistral4MoE",
        "Mistral4Config",
        "softmax, groups (sum top-2, 0-fill), norm if norm_topk_prob "
        "(+1e-20), x routed_scaling_factor",
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "mistral_large4",
        "MistralLarge4TextMoE",
        "MistralLarge4TextConfig",
        "softmax, groups (sum top-2, 0-fill), always norm (+1e-20), x "
        "routed_scaling_factor",
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "mixtral",
        "MixtralSparseMoeBlock",
        "MixtralConfig",
        "softmax -> top-k -> norm",
        _FUSED + ", width intermediate_size",
        "-",
    ),
    Family(
        "muse_spark",
        "MuseSparkMoE",
        "MuseSparkTextConfig",
        "sigmoid(logits x output_multiplier) + bias (choice only), norm "
        "(+1e-15), x routed_scaling_factor",
        "fused SwiGLU on a projected, centred-RMS-normed latent input "
        "(pre_expert_proj, pre_expert_norm, post_expert_proj); each "
        "expert's output scaled by (1 + w), then RMS-normed "
        "(experts.post_expert_norm), before its weight",
        "-",
        note=(
            "expert_latent_size=moe_hidden_size, latent_norm and "
            "post_expert_norm; both norms' weights w become scales 1 + w"
        ),
    ),
    Family(
        "nemotron_h",
        "NemotronHMoE",
        "NemotronHConfig",
        _DS3,
        "non-gated up_proj / down_proj with mlp_hidden_act (relu2: squared "
        "ReLU); fc1/fc2 latent projections when moe_latent_size is set",
        "shared_experts: moe_shared_expert_intermediate_size (0: "
        "intermediate_size), non-gated, biases if mlp_bias",
        note=(
            "moe_latent_size becomes expert_latent_size (fc1/"
            "fc2_latent_proj -> latent_in/latent_out); mlp_bias=True: "
            "shared_expert_bias, and latent_bias with a latent size"
        ),
    ),
    Family(
        "nllb_moe",
        "NllbMoeSparseMLP",
        "NllbMoeConfig",
        "top-2 with capacity and second-expert policy",
        "non-gated ReLU with biases",
        "-",
        (CAPACITY_POLICY,),
    ),
    Family(
        "olmoe",
        "OlmoeSparseMoeBlock",
        "OlmoeConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED + ", width intermediate_size",
        "-",
    ),
    Family(
        "openai_privacy_filter",
        "OpenAIPrivacyFilterMLP",
        "OpenAIPrivacyFilterConfig",
        "as gpt_oss (weights / K, output x K: the same)",
        "as gpt_oss, gate and up in halves (not interleaved), float32",
        "-",
        note="params_from_hf(..., model_type='openai_privacy_filter')",
    ),
    Family(
        "phimoe",
        "PhimoeSparseMoeBlock",
        "PhimoeConfig",
        "sparsemixer (masked softmax with jitter threshold)",
        _FUSED + ", width intermediate_size",
        "-",
        note=(
            "inference routing (eval mode: training samples with Gumbel "
            "noise); always two experts, whatever num_experts_per_tok"
        ),
    ),
    Family(
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED,
        "shared_expert: shared_expert_intermediate_size, x "
        "sigmoid(shared_expert_gate)",
    ),
    Family(
        "qwen3_5_moe",
        "Qwen3_5MoeSparseMoeBlock",
        "Qwen3_5MoeTextConfig",
        "softmax -> top-k -> norm",
        _FUSED,
        "shared_expert: shared_expert_intermediate_size, x "
        "sigmoid(shared_expert_gate)",
    ),
    Family(
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED,
        "-",
    ),
    Family(
        "qwen3_next",
        "Qwen3NextSparseMoeBlock",
        "Qwen3NextConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED,
        "shared_expert: shared_expert_intermediate_size, x "
        "sigmoid(shared_expert_gate)",
    ),
    Family(
        "qwen3_omni_moe",
        "Qwen3OmniMoeThinkerTextSparseMoeBlock",
        "Qwen3OmniMoeTextConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED,
        "-",
        note="the thinker's text block (the talker's is a Qwen2-MoE block)",
    ),
    Family(
        "qwen3_vl_moe",
        "Qwen3VLMoeTextSparseMoeBlock",
        "Qwen3VLMoeTextConfig",
        "softmax -> top-k -> norm",
        _FUSED,
        "-",
    ),
    Family(
        "qwen4_exp",
        "Qwen4ExpTextSparseMoeBlock",
        "Qwen4ExpTextConfig",
        "softmax -> top-k, norm if norm_topk_prob",
        _FUSED,
        "shared_expert: shared_expert_intermediate_size, x "
        "sigmoid(shared_expert_gate)",
    ),
    Family(
        "solar_open",
        "SolarOpenMoE",
        "SolarOpenConfig",
        _DS3,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "step3p7",
        "Step3p7SparseMoeBlock",
        "Step3p7TextConfig",
        "sigmoid + e_score_correction_bias (choice only), norm, x "
        "moe_router_scaling_factor (after the combine)",
        "fused SwiGLU; swiglu_limits clamp after the activation on some layers",
        "shared_experts: share_expert_dim, ungated (clamped on the layers of "
        "swiglu_limits_shared)",
        note=(
            "supported layer by layer (moe_config_from_hf(..., layer_idx=i)) "
            "where swiglu_limits and swiglu_limits_shared are 0 or unset; "
            "clamped layers clamp silu(gate), not gate, which needs: "
            + CLAMP_AFTER_ACTIVATION
        ),
    ),
    Family(
        "switch_transformers",
        "SwitchTransformersSparseMLP",
        "SwitchTransformersConfig",
        "softmax -> top-1 with expert capacity",
        "non-gated ReLU (wi, wo)",
        "-",
        (CAPACITY_POLICY,),
    ),
    Family(
        "unlimited_ocr",
        "UnlimitedOcrTextMoe",
        "UnlimitedOcrTextConfig",
        _DS2,
        _FUSED,
        _DS_SHARED,
    ),
    Family(
        "zaya",
        "ZayaSparseMoeBlock",
        "ZayaConfig",
        "MLP router with state across layers, skip expert, balancing biases",
        _FUSED,
        "-",
        (ROUTER_MLP_STATE,),
    ),
    Family(
        "doge",
        "DogeCDMoE",
        "DogeConfig",
        "product keys: two top-k over sqrt(E) keys each",
        "embedding experts (one up and one down vector each)",
        "dense SwiGLU beside them",
        (PRODUCT_KEYS,),
    ),
)

BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
SUPPORTED = tuple(f.model_type for f in FAMILIES if f.supported)
UNSUPPORTED = tuple(f.model_type for f in FAMILIES if not f.supported)
