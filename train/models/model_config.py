"""`ModelConfig`: the decoder-only transformer `transformer.py` builds.

The presets (`train/presets/`) are values of it; the counts of
`train/presets/sizing.py` are computed from it alone.
"""

from __future__ import annotations

import dataclasses

import moe_core
from train.models import deepseek_v4_config
from train.models import gated_deltanet
from train.models import gemma4_layout

ATTENTIONS = ("gqa", "mla")
QK_NORMS = ("none", "head", "full", "l2")


# --- GPT-OSS: YaRN RoPE scaling (used by model_config.ModelConfig.yarn) ------


@dataclasses.dataclass(frozen=True)
class YarnRope:
  """YaRN's stretch of RoPE to a longer context (GPT-OSS: 4096 x 32).

  Each rotary frequency is blended between itself (fast dimensions, many
  turns over the original context) and itself / factor (slow ones), with a
  linear ramp between the dimensions that turn `beta_fast` and `beta_slow`
  times over `original_max_positions`; cos and sin are scaled by
  0.1 ln(factor) + 1. No parameters.

  Attributes:
    factor: the context stretch (> 1).
    original_max_positions: the pretraining context the ramp is measured on.
    beta_fast: turns over that context above which a dimension is kept.
    beta_slow: turns below which a dimension is divided by `factor`.
    truncate: round the ramp's ends to whole dimensions.
  """

  factor: float
  original_max_positions: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True

  def __post_init__(self):
    if not self.factor > 1:
      raise ValueError(f"yarn.factor must be > 1, got {self.factor!r}.")
    if self.original_max_positions < 1:
      raise ValueError(
          "yarn.original_max_positions must be >= 1, got "
          f"{self.original_max_positions!r}."
      )
    if not self.beta_fast > self.beta_slow > 0:
      raise ValueError(
          "yarn needs beta_fast > beta_slow > 0, got "
          f"beta_fast={self.beta_fast!r}, beta_slow={self.beta_slow!r}."
      )


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{field} must be one of {choices}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer whose MLPs are dense or MoE blocks.

  Attributes:
    name: preset name.
    vocab_size: V.
    hidden_size: D.
    num_layers: transformer blocks.
    num_heads: query heads H.
    num_kv_heads: key/value heads (GQA; equal to H for MHA). Unused by MLA.
    head_dim: per-head width for "gqa".
    attention: "gqa" (multi-/grouped-query attention with RoPE) or "mla"
      (DeepSeek's multi-head latent attention).
    q_lora_rank: MLA query down-projection rank (0: a full-rank query).
    kv_lora_rank: MLA compressed key/value width.
    qk_nope_head_dim: MLA per-head query/key width without RoPE.
    qk_rope_head_dim: MLA per-head query/key width with RoPE (the key part is
      shared by all heads).
    v_head_dim: MLA per-head value width.
    qk_norm: "none", "head" (RMSNorm over each head's query/key, Qwen3),
      "full" (over the whole query/key projection, OLMoE) or "l2" (each
      head's query/key divided by its RMS, no weights, on RoPE layers only:
      Llama 4).
    first_dense_layers: the first blocks use a dense MLP (DeepSeek-V3: 3).
    dense_ffn_size: hidden width of the dense MLPs.
    moe: the MoE block of every other layer (None: an all-dense model).
    tie_embeddings: the output head reuses the input embedding.
    rope_theta: RoPE base.
    norm_eps: RMSNorm epsilon.
    attention_output_gate: Qwen3-Next's gated attention: the query
      projection is twice as wide (each head's query, then its gate) and
      the attention output is scaled by sigmoid(gate) before the output
      projection ("gqa" only).
    partial_rotary_factor: the fraction of each head's query/key that RoPE
      rotates (its first head_dim * factor dimensions; Qwen3-Next: 0.25).
    linear_attention: the Gated DeltaNet layers' widths
      (`gated_deltanet.py`); None: every layer is softmax attention.
    full_attention_interval: with `linear_attention`, layer i is softmax
      attention when (i + 1) % interval == 0 and Gated DeltaNet otherwise
      (Qwen3-Next: 4, three linear layers then one full).
    attention_bias: (GPT-OSS) the q/k/v/o projections of "gqa" have biases.
    attention_sinks: (GPT-OSS) each query head has a learned logit that
      joins its softmax's denominator and takes no value.
    sliding_window: (GPT-OSS) W > 0: "gqa" layers attend to the last W
      positions only (themselves included); 0: full causal attention.
    full_attention_every: (GPT-OSS) with a sliding window, every n-th layer
      (layer i with (i + 1) % n == 0) attends fully (GPT-OSS: 2, the odd
      layers); 0: every layer slides.
    yarn: (GPT-OSS) YaRN scaling of the "gqa" RoPE, or None.
    moe_layer_interval: (Llama 4) after the first_dense_layers, every
      moe_layer_interval-th layer is an MoE layer (layers i with
      (i - first_dense_layers + 1) % interval == 0) and the others dense;
      1: every one (Llama 4 Maverick: 2).
    nope_layer_interval: (Llama 4) every nope_layer_interval-th layer
      (i with (i + 1) % interval == 0) uses no positional encoding (NoPE);
      0: RoPE everywhere.
    attention_chunk_size: (Llama 4) RoPE layers attend only within aligned
      chunks of this many positions; NoPE layers see the whole causal
      context. 0: no chunking.
    attn_temperature_floor: (Llama 4) NoPE layers scale their queries at
      position p by 1 + attn_temperature_scale * log(1 + floor((p + 1) /
      attn_temperature_floor)); 0: no scaling.
    attn_temperature_scale: that scaling's strength.
    gemma4: Gemma 4's decoder layout (`gemma4_layout.py`: sliding and
      global attention layers, a dense MLP beside each MoE block, sandwich
      norms, a soft-capped output), or None for the plain pre-norm block.
    deepseek_v4: None, or DeepSeek-V4's decoder (hyper-connections,
      compressed attention, hash layers; `deepseek_v4_config.py`),
      which then replaces the pre-norm blocks.
  """

  name: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int = 0
  head_dim: int = 0
  attention: str = "gqa"
  q_lora_rank: int = 0
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  qk_norm: str = "none"
  first_dense_layers: int = 0
  dense_ffn_size: int = 0
  moe: moe_core.MoEConfig | None = None
  tie_embeddings: bool = False
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  # --- Qwen3-Next (issue 33): gated attention, partial RoPE, hybrid layout.
  attention_output_gate: bool = False
  partial_rotary_factor: float = 1.0
  linear_attention: gated_deltanet.DeltaNetConfig | None = None
  full_attention_interval: int = 0
  # --- GPT-OSS fields (attention biases, sinks, sliding windows, YaRN) ---
  attention_bias: bool = False
  attention_sinks: bool = False
  sliding_window: int = 0
  full_attention_every: int = 0
  yarn: YarnRope | None = None
  # --- Llama 4 ---
  moe_layer_interval: int = 1
  nope_layer_interval: int = 0
  attention_chunk_size: int = 0
  attn_temperature_floor: int = 0
  attn_temperature_scale: float = 0.0
  # --- end Llama 4 ---
  # --- Gemma 4 (issue 33) ---
  gemma4: gemma4_layout.Gemma4Layout | None = None
  # --- DeepSeek-V4 (issue 33) ---
  deepseek_v4: deepseek_v4_config.DeepseekV4Settings | None = None

  def __post_init__(self):
    self._check_gpt_oss_fields()
    _check_choice("attention", self.attention, ATTENTIONS)
    _check_choice("qk_norm", self.qk_norm, QK_NORMS)
    self._check_qwen3_next_fields()
    if self.attention == "gqa":
      if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
        raise ValueError(
            "num_kv_heads must be >= 1 and divide num_heads, got "
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}."
        )
      if self.head_dim < 2 or self.head_dim % 2:
        raise ValueError(
            "head_dim must be even (RoPE rotates pairs), got "
            f"head_dim={self.head_dim}."
        )
    else:
      if self.qk_norm != "none":
        raise ValueError(
            "qk_norm applies to 'gqa' attention only, got "
            f"qk_norm={self.qk_norm!r} with attention='mla'."
        )
      for name in (
          "kv_lora_rank",
          "qk_nope_head_dim",
          "qk_rope_head_dim",
          "v_head_dim",
      ):
        if getattr(self, name) < 1:
          raise ValueError(
              f"attention='mla' needs {name} >= 1, got "
              f"{getattr(self, name)}."
          )
      if self.qk_rope_head_dim % 2:
        raise ValueError(
            "qk_rope_head_dim must be even (RoPE rotates "
            f"pairs), got {self.qk_rope_head_dim}."
        )
    self._check_llama4_fields()
    if not 0 <= self.first_dense_layers <= self.num_layers:
      raise ValueError(
          "first_dense_layers must be in [0, num_layers], got "
          f"first_dense_layers={self.first_dense_layers}, "
          f"num_layers={self.num_layers}."
      )
    if self.num_dense_layers and self.dense_ffn_size < 1:
      raise ValueError(
          f"{self.num_dense_layers} dense layers need "
          f"dense_ffn_size >= 1, got {self.dense_ffn_size}."
      )
    if self.moe is not None and self.moe.hidden_size != self.hidden_size:
      raise ValueError(
          "moe.hidden_size must equal hidden_size, got "
          f"moe.hidden_size={self.moe.hidden_size}, "
          f"hidden_size={self.hidden_size}."
      )
    if self.gemma4 is not None:  # Gemma 4 (issue 33).
      gemma4_layout.check(self)
    if self.deepseek_v4 is not None:  # DeepSeek-V4 (issue 33)
      deepseek_v4_config.check_model(self)

  def _check_qwen3_next_fields(self) -> None:
    """Validates the gated attention, partial RoPE and hybrid fields."""
    if self.attention_output_gate and self.attention != "gqa":
      raise ValueError(
          "attention_output_gate applies to 'gqa' attention only, got "
          f"attention={self.attention!r}."
      )
    factor = self.partial_rotary_factor
    if not 0.0 < factor <= 1.0:
      raise ValueError(
          f"partial_rotary_factor must be in (0, 1], got {factor!r}."
      )
    if factor != 1.0:
      if self.attention != "gqa":
        raise ValueError(
            "partial_rotary_factor applies to 'gqa' attention only, got "
            f"attention={self.attention!r}."
        )
      rotated = self.head_dim * factor
      if rotated != int(rotated) or int(rotated) < 2 or int(rotated) % 2:
        raise ValueError(
            "head_dim * partial_rotary_factor must be an even int >= 2 "
            f"(RoPE rotates pairs), got head_dim={self.head_dim}, "
            f"partial_rotary_factor={factor}."
        )
    interval = self.full_attention_interval
    if self.linear_attention is None:
      if interval:
        raise ValueError(
            "full_attention_interval needs linear_attention (a "
            f"DeltaNetConfig), got full_attention_interval={interval} "
            "with linear_attention=None."
        )
      return
    if not isinstance(self.linear_attention, gated_deltanet.DeltaNetConfig):
      raise TypeError(
          "linear_attention must be a gated_deltanet.DeltaNetConfig or "
          f"None, got {type(self.linear_attention).__name__}."
      )
    if not isinstance(interval, int) or interval < 1:
      raise ValueError(
          "linear_attention needs full_attention_interval >= 1 (every "
          f"interval-th layer is softmax attention), got {interval!r}."
      )

  def is_linear_attention_layer(self, layer: int) -> bool:
    """Whether layer `layer` mixes tokens with Gated DeltaNet."""
    return (
        self.linear_attention is not None
        and (layer + 1) % self.full_attention_interval != 0
    )

  @property
  def num_linear_attention_layers(self) -> int:
    return sum(map(self.is_linear_attention_layer, range(self.num_layers)))

  @property
  def num_full_attention_layers(self) -> int:
    return self.num_layers - self.num_linear_attention_layers

  @property
  def rotary_dim(self) -> int:
    """Per-head width RoPE rotates ("gqa")."""
    return int(self.head_dim * self.partial_rotary_factor)

  def _check_gpt_oss_fields(self) -> None:
    if self.sliding_window < 0 or self.full_attention_every < 0:
      raise ValueError(
          "sliding_window and full_attention_every must be >= 0, got "
          f"sliding_window={self.sliding_window}, "
          f"full_attention_every={self.full_attention_every}."
      )
    if self.full_attention_every and not self.sliding_window:
      raise ValueError(
          "full_attention_every alternates sliding and full layers, so it "
          f"needs sliding_window >= 1, got full_attention_every="
          f"{self.full_attention_every} with sliding_window=0."
      )
    if self.yarn is not None and not isinstance(self.yarn, YarnRope):
      raise TypeError(
          f"yarn must be a YarnRope or None, got {type(self.yarn).__name__}."
      )
    if self.uses_gpt_oss_attention and (
        self.attention != "gqa" or self.qk_norm != "none"
    ):
      raise ValueError(
          "attention_bias, attention_sinks, sliding_window and yarn apply "
          "to 'gqa' attention without qk_norm, got "
          f"attention={self.attention!r}, qk_norm={self.qk_norm!r}."
      )

  @property
  def logit_softcap(self) -> float:
    """c in the logits' soft cap c * tanh(z / c) (Gemma 4); 0: none."""
    return self.gemma4.logit_softcap if self.gemma4 is not None else 0.0

  @property
  def uses_gpt_oss_attention(self) -> bool:
    """Whether the attention is `sink_attention.py`'s (GPT-OSS)."""
    return bool(
        self.attention_bias
        or self.attention_sinks
        or self.sliding_window
        or self.yarn is not None
    )

  def attention_window(self, layer: int) -> int:
    """Layer `layer`'s sliding window (0: full causal attention)."""
    if self.full_attention_every and (layer + 1) % self.full_attention_every:
      return self.sliding_window
    return 0 if self.full_attention_every else self.sliding_window

  def _check_llama4_fields(self) -> None:
    """Validates the Llama 4 fields (interleaving, NoPE, chunks)."""
    for name, minimum in (
        ("moe_layer_interval", 1),
        ("nope_layer_interval", 0),
        ("attention_chunk_size", 0),
        ("attn_temperature_floor", 0),
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}."
        )
      if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    if self.attn_temperature_floor and not self.nope_layer_interval:
      raise ValueError(
          "attn_temperature_floor scales the queries of NoPE layers, so it "
          "needs nope_layer_interval >= 1, got attn_temperature_floor="
          f"{self.attn_temperature_floor}, nope_layer_interval=0."
      )
    if self.attention != "gqa" and (
        self.nope_layer_interval or self.attention_chunk_size
    ):
      raise ValueError(
          "nope_layer_interval and attention_chunk_size apply to 'gqa' "
          f"attention only, got attention={self.attention!r} with "
          f"nope_layer_interval={self.nope_layer_interval}, "
          f"attention_chunk_size={self.attention_chunk_size}."
      )

  @property
  def num_dense_layers(self) -> int:
    return self.num_layers - self.num_moe_layers

  @property
  def num_moe_layers(self) -> int:
    return sum(map(self.is_moe_layer, range(self.num_layers)))

  def is_moe_layer(self, layer: int) -> bool:
    if self.moe is None or layer < self.first_dense_layers:
      return False
    return (layer - self.first_dense_layers + 1) % self.moe_layer_interval == 0

  def uses_rope(self, layer: int) -> bool:
    """Whether layer `layer` rotates its queries and keys (not NoPE)."""
    interval = self.nope_layer_interval
    return not interval or (layer + 1) % interval != 0

  @property
  def qk_head_dim(self) -> int:
    if self.attention == "mla":
      return self.qk_nope_head_dim + self.qk_rope_head_dim
    return self.head_dim

  @property
  def value_head_dim(self) -> int:
    return self.v_head_dim if self.attention == "mla" else self.head_dim

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)
