"""Llama 4's presets: top-1 routing on the expert's input, NoPE layers,
chunked attention.
"""

from __future__ import annotations

import moe_core
from train.models import model_config
from train.presets import rows


def llama4_moe(
    hidden_size: int, *, num_experts: int, expert_ffn_size: int
) -> moe_core.MoEConfig:
  """Llama 4's MoE block (Llama4TextMoe) at any size.

  Top-1 of the router logits; the sigmoid of the chosen logit scales the
  expert's input (not its output), never renormalised; plus a SwiGLU shared
  expert as wide as a routed one, added ungated.
  """
  return rows.moe_block(
      (hidden_size, num_experts, 1, expert_ffn_size),
      score_func="sigmoid",
      routing_weights_on_input=True,
      shared_ffn_size=expert_ffn_size,
  )


TINY_LLAMA4 = rows.Preset(
    description=(
        "Llama 4 family, tiny: top-1 sigmoid routing that scales the "
        "expert's input, a shared expert, MoE every other layer (dense "
        "between), a NoPE layer every 4th with attention temperature "
        "tuning, weightless L2 QK-norm and chunked attention on the RoPE "
        "layers; GQA. Layers unrolled only (--noscan_layers)."
    ),
    model=rows.tiny_model(
        "tiny_llama4",
        num_kv_heads=2,
        qk_norm="l2",
        dense_ffn_size=256,
        moe=llama4_moe(rows.TINY_D, num_experts=8, expert_ffn_size=128),
        moe_layer_interval=2,
        nope_layer_interval=4,
        # Small enough that a 48-token training sequence crosses chunks and
        # reaches positions the temperature scales.
        attention_chunk_size=16,
        attn_temperature_floor=8,
        attn_temperature_scale=0.1,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    train=rows.TrainDefaults(aux_loss_weight=1e-3),
)


# Llama 4's vision encoder (Llama4VisionModel, 850,960,896) and projector
# (Llama4MultiModalProjector, 20,971,520) of the released vision_config
# (hidden 1408, 34 layers, 16 heads, MLP 5632, patch 14, image 336,
# projector 4096 -> 5120), shared by Scout and Maverick; counted with
# transformers on the meta device (presets_llama4_hf_test.py checks it).
LLAMA4_VISION_PARAMS = 850_960_896 + 20_971_520


def _llama4_text(name: str, **fields) -> model_config.ModelConfig:
  """Llama 4's text model (Llama4TextConfig's defaults, as released)."""
  return model_config.ModelConfig(
      name=name,
      **rows.dims(vocab=202048, d=5120, layers=48, heads=40, kv=8, hd=128),
      dense_ffn_size=16384,  # intermediate_size_mlp
      nope_layer_interval=4,
      attention_chunk_size=8192,
      attn_temperature_floor=8192,
      attn_temperature_scale=0.1,
      rope_theta=500000.0,
      norm_eps=1e-5,
      **fields,
  )


_LLAMA4_LEFT_OUT = (
    " Left out: the vision encoder and projector (multimodal inputs), "
    "RoPE frequency scaling, and the interleaved-pair RoPE layout (ours "
    "rotates halves: the same model up to a permutation of the query/key "
    "columns)."
)


LLAMA4_SCOUT = rows.Preset(
    description=(
        "Llama 4 Scout (17B active, 109B total with the vision encoder), "
        "text model: 16 experts in every layer, weightless L2 QK-norm."
        + _LLAMA4_LEFT_OUT
    ),
    model=_llama4_text(
        "llama4_scout",
        qk_norm="l2",
        moe=llama4_moe(5120, num_experts=16, expert_ffn_size=8192),
    ),
    train=rows.SUGGESTED_FULL_SIZE_RUN,
    published=rows.Published(
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
)


LLAMA4_MAVERICK = rows.Preset(
    description=(
        "Llama 4 Maverick (17B active, 400B total with the vision "
        "encoder), text model: 128 experts every other layer, dense "
        "layers between, no QK-norm." + _LLAMA4_LEFT_OUT
    ),
    model=_llama4_text(
        "llama4_maverick",
        moe=llama4_moe(5120, num_experts=128, expert_ffn_size=8192),
        moe_layer_interval=2,
    ),
    train=rows.SUGGESTED_FULL_SIZE_RUN,
    published=rows.Published(
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
)


# This family's presets, in the order `--model`'s list gives them.
PRESETS = (
    TINY_LLAMA4,
    LLAMA4_SCOUT,
    LLAMA4_MAVERICK,
)
