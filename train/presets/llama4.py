"""Llama 4's presets: top-1 routing on the expert's input, NoPE layers,
chunked attention.
"""

from __future__ import annotations

import moe_core
from train.presets import rows


def llama4_moe(
    hidden_size: int, num_experts: int, expert_ffn_size: int
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


# Llama 4's vision encoder (Llama4VisionModel, 850,960,896) and projector
# (Llama4MultiModalProjector, 20,971,520) of the released vision_config
# (hidden 1408, 34 layers, 16 heads, MLP 5632, patch 14, image 336,
# projector 4096 -> 5120), shared by Scout and Maverick; counted with
# transformers on the meta device (presets_llama4_hf_test.py checks it).
LLAMA4_VISION_PARAMS = 850_960_896 + 20_971_520


_LLAMA4_LEFT_OUT = (
    " Left out: the vision encoder and projector (multimodal inputs), "
    "RoPE frequency scaling, and the interleaved-pair RoPE layout (ours "
    "rotates halves: the same model up to a permutation of the query/key "
    "columns)."
)


def _llama4_preset(
    name_dims: tuple[str, tuple[int, int, int, int, int, int]],
    sizes: tuple[tuple[int, int], int, tuple[int, int]],
    fields: dict,
    *rest,
) -> rows.Preset:
  """A preset of this family (a row of `PRESETS`): the model's name and
  dims (vocabulary, D, layers, heads, KV heads, head dim); its sizes:
  (experts, expert width F), the dense layers' width, (attention chunk,
  attention temperature floor); its other `ModelConfig` fields; then
  `rows.preset_row`'s `rest`. A released model's published counts are the
  multimodal model's (active with the input embedding; the vision encoder
  and projector are `total_beyond_preset`). All share a NoPE layer every
  4th, attention temperature scale 0.1, RoPE theta 5e5 and RMSNorm epsilon
  1e-5 (as released)."""
  moe_sizes, dense_ffn_size, (chunk, floor) = sizes
  return rows.preset_row(
      rows.row_model(
          name_dims,
          (llama4_moe, moe_sizes),
          dense_ffn_size=dense_ffn_size,
          nope_layer_interval=4,
          attention_chunk_size=chunk,
          attn_temperature_floor=floor,
          attn_temperature_scale=0.1,
          rope_theta=500000.0,
          norm_eps=1e-5,
          **fields,
      ),
      rest,
      active_counts_embedding=True,
      total_beyond_preset=LLAMA4_VISION_PARAMS,
  )


# The released text model's dims (Llama4TextConfig's defaults, as
# released): Scout and Maverick differ only in their MoE layers.
_LLAMA4_TEXT = (202048, 5120, 48, 40, 8, 128)


# This family's presets, a row each (`_llama4_preset`), in the order
# `--model`'s list gives them.
PRESETS = tuple(
    _llama4_preset(*row)
    for row in (
        (
            ("tiny_llama4", (256, rows.TINY_D, 4, 4, 2, 32)),
            # Chunks small enough that a 48-token training sequence crosses
            # them and reaches positions the temperature scales.
            ((8, 128), 256, (16, 8)),
            dict(qk_norm="l2", moe_layer_interval=2),
            rows.TrainDefaults(aux_loss_weight=1e-3),
            "Llama 4 family, tiny: top-1 sigmoid routing that scales the "
            "expert's input, a shared expert, MoE every other layer (dense "
            "between), a NoPE layer every 4th with attention temperature "
            "tuning, weightless L2 QK-norm and chunked attention on the RoPE "
            "layers; GQA. Layers unrolled only (--noscan_layers).",
        ),
        (
            ("llama4_scout", _LLAMA4_TEXT),
            ((16, 8192), 16384, (8192, 8192)),
            dict(qk_norm="l2"),
            rows.SUGGESTED_FULL_SIZE_RUN,
            "Llama 4 Scout (17B active, 109B total with the vision encoder), "
            "text model: 16 experts in every layer, weightless L2 QK-norm."
            + _LLAMA4_LEFT_OUT,
            (109e9, 17e9),
            "huggingface.co/blog/llama4-release (Hugging Face's release "
            "post: 'Llama 4 Scout also has 17B active parameters "
            "out of ~109B total'; the transformers docs, model_doc/llama4, "
            "say the same); the figure counts the multimodal model, whose "
            "vision encoder and projector are total_beyond_preset",
        ),
        (
            ("llama4_maverick", _LLAMA4_TEXT),
            ((128, 8192), 16384, (8192, 8192)),
            dict(moe_layer_interval=2),
            rows.SUGGESTED_FULL_SIZE_RUN,
            "Llama 4 Maverick (17B active, 400B total with the vision "
            "encoder), text model: 128 experts every other layer, dense "
            "layers between, no QK-norm." + _LLAMA4_LEFT_OUT,
            (400e9, 17e9),
            "huggingface.co/blog/llama4-release ('Llama 4 Maverick with "
            "17B active parameters out of ~400B total'; the transformers "
            "docs, model_doc/llama4, call the flavour 402B); the figure "
            "counts the multimodal model, whose vision encoder and "
            "projector are total_beyond_preset",
        ),
    )
)
TINY_LLAMA4, LLAMA4_SCOUT, LLAMA4_MAVERICK = PRESETS
