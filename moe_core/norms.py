"""The block's own norms: the router's and the experts' input RMS norms,
and the norm of each routed expert's output (cfg.post_expert_norm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_core import config as config_lib


def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float) -> jax.Array:
  """[..., D] x / sqrt(mean(x^2) + epsilon) * scale [D], in float32."""
  x = x.astype(jnp.float32)
  mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(mean_square + epsilon) * scale.astype(jnp.float32)


def expert_input(
    tokens: jax.Array, params: dict, cfg: config_lib.MoEConfig
) -> jax.Array:
  """What the experts (routed and shared) see: tokens [T, D], or with
  `cfg.expert_input_norm` their RMS norm times params["expert_norm_scale"]
  [D] (Gemma 4's pre_feedforward_layernorm_2), in the tokens' dtype."""
  if not cfg.expert_input_norm:
    return tokens
  normed = rms_norm(tokens, params["expert_norm_scale"], cfg.input_norm_epsilon)
  return normed.astype(tokens.dtype)


def post_expert(
    out: jax.Array, params: dict, cfg: config_lib.MoEConfig
) -> jax.Array:
  """Each routed expert's output rows out [M, W] as the combine weighs
  them: out itself, or with `cfg.post_expert_norm` z / sqrt(mean(z^2) +
  eps), z = out * params["post_expert_norm_scale"] [W] (Muse Spark's
  post_expert_norm: the scale comes before the norm), in float32, returned
  in out's dtype. A zero row (padding) stays zero, a NaN row NaN."""
  if not cfg.post_expert_norm:
    return out
  scale = params["post_expert_norm_scale"].astype(jnp.float32)
  scaled = out.astype(jnp.float32) * scale
  mean_square = jnp.mean(jnp.square(scaled), axis=-1, keepdims=True)
  normed = scaled * jax.lax.rsqrt(mean_square + cfg.post_expert_norm_epsilon)
  return normed.astype(out.dtype)
