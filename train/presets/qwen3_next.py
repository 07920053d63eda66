"""Qwen3-Next's presets (issue 33): a hybrid stack of Gated DeltaNet and
gated attention.
"""

from __future__ import annotations

import moe_core
from train.models import gated_deltanet
from train.models import model_config
from train.presets import rows


def qwen3_next_moe(
    hidden_size: int,
    *,
    num_experts: int,
    top_k: int,
    expert_ffn_size: int,
    shared_ffn_size: int,
) -> moe_core.MoEConfig:
  """Qwen3-Next's MoE block: softmax, top-k renormalised, one shared
  expert whose output is scaled per token by sigmoid(x @ shared_gate)."""
  return rows.moe_block(
      (hidden_size, num_experts, top_k, expert_ffn_size),
      score_func="softmax",
      norm_topk_prob=True,
      shared_ffn_size=shared_ffn_size,
      shared_expert_gate=True,
  )


# What the training model leaves out of Qwen3-Next, for the descriptions.
_QWEN3_NEXT_LEFT_OUT = (
    "Left out: the multi-token-prediction module; zero-centred norm "
    "scales (1 + w; the same function, and the optimiser does not decay "
    "1-D parameters); layers scan only unrolled (--noscan_layers)."
)


# Qwen3-Next (issue 33): every piece of the 80B's stack at CPU size.
TINY_QWEN3_NEXT = rows.Preset(
    description=(
        "Qwen3-Next family, tiny: a hybrid stack of Gated DeltaNet "
        "(linear attention) and gated softmax attention (every 2nd "
        "layer; per-head QK-norm, RoPE on a quarter of each head), "
        "MoE in every layer: softmax top-4 of 16 with a sigmoid-gated "
        "shared expert. " + _QWEN3_NEXT_LEFT_OUT
    ),
    model=rows.tiny_model(
        "tiny_qwen3_next",
        num_kv_heads=2,
        qk_norm="head",
        attention_output_gate=True,
        partial_rotary_factor=0.25,
        linear_attention=gated_deltanet.DeltaNetConfig(
            num_key_heads=2,
            num_value_heads=4,
            key_head_dim=32,
            value_head_dim=32,
            conv_kernel=4,
        ),
        full_attention_interval=2,
        moe=qwen3_next_moe(
            rows.TINY_D,
            num_experts=16,
            top_k=4,
            expert_ffn_size=64,
            shared_ffn_size=64,
        ),
    ),
    train=rows.TrainDefaults(aux_loss_weight=1e-3),
)


# Qwen3-Next (issue 33). Values of Qwen/Qwen3-Next-80B-A3B-Instruct's
# config.json (transformers 5.24.0's Qwen3NextConfig defaults are the same,
# rope_theta apart: the release uses 1e7).
QWEN3_NEXT_80B_A3B = rows.Preset(
    description=(
        "Qwen3-Next-80B-A3B, main model: 48 layers, 12 x (3 Gated "
        "DeltaNet + 1 gated attention), 512 experts top-10 with a gated "
        "shared expert. " + _QWEN3_NEXT_LEFT_OUT
    ),
    model=model_config.ModelConfig(
        name="qwen3_next_80b_a3b",
        **rows.dims(vocab=151936, d=2048, layers=48, heads=16, kv=2, hd=256),
        qk_norm="head",
        attention_output_gate=True,
        partial_rotary_factor=0.25,
        linear_attention=gated_deltanet.DeltaNetConfig(
            num_key_heads=16,
            num_value_heads=32,
            key_head_dim=128,
            value_head_dim=128,
            conv_kernel=4,
        ),
        full_attention_interval=4,
        moe=qwen3_next_moe(
            2048,
            num_experts=512,
            top_k=10,
            expert_ffn_size=512,
            shared_ffn_size=512,
        ),
        rope_theta=1e7,
    ),
    train=rows.SUGGESTED_FULL_SIZE_RUN,
    published=rows.Published(
        total=80e9,
        active=3e9,
        active_counts_embedding=False,
        active_counts_head=False,
        source=(
            "huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct, README.md "
            "('Number of Parameters: 80B in total and 3B activated'; "
            "'Number of Paramaters (Non-Embedding): 79B'), as quoted by "
            "lmstudio.ai/models/qwen3-next; the MTP module is not counted. "
            "The config gives 79.67B total, 79.05B without the embedding "
            "and head (Qwen's 'non-embedding', as in Qwen3-30B-A3B's "
            "29.9B), and 3.87B active with both tables, 3.25B without: "
            "'3B' fits only the non-embedding active count"
        ),
    ),
)


# This family's presets, in the order `--model`'s list gives them.
PRESETS = (
    TINY_QWEN3_NEXT,
    QWEN3_NEXT_80B_A3B,
)
