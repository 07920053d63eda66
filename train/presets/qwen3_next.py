"""Qwen3-Next's presets (issue 33): a hybrid stack of Gated DeltaNet and
gated attention.
"""

from __future__ import annotations

import moe_core
from train.models import gated_deltanet
from train.presets import rows


def qwen3_next_moe(
    hidden_size: int,
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


def _qwen3_next_preset(
    name_dims: tuple[str, tuple[int, int, int, int, int, int]],
    sizes: tuple[tuple[int, int, int, int], tuple[int, int, int, int], int],
    fields: dict,
    *rest,
) -> rows.Preset:
  """A preset of this family (a row of `PRESETS`): the model's name and
  dims (vocabulary, D, layers, heads, KV heads, head dim); its sizes:
  (experts, top-k, expert width F, shared expert width), the first fields
  of its Gated DeltaNet's `DeltaNetConfig` (key heads, value heads, key
  head dim, value head dim), a gated attention layer every how many; its
  other `ModelConfig` fields; then `rows.preset_row`'s `rest` (published
  counts leave out the input embedding and the head: Qwen's
  'non-embedding'). All share per-head QK-norm, the attention output gate,
  RoPE on a quarter of each head and DeltaNet's convolution of 4."""
  moe_sizes, linear, every = sizes
  return rows.preset_row(
      rows.row_model(
          name_dims,
          (qwen3_next_moe, moe_sizes),
          qk_norm="head",
          attention_output_gate=True,
          partial_rotary_factor=0.25,
          linear_attention=gated_deltanet.DeltaNetConfig(
              *linear, conv_kernel=4
          ),
          full_attention_interval=every,
          **fields,
      ),
      rest,
      active_counts_embedding=False,
      active_counts_head=False,
  )


# This family's presets, a row each (`_qwen3_next_preset`), in the order
# `--model`'s list gives them.
PRESETS = tuple(
    _qwen3_next_preset(*row)
    for row in (
        # Every piece of the 80B's stack at CPU size.
        (
            ("tiny_qwen3_next", (256, rows.TINY_D, 4, 4, 2, 32)),
            ((16, 4, 64, 64), (2, 4, 32, 32), 2),
            {},
            rows.TrainDefaults(aux_loss_weight=1e-3),
            "Qwen3-Next family, tiny: a hybrid stack of Gated DeltaNet "
            "(linear attention) and gated softmax attention (every 2nd "
            "layer; per-head QK-norm, RoPE on a quarter of each head), "
            "MoE in every layer: softmax top-4 of 16 with a sigmoid-gated "
            "shared expert. " + _QWEN3_NEXT_LEFT_OUT,
        ),
        # Values of Qwen/Qwen3-Next-80B-A3B-Instruct's config.json
        # (transformers 5.24.0's Qwen3NextConfig defaults are the same,
        # rope_theta apart: the release uses 1e7).
        (
            ("qwen3_next_80b_a3b", (151936, 2048, 48, 16, 2, 256)),
            ((512, 10, 512, 512), (16, 32, 128, 128), 4),
            dict(rope_theta=1e7),
            rows.SUGGESTED_FULL_SIZE_RUN,
            "Qwen3-Next-80B-A3B, main model: 48 layers, 12 x (3 Gated "
            "DeltaNet + 1 gated attention), 512 experts top-10 with a gated "
            "shared expert. " + _QWEN3_NEXT_LEFT_OUT,
            (80e9, 3e9),
            "huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct, README.md "
            "('Number of Parameters: 80B in total and 3B activated'; "
            "'Number of Paramaters (Non-Embedding): 79B'), as quoted by "
            "lmstudio.ai/models/qwen3-next; the MTP module is not counted. "
            "The config gives 79.67B total, 79.05B without the embedding "
            "and head (Qwen's 'non-embedding', as in Qwen3-30B-A3B's "
            "29.9B), and 3.87B active with both tables, 3.25B without: "
            "'3B' fits only the non-embedding active count",
        ),
    )
)
TINY_QWEN3_NEXT, QWEN3_NEXT_80B_A3B = PRESETS
