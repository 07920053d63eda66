"""Model presets: the configs the training program and `--dry_run` take.

Small training presets (`tiny_dsv3`, the default, `tiny_mixtral`,
`tiny_qwen3`, and one per family of issue 33: `tiny_qwen3_next`,
`tiny_gpt_oss`, `tiny_llama4`, `tiny_gemma4`, `tiny_deepseek_v4`) train on
a laptop CPU in minutes; `tpu_v5e_dsv3` (0.66B) fills one TPU v5e chip;
full-size configs of published MoE models
(`deepseek_v3`, `mixtral_8x7b`, `qwen3_30b_a3b`, `olmoe_1b_7b`,
`qwen3_next_80b_a3b`, `gpt_oss_20b`, `gpt_oss_120b`, `llama4_scout`,
`llama4_maverick`, `gemma4_26b_a4b`, `deepseek_v4_flash`,
`deepseek_v4_pro`), from their released configs, are used for `--dry_run`
counts (`sizing.py`) and checked against the published parameter
counts (`published.py`). Qwen3-Next's hybrid stack, Llama 4's
interleaved layers and DeepSeek-V4's decoder (`train/models/deepseek_v4.py`)
train unrolled only (--noscan_layers).
"""

from __future__ import annotations

import dataclasses

import moe_core
from train.models import deepseek_v4_config
from train.models import gated_deltanet
from train.models import gemma4_layout
from train.models import model_config

# The type of `Preset.model`, named here too for the presets' readers.
ModelConfig = model_config.ModelConfig


@dataclasses.dataclass(frozen=True)
class TrainDefaults:
  """Training hyper-parameters a preset suggests; flags override each."""

  steps: int = 200
  batch_size: int = 16
  seq_len: int = 128
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  # DeepSeek-V3 uses 1e-3 over ~500k steps; a few hundred steps need a
  # faster rule for the bias to matter at all.
  bias_update_rate: float = 1e-2
  aux_loss_weight: float = 0.0
  z_loss_weight: float = 0.0


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named model with the training run it suggests (`--model=NAME`)."""

  model: ModelConfig
  train: TrainDefaults = TrainDefaults()
  description: str = ""


# --- MoE blocks of the model families ----------------------------------------


def deepseek_v3_moe(
    hidden_size: int,
    *,
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
  return moe_core.MoEConfig(
      score_func="sigmoid",
      correction_bias=True,
      group_score="sum_top2",
      norm_topk_prob=True,
      norm_epsilon=1e-20,
      routed_scaling_factor=2.5,
      num_experts=num_experts,
      top_k=top_k,
      n_group=n_group,
      topk_group=topk_group,
      hidden_size=hidden_size,
      expert_ffn_size=expert_ffn_size,
      shared_ffn_size=expert_ffn_size,
  )


def softmax_moe(
    hidden_size: int,
    *,
    num_experts: int,
    top_k: int,
    expert_ffn_size: int,
    norm_topk_prob: bool = True,
) -> moe_core.MoEConfig:
  """A Mixtral / Qwen3-MoE / OLMoE block: softmax scores, plain top-k."""
  return moe_core.MoEConfig(
      num_experts=num_experts,
      top_k=top_k,
      hidden_size=hidden_size,
      expert_ffn_size=expert_ffn_size,
      score_func="softmax",
      norm_topk_prob=norm_topk_prob,
  )


# --- Qwen3-Next (issue 33) ----------------------------------------------------


def qwen3_next_moe(
    hidden_size: int,
    *,
    num_experts: int,
    top_k: int,
    expert_ffn_size: int,
    shared_ffn_size: int,
) -> moe_core.MoEConfig:
  """Qwen3-Next's MoE block: softmax, top-k renormalised, one shared
  expert whose output is scaled per token by sigmoid(x @ shared_gate)."""
  return dataclasses.replace(
      softmax_moe(
          hidden_size,
          num_experts=num_experts,
          top_k=top_k,
          expert_ffn_size=expert_ffn_size,
      ),
      shared_ffn_size=shared_ffn_size,
      shared_expert_gate=True,
  )


# What the training model leaves out of Qwen3-Next, for the descriptions.
_QWEN3_NEXT_LEFT_OUT = (
    "Left out: the multi-token-prediction module; zero-centred norm "
    "scales (1 + w; the same function, and the optimiser does not decay "
    "1-D parameters); layers scan only unrolled (--noscan_layers)."
)


# --- GPT-OSS (issue 33): MoE block and attention ------------------------------


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
  return moe_core.MoEConfig(
      num_experts=num_experts,
      top_k=top_k,
      hidden_size=hidden_size,
      expert_ffn_size=expert_ffn_size,
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
) -> ModelConfig:
  """A released GPT-OSS model: width 2880, 64 query heads of 64, 8 KV
  heads, vocabulary 201088, untied embeddings, top-4 experts of 2880."""
  return ModelConfig(
      name=name,
      vocab_size=201088,
      hidden_size=2880,
      num_layers=num_layers,
      num_heads=64,
      num_kv_heads=8,
      head_dim=64,
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

# --- Llama 4: MoE block -------------------------------------------------------


def llama4_moe(
    hidden_size: int, *, num_experts: int, expert_ffn_size: int
) -> moe_core.MoEConfig:
  """Llama 4's MoE block (Llama4TextMoe) at any size.

  Top-1 of the router logits; the sigmoid of the chosen logit scales the
  expert's input (not its output), never renormalised; plus a SwiGLU shared
  expert as wide as a routed one, added ungated.
  """
  return moe_core.MoEConfig(
      num_experts=num_experts,
      top_k=1,
      hidden_size=hidden_size,
      expert_ffn_size=expert_ffn_size,
      score_func="sigmoid",
      routing_weights_on_input=True,
      shared_ffn_size=expert_ffn_size,
  )


# --- end Llama 4: MoE block ---------------------------------------------------

# --- DeepSeek-V4 (issue 33) ---------------------------------------------------


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
  (as `reference/hf_convert` converts transformers' DeepseekV4Config).
  """
  return moe_core.MoEConfig(
      score_func="sqrtsoftplus",
      correction_bias=True,
      norm_topk_prob=True,
      norm_epsilon=1e-20,
      routed_scaling_factor=routed_scaling_factor,
      num_experts=num_experts,
      top_k=top_k,
      hidden_size=hidden_size,
      expert_ffn_size=expert_ffn_size,
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


# --- Small presets that train on a CPU ----------------------------------------

_TINY_D = 128


def _tiny_model(name: str, **fields) -> ModelConfig:
  """A CPU-sized model: byte tokens, width 128, 4 layers of 4 heads of 32."""
  return ModelConfig(
      name=name,
      vocab_size=256,
      hidden_size=_TINY_D,
      num_layers=4,
      num_heads=4,
      head_dim=32,
      **fields,
  )


TINY_DSV3 = Preset(
    description=(
        "DeepSeek-V3 family, tiny: a dense first layer, then MoE "
        "layers with one shared expert, sigmoid routing with an "
        "aux-loss-free correction bias, group-limited top-k and "
        "routed scaling; MHA with RoPE."
    ),
    model=_tiny_model(
        "tiny_dsv3",
        num_kv_heads=4,
        first_dense_layers=1,
        dense_ffn_size=384,
        moe=deepseek_v3_moe(
            _TINY_D,
            num_experts=16,
            top_k=4,
            expert_ffn_size=64,
            n_group=4,
            topk_group=2,
        ),
    ),
    train=TrainDefaults(),
)

TINY_MIXTRAL = Preset(
    description="Mixtral style, tiny: softmax top-2 of 8 experts, GQA.",
    model=_tiny_model(
        "tiny_mixtral",
        num_kv_heads=2,
        moe=softmax_moe(_TINY_D, num_experts=8, top_k=2, expert_ffn_size=192),
    ),
    train=TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
)

TINY_QWEN3 = Preset(
    description=(
        "Qwen3-MoE / OLMoE style, tiny: fine-grained experts "
        "(32, top-8), softmax with top-k renormalisation, GQA with "
        "per-head QK-norm."
    ),
    model=_tiny_model(
        "tiny_qwen3",
        num_kv_heads=2,
        qk_norm="head",
        moe=softmax_moe(_TINY_D, num_experts=32, top_k=8, expert_ffn_size=48),
    ),
    train=TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
)


# Qwen3-Next (issue 33): every piece of the 80B's stack at CPU size.
TINY_QWEN3_NEXT = Preset(
    description=(
        "Qwen3-Next family, tiny: a hybrid stack of Gated DeltaNet "
        "(linear attention) and gated softmax attention (every 2nd "
        "layer; per-head QK-norm, RoPE on a quarter of each head), "
        "MoE in every layer: softmax top-4 of 16 with a sigmoid-gated "
        "shared expert. " + _QWEN3_NEXT_LEFT_OUT
    ),
    model=_tiny_model(
        "tiny_qwen3_next",
        num_kv_heads=2,
        qk_norm="head",
        attention_output_gate=True,
        partial_rotary_factor=0.25,
        linear_attention=gated_deltanet.DeltaNetConfig(
            num_key_heads=2,
            num_value_heads=4,
            key_head_dim=32,
            value_head_dim=32,
            conv_kernel=4,
        ),
        full_attention_interval=2,
        moe=qwen3_next_moe(
            _TINY_D,
            num_experts=16,
            top_k=4,
            expert_ffn_size=64,
            shared_ffn_size=64,
        ),
    ),
    train=TrainDefaults(aux_loss_weight=1e-3),
)


TINY_GPT_OSS = Preset(
    description=(
        "GPT-OSS family, tiny: GQA with q/k/v/o biases and attention "
        "sinks, 8-token sliding windows on the even layers, YaRN RoPE; "
        "biased router, softmax over the top-4 of 16 experts, clamped GLU "
        "experts with biases."
    ),
    model=_tiny_model(
        "tiny_gpt_oss",
        num_kv_heads=2,
        moe=gpt_oss_moe(_TINY_D, num_experts=16, expert_ffn_size=64),
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
    train=TrainDefaults(aux_loss_weight=1e-3),
)


# --- Llama 4: tiny -----------------------------------------------------------

TINY_LLAMA4 = Preset(
    description=(
        "Llama 4 family, tiny: top-1 sigmoid routing that scales the "
        "expert's input, a shared expert, MoE every other layer (dense "
        "between), a NoPE layer every 4th with attention temperature "
        "tuning, weightless L2 QK-norm and chunked attention on the RoPE "
        "layers; GQA. Layers unrolled only (--noscan_layers)."
    ),
    model=_tiny_model(
        "tiny_llama4",
        num_kv_heads=2,
        qk_norm="l2",
        dense_ffn_size=256,
        moe=llama4_moe(_TINY_D, num_experts=8, expert_ffn_size=128),
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
    train=TrainDefaults(aux_loss_weight=1e-3),
)

# --- end Llama 4: tiny --------------------------------------------------------

TINY_DEEPSEEK_V4 = Preset(
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
    model=ModelConfig(
        name="tiny_deepseek_v4",
        vocab_size=256,
        hidden_size=_TINY_D,
        num_layers=4,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        q_lora_rank=64,
        moe=deepseek_v4_moe(
            _TINY_D,
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
    train=TrainDefaults(),
)


# --- One TPU v5e chip --------------------------------------------------------

_TPU_D = 1024

# Sized by compiling its train step for a v5e (jax's TPU topology, from a
# CPU host with libtpu), not by the analytic estimate alone: a 0.66B
# sibling (16 layers, experts 1024 -> 384), estimated at 11.8 GiB, compiled
# to 16.7 GiB, over the chip. XLA's figure is about 1.5x sizing.py's
# at these sizes.
TPU_V5E_DSV3 = Preset(
    description=(
        "DeepSeek-V3 family for one TPU v5e chip (16 GiB HBM): 0.41B "
        "parameters (120M active per token), byte tokens, 14 layers of "
        "width 1024 (a dense first layer, then MoE layers of 32 routed "
        "experts, top-4 in 2 of 4 groups, and a shared expert, each "
        "1024 -> 256), MHA of 8 heads of 128. Float32 parameters and AdamW "
        "state (16 bytes a parameter: 6.1 GiB) with bfloat16 compute. At "
        "its batch of 16 x 512 tokens with --remat=save_moe, "
        "sizing.py estimates 7.5 GiB a device and XLA's TPU "
        "compiler (libtpu 0.0.50, the step compiled for a v5e from a CPU "
        "host) 11.5 GiB (9.3 GiB with --remat=full); without remat the "
        "estimate is 12.2 GiB."
    ),
    model=ModelConfig(
        name="tpu_v5e_dsv3",
        vocab_size=256,
        hidden_size=_TPU_D,
        num_layers=14,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        first_dense_layers=1,
        dense_ffn_size=3072,
        moe=deepseek_v3_moe(
            _TPU_D,
            num_experts=32,
            top_k=4,
            expert_ffn_size=256,
            n_group=4,
            topk_group=2,
        ),
    ),
    # A learning rate for width 1024 (the tiny presets' 3e-3 is for 128).
    train=TrainDefaults(
        batch_size=16, seq_len=512, learning_rate=1e-3, warmup_steps=20
    ),
)

# The remat policy the description's memory estimate is for.
TPU_V5E_DSV3_REMAT = "save_moe"


# --- Full-size published configs ----------------------------------------------


def _full_size_training(**changes) -> TrainDefaults:
  """The suggested run of a full-size model: 4096-token sequences."""
  return TrainDefaults(seq_len=4096, **changes)


DEEPSEEK_V3 = Preset(
    description="DeepSeek-V3 (671B), main model without the MTP module.",
    model=ModelConfig(
        name="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_dense_layers=3,
        dense_ffn_size=18432,
        moe=deepseek_v3_moe(
            7168,
            num_experts=256,
            top_k=8,
            expert_ffn_size=2048,
            n_group=8,
            topk_group=4,
        ),
        rope_theta=10000.0,
    ),
    train=_full_size_training(
        batch_size=15360, learning_rate=2.2e-4, bias_update_rate=1e-3
    ),
)

MIXTRAL_8X7B = Preset(
    description="Mixtral 8x7B.",
    model=ModelConfig(
        name="mixtral_8x7b",
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        moe=softmax_moe(4096, num_experts=8, top_k=2, expert_ffn_size=14336),
        rope_theta=1e6,
        norm_eps=1e-5,
    ),
    train=_full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-2
    ),
)

QWEN3_30B_A3B = Preset(
    description="Qwen3-30B-A3B.",
    model=ModelConfig(
        name="qwen3_30b_a3b",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        qk_norm="head",
        moe=softmax_moe(2048, num_experts=128, top_k=8, expert_ffn_size=768),
        rope_theta=1e6,
    ),
    train=_full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
    ),
)

OLMOE_1B_7B = Preset(
    description="OLMoE-1B-7B.",
    model=ModelConfig(
        name="olmoe_1b_7b",
        vocab_size=50304,
        hidden_size=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        qk_norm="full",
        moe=softmax_moe(
            2048,
            num_experts=64,
            top_k=8,
            expert_ffn_size=1024,
            norm_topk_prob=False,
        ),
        norm_eps=1e-5,
    ),
    train=_full_size_training(
        batch_size=1024,
        learning_rate=4e-4,
        aux_loss_weight=1e-2,
        z_loss_weight=1e-3,
    ),
)

# Qwen3-Next (issue 33). Values of Qwen/Qwen3-Next-80B-A3B-Instruct's
# config.json (transformers 5.24.0's Qwen3NextConfig defaults are the same,
# rope_theta apart: the release uses 1e7).
QWEN3_NEXT_80B_A3B = Preset(
    description=(
        "Qwen3-Next-80B-A3B, main model: 48 layers, 12 x (3 Gated "
        "DeltaNet + 1 gated attention), 512 experts top-10 with a gated "
        "shared expert. " + _QWEN3_NEXT_LEFT_OUT
    ),
    model=ModelConfig(
        name="qwen3_next_80b_a3b",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        qk_norm="head",
        attention_output_gate=True,
        partial_rotary_factor=0.25,
        linear_attention=gated_deltanet.DeltaNetConfig(
            num_key_heads=16,
            num_value_heads=32,
            key_head_dim=128,
            value_head_dim=128,
            conv_kernel=4,
        ),
        full_attention_interval=4,
        moe=qwen3_next_moe(
            2048,
            num_experts=512,
            top_k=10,
            expert_ffn_size=512,
            shared_ffn_size=512,
        ),
        rope_theta=1e7,
    ),
    train=_full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
    ),
)

GPT_OSS_20B = Preset(
    description="gpt-oss-20b." + _GPT_OSS_LEFT_OUT,
    model=gpt_oss_model("gpt_oss_20b", num_layers=24, num_experts=32),
    train=_full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
    ),
)

GPT_OSS_120B = Preset(
    description="gpt-oss-120b." + _GPT_OSS_LEFT_OUT,
    model=gpt_oss_model("gpt_oss_120b", num_layers=36, num_experts=128),
    train=_full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
    ),
)

# --- Llama 4: full size ------------------------------------------------------


def _llama4_text(name: str, **fields) -> ModelConfig:
  """Llama 4's text model (Llama4TextConfig's defaults, as released)."""
  return ModelConfig(
      name=name,
      vocab_size=202048,
      hidden_size=5120,
      num_layers=48,
      num_heads=40,
      num_kv_heads=8,
      head_dim=128,
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

LLAMA4_SCOUT = Preset(
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
    train=_full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
    ),
)

LLAMA4_MAVERICK = Preset(
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
    train=_full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
    ),
)

# --- end Llama 4: full size ---------------------------------------------------

# --- Gemma 4 (issue 33) -------------------------------------------------------


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
  return moe_core.MoEConfig(
      num_experts=num_experts,
      top_k=top_k,
      hidden_size=hidden_size,
      expert_ffn_size=expert_ffn_size,
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

TINY_GEMMA4 = Preset(
    description=(
        "Gemma 4 MoE, tiny: each layer a dense GeGLU MLP beside an MoE "
        "block (router with its own norm and scale, per-expert output "
        "scale, softmax top-4 of 16), sandwich norms; sliding-window "
        "layers (window 16) and every second layer global (wider heads, "
        "one KV head, keys as values, RoPE on a quarter of the pairs); "
        "QK- and V-norm, unscaled scores, tied embeddings, soft-capped "
        "logits. " + _GEMMA4_LEFT_OUT
    ),
    model=_tiny_model(
        "tiny_gemma4",
        num_kv_heads=2,
        qk_norm="head",
        dense_ffn_size=96,
        moe=gemma4_moe(_TINY_D, num_experts=16, top_k=4, expert_ffn_size=48),
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
    train=TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
)

GEMMA4_26B_A4B = Preset(
    description=(
        "Gemma 4 26B A4B, the text decoder (google/gemma-4-26B-A4B "
        "config.json's text_config); the ~550M vision tower is not "
        "counted. " + _GEMMA4_LEFT_OUT
    ),
    model=ModelConfig(
        name="gemma4_26b_a4b",
        vocab_size=262144,
        hidden_size=2816,
        num_layers=30,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
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
    train=_full_size_training(
        batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
    ),
)

_V4_DESCRIPTION = (
    "(main model without the MTP layer). The training model implements "
    "hyper-connections with Sinkhorn, the low-rank query, one shared "
    "key/value head, partial RoPE, sinks, the 128-token window, both "
    "compressors, the indexer's top-k, hash and sqrt-softplus routing; "
    "left out: YaRN on the compressed layers' RoPE, the indexer's loss."
)

DEEPSEEK_V4_FLASH = Preset(
    description="DeepSeek-V4-Flash (284B, 13B active) " + _V4_DESCRIPTION,
    model=ModelConfig(
        name="deepseek_v4_flash",
        vocab_size=129280,
        hidden_size=4096,
        num_layers=43,
        num_heads=64,
        num_kv_heads=1,
        head_dim=512,
        q_lora_rank=1024,
        moe=deepseek_v4_moe(
            4096,
            num_experts=256,
            top_k=6,
            expert_ffn_size=2048,
            routed_scaling_factor=1.5,
        ),
        rope_theta=10000.0,
        deepseek_v4=deepseek_v4_config.DeepseekV4Settings(
            layer_types=_v4_layer_types((0, 0), 43),
            o_groups=8,
            o_lora_rank=1024,
            index_topk=512,
        ),
    ),
    train=_full_size_training(
        batch_size=1024, learning_rate=2.2e-4, bias_update_rate=1e-3
    ),
)

DEEPSEEK_V4_PRO = Preset(
    description="DeepSeek-V4-Pro (1.6T, 49B active) " + _V4_DESCRIPTION,
    model=ModelConfig(
        name="deepseek_v4_pro",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        num_kv_heads=1,
        head_dim=512,
        q_lora_rank=1536,
        moe=deepseek_v4_moe(
            7168,
            num_experts=384,
            top_k=6,
            expert_ffn_size=3072,
            routed_scaling_factor=2.5,
        ),
        rope_theta=10000.0,
        deepseek_v4=deepseek_v4_config.DeepseekV4Settings(
            layer_types=_v4_layer_types((128, 128), 61),
            o_groups=16,
            o_lora_rank=1024,
            index_topk=1024,
        ),
    ),
    train=_full_size_training(
        batch_size=1024, learning_rate=2.2e-4, bias_update_rate=1e-3
    ),
)

PRESETS: dict[str, Preset] = {
    p.model.name: p
    for p in (
        TINY_DSV3,
        TINY_MIXTRAL,
        TINY_QWEN3,
        TPU_V5E_DSV3,  # One TPU v5e chip (issue 42).
        DEEPSEEK_V3,
        MIXTRAL_8X7B,
        QWEN3_30B_A3B,
        OLMOE_1B_7B,
        # DeepSeek-V4 (issue 33)
        TINY_DEEPSEEK_V4,
        DEEPSEEK_V4_FLASH,
        DEEPSEEK_V4_PRO,
        TINY_GEMMA4,  # Gemma 4 (issue 33).
        GEMMA4_26B_A4B,
        TINY_LLAMA4,
        LLAMA4_SCOUT,
        LLAMA4_MAVERICK,
        # Qwen3-Next (issue 33).
        TINY_QWEN3_NEXT,
        QWEN3_NEXT_80B_A3B,
        # GPT-OSS (issue 33).
        TINY_GPT_OSS,
        GPT_OSS_20B,
        GPT_OSS_120B,
    )
}
DEFAULT_PRESET = "tiny_dsv3"
FULL_SIZE = (
    "deepseek_v3",
    "mixtral_8x7b",
    "qwen3_30b_a3b",
    "olmoe_1b_7b",
    # Qwen3-Next (issue 33).
    "qwen3_next_80b_a3b",
    # GPT-OSS (issue 33).
    "gpt_oss_20b",
    "gpt_oss_120b",
    # Llama 4 (issue 33).
    "llama4_scout",
    "llama4_maverick",
    # Gemma 4 (issue 33).
    "gemma4_26b_a4b",
    # DeepSeek-V4 (issue 33).
    "deepseek_v4_flash",
    "deepseek_v4_pro",
)


def get_preset(name: str) -> Preset:
  if name not in PRESETS:
    raise ValueError(
        f"unknown model preset {name!r}; valid names: {sorted(PRESETS)}."
    )
  return PRESETS[name]
