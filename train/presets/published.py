"""Published parameter counts of the full-size presets, and how to compare.

`train/presets/` holds the configs (from each model's Hugging Face
config.json); the figures here are what the model cards say, so a test can
check that `sizing.py` counts the configs as their authors do.
"""

from __future__ import annotations

import dataclasses

from train import presets
from train.presets import sizing


@dataclasses.dataclass(frozen=True)
class Published:
  """A published parameter count, with where it was read.

  Attributes:
    total: total parameters.
    active: parameters used per token.
    active_counts_embedding: whether `active` includes the input embedding
      table (model cards differ; the output head is always included).
    source: where the figures were read.
    active_counts_head: whether `active` includes the output head (Qwen's
      "non-embedding" figures leave out both tables).
    total_beyond_preset: parameters the card's total counts that the preset
      does not build (Llama 4: the vision encoder and its projector), added
      to the preset's total before comparing; none of them is active per
      text token.
  """

  total: float
  active: float
  active_counts_embedding: bool
  source: str
  active_counts_head: bool = True
  total_beyond_preset: int = 0


# Llama 4's vision encoder (Llama4VisionModel, 850,960,896) and projector
# (Llama4MultiModalProjector, 20,971,520) of the released vision_config
# (hidden 1408, 34 layers, 16 heads, MLP 5632, patch 14, image 336,
# projector 4096 -> 5120), shared by Scout and Maverick; counted with
# transformers on the meta device (presets_llama4_hf_test.py checks it).
LLAMA4_VISION_PARAMS = 850_960_896 + 20_971_520

# Published counts, read with the search tool from the sources named (the
# configs themselves are those of the models' Hugging Face config.json).
PUBLISHED: dict[str, Published] = {
    "deepseek_v3": Published(
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
    "mixtral_8x7b": Published(
        total=46.7e9,
        active=12.9e9,
        active_counts_embedding=True,
        source=(
            "mistral.ai/news/mixtral-of-experts ('46.7B total parameters "
            "but only uses 12.9B parameters per token')"
        ),
    ),
    "qwen3_30b_a3b": Published(
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
    "olmoe_1b_7b": Published(
        total=6.9e9,
        active=1.3e9,
        active_counts_embedding=True,
        source=(
            "OLMoE (arXiv:2409.02060): 6.9B total, 1.3B active per "
            "token, as listed by labindex.ai/outputs/ai2/olmoe; the "
            "abstract rounds them to 7B and 1B"
        ),
    ),
    # Qwen3-Next (issue 33).
    "qwen3_next_80b_a3b": Published(
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
    # --- GPT-OSS (issue 33) ---
    # The card's parameter table, as reproduced by
    # adrian.idv.hk/2026-03-25-gptoss: "Model Size | 116.83B | 20.91B",
    # "Active parameters | 5.13B | 3.61B", "MLP parameters | 114.71B |
    # 19.12B", "Attention parameters | 0.96B | 0.64B", "Embed/Unembed params
    # | 1.16B | 1.16B" (120b | 20b). Its active figures are the attention,
    # the router and top-4 experts, and the unembedding, without the
    # embedding: the only convention the configs match (3.608B and 5.133B;
    # 4.187B and 5.712B with the embedding).
    "gpt_oss_20b": Published(
        total=20.91e9,
        active=3.61e9,
        active_counts_embedding=False,
        source=(
            "OpenAI, gpt-oss-120b & gpt-oss-20b Model Card (arXiv "
            "2508.10925), parameter table: 'Model Size 20.91B', 'Active "
            "parameters 3.61B' (as reproduced by adrian.idv.hk/"
            "2026-03-25-gptoss); section 2.1's text rounds them: "
            "'gpt-oss-20b: 20.9B total parameters (3.6B active)' (as "
            "quoted by lephongphu.site/?p=726)"
        ),
    ),
    "gpt_oss_120b": Published(
        total=116.83e9,
        active=5.13e9,
        active_counts_embedding=False,
        source=(
            "OpenAI, gpt-oss-120b & gpt-oss-20b Model Card (arXiv "
            "2508.10925), parameter table: 'Model Size 116.83B', 'Active "
            "parameters 5.13B' (as reproduced by adrian.idv.hk/"
            "2026-03-25-gptoss); section 2.1's text rounds them: "
            "'gpt-oss-120b: 116.8B total parameters (5.1B active)' (as "
            "quoted by lephongphu.site/?p=726)"
        ),
    ),
    # --- Llama 4 ---
    "llama4_scout": Published(
        total=109e9,
        active=17e9,
        active_counts_embedding=True,
        source=(
            "huggingface.co/blog/llama4-release (Hugging Face's release "
            "post: 'Llama 4 Scout also has 17B active parameters "
            "out of ~109B total'; the transformers docs, model_doc/llama4, "
            "say the same); the figure counts the multimodal model, whose "
            "vision encoder and projector are total_beyond_preset"
        ),
        total_beyond_preset=LLAMA4_VISION_PARAMS,
    ),
    "llama4_maverick": Published(
        total=400e9,
        active=17e9,
        active_counts_embedding=True,
        source=(
            "huggingface.co/blog/llama4-release ('Llama 4 Maverick with "
            "17B active parameters out of ~400B total'; the transformers "
            "docs, model_doc/llama4, call the flavour 402B); the figure "
            "counts the multimodal model, whose vision encoder and "
            "projector are total_beyond_preset"
        ),
        total_beyond_preset=LLAMA4_VISION_PARAMS,
    ),
    # --- end Llama 4 ---
    # --- Gemma 4 (issue 33) ---
    "gemma4_26b_a4b": Published(
        total=25.2e9,
        active=3.8e9,
        active_counts_embedding=True,
        source=(
            "Google's Gemma 4 model card for google/gemma-4-26B-A4B(-it) "
            "('25.2B total parameters, 3.8B active'; its vision encoder "
            "'~550M' listed apart), as quoted by "
            "huggingface.co/OpenExplorer/gemma-4-26B-A4B-it ('Total model "
            "parameters 25.2B | Active 3.8B | Vision model (ViT) ~550M') "
            "and vast.ai/model/gemma-4-26b-a4b-it ('25.2B total parameters "
            "but only 3.8B active per token'). The text decoder alone "
            "counts 25.23B (transformers on the meta device agrees, "
            "presets_gemma4_hf_test.py), so the 25.2B is the text "
            "model's: with the vision tower it would be about 25.8B"
        ),
    ),
    # --- DeepSeek-V4 (issue 33) ---
    "deepseek_v4_flash": Published(
        total=284e9,
        active=13e9,
        active_counts_embedding=False,
        source=(
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
        ),
    ),
    "deepseek_v4_pro": Published(
        total=1.6e12,
        active=49e9,
        active_counts_embedding=False,
        source=(
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
        ),
    ),
}
# The published figures are rounded to 2-3 significant digits: a count
# matches when it is within half a unit of the last published digit, plus 1%
# for the conventions that differ between cards (what counts as "active").
PUBLISHED_RELATIVE_TOLERANCE = 0.01


def published_tolerance(value: float) -> float:
  """Absolute tolerance for a published figure like 46.7e9, 37e9 or 1.6e12
  (cards quote billions, or trillions from 1e12 on)."""
  unit = 1e12 if value >= 1e12 else 1e9
  digits = f"{value / unit:g}"
  decimals = len(digits.partition(".")[2])
  return 0.5 * 10.0 ** (-decimals) * unit + PUBLISHED_RELATIVE_TOLERANCE * value


def counts_as_published(name: str) -> tuple[int, int]:
  """(total, active) of preset `name`, active counted as its card counts it."""
  counts = sizing.param_counts(presets.get_preset(name).model)
  total = counts.total + PUBLISHED[name].total_beyond_preset
  active = (
      counts.active
      if PUBLISHED[name].active_counts_embedding
      else counts.active_without_embedding
  )
  if not PUBLISHED[name].active_counts_head:
    active -= counts.head
  return total, active
