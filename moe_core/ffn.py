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
  return _ACTIVATIONS[name]


def gated(gate: jax.Array, up: jax.Array, name: str) -> jax.Array:
  """act(gate) * up, computed in float32, returned in gate's dtype."""
  h = activation(name)(gate.astype(jnp.float32)) * up.astype(jnp.float32)
  return h.astype(gate.dtype)


def _matmul(a, b):
  """a @ b with float32 accumulation, in a's dtype."""
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
