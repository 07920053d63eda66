"""Gemma 4's decoder layer for the training model (`transformer.py`).

`Gemma4Block` takes the place of `layers.Block` when `ModelConfig.gemma4` is
set; `gemma4_layout.py` describes the layout and counts it. Written
from transformers' modeling_gemma4.py (5.24.0) as a specification; the
parameter layout follows `transformer.py` (x @ W, float32 master weights,
compute in the activations' dtype, norms and softmax in float32).

Left out: the per-layer `layer_scalar` (a fixed buffer, 1 at
initialisation, not a parameter), the per-layer input embeddings and the
shared key/value layers of the small Gemma 4 models (off in the MoE model),
and the vision tower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from train.models import attention as attention_lib
from train.models import gemma4_layout
from train.models import layers
from train.models import model_config


def unscaled_rms_norm(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, in float32, with no learned scale."""
  x32 = x.astype(jnp.float32)
  norm = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * norm).astype(x.dtype)


def proportional_rope(
    x: jax.Array, positions: jax.Array, theta: float, fraction: float
) -> jax.Array:
  """RoPE of x [B, T, H, d] at positions [T] on a fraction of its pairs.

  Pairs (i, i + d/2), as `attention.rope`; pair i turns at
  theta ** (-2i / d) when i < fraction * d / 2 and not at all otherwise
  (transformers' "proportional" RoPE). fraction = 1 is `attention.rope`.
  """
  if fraction == 1.0:
    return attention_lib.rope(x, positions, theta)
  d = x.shape[-1]
  half = d // 2
  rotated = int(fraction * d // 2)
  pair = jnp.arange(half, dtype=jnp.float32)
  freq = jnp.where(pair < rotated, theta ** (-2.0 * pair / d), 0.0)
  return attention_lib.rope_with_frequencies(x, positions, freq)


def windowed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    window: int,
    query_block: int = attention_lib.QUERY_BLOCK,
) -> jax.Array:
  """Causal attention with unscaled scores, optionally in a sliding window.

  Gemma 4 normalises queries and keys per head and multiplies their dot
  product by 1 (not head_dim ** -0.5). Sequences longer than `query_block`
  (and a multiple of it) run one block of queries at a time, rematerialised
  in the backward (`attention.in_query_blocks`); a block then
  scores only the keys its window can reach (query_block + W - 1 of them),
  or every key without a window.

  Args:
    q: [B, T, H, d].
    k, v: [B, T, Hkv, d], Hkv dividing H.
    window: W > 0: query t sees keys t - W + 1 .. t; 0: every key <= t.
    query_block: queries per block.

  Returns:
    [B, T, H, d] in v's dtype.
  """
  t = q.shape[1]
  if t <= query_block or t % query_block:
    return _attention_rows(q, k, v, window, 0, 0)
  span = query_block + window - 1 if window else t
  if window:
    # W - 1 keys of padding in front: the block at row r reads padded keys
    # r .. r + span - 1, i.e. positions r - W + 1 .. r + query_block - 1.
    pad = [(0, 0), (window - 1, 0), (0, 0), (0, 0)]
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)

  def attend(q_rows, first_row):
    if not window:
      return _attention_rows(q_rows, k, v, 0, first_row, 0)
    k_rows, v_rows = (
        jax.lax.dynamic_slice_in_dim(x, first_row, span, axis=1) for x in (k, v)
    )
    return _attention_rows(
        q_rows, k_rows, v_rows, window, first_row, first_row - window + 1
    )

  return attention_lib.in_query_blocks(attend, q, query_block)


def _attention_rows(q, k, v, window: int, first_row, first_key) -> jax.Array:
  """`windowed_attention` of some queries against some keys.

  Args:
    q: [B, Tq, H, d], the queries of rows first_row .. first_row + Tq - 1.
    k, v: [B, Tk, Hkv, d], the keys and values at positions first_key ..
      first_key + Tk - 1 (those at negative positions are padding).
    window: as `windowed_attention`'s.
    first_row, first_key: positions (traced ints inside a loop).
  """
  b, tq, h, d = q.shape
  tk, kv_heads = k.shape[1], k.shape[2]
  q = q.reshape(b, tq, kv_heads, h // kv_heads, d)
  logits = jnp.einsum(
      "btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32
  )
  key_position = first_key + jnp.arange(tk)
  distance = (first_row + jnp.arange(tq))[:, None] - key_position[None, :]
  visible = (distance >= 0) & (key_position >= 0)[None, :]
  if window:
    visible &= distance < window
  logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum(
      "bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32
  )
  return out.reshape(b, tq, h, v.shape[-1]).astype(v.dtype)


class Gemma4Attention(nnx.Module):
  """A sliding or a global attention layer of Gemma 4: [B, T, D] -> same.

  Queries and keys are RMS-normed per head (learned scales), values too
  (no scale), then RoPE turns queries and keys. A global layer with
  `global_k_eq_v` has no value projection: its values are the keys'
  projection before the key norm and RoPE.
  """

  def __init__(
      self, cfg: model_config.ModelConfig, layer: int, *, rngs: nnx.Rngs
  ):
    layout = cfg.gemma4
    d, h = cfg.hidden_size, cfg.num_heads
    hd, kv_heads, has_values = gemma4_layout.layer_shape(cfg, layer)
    self.num_heads, self.num_kv_heads, self.head_dim = h, kv_heads, hd
    self.eps = cfg.norm_eps
    if layout.is_global(layer, cfg.num_layers):
      self.window = 0
      self.rope_theta = layout.global_rope_theta
      self.rope_fraction = layout.global_rope_fraction
    else:
      self.window = layout.sliding_window
      self.rope_theta, self.rope_fraction = cfg.rope_theta, 1.0
    self.wq = layers.weight(rngs.params(), (d, h * hd))
    self.wk = layers.weight(rngs.params(), (d, kv_heads * hd))
    self.has_values = has_values
    if has_values:
      self.wv = layers.weight(rngs.params(), (d, kv_heads * hd))
    self.wo = layers.weight(rngs.params(), (h * hd, d))
    self.q_norm = layers.RMSNorm(hd, cfg.norm_eps)
    self.k_norm = layers.RMSNorm(hd, cfg.norm_eps)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    kv_shape = (b, t, self.num_kv_heads, self.head_dim)
    q = layers.matmul(x, self.wq[...]).reshape(b, t, self.num_heads, -1)
    keys = layers.matmul(x, self.wk[...]).reshape(kv_shape)
    values = (
        layers.matmul(x, self.wv[...]).reshape(kv_shape)
        if self.has_values
        else keys
    )
    q = proportional_rope(
        self.q_norm(q), positions, self.rope_theta, self.rope_fraction
    )
    k = proportional_rope(
        self.k_norm(keys), positions, self.rope_theta, self.rope_fraction
    )
    v = unscaled_rms_norm(values, self.eps)
    out = windowed_attention(q, k, v, self.window).reshape(b, t, -1)
    return layers.matmul(out, self.wo[...])


class GeGLU(layers.DenseMLP):
  """gelu_tanh(x @ w_gate) * (x @ w_up) @ w_down: [B, T, D] -> same."""

  def activation(self, gate: jax.Array) -> jax.Array:
    return jax.nn.gelu(gate, approximate=True)


class Gemma4Block(layers.LayerBlock):
  """A Gemma 4 MoE decoder layer: x [B, T, D] -> (x, MoE stats).

      x += post_attn_norm(attn(attn_norm(x)))
      dense = post_dense_norm(mlp(mlp_norm(x)))
      routed = post_moe_norm(moe(x))   # the MoE block norms its own inputs
      x += post_mlp_norm(dense + routed)

  `mlp` is the MoE block, as in `layers.Block` (the training loop finds the
  MoE blocks by that name); `dense_mlp` the GeGLU beside it.
  """

  def build(self, cfg, layer, rngs, new_moe) -> None:
    d, eps = cfg.hidden_size, cfg.norm_eps
    self.is_moe = True
    self.attn_norm = layers.RMSNorm(d, eps)
    self.attn = Gemma4Attention(cfg, layer, rngs=rngs)
    self.post_attn_norm = layers.RMSNorm(d, eps)
    self.mlp_norm = layers.RMSNorm(d, eps)
    self.dense_mlp = GeGLU(d, cfg.dense_ffn_size, rngs=rngs)
    self.post_dense_norm = layers.RMSNorm(d, eps)
    self.mlp = new_moe(cfg.moe)
    self.post_moe_norm = layers.RMSNorm(d, eps)
    self.post_mlp_norm = layers.RMSNorm(d, eps)

  def __call__(self, x: jax.Array, positions: jax.Array):
    x = x + self.post_attn_norm(self.attn(self.attn_norm(x), positions))
    dense = self.post_dense_norm(self.dense_mlp(self.mlp_norm(x)))
    routed, aux = self.mlp(x)
    out = self.post_mlp_norm(dense + self.post_moe_norm(routed))
    return x + out, layers.moe_stats(aux)


class Gemma4Period(nnx.Module):
  """`global_every` consecutive Gemma 4 layers: x -> (x, stats [N, ...]).

  The layers repeat with this period (sliding ones, then a global one), so
  the scanned model (`scan_model.py`) stacks periods, not layers.
  """

  def __init__(
      self,
      cfg: model_config.ModelConfig,
      first_layer: int,
      *,
      backend: str,
      rngs: nnx.Rngs,
      moe_mesh: dict | None = None,
  ):
    module_list = getattr(nnx, "List", list)  # As transformer.Transformer's.
    self.layers = module_list(
        [
            Gemma4Block(
                cfg,
                first_layer + j,
                backend=backend,
                rngs=rngs,
                moe_mesh=moe_mesh,
            )
            for j in range(cfg.gemma4.global_every)
        ]
    )

  def __call__(self, x: jax.Array, positions: jax.Array, layer_index=None):
    """`layer_index`: what `scan_model.run_stack` passes every stacked unit;
    a period's layers know their kinds, so it is unused."""
    del layer_index
    stats = []
    for layer in self.layers:
      x, layer_stats = layer(x, positions)
      stats.append(layer_stats)
    return x, layers.stack_stats(stats)


# What `families.py` asks of a family: its layer, and what a scan stacks
# in place of the layers.
Block = Gemma4Block
ScanPeriod = Gemma4Period


def num_periods(cfg: model_config.ModelConfig) -> int:
  """How many `Gemma4Period`s make the model (ValueError if not whole)."""
  period = cfg.gemma4.global_every
  if cfg.num_layers % period:
    raise ValueError(
        f"model {cfg.name!r} (gemma4): scanned layers need num_layers a "
        f"multiple of gemma4.global_every, got num_layers={cfg.num_layers}, "
        f"global_every={period}; run it with --noscan_layers."
    )
  return cfg.num_layers // period


def layer_stats(period_stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Stats of stacked periods [P, N, ...] as per layer, [P * N, ...]."""
  return jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), period_stats)
