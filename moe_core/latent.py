"""The latent projections around the routed experts (cfg.expert_latent_size).

Nemotron-H and Muse Spark run their routed experts at a width L below the
model's D: the experts' input is projected down before the dispatch (so the
dispatch and any expert-parallel exchange move [L] rows, not [D]) and the
combined output is projected back. Both run outside the backends, on one
device and per device under a mesh, so every backend gets them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_core import config as config_lib
from moe_core import norms


def project_in(
    tokens: jax.Array, params: dict, cfg: config_lib.MoEConfig
) -> jax.Array:
  """The routed experts' input: tokens [T, D] -> [T, L] = tokens @
  latent_in [D, L] (+ latent_in_bias [L] where cfg.latent_bias),
  RMS-normed times latent_norm_scale [L] where cfg.latent_norm (Muse
  Spark's pre_expert_norm); the product in the tokens' dtype accumulated
  in float32, the norm in float32, returned in the tokens' dtype. tokens
  itself without a latent width."""
  if not cfg.expert_latent_size:
    return tokens
  rows = _product(tokens, params["latent_in"])
  if cfg.latent_bias:  # Nemotron-H's mlp_bias.
    rows = rows + params["latent_in_bias"].astype(jnp.float32)
  if cfg.latent_norm:
    rows = norms.rms_norm(
        rows, params["latent_norm_scale"], cfg.latent_norm_epsilon
    )
  return rows.astype(tokens.dtype)


def project_out(
    y: jax.Array, params: dict, cfg: config_lib.MoEConfig
) -> jax.Array:
  """The combined routed output back at the model's width: y [T, L] ->
  [T, D] = y @ latent_out [L, D] (+ latent_out_bias [D] where
  cfg.latent_bias), accumulated in float32, in y's dtype. y
  itself without a latent width."""
  if not cfg.expert_latent_size:
    return y
  out = _product(y, params["latent_out"])
  if cfg.latent_bias:
    out = out + params["latent_out_bias"].astype(jnp.float32)
  return out.astype(y.dtype)


def _product(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [T, C] @ b [C, N] in a's dtype (as the shared expert's products),
  accumulated and returned in float32."""
  return jnp.dot(a, b.astype(a.dtype), preferred_element_type=jnp.float32)
