"""The DeepSeek router families: DeepSeek-V2/V3/V4, Mistral 4 and kin.

Rows of `families.FAMILIES` (see `family_row.py` for the notation): the
families whose router is DeepSeek-V3's sigmoid + correction bias with
groups, DeepSeek-V2's softmax with group max, or Mistral 4's softmax with
groups scored by their two best.
"""

from __future__ import annotations

from hf_convert import family_row

_DS3 = (
    "ds3: sigmoid + correction bias, groups (sum top-2), norm if "
    "norm_topk_prob (+1e-20), x routed_scaling_factor"
)
_DS2 = (
    "DeepSeek-V2: softmax -> top-k (greedy or group max, 0-fill), never "
    "normalised, x routed_scaling_factor"
)
_DS_SHARED = (
    "shared_experts: SwiGLU, n_shared_experts x moe_intermediate_size, ungated"
)


def _ds3(model_type, block, config, shared=_DS_SHARED):
  """A DeepSeek-V3 block as it is: ds3, fused SwiGLU, `shared`."""
  return family_row.Family(
      model_type, block, config, _DS3, family_row.FUSED, shared
  )


def _ds2(model_type, block, config):
  """A DeepSeek-V2 block as it is."""
  return family_row.Family(
      model_type, block, config, _DS2, family_row.FUSED, _DS_SHARED
  )


def _hy_v4(model_type, block, config):
  """HY-V4 and its VL text part: the same block."""
  return family_row.Family(
      model_type,
      block,
      config,
      _DS3,
      "fused SwiGLU (always silu) with clamp (swiglu_limit)",
      _DS_SHARED + ", not clamped",
      note=(
          "swiglu_limit clamps the routed experts; its shared expert is "
          "not clamped: shared_swiglu_clamp=False"
      ),
  )


ROWS = (
    family_row.Family(
        "axk1",
        "AXK1MoE",
        "AXK1Config",
        _DS3,
        family_row.FUSED,
        _DS_SHARED,
        note=(
            "output_norm=True, output_norm_epsilon=rms_norm_eps: its "
            "post_mlp_layernorm (weight -> output_norm_scale) normalises the "
            "routed plus shared output"
        ),
    ),
    family_row.Family(
        "axk2",
        "AXK2MoE",
        "AXK2Config",
        "ds3; with groups, excluded groups filled with 0.0",
        family_row.FUSED,
        _DS_SHARED,
        note=(
            "supported with n_group None or 1 (A.X-K2-Light, the default); "
            "groups need: "
        )
        + family_row.ZERO_FILLED_GROUPS,
    ),
    _ds3("bailing_hybrid", "BailingHybridMoE", "BailingHybridConfig"),
    family_row.Family(
        "beam",
        "BeamMoE",
        "BeamConfig",
        _DS3 + " (scale after the combine)",
        family_row.FUSED + ", activation in float32",
        "-",
    ),
    _ds2("deepseek_ocr2", "DeepseekOcr2TextMoe", "DeepseekOcr2TextConfig"),
    _ds2("deepseek_v2", "DeepseekV2Moe", "DeepseekV2Config"),
    _ds3("deepseek_v3", "DeepseekV3MoE", "DeepseekV3Config"),
    _ds3("deepseek_v32", "DeepseekV32MoE", "DeepseekV32Config"),
    family_row.Family(
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
    _ds3("dots1", "Dots1MoE", "Dots1Config"),
    _ds3(
        "dots3_note",
        "Dots3NoteTextMoE",
        "Dots3NoteTextConfig",
        "shared_experts: n_shared_experts x shared_experts_intermediate_size, "
        "ungated",
    ),
    _ds3(
        "exaone_moe",
        "ExaoneMoeSparseMoEBlock",
        "ExaoneMoeConfig",
        "shared_experts: num_shared_experts x moe_intermediate_size, ungated",
    ),
    _ds3("glm4_moe", "Glm4MoeMoE", "Glm4MoeConfig"),
    _ds3("glm4_moe_lite", "Glm4MoeLiteMoE", "Glm4MoeLiteConfig"),
    _ds3("glm4v_moe", "Glm4vMoeTextMoE", "Glm4vMoeTextConfig"),
    family_row.Family(
        "glm5_next",
        "Glm5NextTextMoE",
        "Glm5NextTextConfig",
        _DS3,
        "fused SwiGLU (always silu) with clamp (swiglu_limit)",
        _DS_SHARED + ", SwiGLU (hidden_act) with the same clamp",
        note="supported with hidden_act='silu' (the default)",
    ),
    _ds3("glm_moe_dsa", "GlmMoeDsaMoE", "GlmMoeDsaConfig"),
    _hy_v4("hy_v4", "HYV4MoE", "HYV4Config"),
    _hy_v4("hy_v4_vl", "HYV4VLMoE", "HYV4VLTextConfig"),
    _ds3("kimi_linear", "KimiLinearMoE", "KimiLinearConfig"),
    _ds3("mimo_v2_flash", "MiMoV2FlashMoE", "MiMoV2FlashConfig", "-"),
    family_row.Family(
        "mistral4",
        "Mistral4MoE",
        "Mistral4Config",
        "softmax, groups (sum top-2, 0-fill), norm if norm_topk_prob "
        "(+1e-20), x routed_scaling_factor",
        family_row.FUSED,
        _DS_SHARED,
    ),
    family_row.Family(
        "mistral_large4",
        "MistralLarge4TextMoE",
        "MistralLarge4TextConfig",
        "softmax, groups (sum top-2, 0-fill), always norm (+1e-20), x "
        "routed_scaling_factor",
        family_row.FUSED,
        _DS_SHARED,
    ),
    family_row.Family(
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
    _ds3("solar_open", "SolarOpenMoE", "SolarOpenConfig"),
    _ds2("unlimited_ocr", "UnlimitedOcrTextMoe", "UnlimitedOcrTextConfig"),
)
