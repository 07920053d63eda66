"""DeepSeek-V4's decoder for the training model (`ModelConfig.deepseek_v4`).

`transformer.py`'s `Transformer` builds these blocks instead of its pre-norm
ones when the config has DeepSeek-V4 settings (`deepseek_v4_config.py`)
and runs `forward`:

    tokens [B, T] -> embed [B, T, D] -> n copies: streams [B, T, n, D]
      -> per layer, twice (attention, then MoE), a hyper-connection:
           post, comb, x = hc(streams)      x = the streams collapsed, [B,T,D]
           streams = post * sublayer(norm(x)) + comb^T @ streams
      -> hyper-head: streams collapsed to [B, T, D] -> norm -> head -> logits

What each piece does, as in transformers' modeling_deepseek_v4.py:
  * hyper-connections (mHC): from the RMS-normalised streams, one linear map
    gives pre (sigmoid), post (2 sigmoid) and comb (softmax rows, then
    Sinkhorn-Knopp towards a doubly-stochastic matrix) per token;
  * attention: a low-rank query (q_a, its norm, q_b, then an unweighted
    per-head RMSNorm), one key/value head (kv, its norm) read as both key
    and value, RoPE on each head's trailing `rope_head_dim` channels
    (interleaved pairs), undone on the output at the query's position,
    per-head sinks in the softmax, a sliding window, and a grouped low-rank
    output projection (o_a per group, o_b);
  * compressed layers add entries to the keys: "hca" pools each window of
    `hca_rate` tokens (a softmax over the window of learned gates plus a
    position bias, then a norm and RoPE at the window's first position);
    "csa" pools overlapping windows of 2 * `csa_rate` (two series per
    token), and its indexer (its own pooled keys, queries from the query's
    low-rank code, ReLU scores weighted per head) keeps each query's
    `index_topk` best entries. A query sees entry w once its window is
    complete (w < (t + 1) // rate);
  * MoE: the first `num_hash_layers` route by a token-id table (`HashTable`
    routing state), the rest by sqrt-softplus scores with a correction
    bias; both with the SwiGLU clamp of `moe` (`swiglu_limit`).

Simplified or left out (the parameter layout is exact either way):
  * RoPE of the compressed layers uses `compress_rope_theta` without the
    released config's YaRN scaling (factor 16 beyond 65,536 tokens);
  * as in transformers, nothing trains the indexer (its scores only
    select), the paper's indexer loss is not implemented;
  * attention is computed densely over the sequence (masked to the window)
    and no cache is kept: a training forward, not an inference one;
  * the multi-token-prediction layer is not built (nor counted, as in the
    published figures); expert parallelism refuses the hash layers
    (`moe_core.moe_layer`), and `scan_model.py` refuses the model.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
from flax import nnx

from moe_core import flax as moe_flax
from train.models import deepseek_v4_config
from train.models import layers
from train.models import model_config


class LayerInputs(typing.NamedTuple):
  """What every layer reads besides the streams.

  Attributes:
    positions: [T] token positions.
    token_ids: [B, T] int token ids (the hash layers route by them).
  """

  positions: jax.Array
  token_ids: jax.Array


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, in float32 (no learned scale)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rope_trailing(
    x: jax.Array,
    positions: jax.Array,
    theta: float,
    rope_dim: int,
    inverse: bool = False,
) -> jax.Array:
  """RoPE on the last `rope_dim` channels of x, pairs (2i, 2i + 1).

  Args:
    x: [B, T, d] or [B, T, H, d], positions along axis 1.
    positions: [T].
    theta: the RoPE base.
    rope_dim: trailing channels rotated (even); the others pass.
    inverse: rotate by minus the angle (undoes a forward rotation).

  Returns:
    x's shape and dtype.
  """
  half = rope_dim // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / rope_dim)
  angle = positions.astype(jnp.float32)[:, None] * freq  # [T, half]
  shape = (1, angle.shape[0]) + (1,) * (x.ndim - 3) + (half,)
  cos = jnp.cos(angle).reshape(shape)
  sin = jnp.sin(angle).reshape(shape)
  if inverse:
    sin = -sin
  kept, rotated = jnp.split(x, [x.shape[-1] - rope_dim], axis=-1)
  rotated = rotated.astype(jnp.float32)
  even, odd = rotated[..., 0::2], rotated[..., 1::2]
  turned = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], -1)
  turned = turned.reshape(rotated.shape).astype(x.dtype)
  return jnp.concatenate([kept, turned], axis=-1)


def sinkhorn(matrix: jax.Array, iterations: int, eps: float) -> jax.Array:
  """Alternately normalises columns and rows of [..., n, n] (positive).

  Columns first, then `iterations - 1` rounds of rows and columns. A loop
  (a scan, differentiable) rather than unrolled: 20 rounds in each of two
  hyper-connections per layer would otherwise be a large share of the
  program to compile.
  """

  def columns(m):
    return m / (m.sum(axis=-2, keepdims=True) + eps)

  def rows_then_columns(_, m):
    return columns(m / (m.sum(axis=-1, keepdims=True) + eps))

  return jax.lax.fori_loop(
      0, iterations - 1, rows_then_columns, columns(matrix)
  )


class HyperConnection(nnx.Module):
  """The weights that carry n residual streams through one sub-layer.

  streams [B, T, n, D] -> (post [B, T, n], comb [B, T, n, n], both float32,
  and x [B, T, D], the streams collapsed by pre, in the streams' dtype).
  """

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    s = cfg.deepseek_v4
    n, d = s.hc_mult, cfg.hidden_size
    self.n, self.iters, self.hc_eps = n, s.hc_sinkhorn_iters, s.hc_eps
    self.norm_eps = cfg.norm_eps
    self.fn = layers.weight(rngs.params(), (n * d, (2 + n) * n))
    self.base = nnx.Param(jnp.zeros(((2 + n) * n,), jnp.float32))
    self.scale = nnx.Param(jnp.ones((3,), jnp.float32))

  def __call__(self, streams: jax.Array):
    b, t, n, d = streams.shape
    flat = unweighted_rms_norm(streams.reshape(b, t, n * d), self.norm_eps)
    mixes = flat @ self.fn[...]
    base, scale = self.base[...], self.scale[...]
    pre, post, comb = jnp.split(mixes, [n, 2 * n], axis=-1)
    pre = jax.nn.sigmoid(pre * scale[0] + base[:n]) + self.hc_eps
    post = 2 * jax.nn.sigmoid(post * scale[1] + base[n : 2 * n])
    comb = comb * scale[2] + base[2 * n :]
    comb = jax.nn.softmax(comb.reshape(b, t, n, n), axis=-1) + self.hc_eps
    comb = sinkhorn(comb, self.iters, self.hc_eps)
    x = jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32))
    return post, comb, x.astype(streams.dtype)


def merge_streams(post, comb, output, streams):
  """post * output added to every stream, plus the streams mixed by comb:
  new[k] = post[k] * output + sum_j comb[j, k] * streams[j]."""
  dtype = streams.dtype
  mixed = jnp.einsum("btjk,btjd->btkd", comb.astype(dtype), streams)
  return post.astype(dtype)[..., None] * output[:, :, None, :] + mixed


class HyperHead(nnx.Module):
  """The streams [B, T, n, D] collapsed to [B, T, D] before the final norm."""

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    s = cfg.deepseek_v4
    n, d = s.hc_mult, cfg.hidden_size
    self.hc_eps, self.norm_eps = s.hc_eps, cfg.norm_eps
    self.fn = layers.weight(rngs.params(), (n * d, n))
    self.base = nnx.Param(jnp.zeros((n,), jnp.float32))
    self.scale = nnx.Param(jnp.ones((1,), jnp.float32))

  def __call__(self, streams: jax.Array) -> jax.Array:
    b, t, n, d = streams.shape
    flat = unweighted_rms_norm(streams.reshape(b, t, n * d), self.norm_eps)
    mixes = flat @ self.fn[...]
    pre = jax.nn.sigmoid(mixes * self.scale[0] + self.base[...]) + self.hc_eps
    x = jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32))
    return x.astype(streams.dtype)


class Pooler(nnx.Module):
  """Pools windows of `rate` tokens into one entry each: x [B, T, D] ->
  entries [B, T // rate, width] (normed, RoPE at each window's start).

  With `overlap` (compressed-sparse attention and its indexer) each token
  gives two series; entry w pools window w-1's first series with window w's
  second, 2 * rate slots. Each channel's slots are weighted by a softmax of
  their gates plus a learned bias per slot position.
  """

  def __init__(
      self,
      cfg: model_config.ModelConfig,
      width: int,
      rate: int,
      overlap: bool,
      *,
      rngs: nnx.Rngs,
  ):
    series = 2 if overlap else 1
    d = cfg.hidden_size
    self.width, self.rate, self.overlap = width, rate, overlap
    self.theta = cfg.deepseek_v4.compress_rope_theta
    self.rope_dim = min(cfg.deepseek_v4.rope_head_dim, width)
    self.wkv = layers.weight(rngs.params(), (d, series * width))
    self.wgate = layers.weight(rngs.params(), (d, series * width))
    self.position_bias = nnx.Param(
        jnp.zeros((rate, series * width), jnp.float32)
    )
    self.norm = layers.RMSNorm(width, cfg.norm_eps)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    n, rate, w = t // self.rate, self.rate, self.width
    x = x[:, : n * rate]
    kv = layers.matmul(x, self.wkv[...]).reshape(b, n, rate, -1)
    gate = layers.matmul(x, self.wgate[...]).reshape(b, n, rate, -1)
    gate = gate.astype(jnp.float32) + self.position_bias[...]
    if self.overlap:
      # Slots 0..rate-1: the previous window's first series (none before
      # window 0: gates -inf, weight 0); slots rate..: this window's second.
      def previous(a, fill):
        pad = jnp.full((b, 1, rate, w), fill, a.dtype)
        return jnp.concatenate([pad, a[:, :-1, :, :w]], axis=1)

      kv = jnp.concatenate([previous(kv, 0), kv[..., w:]], axis=2)
      gate = jnp.concatenate([previous(gate, -jnp.inf), gate[..., w:]], axis=2)
    weights = jax.nn.softmax(gate, axis=2)
    pooled = jnp.sum(kv.astype(jnp.float32) * weights, axis=2)
    entries = self.norm(pooled.astype(x.dtype))
    starts = jnp.arange(n) * rate
    return rope_trailing(entries, starts, self.theta, self.rope_dim)


def visible_entries(num_entries: int, seq_len: int, rate: int) -> jax.Array:
  """[T, W] bool: query t sees entry w once its window is complete."""
  complete = (jnp.arange(seq_len) + 1) // rate
  return jnp.arange(num_entries)[None, :] < complete[:, None]


class Indexer(nnx.Module):
  """Chooses each query's compressed-sparse entries (the lightning indexer).

  score[t, w] = sum_h weight[t, h] * relu(q[t, h] . key[w]) / sqrt(d_I);
  a query keeps its `index_topk` best visible entries.
  """

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    s = cfg.deepseek_v4
    self.heads, self.head_dim, self.topk = (
        s.index_n_heads,
        s.index_head_dim,
        s.index_topk,
    )
    self.theta, self.rope_dim = s.compress_rope_theta, s.rope_head_dim
    self.rate = s.csa_rate
    self.keys = Pooler(cfg, s.index_head_dim, s.csa_rate, True, rngs=rngs)
    self.wq_b = layers.weight(
        rngs.params(), (cfg.q_lora_rank, s.index_n_heads * s.index_head_dim)
    )
    self.w_heads = layers.weight(
        rngs.params(), (cfg.hidden_size, s.index_n_heads)
    )

  def __call__(self, x, q_code, positions, visible) -> jax.Array:
    """[B, T, W] bool: the entries each query attends to."""
    b, t, _ = x.shape
    keys = self.keys(x)  # [B, W, d_I]
    q = layers.matmul(q_code, self.wq_b[...])
    q = q.reshape(b, t, self.heads, self.head_dim)
    q = rope_trailing(
        q, positions, self.theta, min(self.rope_dim, self.head_dim)
    )
    scores = jnp.einsum(
        "bthd,bwd->bthw", q, keys, preferred_element_type=jnp.float32
    )
    scores = jax.nn.relu(scores) * self.head_dim**-0.5
    weights = layers.matmul(x, self.w_heads[...]).astype(jnp.float32)
    index = jnp.einsum("bthw,bth->btw", scores, weights * self.heads**-0.5)
    # Selection only: no gradient flows through the choice.
    index = jnp.where(visible, jax.lax.stop_gradient(index), -jnp.inf)
    k = min(self.topk, index.shape[-1])
    best = jax.lax.top_k(index, k)[1]  # [B, T, k]

    def chosen(row):  # [k] -> [W] bool
      return jnp.zeros(index.shape[-1], bool).at[row].set(True)

    # Fewer than k visible: the rest of the k are invisible ones, dropped.
    return visible & jax.vmap(jax.vmap(chosen))(best)


class Attention(nnx.Module):
  """DeepSeek-V4 attention of one layer: x [B, T, D] -> [B, T, D]."""

  def __init__(
      self, cfg: model_config.ModelConfig, layer: int, *, rngs: nnx.Rngs
  ):
    s = cfg.deepseek_v4
    d, h, hd, qr = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    self.num_heads, self.head_dim, self.norm_eps = h, hd, cfg.norm_eps
    self.kind = s.layer_types[layer]
    self.window, self.rope_dim, self.groups = (
        s.sliding_window,
        s.rope_head_dim,
        s.o_groups,
    )
    self.theta = (
        cfg.rope_theta if self.kind == "sliding" else (s.compress_rope_theta)
    )
    self.wq_a = layers.weight(rngs.params(), (d, qr))
    self.q_a_norm = layers.RMSNorm(qr, cfg.norm_eps)
    self.wq_b = layers.weight(rngs.params(), (qr, h * hd))
    self.wkv = layers.weight(rngs.params(), (d, hd))
    self.kv_norm = layers.RMSNorm(hd, cfg.norm_eps)
    self.wo_a = layers.weight(
        rngs.params(), (s.o_groups, h * hd // s.o_groups, s.o_lora_rank)
    )
    self.wo_b = layers.weight(rngs.params(), (s.o_groups * s.o_lora_rank, d))
    self.sinks = nnx.Param(jnp.zeros((h,), jnp.float32))
    self.rate = {"csa": s.csa_rate, "hca": s.hca_rate}.get(self.kind, 0)
    if self.kind != "sliding":
      self.compressor = Pooler(
          cfg, hd, self.rate, overlap=self.kind == "csa", rngs=rngs
      )
    if self.kind == "csa":
      self.indexer = Indexer(cfg, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    h, hd = self.num_heads, self.head_dim
    q_code = self.q_a_norm(layers.matmul(x, self.wq_a[...]))
    q = layers.matmul(q_code, self.wq_b[...]).reshape(b, t, h, hd)
    q = unweighted_rms_norm(q, self.norm_eps).astype(x.dtype)
    q = rope_trailing(q, positions, self.theta, self.rope_dim)
    kv = self.kv_norm(layers.matmul(x, self.wkv[...]))  # [B, T, hd]
    kv = rope_trailing(kv, positions, self.theta, self.rope_dim)

    rows, cols = positions[:, None], positions[None, :]
    local = (cols <= rows) & (rows - cols < self.window)  # [T, T]
    keys, masks = [kv], [jnp.broadcast_to(local, (b, t, t))]
    if self.kind != "sliding":
      entries = self.compressor(x)  # [B, W, hd]
      seen = visible_entries(entries.shape[1], t, self.rate)
      seen = jnp.broadcast_to(seen, (b, t, entries.shape[1]))
      if self.kind == "csa":
        seen = self.indexer(x, q_code, positions, seen)
      keys.append(entries)
      masks.append(seen)
    keys = jnp.concatenate(keys, axis=1)  # [B, S, hd], S = T (+ W)
    mask = jnp.concatenate(masks, axis=-1)  # [B, T, S]
    logits = jnp.einsum(
        "bthd,bsd->bhts", q, keys, preferred_element_type=jnp.float32
    )
    logits = jnp.where(mask[:, None], logits * hd**-0.5, -jnp.inf)
    # The sink: one more logit per head that takes weight and gives nothing.
    sink = jnp.broadcast_to(self.sinks[...][None, :, None, None], (b, h, t, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], -1), axis=-1)
    # In float32: XLA:CPU has no bf16 x bf16 -> f32 kernel for these two
    # contractions' layouts.
    probs = probs[..., :-1]
    out = jnp.einsum("bhts,bsd->bthd", probs, keys.astype(jnp.float32))
    out = out.astype(x.dtype)
    # Values are the keys, so their RoPE part rotated; undo it at the query.
    out = rope_trailing(out, positions, self.theta, self.rope_dim, inverse=True)
    grouped = out.reshape(b, t, self.groups, h * hd // self.groups)
    low_rank = jnp.einsum(
        "btgi,gio->btgo", grouped.astype(jnp.float32), self.wo_a[...]
    ).astype(x.dtype)
    return layers.matmul(low_rank.reshape(b, t, -1), self.wo_b[...])


class Block(layers.LayerBlock):
  """One DeepSeek-V4 layer on the streams; returns (streams, MoE stats).

  Called as `block(streams, LayerInputs(positions, token_ids))`, so that
  `moe_core.flax.call_block` runs it under a remat policy like any block.
  """

  def build(self, cfg, layer, rngs, new_moe) -> None:
    self.is_moe = True
    self.hashed = layer < cfg.deepseek_v4.num_hash_layers
    self.attn_hc = HyperConnection(cfg, rngs=rngs)
    self.attn_norm = layers.RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.attn = Attention(cfg, layer, rngs=rngs)
    self.mlp_hc = HyperConnection(cfg, rngs=rngs)
    self.mlp_norm = layers.RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.mlp = new_moe(deepseek_v4_config.layer_moe(cfg, layer))

  def __call__(self, streams: jax.Array, inputs: LayerInputs):
    post, comb, x = self.attn_hc(streams)
    y = self.attn(self.attn_norm(x), inputs.positions)
    streams = merge_streams(post, comb, y, streams)
    post, comb, x = self.mlp_hc(streams)
    token_ids = inputs.token_ids if self.hashed else None
    y, aux = self.mlp(self.mlp_norm(x), token_ids=token_ids)
    return merge_streams(post, comb, y, streams), layers.moe_stats(aux)


def add_modules(model, cfg: model_config.ModelConfig, rngs: nnx.Rngs) -> None:
  """Sets `model.hc_head`: the hyper-head that folds the streams into one
  (`families.py`'s hook; the name is the checkpoints' tree path)."""
  model.hc_head = HyperHead(cfg, rngs=rngs)


def forward(model, tokens: jax.Array):
  """`transformer.Transformer.__call__` for a DeepSeek-V4 config: tokens [B, T]
  -> (logits [B, T, V] float32, MoE stats [L, ...])."""
  x = layers.embed_tokens(model, tokens)
  n = model.cfg.deepseek_v4.hc_mult
  streams = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], n, x.shape[2]))
  inputs = LayerInputs(jnp.arange(tokens.shape[1]), tokens)
  stats = []
  for block in model.blocks:
    streams, block_stats = moe_flax.call_block(
        block, streams, inputs, model.remat
    )
    stats.append(block_stats)
  x = model.hc_head(streams)
  return layers.output_logits(model, x), layers.stack_stats(stats)
