"""GPT-OSS's presets (issue 33): sink attention, sliding windows, YaRN, and
the clamped GLU experts.
"""

from __future__ import annotations

import moe_core
from train.models import model_config
from train.presets import rows


def gpt_oss_moe(
    hidden_size: int,
    *,
    num_experts: int,
    expert_ffn_size: int,
    top_k: int = 4,
) -> moe_core.MoEConfig:
  """GPT-OSS's MoE block at any size (transformers' GptOssMLP).

  A router with a bias, top-k of its logits and a softmax over those K
  (softmax then top-k renormalisation: the same weights); experts with
  biases on every linear and the clamped GLU (up + 1) * g * sigmoid(1.702
  g), gate <= 7 and up in [-7, 7]; no shared expert.
  """
  return rows.moe_block(
      (hidden_size, num_experts, top_k, expert_ffn_size),
      score_func="softmax",
      norm_topk_prob=True,
      router_bias=True,
      activation="gpt_oss_glu",
      swiglu_alpha=1.702,
      swiglu_limit=7.0,
      expert_bias=True,
  )


# GPT-OSS's attention besides its MoE: q/k/v/o biases, sinks, a 128-token
# window on the even layers, YaRN from 4096 to 131072 positions (the
# released config.json's rope_scaling).
GPT_OSS_ATTENTION = dict(
    attention_bias=True,
    attention_sinks=True,
    sliding_window=128,
    full_attention_every=2,
    yarn=model_config.YarnRope(
        factor=32.0,
        original_max_positions=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    ),
)


def gpt_oss_model(
    name: str, *, num_layers: int, num_experts: int
) -> model_config.ModelConfig:
  """A released GPT-OSS model: width 2880, 64 query heads of 64, 8 KV
  heads, vocabulary 201088, untied embeddings, top-4 experts of 2880."""
  return model_config.ModelConfig(
      name=name,
      **rows.dims(
          vocab=201088, d=2880, layers=num_layers, heads=64, kv=8, hd=64
      ),
      moe=gpt_oss_moe(2880, num_experts=num_experts, expert_ffn_size=2880),
      rope_theta=150000.0,
      norm_eps=1e-5,
      **GPT_OSS_ATTENTION,
  )


_GPT_OSS_LEFT_OUT = (
    " Implemented: biased q/k/v/o projections, attention sinks, "
    "alternating 128-token sliding-window and full layers, YaRN RoPE "
    "(factor 32 over 4096), the biased router with a softmax over the "
    "top-4 logits and the clamped GLU experts with biases. Left out: "
    "MXFP4 expert weights (trained here in float32/bfloat16) and the "
    "auxiliary loss transformers adds when output_router_logits is set."
)


TINY_GPT_OSS = rows.Preset(
    description=(
        "GPT-OSS family, tiny: GQA with q/k/v/o biases and attention "
        "sinks, 8-token sliding windows on the even layers, YaRN RoPE; "
        "biased router, softmax over the top-4 of 16 experts, clamped GLU "
        "experts with biases."
    ),
    model=rows.tiny_model(
        "tiny_gpt_oss",
        num_kv_heads=2,
        moe=gpt_oss_moe(rows.TINY_D, num_experts=16, expert_ffn_size=64),
        rope_theta=150000.0,
        norm_eps=1e-5,
        **{
            **GPT_OSS_ATTENTION,
            # A window shorter than the training sequences, so it matters;
            # YaRN stretched from 16 positions, so its ramp crosses pairs.
            "sliding_window": 8,
            "yarn": model_config.YarnRope(
                factor=4.0, original_max_positions=16, truncate=False
            ),
        },
    ),
    train=rows.TrainDefaults(aux_loss_weight=1e-3),
)


def _gpt_oss_release(
    name: str, sizes: tuple[int, int], card: tuple[str, str, str, str]
) -> rows.Preset:
  """A released gpt-oss (a row of `_GPT_OSS_RELEASES`): its `sizes`
  (layers, experts) and the `card`'s figures: total and active parameters
  as the card's table gives them, then as its section 2.1 rounds them."""
  title = name.replace("_", "-")
  total, active, rounded_total, rounded_active = card
  return rows.Preset(
      description=title + "." + _GPT_OSS_LEFT_OUT,
      model=gpt_oss_model(name, num_layers=sizes[0], num_experts=sizes[1]),
      train=rows.SUGGESTED_FULL_SIZE_RUN,
      published=rows.Published(
          total=float(total) * 1e9,
          active=float(active) * 1e9,
          active_counts_embedding=False,
          source=(
              "OpenAI, gpt-oss-120b & gpt-oss-20b Model Card (arXiv "
              f"2508.10925), parameter table: 'Model Size {total}B', 'Active "
              f"parameters {active}B' (as reproduced by adrian.idv.hk/"
              "2026-03-25-gptoss); section 2.1's text rounds them: "
              f"'{title}: {rounded_total}B total parameters "
              f"({rounded_active}B active)' (as quoted by "
              "lephongphu.site/?p=726)"
          ),
      ),
  )


# The released models, a row each: name, (layers, experts), and the card's
# figures in billions: total and active as its parameter table gives them,
# then as its section 2.1's text rounds them. The card's parameter table, as
# reproduced by adrian.idv.hk/2026-03-25-gptoss: "Model Size | 116.83B |
# 20.91B", "Active parameters | 5.13B | 3.61B", "MLP parameters | 114.71B |
# 19.12B", "Attention parameters | 0.96B | 0.64B", "Embed/Unembed params |
# 1.16B | 1.16B" (120b | 20b). Its active figures are the attention, the
# router and top-4 experts, and the unembedding, without the embedding: the
# only convention the configs match (3.608B and 5.133B; 4.187B and 5.712B
# with the embedding).
_GPT_OSS_RELEASES = (
    ("gpt_oss_20b", (24, 32), ("20.91", "3.61", "20.9", "3.6")),
    ("gpt_oss_120b", (36, 128), ("116.83", "5.13", "116.8", "5.1")),
)


# This family's presets, in the order `--model`'s list gives them.
PRESETS = (TINY_GPT_OSS,) + tuple(
    _gpt_oss_release(*row) for row in _GPT_OSS_RELEASES
)
