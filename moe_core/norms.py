"""The block's own input norms: the router's and the experts' RMS norms."""

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
