"""Llama 4's parameter-free attention pieces (`layers.py` uses them).

Llama 4 interleaves RoPE layers with NoPE layers (no positional encoding,
every `nope_layer_interval`-th layer). On RoPE layers the queries and keys
are divided by their RMS per head (an L2 norm without weights) and attend
within aligned chunks (`attention.causal_attention`'s `chunk_size`); on
NoPE layers the queries are scaled up with the position (attention
temperature tuning, arXiv:2501.19399) so that the softmax stays sharp over
long contexts. None of these has parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) over the last axis, in float32, x's dtype.

  Args:
    x: [..., d], e.g. queries [B, T, H, d].
    eps: added to the mean square.
  """
  x32 = x.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale).astype(x.dtype)


def temperature_scale(
    positions: jax.Array, floor: int, strength: float
) -> jax.Array:
  """The query scale of a NoPE layer at each position, [T] float32.

  1 + strength * log(1 + floor((p + 1) / floor)): exactly 1 for the first
  floor - 1 positions, then growing with the logarithm of the position.

  Args:
    positions: [T] int positions p.
    floor: the number of positions per step of the floor (> 0).
    strength: the logarithm's coefficient.
  """
  steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / floor)
  return 1.0 + strength * jnp.log1p(steps)


def mean_attended_keys(seq_len: int, chunk_size: int) -> float:
  """Keys a query attends to on average, causal and within chunks.

  Position p sees p % C + 1 keys with chunks of C (p + 1 without); the
  mean over p in [0, seq_len) is (seq_len + 1) / 2 when C >= seq_len.

  Args:
    seq_len: T.
    chunk_size: C, or 0 for no chunking.
  """
  chunk = chunk_size or seq_len
  full, rest = divmod(seq_len, chunk)
  total = full * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2
  return total / seq_len
