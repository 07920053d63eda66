"""Softmax-routed families: Mixtral, Qwen3-MoE and OLMoE (plain top-k, no
shared expert).
"""

from __future__ import annotations

import moe_core
from train.models import model_config
from train.presets import rows


def softmax_moe(
    hidden_size: int,
    *,
    num_experts: int,
    top_k: int,
    expert_ffn_size: int,
    norm_topk_prob: bool = True,
) -> moe_core.MoEConfig:
  """A Mixtral / Qwen3-MoE / OLMoE block: softmax scores, plain top-k."""
  return rows.moe_block(
      (hidden_size, num_experts, top_k, expert_ffn_size),
      score_func="softmax",
      norm_topk_prob=norm_topk_prob,
  )


TINY_MIXTRAL = rows.Preset(
    description="Mixtral style, tiny: softmax top-2 of 8 experts, GQA.",
    model=rows.tiny_model(
        "tiny_mixtral",
        num_kv_heads=2,
        moe=softmax_moe(
            rows.TINY_D, num_experts=8, top_k=2, expert_ffn_size=192
        ),
    ),
    train=rows.TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
)


TINY_QWEN3 = rows.Preset(
    description=(
        "Qwen3-MoE / OLMoE style, tiny: fine-grained experts "
        "(32, top-8), softmax with top-k renormalisation, GQA with "
        "per-head QK-norm."
    ),
    model=rows.tiny_model(
        "tiny_qwen3",
        num_kv_heads=2,
        qk_norm="head",
        moe=softmax_moe(
            rows.TINY_D, num_experts=32, top_k=8, expert_ffn_size=48
        ),
    ),
    train=rows.TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
)


MIXTRAL_8X7B = rows.Preset(
    description="Mixtral 8x7B.",
    model=model_config.ModelConfig(
        name="mixtral_8x7b",
        **rows.dims(vocab=32000, d=4096, layers=32, heads=32, kv=8, hd=128),
        moe=softmax_moe(4096, num_experts=8, top_k=2, expert_ffn_size=14336),
        rope_theta=1e6,
        norm_eps=1e-5,
    ),
    train=rows.full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-2
    ),
    published=rows.Published(
        total=46.7e9,
        active=12.9e9,
        active_counts_embedding=True,
        source=(
            "mistral.ai/news/mixtral-of-experts ('46.7B total parameters "
            "but only uses 12.9B parameters per token')"
        ),
    ),
)


QWEN3_30B_A3B = rows.Preset(
    description="Qwen3-30B-A3B.",
    model=model_config.ModelConfig(
        name="qwen3_30b_a3b",
        **rows.dims(vocab=151936, d=2048, layers=48, heads=32, kv=4, hd=128),
        qk_norm="head",
        moe=softmax_moe(2048, num_experts=128, top_k=8, expert_ffn_size=768),
        rope_theta=1e6,
    ),
    train=rows.SUGGESTED_FULL_SIZE_RUN,
    published=rows.Published(
        total=30.5e9,
        active=3.3e9,
        active_counts_embedding=True,
        source=(
            "the Qwen3-30B-A3B model card's '30.5B in total and 3.3B "
            "activated', as quoted by docs.vllm.ai (vLLM-Ascend "
            "tutorials/models/Qwen3-30B-A3B) and "
            "apxml.com/models/qwen3-30b-a3b"
        ),
    ),
)


OLMOE_1B_7B = rows.Preset(
    description="OLMoE-1B-7B.",
    model=model_config.ModelConfig(
        name="olmoe_1b_7b",
        **rows.dims(vocab=50304, d=2048, layers=16, heads=16, kv=16, hd=128),
        qk_norm="full",
        moe=softmax_moe(
            2048,
            num_experts=64,
            top_k=8,
            expert_ffn_size=1024,
            norm_topk_prob=False,
        ),
        norm_eps=1e-5,
    ),
    train=rows.full_size_training(
        batch_size=1024,
        learning_rate=4e-4,
        aux_loss_weight=1e-2,
        z_loss_weight=1e-3,
    ),
    published=rows.Published(
        total=6.9e9,
        active=1.3e9,
        active_counts_embedding=True,
        source=(
            "OLMoE (arXiv:2409.02060): 6.9B total, 1.3B active per "
            "token, as listed by labindex.ai/outputs/ai2/olmoe; the "
            "abstract rounds them to 7B and 1B"
        ),
    ),
)


# This family's presets, in the order `--model`'s list gives them.
PRESETS = (
    TINY_MIXTRAL,
    TINY_QWEN3,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    OLMOE_1B_7B,
)
