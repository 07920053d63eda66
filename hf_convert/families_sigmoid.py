"""The sigmoid router families: Llama 4, MiniMax-M2, Inkling and kin.

Rows of `families.FAMILIES` (see `family_row.py` for the notation): the
families that score experts with a sigmoid, most with a correction bias
for the choice only, without DeepSeek-V3's groups.
"""

from __future__ import annotations

from hf_convert import family_row

ROWS = (
    family_row.Family(
        "afmoe",
        "AfmoeSparseMoeBlock",
        "AfmoeConfig",
        "sigmoid + expert_bias (choice only), norm (+1e-20), x route_scale",
        family_row.FUSED,
        "shared_experts: num_shared_experts x moe_intermediate_size, ungated",
    ),
    family_row.Family(
        "flint",
        "FlintSparseMoeBlock",
        "FlintConfig",
        "sigmoid -> top-k (no bias), norm if norm_topk_prob",
        family_row.FUSED,
        "shared_expert: shared_expert_intermediate_size, ungated",
    ),
    family_row.Family(
        "hy_v3",
        "HYV3MoE",
        "HYV3Config",
        "sigmoid + e_score_correction_bias (block buffer), norm (+1e-20), x "
        "router_scaling_factor",
        family_row.FUSED,
        "shared_experts: num_shared_experts x moe_intermediate_size, ungated",
    ),
    family_row.Family(
        "inkling",
        "InklingMoE",
        "InklingTextConfig",
        "sigmoid over E routed + S shared logits, bias for the choice; the K "
        "chosen and the S shared weights normalised together (softmax of "
        "log-sigmoid), x route_scale x global_scale",
        family_row.FUSED,
        "shared_experts: SwiGLU, each scaled by its router weight",
        note=(
            "num_always_on_experts=S: its S shared experts are dropless' "
            "last S experts (num_experts = E + S, top_k = K + S), always "
            "chosen and weighed by the router with the K; gate.global_scale "
            "-> expert_output_scale"
        ),
    ),
    family_row.Family(
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
    family_row.Family(
        "inkling2_loop",
        "Inkling2LoopSparseMoeBlock",
        "Inkling2LoopTextConfig",
        "as inkling2",
        "as inkling2",
        "-",
        note="supported with scoring_func='sigmoid' (the default)",
    ),
    family_row.Family(
        "kolibri1",
        "Kolibri1SparseMoeBlock",
        "Kolibri1Config",
        "logits + e_score_correction_bias -> top-k; sigmoid of the chosen "
        "(unbiased) logits, norm if norm_topk_prob",
        family_row.FUSED,
        "shared_experts: shared_expert_intermediate_size, ungated",
    ),
    family_row.Family(
        "laguna",
        "LagunaSparseMoeBlock",
        "LagunaConfig",
        "optional logit soft-cap, sigmoid + e_score_correction_bias, norm, x "
        "moe_routed_scaling_factor",
        family_row.FUSED,
        "shared_experts: shared_expert_intermediate_size, ungated",
    ),
    family_row.Family(
        "lfm2_moe",
        "Lfm2MoeSparseMoeBlock",
        "Lfm2MoeConfig",
        "sigmoid (+ expert_bias if use_expert_bias) -> top-k, norm if "
        "norm_topk_prob (+1e-6), x routed_scaling_factor",
        "fused SwiGLU (always silu)",
        "-",
    ),
    family_row.Family(
        "llama4",
        "Llama4TextMoe",
        "Llama4TextConfig",
        "top-k logits -> sigmoid (no renormalisation); the weight scales the "
        "expert's input",
        "SwiGLU, gate_up_proj [E, D, 2F]",
        "shared_expert: intermediate_size, ungated",
    ),
    family_row.Family(
        "minimax_m2",
        "MiniMaxM2SparseMoeBlock",
        "MiniMaxM2Config",
        "sigmoid + e_score_correction_bias (block buffer), norm (no epsilon)",
        family_row.FUSED + ", width intermediate_size",
        "-",
    ),
    family_row.Family(
        "minimax_m3_vl",
        "MiniMaxM3VLSparseMoeBlock",
        "MiniMaxM3VLTextConfig",
        "as minimax_m2, x routed_scaling_factor (after the combine)",
        "GPT-OSS clamped GLU with gate and up chunked (not interleaved)",
        "shared_experts: shared_intermediate_size, the same clamped GLU "
        "(gate_up_proj [2Fs, D], gate rows first)",
    ),
    family_row.Family(
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
    family_row.Family(
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
            + family_row.CLAMP_AFTER_ACTIVATION
        ),
    ),
)
