"""DeepSeek-V4's presets (issue 33): hyper-connections, compressed
attention, hash and sqrt-softplus routing (`train/models/deepseek_v4.py`).
"""

from __future__ import annotations

import moe_core
from train.models import deepseek_v4_config
from train.models import model_config
from train.presets import rows


def deepseek_v4_moe(
    hidden_size: int,
    *,
    num_experts: int,
    top_k: int,
    expert_ffn_size: int,
    routed_scaling_factor: float,
) -> moe_core.MoEConfig:
  """DeepSeek-V4's scored MoE block at any size (its hash layers':
  `deepseek_v4_config.hash_moe`).

  sqrt(softplus) scores with the aux-loss-free correction bias, plain top-k
  (no groups), weights renormalised then scaled, one shared expert as wide
  as a routed one, and the SwiGLU clamp at 10 on routed and shared experts
  (as `hf_convert/` converts transformers' DeepseekV4Config).
  """
  return rows.moe_block(
      (hidden_size, num_experts, top_k, expert_ffn_size),
      score_func="sqrtsoftplus",
      correction_bias=True,
      norm_topk_prob=True,
      norm_epsilon=1e-20,
      routed_scaling_factor=routed_scaling_factor,
      shared_ffn_size=expert_ffn_size,
      swiglu_limit=10.0,
  )


# The released configs' compress_ratios (without the MTP layer's last
# entry), as layer types: 0 -> "sliding", 4 -> "csa", 128 -> "hca".
_V4_RATIO_TYPES = {0: "sliding", 4: "csa", 128: "hca"}


def _v4_layer_types(first: tuple[int, ...], num_layers: int) -> tuple:
  """`first`, then CSA on even and HCA on odd layers (both released maps)."""
  ratios = first + tuple(
      4 if i % 2 == 0 else 128 for i in range(len(first), num_layers)
  )
  return tuple(_V4_RATIO_TYPES[r] for r in ratios)


TINY_DEEPSEEK_V4 = rows.Preset(
    description=(
        "DeepSeek-V4 family, tiny: 4 hyper-connection streams mixed by a "
        "Sinkhorn-normalised matrix, low-rank queries over one shared "
        "key/value head with partial RoPE, per-head sinks, a 32-token "
        "sliding window, compressed-sparse (rate 4, indexer top-8) and "
        "heavily-compressed (rate 16) layers, a grouped low-rank output "
        "projection; 2 hash-routed MoE layers then sqrt-softplus routing "
        "with a correction bias, SwiGLU clamp 10. Left out: YaRN on the "
        "compressed layers' RoPE, the indexer's training loss, the MTP "
        "layer."
    ),
    model=model_config.ModelConfig(
        name="tiny_deepseek_v4",
        **rows.dims(vocab=256, d=rows.TINY_D, layers=4, heads=4, kv=1, hd=64),
        q_lora_rank=64,
        moe=deepseek_v4_moe(
            rows.TINY_D,
            num_experts=16,
            top_k=4,
            expert_ffn_size=64,
            routed_scaling_factor=1.5,
        ),
        deepseek_v4=deepseek_v4_config.DeepseekV4Settings(
            layer_types=("sliding", "csa", "hca", "csa"),
            num_hash_layers=2,
            rope_head_dim=16,
            o_groups=2,
            o_lora_rank=64,
            sliding_window=32,
            csa_rate=4,
            hca_rate=16,
            index_n_heads=2,
            index_head_dim=32,
            index_topk=8,
        ),
    ),
    train=rows.TrainDefaults(),
)


# DeepSeek-V3's recipe at V4's batch (the V4 report gives none of its own).
_V4_RUN = rows.full_size_training(
    batch_size=1024, learning_rate=2.2e-4, bias_update_rate=1e-3
)


_V4_DESCRIPTION = (
    "(main model without the MTP layer). The training model implements "
    "hyper-connections with Sinkhorn, the low-rank query, one shared "
    "key/value head, partial RoPE, sinks, the 128-token window, both "
    "compressors, the indexer's top-k, hash and sqrt-softplus routing; "
    "left out: YaRN on the compressed layers' RoPE, the indexer's loss."
)


def _v4_release(
    names: tuple[str, str],
    sizes: tuple[int, int, int, int, int, int],
    routing: tuple[int, int, float, tuple[int, int]],
    published: tuple[float, float, str],
) -> rows.Preset:
  """A released DeepSeek-V4 (a row of `_V4_RELEASES`): vocabulary 129280,
  one key/value head of 512, RoPE theta 1e4, top-6 experts, output rank
  1024, CSA and HCA alternating after the first two layers; DeepSeek-V3's
  recipe at V4's batch."""
  name, title = names
  total, active, source = published
  d, layers, heads, q_lora_rank, o_groups, index_topk = sizes
  num_experts, expert_ffn_size, scale, first_ratios = routing
  return rows.Preset(
      description=title + _V4_DESCRIPTION,
      model=model_config.ModelConfig(
          name=name,
          **rows.dims(
              vocab=129280, d=d, layers=layers, heads=heads, kv=1, hd=512
          ),
          q_lora_rank=q_lora_rank,
          moe=deepseek_v4_moe(
              d,
              num_experts=num_experts,
              top_k=6,
              expert_ffn_size=expert_ffn_size,
              routed_scaling_factor=scale,
          ),
          rope_theta=10000.0,
          deepseek_v4=deepseek_v4_config.DeepseekV4Settings(
              layer_types=_v4_layer_types(first_ratios, layers),
              o_groups=o_groups,
              o_lora_rank=1024,
              index_topk=index_topk,
          ),
      ),
      train=_V4_RUN,
      published=rows.Published(
          total, active, active_counts_embedding=False, source=source
      ),
  )


# Where each release's published counts were read.
_V4_FLASH_SOURCE = (
    "huggingface.co/deepseek-ai/DeepSeek-V4-Flash, README.md's "
    "model table ('DeepSeek-V4-Flash | 284B | 13B | 1M'), as "
    "extracted by raw.githubusercontent.com/antirez/ds4/main/"
    "MODEL_CARD.md and quoted by openrouter.ai/deepseek/"
    "deepseek-v4-flash ('284B total parameters and 13B activated "
    "parameters'). The config gives 284.33B total (transformers "
    "5.24.0 counts the same on the meta device, plus its two "
    "routing buffers) and 13.27B active without the input "
    "embedding (13.80B with it), so the card's 13B leaves the "
    "embedding out. The MTP layer is not counted"
)
_V4_PRO_SOURCE = (
    "huggingface.co/deepseek-ai/DeepSeek-V4-Pro, README.md's model "
    "table ('DeepSeek-V4-Pro | 1.6T | 49B | 1M'), as extracted by "
    "raw.githubusercontent.com/antirez/ds4/main/MODEL_CARD.md. The "
    "config's values were read from third-party transcriptions of "
    "its config.json (no copy of the file itself was found): 61 "
    "layers of width 7168, 128 heads, q_lora_rank 1536, 16 output "
    "groups, index_topk 1024, 384 experts of 3072 (top 6, scale "
    "2.5), compress_ratios 128, 128, then 4 / 128 alternating. "
    "They give 1.573T total, within the card's rounding of 1.6T, "
    "and 48.85B active without the input embedding (49.78B with "
    "it)"
)


# The released models, a row each: name and the description's head; the
# config's D, layers, heads, q_lora_rank, o_groups and index_topk; its
# experts, their F, the routed scale and the first two layers' compress
# ratios; the published counts (total, and active without the input
# embedding) and where they were read.
_V4_RELEASES = (
    (
        ("deepseek_v4_flash", "DeepSeek-V4-Flash (284B, 13B active) "),
        (4096, 43, 64, 1024, 8, 512),
        (256, 2048, 1.5, (0, 0)),
        (284e9, 13e9, _V4_FLASH_SOURCE),
    ),
    (
        ("deepseek_v4_pro", "DeepSeek-V4-Pro (1.6T, 49B active) "),
        (7168, 61, 128, 1536, 16, 1024),
        (384, 3072, 2.5, (128, 128)),
        (1.6e12, 49e9, _V4_PRO_SOURCE),
    ),
)


# This family's presets, in the order `--model`'s list gives them.
PRESETS = (TINY_DEEPSEEK_V4,) + tuple(_v4_release(*row) for row in _V4_RELEASES)
