"""DeepSeek-V3's presets: the tiny default, one TPU v5e chip's, and the
671B (`tiny_dsv3`, `tpu_v5e_dsv3` and its dense twin `tpu_v5e_dsv3_dense`,
`deepseek_v3`).
"""

from __future__ import annotations

import dataclasses

import moe_core
from train.presets import rows


def deepseek_v3_moe(
    hidden_size: int,
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


def _deepseek_v3_preset(
    name_dims: tuple[str, tuple[int, ...]],
    sizes: tuple[tuple[int, int, int, int, int], tuple[int, int]],
    fields: dict,
    *rest,
) -> rows.Preset:
  """A preset of this family (a row of `PRESETS`): the model's name and
  dims (vocabulary, D, layers, heads, and where given KV heads and head
  dim); its sizes: (experts, top-k, expert width F, groups, groups kept),
  (dense first layers, their MLP's width); its other `ModelConfig` fields;
  then `rows.preset_row`'s `rest` (published counts include the input
  embedding)."""
  moe_sizes, (first_dense_layers, dense_ffn_size) = sizes
  return rows.preset_row(
      rows.row_model(
          name_dims,
          (deepseek_v3_moe, moe_sizes),
          first_dense_layers=first_dense_layers,
          dense_ffn_size=dense_ffn_size,
          **fields,
      ),
      rest,
      active_counts_embedding=True,
  )


# The width of the one-chip preset.
_TPU_D = 1024


# DeepSeek-V3's multi-head latent attention (the 671B's config.json).
_V3_MLA = dict(
    attention="mla",
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)


# This family's presets, a row each (`_deepseek_v3_preset`), in the order
# `--model`'s list gives them.
PRESETS = tuple(
    _deepseek_v3_preset(*row)
    for row in (
        (
            ("tiny_dsv3", (256, rows.TINY_D, 4, 4, 4, 32)),
            ((16, 4, 64, 4, 2), (1, 384)),
            {},
            rows.TrainDefaults(),
            "DeepSeek-V3 family, tiny: a dense first layer, then MoE "
            "layers with one shared expert, sigmoid routing with an "
            "aux-loss-free correction bias, group-limited top-k and "
            "routed scaling; MHA with RoPE.",
        ),
        # Sized by compiling its train step for a v5e (jax's TPU topology,
        # from a CPU host with libtpu), not by the analytic estimate alone: a
        # 0.66B sibling (16 layers, experts 1024 -> 384), estimated at 11.8
        # GiB, compiled to 16.7 GiB, over the chip. XLA's figure is about
        # 1.5x sizing.py's at these sizes.
        (
            ("tpu_v5e_dsv3", (256, _TPU_D, 14, 8, 8, 128)),
            ((32, 4, 256, 4, 2), (1, 3072)),
            {},
            # A learning rate for width 1024 (the tiny presets' 3e-3 is for
            # 128).
            rows.TrainDefaults(
                batch_size=16, seq_len=512, learning_rate=1e-3, warmup_steps=20
            ),
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
            "estimate is 12.2 GiB.",
        ),
        (
            ("deepseek_v3", (129280, 7168, 61, 128)),
            ((256, 8, 2048, 8, 4), (3, 18432)),
            dict(**_V3_MLA, rope_theta=10000.0),
            rows.full_size_training(
                batch_size=15360, learning_rate=2.2e-4, bias_update_rate=1e-3
            ),
            "DeepSeek-V3 (671B), main model without the MTP module.",
            (671e9, 37e9),
            "huggingface.co/deepseek-ai/DeepSeek-V3, README.md ('671B "
            "total parameters with 37B activated for each token'); the "
            "MTP module is counted apart. README_WEIGHTS.md's finer "
            "'36.7B activated, including 0.9B for Embedding and 0.9B for "
            "the output Head' disagrees with the config by about 0.9B "
            "(the config gives 37.5B with both, 36.6B without the input "
            "embedding); both conventions fall within the card's 37B",
        ),
    )
)
TINY_DSV3, TPU_V5E_DSV3, DEEPSEEK_V3 = PRESETS


def dense_twin(preset: rows.Preset, name: str) -> rows.Preset:
  """`preset`'s model with every layer a dense MLP of one width: the width
  that gives the model the same active FFN FLOPs a token (each MoE layer's
  K routed experts and its shared expert, each dense layer's MLP), rounded
  to 128. The baseline an MoE training step is measured against."""
  model = preset.model
  moe = model.moe
  moe_width = moe.top_k * moe.expert_ffn_size + moe.shared_ffn_size
  total = (
      model.num_moe_layers * moe_width
      + model.num_dense_layers * model.dense_ffn_size
  )
  width = max(128, round(total / model.num_layers / 128) * 128)
  return dataclasses.replace(
      preset,
      model=dataclasses.replace(
          model, name=name, moe=None, dense_ffn_size=width
      ),
      description=(
          f"{model.name}'s dense twin: the same model with every layer a "
          f"dense MLP of width {width}, the same active FFN FLOPs a token "
          f"(the baseline of {model.name}'s MoE step)."
      ),
      published=None,
  )


# tpu_v5e_dsv3 with 14 dense layers of width 1408 (13 MoE layers of 4 x 256
# routed + 256 shared, and one dense layer of 3072, a layer on average).
TPU_V5E_DSV3_DENSE = dense_twin(TPU_V5E_DSV3, "tpu_v5e_dsv3_dense")
PRESETS = PRESETS + (TPU_V5E_DSV3_DENSE,)


# The remat policy TPU_V5E_DSV3's description's memory estimate is for.
TPU_V5E_DSV3_REMAT = "save_moe"
