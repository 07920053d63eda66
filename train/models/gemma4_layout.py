"""Gemma 4's decoder layout: the settings `ModelConfig.gemma4` holds, and
what they cost (parameters, attention FLOPs), from the config alone.

A Gemma 4 MoE decoder layer (transformers' `Gemma4TextDecoderLayer`) has,
beside the usual pre-norm attention:

- sandwich norms: the attention's output is RMS-normed before the residual
  add, and so is the feed-forward's;
- a dense GeGLU MLP *and* an MoE block side by side: the MLP reads the
  pre-feed-forward norm of the residual, the MoE block the residual itself
  (its router and its experts each apply their own norm, the
  `moe_core.MoEConfig` switches router_input_norm / expert_input_norm);
  each output gets its own RMS norm, the two are summed, normed once more
  and added to the residual;
- two kinds of attention layer: sliding-window layers (head_dim,
  num_kv_heads, RoPE over the whole head at rope_theta) and, every
  `global_every`-th layer and the last, global layers (global_head_dim,
  global_kv_heads, keys reused as values, RoPE over a fraction of the head
  at global_rope_theta);
- RMS norms on each head's queries and keys (with a scale) and values
  (without one), and attention scores that are not scaled by
  head_dim ** -0.5;
- a soft-capped output: cap * tanh(logits / cap).

This module has no flax: `model_config.py` and `train/presets/sizing.py` use
it; `gemma4.py` builds the layers.
"""

from __future__ import annotations

import dataclasses

from train.models import field_checks

_NORMS_PER_LAYER = 6  # input, post-attention, pre/post-FF, post-MLP, post-MoE


@dataclasses.dataclass(frozen=True)
class Gemma4Layout:
  """What a Gemma 4 decoder adds to `ModelConfig`.

  The sliding layers take ModelConfig's head_dim, num_kv_heads and
  rope_theta; `dense_ffn_size` is the width of every layer's dense MLP.

  Attributes:
    sliding_window: W >= 1: on a sliding layer, query t sees keys t - W + 1
      .. t.
    global_every: n >= 1: layer i (from 0) is global when (i + 1) % n == 0,
      and the last layer always is (transformers' default layer_types).
    global_head_dim: per-head width of the global layers (even).
    global_kv_heads: key/value heads of the global layers (dividing
      num_heads).
    global_k_eq_v: the global layers have no value projection: the keys'
      projection, before its norm and RoPE, is the values' too.
    global_rope_theta: RoPE base of the global layers.
    global_rope_fraction: the fraction of a global head's dimension pairs
      that RoPE rotates (transformers' "proportional" RoPE: pair i of d/2
      turns at global_rope_theta ** (-2i / d) when i < fraction * d / 2, the
      rest not at all), in (0, 1].
    logit_softcap: cap > 0: logits -> cap * tanh(logits / cap); 0: none.
  """

  sliding_window: int
  global_every: int
  global_head_dim: int
  global_kv_heads: int
  global_k_eq_v: bool = True
  global_rope_theta: float = 1e6
  global_rope_fraction: float = 1.0
  logit_softcap: float = 0.0

  def __post_init__(self):
    field_checks.check_positive_ints(
        self,
        "gemma4",
        (
            "sliding_window",
            "global_every",
            "global_head_dim",
            "global_kv_heads",
        ),
    )
    if self.global_head_dim % 2:
      raise ValueError(
          "gemma4.global_head_dim must be even (RoPE rotates pairs), got "
          f"{self.global_head_dim}."
      )
    if not 0.0 < self.global_rope_fraction <= 1.0:
      raise ValueError(
          "gemma4.global_rope_fraction must be in (0, 1], got "
          f"{self.global_rope_fraction!r}."
      )
    if not self.global_rope_theta > 0.0:
      raise ValueError(
          "gemma4.global_rope_theta must be > 0, got "
          f"{self.global_rope_theta!r}."
      )
    if not self.logit_softcap >= 0.0:
      raise ValueError(
          "gemma4.logit_softcap must be >= 0 (0: no cap), got "
          f"{self.logit_softcap!r}."
      )

  def is_global(self, layer: int, num_layers: int) -> bool:
    return (layer + 1) % self.global_every == 0 or layer == num_layers - 1


def check(cfg) -> None:
  """ValueErrors for a `ModelConfig` whose `gemma4` layout cannot hold."""
  layout = cfg.gemma4
  if not isinstance(layout, Gemma4Layout):
    raise TypeError(
        "gemma4 must be a Gemma4Layout or None, got "
        f"{type(layout).__name__}."
    )
  if cfg.attention != "gqa" or cfg.qk_norm != "head":
    raise ValueError(
        "gemma4 layers use 'gqa' attention with per-head QK-norm: they need "
        f"attention='gqa', qk_norm='head', got attention={cfg.attention!r}, "
        f"qk_norm={cfg.qk_norm!r}."
    )
  if cfg.moe is None or cfg.first_dense_layers:
    raise ValueError(
        "gemma4 layers each have an MoE block: they need moe set and "
        f"first_dense_layers=0, got moe={cfg.moe!r}, "
        f"first_dense_layers={cfg.first_dense_layers}."
    )
  if cfg.dense_ffn_size < 1:
    raise ValueError(
        "gemma4 layers each have a dense MLP beside the MoE block: they "
        f"need dense_ffn_size >= 1, got {cfg.dense_ffn_size}."
    )
  if cfg.num_heads % layout.global_kv_heads:
    raise ValueError(
        "gemma4.global_kv_heads must divide num_heads, got "
        f"global_kv_heads={layout.global_kv_heads}, "
        f"num_heads={cfg.num_heads}."
    )


def layer_shape(cfg, layer: int) -> tuple[int, int, bool]:
  """(head_dim, kv_heads, has_value_projection) of attention layer `layer`."""
  layout = cfg.gemma4
  if layout.is_global(layer, cfg.num_layers):
    return (
        layout.global_head_dim,
        layout.global_kv_heads,
        not layout.global_k_eq_v,
    )
  return cfg.head_dim, cfg.num_kv_heads, True


def attention_param_count(cfg, layer: int) -> int:
  """Projections and the query/key norm scales of attention layer `layer`."""
  d, h = cfg.hidden_size, cfg.num_heads
  hd, kv_heads, has_v = layer_shape(cfg, layer)
  kv_width = kv_heads * hd
  projections = 2 * d * h * hd + d * kv_width * (2 if has_v else 1)
  return projections + 2 * hd


def shared_param_counts(cfg) -> tuple[int, int, int]:
  """(attention, dense MLP, norms) parameters of the whole model.

  norms: the six RMS norm scales of every layer and the final norm (the
  value norm has no scale; the MoE block's own norms count in `moe`).
  """
  d = cfg.hidden_size
  attention = sum(attention_param_count(cfg, i) for i in range(cfg.num_layers))
  dense_mlp = cfg.num_layers * 3 * d * cfg.dense_ffn_size
  norms = _NORMS_PER_LAYER * d * cfg.num_layers + d
  return attention, dense_mlp, norms


def attention_flops(cfg, seq_len: int) -> float:
  """Forward FLOPs per token of the scores and the weighted values.

  A query sees (seq_len + 1) / 2 keys on average under the causal mask; on
  a sliding layer at most W, on average W (W + 1) / 2 / seq_len fewer for
  the first W - 1 queries: sum over t of min(t + 1, W), over seq_len.
  """
  layout = cfg.gemma4
  window = min(layout.sliding_window, seq_len)
  sliding_context = (
      window * (window + 1) / 2 + (seq_len - window) * window
  ) / seq_len
  flops = 0.0
  for layer in range(cfg.num_layers):
    hd, _, _ = layer_shape(cfg, layer)
    if layout.is_global(layer, cfg.num_layers):
      context = (seq_len + 1) / 2
    else:
      context = sliding_context
    flops += 2 * cfg.num_heads * context * 2 * hd
  return flops
