"""Softmax-routed families: Mixtral, Qwen3-MoE and OLMoE (plain top-k, no
shared expert).
"""

from __future__ import annotations

import moe_core
from train.presets import rows


def softmax_moe(
    hidden_size: int,
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


def _softmax_preset(
    names_sizes: tuple[str, tuple[int, ...], tuple],
    fields: dict,
    *rest,
) -> rows.Preset:
  """A preset of this family (a row of `PRESETS`): the model's name, its
  dims (vocabulary, D, layers, heads, KV heads, head dim) and MoE block
  (experts, top-k, expert width F and, where given, whether top-k
  renormalises: yes by default); its other `ModelConfig` fields; then
  `rows.preset_row`'s `rest` (published counts include the input
  embedding)."""
  return rows.preset_row(
      rows.row_model(
          names_sizes[:2],
          (softmax_moe, names_sizes[2]),
          **fields,
      ),
      rest,
      active_counts_embedding=True,
  )


# The tiny models' dims (`rows.tiny_model`'s, with 2 KV heads) and run.
_TINY = (256, rows.TINY_D, 4, 4, 2, 32)
_TINY_RUN = rows.TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3)


# This family's presets, a row each (`_softmax_preset`), in the order
# `--model`'s list gives them.
PRESETS = tuple(
    _softmax_preset(*row)
    for row in (
        (
            ("tiny_mixtral", _TINY, (8, 2, 192)),
            {},
            _TINY_RUN,
            "Mixtral style, tiny: softmax top-2 of 8 experts, GQA.",
        ),
        (
            ("tiny_qwen3", _TINY, (32, 8, 48)),
            dict(qk_norm="head"),
            _TINY_RUN,
            "Qwen3-MoE / OLMoE style, tiny: fine-grained experts "
            "(32, top-8), softmax with top-k renormalisation, GQA with "
            "per-head QK-norm.",
        ),
        (
            ("mixtral_8x7b", (32000, 4096, 32, 32, 8, 128), (8, 2, 14336)),
            dict(rope_theta=1e6, norm_eps=1e-5),
            rows.full_size_training(
                batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-2
            ),
            "Mixtral 8x7B.",
            (46.7e9, 12.9e9),
            "mistral.ai/news/mixtral-of-experts ('46.7B total parameters "
            "but only uses 12.9B parameters per token')",
        ),
        (
            ("qwen3_30b_a3b", (151936, 2048, 48, 32, 4, 128), (128, 8, 768)),
            dict(qk_norm="head", rope_theta=1e6),
            rows.SUGGESTED_FULL_SIZE_RUN,
            "Qwen3-30B-A3B.",
            (30.5e9, 3.3e9),
            "the Qwen3-30B-A3B model card's '30.5B in total and 3.3B "
            "activated', as quoted by docs.vllm.ai (vLLM-Ascend "
            "tutorials/models/Qwen3-30B-A3B) and "
            "apxml.com/models/qwen3-30b-a3b",
        ),
        (
            (
                "olmoe_1b_7b",
                (50304, 2048, 16, 16, 16, 128),
                (64, 8, 1024, False),
            ),
            dict(qk_norm="full", norm_eps=1e-5),
            rows.full_size_training(
                batch_size=1024,
                learning_rate=4e-4,
                aux_loss_weight=1e-2,
                z_loss_weight=1e-3,
            ),
            "OLMoE-1B-7B.",
            (6.9e9, 1.3e9),
            "OLMoE (arXiv:2409.02060): 6.9B total, 1.3B active per "
            "token, as listed by labindex.ai/outputs/ai2/olmoe; the "
            "abstract rounds them to 7B and 1B",
        ),
    )
)
TINY_MIXTRAL, TINY_QWEN3, MIXTRAL_8X7B, QWEN3_30B_A3B, OLMOE_1B_7B = PRESETS
