"""Gemma 4's presets (issue 33): a dense MLP beside each MoE block, sliding
and global layers (`train/models/gemma4.py`).
"""

from __future__ import annotations

import moe_core
from train.models import gemma4_layout
from train.models import model_config
from train.presets import rows


def gemma4_moe(
    hidden_size: int,
    *,
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
  `reference.hf_convert`'s gemma4 entry reads a transformers config.
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


TINY_GEMMA4 = rows.Preset(
    description=(
        "Gemma 4 MoE, tiny: each layer a dense GeGLU MLP beside an MoE "
        "block (router with its own norm and scale, per-expert output "
        "scale, softmax top-4 of 16), sandwich norms; sliding-window "
        "layers (window 16) and every second layer global (wider heads, "
        "one KV head, keys as values, RoPE on a quarter of the pairs); "
        "QK- and V-norm, unscaled scores, tied embeddings, soft-capped "
        "logits. " + _GEMMA4_LEFT_OUT
    ),
    model=rows.tiny_model(
        "tiny_gemma4",
        num_kv_heads=2,
        qk_norm="head",
        dense_ffn_size=96,
        moe=gemma4_moe(
            rows.TINY_D, num_experts=16, top_k=4, expert_ffn_size=48
        ),
        tie_embeddings=True,
        gemma4=gemma4_layout.Gemma4Layout(
            sliding_window=16,
            global_every=2,
            global_head_dim=64,
            global_kv_heads=1,
            global_k_eq_v=True,
            global_rope_theta=1e6,
            global_rope_fraction=0.25,
            logit_softcap=30.0,
        ),
    ),
    train=rows.TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
)


GEMMA4_26B_A4B = rows.Preset(
    description=(
        "Gemma 4 26B A4B, the text decoder (google/gemma-4-26B-A4B "
        "config.json's text_config); the ~550M vision tower is not "
        "counted. " + _GEMMA4_LEFT_OUT
    ),
    model=model_config.ModelConfig(
        name="gemma4_26b_a4b",
        **rows.dims(vocab=262144, d=2816, layers=30, heads=16, kv=8, hd=256),
        qk_norm="head",
        dense_ffn_size=2112,
        moe=gemma4_moe(2816, num_experts=128, top_k=8, expert_ffn_size=704),
        tie_embeddings=True,
        rope_theta=10000.0,
        norm_eps=1e-6,
        gemma4=gemma4_layout.Gemma4Layout(
            sliding_window=1024,
            global_every=6,
            global_head_dim=512,
            global_kv_heads=2,
            global_k_eq_v=True,
            global_rope_theta=1e6,
            global_rope_fraction=0.25,
            logit_softcap=30.0,
        ),
    ),
    # Google publishes no training recipe: Qwen3-30B-A3B's suggestion.
    train=rows.SUGGESTED_FULL_SIZE_RUN,
    published=rows.Published(
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
)


# This family's presets, in the order `--model`'s list gives them.
PRESETS = (
    TINY_GEMMA4,
    GEMMA4_26B_A4B,
)
