"""Gemma 4's presets (issue 33): a dense MLP beside each MoE block, sliding
and global layers (`train/models/gemma4.py`).
"""

from __future__ import annotations

import moe_core
from train.models import gemma4_layout
from train.presets import rows


def gemma4_moe(
    hidden_size: int,
    num_experts: int,
    top_k: int,
    expert_ffn_size: int,
    norm_eps: float = 1e-6,
) -> moe_core.MoEConfig:
  """Gemma 4's MoE block (the half of its decoder layer) at any size.

  It reads the layer's residual: the router through its own RMS norm and
  scale [D] times hidden_size ** -0.5, the experts through their own RMS
  norm; softmax scores, top-k renormalised, then times a learned scale per
  chosen expert; GeGLU (tanh) experts. As
  `hf_convert`'s gemma4 entry reads a transformers config.
  """
  return rows.moe_block(
      (hidden_size, num_experts, top_k, expert_ffn_size),
      score_func="softmax",
      norm_topk_prob=True,
      router_input_norm=True,
      router_input_scale=float(hidden_size**-0.5),
      expert_input_norm=True,
      input_norm_epsilon=norm_eps,
      expert_output_scale=True,
      activation="gelu_tanh",
  )


_GEMMA4_LEFT_OUT = (
    "Left out: the per-layer layer_scalar buffer (1 at initialisation, not "
    "a parameter) and the vision tower. Scanned layers stack "
    "periods of global_every layers. The embedding scale sqrt(D) is the "
    "tied head's D ** -0.5 reparametrised (the same function)."
)


def _gemma4_preset(
    name_dims: tuple[str, tuple[int, int, int, int, int, int]],
    sizes: tuple[tuple[int, int, int], int, tuple[int, int, int, int]],
    *rest,
) -> rows.Preset:
  """A preset of this family (a row of `PRESETS`): the model's name and
  dims (vocabulary, D, layers, heads, KV heads, head dim); its sizes:
  (experts, top-k, expert width F), the dense MLP's width, the first
  fields of its `Gemma4Layout` (sliding window, a global layer every how
  many, the global layers' head dim and KV heads); then
  `rows.preset_row`'s `rest` (published counts include the input
  embedding). All share per-head QK-norm, tied embeddings, global layers
  with keys as values and RoPE (theta 1e6) on a quarter of the pairs,
  logits soft-capped at 30, RoPE theta 1e4 and RMSNorm epsilon 1e-6 (as
  released)."""
  moe_sizes, dense_ffn_size, layout = sizes
  return rows.preset_row(
      rows.row_model(
          name_dims,
          (gemma4_moe, moe_sizes),
          dense_ffn_size=dense_ffn_size,
          qk_norm="head",
          tie_embeddings=True,
          rope_theta=10000.0,
          norm_eps=1e-6,
          gemma4=gemma4_layout.Gemma4Layout(
              *layout,
              global_k_eq_v=True,
              global_rope_theta=1e6,
              global_rope_fraction=0.25,
              logit_softcap=30.0,
          ),
      ),
      rest,
      active_counts_embedding=True,
  )


# This family's presets, a row each (`_gemma4_preset`), in the order
# `--model`'s list gives them.
PRESETS = tuple(
    _gemma4_preset(*row)
    for row in (
        (
            ("tiny_gemma4", (256, rows.TINY_D, 4, 4, 2, 32)),
            ((16, 4, 48), 96, (16, 2, 64, 1)),
            rows.TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
            "Gemma 4 MoE, tiny: each layer a dense GeGLU MLP beside an MoE "
            "block (router with its own norm and scale, per-expert output "
            "scale, softmax top-4 of 16), sandwich norms; sliding-window "
            "layers (window 16) and every second layer global (wider heads, "
            "one KV head, keys as values, RoPE on a quarter of the pairs); "
            "QK- and V-norm, unscaled scores, tied embeddings, soft-capped "
            "logits. " + _GEMMA4_LEFT_OUT,
        ),
        (
            ("gemma4_26b_a4b", (262144, 2816, 30, 16, 8, 256)),
            ((128, 8, 704), 2112, (1024, 6, 512, 2)),
            # Google publishes no training recipe: Qwen3-30B-A3B's suggestion.
            rows.SUGGESTED_FULL_SIZE_RUN,
            "Gemma 4 26B A4B, the text decoder (google/gemma-4-26B-A4B "
            "config.json's text_config); the ~550M vision tower is not "
            "counted. " + _GEMMA4_LEFT_OUT,
            (25.2e9, 3.8e9),
            "Google's Gemma 4 model card for google/gemma-4-26B-A4B(-it) "
            "('25.2B total parameters, 3.8B active'; its vision encoder "
            "'~550M' listed apart), as quoted by "
            "huggingface.co/OpenExplorer/gemma-4-26B-A4B-it ('Total model "
            "parameters 25.2B | Active 3.8B | Vision model (ViT) ~550M') "
            "and vast.ai/model/gemma-4-26b-a4b-it ('25.2B total parameters "
            "but only 3.8B active per token'). The text decoder alone "
            "counts 25.23B (transformers on the meta device agrees, "
            "presets_gemma4_hf_test.py), so the 25.2B is the text "
            "model's: with the vision tower it would be about 25.8B",
        ),
    )
)
TINY_GEMMA4, GEMMA4_26B_A4B = PRESETS
