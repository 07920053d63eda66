"""The pieces every decoder here is built of, and the standard block.

`Block` is a pre-norm residual block: an attention (grouped-query with RoPE,
optionally QK-normed, output-gated and partially rotated as in Qwen3-Next,
or DeepSeek's multi-head latent attention; or, per layer as the config
says, Qwen3-Next's Gated DeltaNet, `gated_deltanet.py`, or GPT-OSS's sink
attention, `sink_attention.py`) and an MLP: a dense SwiGLU (the first
`first_dense_layers`, and with `moe_layer_interval` > 1 the layers between
MoE ones) or a `moe_core.flax.MoE` (the rest). The families with blocks of
their own (`families.py`) build them from the same pieces: `weight`,
`matmul`, `RMSNorm`, `moe_stats`, and the model's ends (`embed_tokens`,
`output_logits`, `stack_stats`).

Mixed precision: parameters are stored in float32 and cast to the compute
dtype (bfloat16 by default) where used; norms, softmax and logits are
computed in float32; routing is float32 inside `moe_core`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import moe_core
from moe_core import flax as moe_flax
from train.models import attention
from train.models import gated_deltanet
from train.models import llama4
from train.models import model_config
from train.models import sink_attention


def weight(key, shape, fan_in=None):
  """Truncated normal, std 1/sqrt(fan_in) (fan_in: shape[-2] by default)."""
  std = (fan_in or shape[-2]) ** -0.5
  return nnx.Param(
      std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
  )


# x @ w in x's dtype, accumulated in float32: defined beside the attention
# math, which sink_attention.py uses without importing this module.
matmul = attention.matmul


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last axis, computed in float32."""

  def __init__(self, dim: int, eps: float):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    norm = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * norm * self.scale[...]).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with RoPE and optional QK-norm: [B,T,D] -> same.

  With `use_rope=False` (a Llama 4 NoPE layer) there is no RoPE, no "l2"
  QK-norm and no chunking, and the queries get the temperature scaling of
  `cfg.attn_temperature_floor` if set.
  """

  def __init__(
      self,
      cfg: model_config.ModelConfig,
      *,
      rngs: nnx.Rngs,
      use_rope: bool = True,
  ):
    d, h, hkv, hd = attention.set_head_sizes(self, cfg)
    self.qk_norm = cfg.qk_norm
    self.output_gate = cfg.attention_output_gate
    self.rotary_dim = cfg.rotary_dim
    self.use_rope = use_rope
    self.norm_eps = cfg.norm_eps
    self.chunk_size = cfg.attention_chunk_size if use_rope else 0
    self.temperature = (
        (cfg.attn_temperature_floor, cfg.attn_temperature_scale)
        if not use_rope and cfg.attn_temperature_floor
        else None
    )
    # Gated attention: per head, the query then its gate (transformers'
    # layout of Qwen3-Next's q_proj).
    q_width = 2 * h * hd if self.output_gate else h * hd
    self.wq = weight(rngs.params(), (d, q_width))
    self.wk = weight(rngs.params(), (d, hkv * hd))
    self.wv = weight(rngs.params(), (d, hkv * hd))
    self.wo = weight(rngs.params(), (h * hd, d))
    if cfg.qk_norm == "head":  # Qwen3: one scale per head dimension.
      self.q_norm = RMSNorm(hd, cfg.norm_eps)
      self.k_norm = RMSNorm(hd, cfg.norm_eps)
    elif cfg.qk_norm == "full":  # OLMoE: over the whole projection.
      self.q_norm = RMSNorm(h * hd, cfg.norm_eps)
      self.k_norm = RMSNorm(hkv * hd, cfg.norm_eps)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    q, k, v = (matmul(x, w[...]) for w in (self.wq, self.wk, self.wv))
    if self.output_gate:
      q, gate = jnp.split(q.reshape(b, t, self.num_heads, -1), 2, axis=-1)
      q = q.reshape(b, t, -1)
    if self.qk_norm == "full":
      q, k = self.q_norm(q), self.k_norm(k)
    q = q.reshape(b, t, self.num_heads, self.head_dim)
    k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
    v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.qk_norm == "head":
      q, k = self.q_norm(q), self.k_norm(k)
    if self.use_rope:
      q = _partial_rope(q, positions, self.rope_theta, self.rotary_dim)
      k = _partial_rope(k, positions, self.rope_theta, self.rotary_dim)
      if self.qk_norm == "l2":  # Llama 4: RoPE layers only.
        q = llama4.l2_norm(q, self.norm_eps)
        k = llama4.l2_norm(k, self.norm_eps)
    if self.temperature is not None:
      scale = llama4.temperature_scale(positions, *self.temperature)
      q = (q * scale[None, :, None, None]).astype(q.dtype)
    out = attention.causal_attention(q, k, v, chunk_size=self.chunk_size)
    if self.output_gate:
      sigmoid = jax.nn.sigmoid(gate.astype(jnp.float32))
      out = (out.astype(jnp.float32) * sigmoid).astype(out.dtype)
    return matmul(out.reshape(b, t, -1), self.wo[...])


def _partial_rope(x, positions, theta, rotary_dim):
  """RoPE on the first `rotary_dim` of x's last axis; the rest unrotated."""
  if rotary_dim == x.shape[-1]:
    return attention.rope(x, positions, theta)
  rotated = attention.rope(x[..., :rotary_dim], positions, theta)
  return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


class LatentAttention(nnx.Module):
  """DeepSeek-V2/V3 multi-head latent attention (MLA): [B,T,D] -> same.

  Queries go through an optional low-rank bottleneck; keys and values are
  rebuilt from a normalised kv_lora_rank-wide latent, plus one RoPE key part
  shared by every head. Computed in the expanded (training) form.
  """

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    d, h = cfg.hidden_size, cfg.num_heads
    self.num_heads = h
    self.nope, self.rope_dim, self.v_dim = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    self.kv_rank = cfg.kv_lora_rank
    self.rope_theta = cfg.rope_theta
    qk = self.nope + self.rope_dim
    self.q_lora = bool(cfg.q_lora_rank)
    if self.q_lora:
      self.wq_a = weight(rngs.params(), (d, cfg.q_lora_rank))
      self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
      self.wq_b = weight(rngs.params(), (cfg.q_lora_rank, h * qk))
    else:
      self.wq = weight(rngs.params(), (d, h * qk))
    self.wkv_a = weight(rngs.params(), (d, self.kv_rank + self.rope_dim))
    self.kv_a_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
    self.wkv_b = weight(
        rngs.params(), (self.kv_rank, h * (self.nope + self.v_dim))
    )
    self.wo = weight(rngs.params(), (h * self.v_dim, d))

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    h = self.num_heads
    if self.q_lora:
      q = matmul(self.q_a_norm(matmul(x, self.wq_a[...])), self.wq_b[...])
    else:
      q = matmul(x, self.wq[...])
    q = q.reshape(b, t, h, self.nope + self.rope_dim)
    q_nope, q_rope = jnp.split(q, [self.nope], axis=-1)
    latent, k_rope = jnp.split(
        matmul(x, self.wkv_a[...]), [self.kv_rank], axis=-1
    )
    kv = matmul(self.kv_a_norm(latent), self.wkv_b[...])
    k_nope, v = jnp.split(
        kv.reshape(b, t, h, self.nope + self.v_dim), [self.nope], axis=-1
    )
    k_rope = attention.rope(k_rope[:, :, None, :], positions, self.rope_theta)
    q = jnp.concatenate(
        [q_nope, attention.rope(q_rope, positions, self.rope_theta)], axis=-1
    )
    k = jnp.concatenate(
        [k_nope, jnp.broadcast_to(k_rope, (b, t, h, self.rope_dim))], axis=-1
    )
    out = attention.causal_attention(q, k, v).reshape(b, t, -1)
    return matmul(out, self.wo[...])


class DenseMLP(nnx.Module):
  """SwiGLU: silu(x @ w_gate) * (x @ w_up) @ w_down, [B,T,D] -> same.

  A gated MLP of another activation (Gemma 4's GeGLU) overrides
  `activation`.
  """

  def __init__(self, hidden: int, ffn: int, *, rngs: nnx.Rngs):
    self.w_gate = weight(rngs.params(), (hidden, ffn))
    self.w_up = weight(rngs.params(), (hidden, ffn))
    self.w_down = weight(rngs.params(), (ffn, hidden))

  def activation(self, gate: jax.Array) -> jax.Array:
    """The gate's activation, in float32."""
    return jax.nn.silu(gate)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate = matmul(x, self.w_gate[...]).astype(jnp.float32)
    up = matmul(x, self.w_up[...]).astype(jnp.float32)
    hidden = self.activation(gate) * up
    return matmul(hidden.astype(x.dtype), self.w_down[...])


def moe_stats(aux: moe_core.MoEAux) -> dict[str, jax.Array]:
  """The parts of `MoEAux` the training loop needs (small, per layer)."""
  return {
      "tokens_per_expert": aux.tokens_per_expert,
      "load_balancing_loss": aux.load_balancing_loss,
      "router_z_loss": aux.router_z_loss,
      "dropped_tokens": aux.dropped_tokens,
      "invalid_assignments": aux.invalid_assignments,
  }


class LayerBlock(nnx.Module):
  """A layer as the model builds it: `Block(cfg, layer, *, backend, rngs,
  moe_mesh)`, the constructor `families.py` asks of every family's layer.

  A subclass builds its modules in `build`, where `new_moe(moe_cfg)` makes
  an MoE block (`moe_core.flax.MoE`) on the model's backend and mesh.

  Args:
    cfg: the model config.
    layer: the layer's index.
    backend: the MoE backend name.
    rngs: `nnx.Rngs` with a "params" stream, drawn in `build`'s order.
    moe_mesh: None for one device, or the keyword arguments that put the
      MoE block on a mesh (`transformer.LanguageModel`'s).
  """

  def __init__(
      self,
      cfg: model_config.ModelConfig,
      layer: int,
      *,
      backend: str,
      rngs: nnx.Rngs,
      moe_mesh: dict | None = None,
  ):
    def new_moe(moe_cfg: moe_core.MoEConfig) -> moe_flax.MoE:
      return moe_flax.MoE(
          moe_cfg, backend=backend, rngs=rngs, **(moe_mesh or {})
      )

    self.build(cfg, layer, rngs, new_moe)

  def build(self, cfg, layer, rngs, new_moe) -> None:
    """Builds the layer's modules from the constructor's arguments."""
    raise NotImplementedError


class Block(LayerBlock):
  """Pre-norm block; returns (x, MoE stats or None for a dense MLP)."""

  def build(self, cfg, layer, rngs, new_moe) -> None:
    self.is_moe = cfg.is_moe_layer(layer)
    self.layer = layer
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    # GPT-OSS's attention (biases, sinks, windows, YaRN) takes the layer.
    self.attn_takes_layer = (
        cfg.uses_gpt_oss_attention and not cfg.is_linear_attention_layer(layer)
    )
    if cfg.is_linear_attention_layer(layer):  # Qwen3-Next's hybrid stack.
      self.attn = gated_deltanet.GatedDeltaNet(
          cfg.linear_attention, cfg.hidden_size, cfg.norm_eps, rngs=rngs
      )
    elif self.attn_takes_layer:
      self.attn = sink_attention.SinkAttention(cfg, rngs=rngs, weight=weight)
    elif cfg.attention == "mla":
      self.attn = LatentAttention(cfg, rngs=rngs)
    else:
      self.attn = Attention(cfg, rngs=rngs, use_rope=cfg.uses_rope(layer))
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    if self.is_moe:
      self.mlp = new_moe(cfg.moe)
    else:
      self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_ffn_size, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, layer=None):
    """`layer`: this block's index, traced under a scan (None: its own)."""
    if self.attn_takes_layer:
      layer = self.layer if layer is None else layer
      x = x + self.attn(self.attn_norm(x), positions, layer)
    else:
      x = x + self.attn(self.attn_norm(x), positions)
    h = self.mlp_norm(x)
    if self.is_moe:
      y, aux = self.mlp(h)
      return x + y, moe_stats(aux)
    return x + self.mlp(h), None


def embedding(cfg: model_config.ModelConfig, rngs: nnx.Rngs) -> nnx.Param:
  """The token embedding [V, D]: float32, N(0, 1), drawn first of a model's
  parameters."""
  return nnx.Param(
      jax.random.normal(
          rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32
      )
  )


def embed_tokens(model: nnx.Module, tokens: jax.Array) -> jax.Array:
  """tokens [B, T] -> x [B, T, D] in the model's compute dtype."""
  return model.embed[...][tokens].astype(model.compute_dtype)


def output_logits(model: nnx.Module, x: jax.Array) -> jax.Array:
  """The final norm and the output head: x [B, T, D] -> [B, T, V] float32."""
  x = model.final_norm(x)
  if model.cfg.tie_embeddings:
    head = model.embed[...].T * model.cfg.hidden_size**-0.5
  else:
    head = model.head[...]
  logits = jnp.dot(x, head.astype(x.dtype), preferred_element_type=jnp.float32)
  cap = model.cfg.logit_softcap
  if cap:  # Gemma 4: cap * tanh(z / cap).
    logits = cap * jnp.tanh(logits / cap)
  return logits


def stack_stats(stats: list[dict]) -> dict[str, jax.Array] | None:
  """Per-layer `moe_stats` as one dict of [L_moe, ...] arrays (None if no
  layer has an MoE block)."""
  if not stats:
    return None
  return jax.tree.map(lambda *layers: jnp.stack(layers), *stats)
