"""GPT-OSS attention: GQA with biases, attention sinks, sliding windows, YaRN.

The pieces `layers.py`'s plain `Attention` lacks, used when a config
sets any of `attention_bias`, `attention_sinks`, `sliding_window` or `yarn`
(`ModelConfig.uses_gpt_oss_attention`):

- biases on the query, key, value and output projections;
- one learned sink logit per query head: it joins the softmax's
  denominator (so a head can attend to "nothing") and carries no value;
- a sliding window on some layers (GPT-OSS: the even ones see the last 128
  positions, the odd ones everything before them);
- YaRN-scaled rotary frequencies (`model_config.YarnRope`).

The window is a function of the layer index, which may be traced: under
`scan_model.py`'s scan every layer of a stack shares one module and
gets its index as an array.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from train.models import attention
from train.models import model_config


def yarn_frequencies(
    head_dim: int, theta: float, yarn: model_config.YarnRope
) -> tuple[jax.Array, float]:
  """(inverse frequencies [head_dim / 2], cos/sin scale) of YaRN RoPE."""
  half = head_dim // 2
  base = attention.rope_frequencies(head_dim, theta)

  def dimension_of(turns):
    # The (fractional) pair index whose wavelength fits `turns` times in
    # the original context.
    wavelength_ratio = yarn.original_max_positions / (turns * 2 * math.pi)
    return head_dim * math.log(wavelength_ratio) / (2 * math.log(theta))

  low, high = dimension_of(yarn.beta_fast), dimension_of(yarn.beta_slow)
  if yarn.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if high == low:
    high += 1e-3  # A step instead of a ramp, without dividing by zero.
  # 0 below `low` (fast pairs keep their frequency), 1 above `high`.
  ramp = jnp.clip(
      (jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0, 1
  )
  freq = base * (1 - ramp) + base / yarn.factor * ramp
  return freq, 0.1 * math.log(yarn.factor) + 1.0


def sink_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array | None,
    window,
    query_block: int = attention.QUERY_BLOCK,
) -> jax.Array:
  """Causal softmax attention with optional sinks and a sliding window.

  Long sequences (a multiple of `query_block`) run one block of queries at
  a time, rematerialised in the backward (`attention.in_query_blocks`).

  Args:
    q: [B, T, H, d].
    k: [B, T, Hkv, d], Hkv dividing H (query head h reads kv head
      h // (H / Hkv)).
    v: [B, T, Hkv, dv].
    sinks: None, or [H] logits, one per query head, added to the softmax's
      denominator only.
    window: W > 0: query t sees keys t - W + 1 .. t; 0: keys 0 .. t. An int
      or a traced int scalar.
    query_block: queries per block.

  Returns:
    [B, T, H, dv] in v's dtype; scores and softmax in float32.
  """
  return attention.in_query_blocks(
      lambda q_rows, first_row: _sink_attention_rows(
          q_rows, k, v, sinks, window, first_row
      ),
      q,
      query_block,
  )


def _sink_attention_rows(q, k, v, sinks, window, first_row) -> jax.Array:
  """`sink_attention` of the queries q [B, Tq, H, d] at rows first_row..
  against every key and value [B, T, Hkv, d|dv]."""
  b, tq, h, d = q.shape
  t, hkv = k.shape[1], k.shape[2]
  group = h // hkv
  q = q.reshape(b, tq, hkv, group, d)
  logits = (
      jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
      * d**-0.5
  )
  distance = first_row + jnp.arange(tq)[:, None] - jnp.arange(t)[None, :]
  visible = (distance >= 0) & ((window <= 0) | (distance < window))
  logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
  peak = jnp.max(logits, axis=-1, keepdims=True)  # A row sees itself.
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, hkv, group, 1, 1)
    peak = jnp.maximum(peak, sink)
  # Shifted by the larger of the row's peak and its sink, so no exp
  # overflows; the shift cancels in the ratio, so it needs no gradient.
  peak = jax.lax.stop_gradient(peak)
  weights = jnp.exp(logits - peak)
  denominator = jnp.sum(weights, axis=-1, keepdims=True)
  if sinks is not None:
    denominator = denominator + jnp.exp(sink - peak)
  probs = (weights / denominator).astype(v.dtype)
  out = jnp.einsum(
      "bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32
  )
  return out.reshape(b, tq, h, v.shape[-1]).astype(v.dtype)


class SinkAttention(nnx.Module):
  """GPT-OSS's grouped-query attention: [B, T, D] -> [B, T, D].

  Parameters: wq [D, H*d], wk and wv [D, Hkv*d], wo [H*d, D]; with
  `attention_bias` bq, bk, bv, bo; with `attention_sinks` sinks [H].
  """

  def __init__(
      self,
      cfg: model_config.ModelConfig,
      *,
      rngs: nnx.Rngs,
      weight,
  ):
    """`weight(key, shape)` makes a projection (`layers.weight`)."""
    d, h, hkv, hd = attention.set_head_sizes(self, cfg)
    self.yarn = cfg.yarn
    # Static: the same for every layer, so a scanned stack can share it.
    self.windows = tuple(cfg.attention_window(i) for i in range(cfg.num_layers))
    self.wq = weight(rngs.params(), (d, h * hd))
    self.wk = weight(rngs.params(), (d, hkv * hd))
    self.wv = weight(rngs.params(), (d, hkv * hd))
    self.wo = weight(rngs.params(), (h * hd, d))
    self.has_bias = cfg.attention_bias
    if cfg.attention_bias:  # Zero at the start, as the projections' own.
      self.bq = nnx.Param(jnp.zeros((h * hd,), jnp.float32))
      self.bk = nnx.Param(jnp.zeros((hkv * hd,), jnp.float32))
      self.bv = nnx.Param(jnp.zeros((hkv * hd,), jnp.float32))
      self.bo = nnx.Param(jnp.zeros((d,), jnp.float32))
    self.has_sinks = cfg.attention_sinks
    if cfg.attention_sinks:
      # exp(0) = 1: at the start a sink weighs as much as one key of equal
      # score, which the model then learns to raise or lower.
      self.sinks = nnx.Param(jnp.zeros((h,), jnp.float32))

  def _project(self, x, w, bias_name):
    y = attention.matmul(x, w[...])
    if self.has_bias:
      y = y + getattr(self, bias_name)[...].astype(y.dtype)
    return y

  def _rope(self, x, positions):
    if self.yarn is None:
      return attention.rope(x, positions, self.rope_theta)
    freq, scale = yarn_frequencies(self.head_dim, self.rope_theta, self.yarn)
    return attention.rope_with_frequencies(x, positions, freq, scale)

  def __call__(self, x: jax.Array, positions: jax.Array, layer) -> jax.Array:
    """x [B, T, D] at positions [T]; `layer` (int or traced) picks the
    window."""
    b, t, _ = x.shape
    q = self._project(x, self.wq, "bq").reshape(b, t, self.num_heads, -1)
    k = self._project(x, self.wk, "bk").reshape(b, t, self.num_kv_heads, -1)
    v = self._project(x, self.wv, "bv").reshape(b, t, self.num_kv_heads, -1)
    q, k = self._rope(q, positions), self._rope(k, positions)
    if isinstance(layer, int):
      window = self.windows[layer]
    else:
      window = jnp.asarray(self.windows, jnp.int32)[layer]
    sinks = self.sinks[...] if self.has_sinks else None
    out = sink_attention(q, k, v, sinks, window).reshape(b, t, -1)
    return self._project(out, self.wo, "bo")
