"""Gated DeltaNet: the linear-attention layers of Qwen3-Next's hybrid stack.

A token mixer that keeps, per value head, a state matrix S [dk, dv] in place
of a key/value cache. Each token decays the state, corrects what it stores
for the token's key (the delta rule) and reads it with the token's query:

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - k_t^T S_t))^T
    o_t = S_t^T q_t

with q and k L2-normalised (q further scaled by dk^-0.5), beta_t =
sigmoid(b_t) the write strength and g_t = -exp(A_log) softplus(a_t +
dt_bias) the log-decay. Around the rule: one input projection to
[q, k, v, z], one to [b, a], a depthwise causal convolution (then SiLU) over
[q, k, v], a gated RMSNorm, norm(o) * silu(z), and the output projection.

`gated_delta_rule` runs the recurrence as a plain `jax.lax.scan` over time:
exact and simple, fine for training the tiny presets on a CPU, but it keeps
the state of every step for the backward ([B, T, Hv, dk, dv] float32) and
runs one token at a time. A chunked (WY) form is what long sequences need;
it is not written here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from train.models import field_checks


@dataclasses.dataclass(frozen=True)
class DeltaNetConfig:
  """The widths of a Gated DeltaNet layer (Qwen3-Next's `linear_*` fields).

  Attributes:
    num_key_heads: Hk, query/key heads.
    num_value_heads: Hv, value heads; a multiple of Hk (each query/key head
      serves Hv / Hk consecutive value heads).
    key_head_dim: dk.
    value_head_dim: dv.
    conv_kernel: width of the depthwise causal convolution.
  """

  num_key_heads: int
  num_value_heads: int
  key_head_dim: int
  value_head_dim: int
  conv_kernel: int = 4

  def __post_init__(self):
    field_checks.check_positive_ints(
        self,
        "DeltaNetConfig",
        (
            "num_key_heads",
            "num_value_heads",
            "key_head_dim",
            "value_head_dim",
            "conv_kernel",
        ),
    )
    if self.num_value_heads % self.num_key_heads:
      raise ValueError(
          "DeltaNetConfig.num_value_heads must be a multiple of "
          f"num_key_heads, got num_value_heads={self.num_value_heads}, "
          f"num_key_heads={self.num_key_heads}."
      )

  @property
  def key_width(self) -> int:
    return self.num_key_heads * self.key_head_dim

  @property
  def value_width(self) -> int:
    return self.num_value_heads * self.value_head_dim

  @property
  def conv_width(self) -> int:
    """Channels of the convolution: [q, k, v] concatenated."""
    return 2 * self.key_width + self.value_width


def param_count(dn: DeltaNetConfig, hidden_size: int) -> int:
  """Parameters of one Gated DeltaNet layer (`GatedDeltaNet`'s layout)."""
  d, hv = hidden_size, dn.num_value_heads
  in_proj = d * (2 * dn.key_width + 2 * dn.value_width) + d * 2 * hv
  conv = dn.conv_width * dn.conv_kernel
  decay = 2 * hv  # A_log, dt_bias
  norm = dn.value_head_dim  # One gated-norm scale shared by the heads.
  return in_proj + conv + decay + norm + dn.value_width * d


def recurrence_flops_per_token(dn: DeltaNetConfig) -> float:
  """Forward FLOPs of the recurrence per token (projections apart).

  Per value head: decay, read k^T S, write k delta^T and read S^T q, each
  dk * dv multiply-adds; plus the convolution's multiply-adds.
  """
  state = dn.num_value_heads * dn.key_head_dim * dn.value_head_dim
  return 2.0 * (4 * state + dn.conv_width * dn.conv_kernel)


# --- The math, on arrays ------------------------------------------------------


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last axis (the FLA convention)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_depthwise_conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """Per-channel causal convolution: out[t] = sum_j kernel[j] x[t - K + 1 + j].

  Args:
    x: [B, T, C].
    kernel: [K, C] (the last tap weighs the current token).

  Returns:
    [B, T, C] in float32; positions before the sequence count as zeros.
  """
  taps = kernel.shape[0]
  x = x.astype(jnp.float32)
  padded = jnp.pad(x, ((0, 0), (taps - 1, 0), (0, 0)))
  t = x.shape[1]
  kernel = kernel.astype(jnp.float32)
  return sum(padded[:, j : j + t] * kernel[j] for j in range(taps))


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_decay: jax.Array,
    beta: jax.Array,
) -> jax.Array:
  """The gated delta rule over a sequence, from a zero state (lax.scan).

  Args:
    q: [B, T, Hv, dk] queries, already L2-normalised (and repeated to the
      value heads).
    k: [B, T, Hv, dk] keys, L2-normalised.
    v: [B, T, Hv, dv].
    log_decay: [B, T, Hv], g_t <= 0 (the state is scaled by exp(g_t)).
    beta: [B, T, Hv], write strength in (0, 1).

  Returns:
    o [B, T, Hv, dv] float32, o_t = S_t^T q_t * dk^-0.5.
  """
  b, _, hv, dk = k.shape
  dv = v.shape[-1]
  q = q.astype(jnp.float32) * dk**-0.5
  inputs = [
      jnp.moveaxis(x.astype(jnp.float32), 1, 0)
      for x in (q, k, v, log_decay, beta)
  ]

  def step(state, xs):
    q_t, k_t, v_t, g_t, beta_t = xs  # [B, Hv, dk|dv], [B, Hv]
    state = state * jnp.exp(g_t)[..., None, None]
    stored = jnp.einsum("bhkv,bhk->bhv", state, k_t)
    delta = (v_t - stored) * beta_t[..., None]
    state = state + k_t[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

  state = jnp.zeros((b, hv, dk, dv), jnp.float32)
  _, out = jax.lax.scan(step, state, inputs)
  return jnp.moveaxis(out, 0, 1)


def gated_rms_norm(
    x: jax.Array, gate: jax.Array, scale: jax.Array, eps: float
) -> jax.Array:
  """RMSNorm of x over its last axis, times scale, times silu(gate); f32."""
  x = x.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return x * scale * jax.nn.silu(gate.astype(jnp.float32))


# --- The layer ----------------------------------------------------------------


def _weight(key, shape, fan_in):
  """Truncated normal, std 1/sqrt(fan_in), as `layers.weight`."""
  return nnx.Param(
      fan_in**-0.5
      * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
  )


def _matmul(x, w):
  return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


class GatedDeltaNet(nnx.Module):
  """Qwen3-Next's linear-attention token mixer: x [B, T, D] -> [B, T, D].

  The input projections keep transformers' grouped layout, so a checkpoint's
  weights map one to one (transposed): `w_qkvz` [D, Hk * (2 dk + 2 r dv)]
  holds, for each query/key head in turn, its q (dk), k (dk), then the v and
  z of its r = Hv / Hk value heads (r dv each); `w_ba` [D, Hk * 2r] holds
  each head's r b's then its r a's. `conv` is [K, C] over the channels
  [q (Hk dk), k (Hk dk), v (Hv dv)].
  """

  def __init__(
      self,
      dn: DeltaNetConfig,
      hidden_size: int,
      norm_eps: float,
      *,
      rngs: nnx.Rngs,
  ):
    self.dn, self.norm_eps = dn, norm_eps
    d, hv = hidden_size, dn.num_value_heads
    self.w_qkvz = _weight(
        rngs.params(), (d, 2 * dn.key_width + 2 * dn.value_width), d
    )
    self.w_ba = _weight(rngs.params(), (d, 2 * hv), d)
    self.conv = _weight(
        rngs.params(), (dn.conv_kernel, dn.conv_width), dn.conv_kernel
    )
    # transformers' initial values: dt_bias 1, A = exp(A_log) ~ U(0, 16).
    self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32))
    self.a_log = nnx.Param(
        jnp.log(
            jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1e-2, 16.0)
        )
    )
    self.norm_scale = nnx.Param(jnp.ones((dn.value_head_dim,), jnp.float32))
    self.w_out = _weight(rngs.params(), (dn.value_width, d), dn.value_width)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    del positions  # Order comes from the recurrence and the convolution.
    dn = self.dn
    b, t, _ = x.shape
    hk, r = dn.num_key_heads, dn.num_value_heads // dn.num_key_heads
    dk, dv = dn.key_head_dim, dn.value_head_dim
    qkvz = _matmul(x, self.w_qkvz[...]).reshape(b, t, hk, -1)
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    ba = _matmul(x, self.w_ba[...]).reshape(b, t, hk, 2 * r)
    beta_logit, a = (s.reshape(b, t, hk * r) for s in jnp.split(ba, 2, -1))
    mixed = jnp.concatenate(
        [s.reshape(b, t, -1) for s in (q, k, v)], axis=-1
    ).astype(x.dtype)
    mixed = jax.nn.silu(causal_depthwise_conv(mixed, self.conv[...]))
    q, k, v = jnp.split(mixed, [dn.key_width, 2 * dn.key_width], axis=-1)
    q = jnp.repeat(l2_normalize(q.reshape(b, t, hk, dk)), r, axis=2)
    k = jnp.repeat(l2_normalize(k.reshape(b, t, hk, dk)), r, axis=2)
    v = v.reshape(b, t, hk * r, dv)
    beta = jax.nn.sigmoid(beta_logit)
    log_decay = -jnp.exp(self.a_log[...]) * jax.nn.softplus(
        a + self.dt_bias[...]
    )
    out = gated_delta_rule(q, k, v, log_decay, beta)
    out = gated_rms_norm(
        out, z.reshape(b, t, hk * r, dv), self.norm_scale[...], self.norm_eps
    )
    out = out.reshape(b, t, dn.value_width).astype(x.dtype)
    return _matmul(out, self.w_out[...]).astype(x.dtype)
