"""DeepSeek-V3's presets: the tiny default, one TPU v5e chip's, and the
671B (`tiny_dsv3`, `tpu_v5e_dsv3`, `deepseek_v3`).
"""

from __future__ import annotations

import moe_core
from train.models import model_config
from train.presets import rows


def deepseek_v3_moe(
    hidden_size: int,
    *,
    num_experts: int,
    top_k: int,
    expert_ffn_size: int,
    n_group: int,
    topk_group: int,
) -> moe_core.MoEConfig:
  """DeepSeek-V3's MoE block at any size (D, E, K, F and the groups given).

  Sigmoid scores with the aux-loss-free correction bias, group-limited top-k
  (`n_group` groups ranked by the sum of their two best scores, the best
  `topk_group` kept), top-k weights renormalised then scaled by 2.5, and one
  shared expert as wide as a routed one.
  """
  return rows.moe_block(
      (hidden_size, num_experts, top_k, expert_ffn_size),
      score_func="sigmoid",
      correction_bias=True,
      group_score="sum_top2",
      norm_topk_prob=True,
      norm_epsilon=1e-20,
      routed_scaling_factor=2.5,
      n_group=n_group,
      topk_group=topk_group,
      shared_ffn_size=expert_ffn_size,
  )


TINY_DSV3 = rows.Preset(
    description=(
        "DeepSeek-V3 family, tiny: a dense first layer, then MoE "
        "layers with one shared expert, sigmoid routing with an "
        "aux-loss-free correction bias, group-limited top-k and "
        "routed scaling; MHA with RoPE."
    ),
    model=rows.tiny_model(
        "tiny_dsv3",
        num_kv_heads=4,
        first_dense_layers=1,
        dense_ffn_size=384,
        moe=deepseek_v3_moe(
            rows.TINY_D,
            num_experts=16,
            top_k=4,
            expert_ffn_size=64,
            n_group=4,
            topk_group=2,
        ),
    ),
    train=rows.TrainDefaults(),
)


# The width of the one-chip preset.
_TPU_D = 1024


# Sized by compiling its train step for a v5e (jax's TPU topology, from a
# CPU host with libtpu), not by the analytic estimate alone: a 0.66B
# sibling (16 layers, experts 1024 -> 384), estimated at 11.8 GiB, compiled
# to 16.7 GiB, over the chip. XLA's figure is about 1.5x sizing.py's
# at these sizes.
TPU_V5E_DSV3 = rows.Preset(
    description=(
        "DeepSeek-V3 family for one TPU v5e chip (16 GiB HBM): 0.41B "
        "parameters (120M active per token), byte tokens, 14 layers of "
        "width 1024 (a dense first layer, then MoE layers of 32 routed "
        "experts, top-4 in 2 of 4 groups, and a shared expert, each "
        "1024 -> 256), MHA of 8 heads of 128. Float32 parameters and AdamW "
        "state (16 bytes a parameter: 6.1 GiB) with bfloat16 compute. At "
        "its batch of 16 x 512 tokens with --remat=save_moe, "
        "train/presets/sizing.py estimates 7.5 GiB a device and XLA's TPU "
        "compiler (libtpu 0.0.50, the step compiled for a v5e from a CPU "
        "host) 11.5 GiB (9.3 GiB with --remat=full); without remat the "
        "estimate is 12.2 GiB."
    ),
    model=model_config.ModelConfig(
        name="tpu_v5e_dsv3",
        **rows.dims(vocab=256, d=_TPU_D, layers=14, heads=8, kv=8, hd=128),
        first_dense_layers=1,
        dense_ffn_size=3072,
        moe=deepseek_v3_moe(
            _TPU_D,
            num_experts=32,
            top_k=4,
            expert_ffn_size=256,
            n_group=4,
            topk_group=2,
        ),
    ),
    # A learning rate for width 1024 (the tiny presets' 3e-3 is for 128).
    train=rows.TrainDefaults(
        batch_size=16, seq_len=512, learning_rate=1e-3, warmup_steps=20
    ),
)


# The remat policy the description's memory estimate is for.
TPU_V5E_DSV3_REMAT = "save_moe"


DEEPSEEK_V3 = rows.Preset(
    description="DeepSeek-V3 (671B), main model without the MTP module.",
    model=model_config.ModelConfig(
        name="deepseek_v3",
        **rows.dims(vocab=129280, d=7168, layers=61, heads=128),
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_dense_layers=3,
        dense_ffn_size=18432,
        moe=deepseek_v3_moe(
            7168,
            num_experts=256,
            top_k=8,
            expert_ffn_size=2048,
            n_group=8,
            topk_group=4,
        ),
        rope_theta=10000.0,
    ),
    train=rows.full_size_training(
        batch_size=15360, learning_rate=2.2e-4, bias_update_rate=1e-3
    ),
    published=rows.Published(
        total=671e9,
        active=37e9,
        active_counts_embedding=True,
        source=(
            "huggingface.co/deepseek-ai/DeepSeek-V3, README.md ('671B "
            "total parameters with 37B activated for each token'); the "
            "MTP module is counted apart. README_WEIGHTS.md's finer "
            "'36.7B activated, including 0.9B for Embedding and 0.9B for "
            "the output Head' disagrees with the config by about 0.9B "
            "(the config gives 37.5B with both, 36.6B without the input "
            "embedding); both conventions fall within the card's 37B"
        ),
    ),
)


# This family's presets, in the order `--model`'s list gives them.
PRESETS = (
    TINY_DSV3,
    TPU_V5E_DSV3,
    DEEPSEEK_V3,
)
