"""Gated FFN pieces: activations and the dense shared expert."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_core import config as config_lib

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    # Hugging Face's "gelu" is the exact erf form; "gelu_pytorch_tanh" the
    # tanh approximation.
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def activation(name: str):
  """The elementwise function called `name` ("silu", "gelu", "gelu_tanh")."""
  return _ACTIVATIONS[name]


def gated(gate: jax.Array, up: jax.Array, name: str) -> jax.Array:
  """act(gate) * up: two [M, F] -> [M, F], computed in float32, gate's dtype."""
  h = activation(name)(gate.astype(jnp.float32)) * up.astype(jnp.float32)
  return h.astype(gate.dtype)


def _matmul(a, b):
  """a [T, C] @ b [C, N] -> [T, N], accumulated in float32, in a's dtype."""
  return jnp.dot(
      a, b.astype(a.dtype), preferred_element_type=jnp.float32
  ).astype(a.dtype)


def shared_expert(
    params: dict, x: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array:
  """The always-on expert: [T, D] -> [T, D], optionally sigmoid-gated."""
  h = gated(
      _matmul(x, params["shared_w_gate"]),
      _matmul(x, params["shared_w_up"]),
      cfg.activation,
  )
  y = _matmul(h, params["shared_w_down"])
  if cfg.shared_expert_gate:
    gate_logit = jnp.dot(
        x.astype(jnp.float32), params["shared_gate"].astype(jnp.float32)
    )
    y = (jax.nn.sigmoid(gate_logit) * y.astype(jnp.float32)).astype(x.dtype)
  return y


def add_shared_expert(
    y: jax.Array, params: dict, tokens: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array:
  """y + the shared expert of `tokens` (summed in float32), in tokens' dtype.

  The last step of the block, on one device and per device under a mesh
  (`parallel.moe_layer`). y unchanged if cfg has no shared expert.

  Args:
    y: [T, D] the routed experts' output for `tokens`.
    params: the block's params (shared_w_* and shared_gate, if any).
    tokens: [T, D] the block's input.
    cfg: the block's config.
  """
  if not cfg.shared_ffn_size:
    return y
  shared = shared_expert(params, tokens, cfg)
  return (y.astype(jnp.float32) + shared.astype(jnp.float32)).astype(
      tokens.dtype
  )
