"""Expert FFN pieces: activations, biases and the dense shared expert.

The activations themselves are the registry `moe_core.activations` (the
extension point for a new one); this module applies them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_core import activations as activations_lib
from moe_core import config as config_lib
from moe_core import norms

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    # Hugging Face's "gelu" is the exact erf form; "gelu_pytorch_tanh" the
    # tanh approximation.
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def activation(name: str):
  """The elementwise function of a plain GLU ("silu", "gelu", "gelu_tanh");
  `moe_core.activations` holds every activation."""
  return _ACTIVATIONS[name]


def gated(gate: jax.Array, up: jax.Array, name: str) -> jax.Array:
  """act(gate) * up: two [M, F] -> [M, F], computed in float32, gate's dtype.

  Only the plain GLUs of `activation`; `hidden` computes every activation.
  """
  h = activation(name)(gate.astype(jnp.float32)) * up.astype(jnp.float32)
  return h.astype(gate.dtype)


def hidden(
    gate: jax.Array | None,
    up: jax.Array,
    settings: activations_lib.Settings,
    gate_bias: jax.Array | None = None,
    up_bias: jax.Array | None = None,
) -> jax.Array:
  """h = f(gate, up) (gated) or f(up) (gate None): [M, F] -> [M, F].

  Biases [M, F] (per row, already gathered by `row_bias`) are added in
  float32 first; then the activation of `settings` (`moe_core.activations`,
  its clamp included), in float32; h is returned in up's dtype.
  """
  up32 = up.astype(jnp.float32)
  if up_bias is not None:
    up32 = up32 + up_bias
  gate32 = None
  if gate is not None:
    gate32 = gate.astype(jnp.float32)
    if gate_bias is not None:
      gate32 = gate32 + gate_bias
  return activations_lib.hidden(settings, gate32, up32).astype(up.dtype)


def row_bias(bias: jax.Array, group_sizes: jax.Array, num_rows: int):
  """Each row's bias: bias [E, N] over rows sorted by group -> [M, N] float32.

  Rows at or past sum(group_sizes) get 0, so that they stay zero rows.
  """
  ends = jnp.cumsum(group_sizes)
  group = jnp.searchsorted(ends, jnp.arange(num_rows), side="right")
  return jnp.take(
      bias.astype(jnp.float32), group, axis=0, mode="fill", fill_value=0
  )


def add_row_bias(
    out: jax.Array, bias: jax.Array | None, group_sizes: jax.Array
) -> jax.Array:
  """out [M, N] + `row_bias(bias)` in float32, in out's dtype; out if None."""
  if bias is None:
    return out
  summed = out.astype(jnp.float32) + row_bias(bias, group_sizes, out.shape[0])
  return summed.astype(out.dtype)


def _matmul(a, b):
  """a [T, C] @ b [C, N] -> [T, N], accumulated in float32, in a's dtype."""
  return jnp.dot(
      a, b.astype(a.dtype), preferred_element_type=jnp.float32
  ).astype(a.dtype)


def shared_expert(
    params: dict, x: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array:
  """The always-on expert: [T, D] -> [T, D], optionally sigmoid-gated.

  Its activation is the routed experts' (clamp included unless
  cfg.shared_swiglu_clamp is False): a non-gated one has no shared_w_gate.
  With cfg.shared_expert_bias, shared_b_gate and shared_b_up [Fs] are added
  in float32 before the activation, shared_b_down [D] after the down
  product (before the gate).
  """
  settings = activations_lib.Settings.from_config(cfg)
  if not cfg.shared_swiglu_clamp:  # HY-V4: the routed experts only.
    settings = dataclasses.replace(settings, swiglu_limit=None)

  def bias(name):  # [Fs] or [D] float32, broadcast over the tokens.
    if not cfg.shared_expert_bias or name not in params:
      return None
    return params[name].astype(jnp.float32)

  gate = None
  if settings.activation.gated:
    gate = _matmul(x, params["shared_w_gate"])
  h = hidden(
      gate,
      _matmul(x, params["shared_w_up"]),
      settings,
      gate_bias=bias("shared_b_gate"),
      up_bias=bias("shared_b_up"),
  )
  y = _matmul(h, params["shared_w_down"])
  if cfg.shared_expert_bias:
    y = (y.astype(jnp.float32) + bias("shared_b_down")).astype(x.dtype)
  if cfg.shared_expert_gate:
    gate_logit = jnp.dot(
        x.astype(jnp.float32), params["shared_gate"].astype(jnp.float32)
    )
    y = (jax.nn.sigmoid(gate_logit) * y.astype(jnp.float32)).astype(x.dtype)
  return y


def add_shared_expert(
    y: jax.Array, params: dict, tokens: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array:
  """y + the shared expert of `tokens` (summed in float32; halved where
  cfg.shared_combine == "mean"), in tokens' dtype.

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
  total = y.astype(jnp.float32) + shared.astype(jnp.float32)
  if cfg.shared_combine == "mean":  # Cohere 2 MoE's "average".
    total = total * 0.5
  return total.astype(tokens.dtype)


def finish_block(
    y: jax.Array, params: dict, tokens: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array:
  """The block's last steps after the routed experts' y [T, D]: the shared
  expert (`add_shared_expert`), then the output bias [D] where
  cfg.output_bias (JetMoE), summed in float32, then the output's RMS norm
  where cfg.output_norm (A.X-K1), in float32; [T, D] in tokens' dtype.

  Run outside the backends (on one device and per device under a mesh), so
  every backend gets both.
  """
  y = add_shared_expert(y, params, tokens, cfg)
  if not (cfg.output_bias or cfg.output_norm):
    return y
  y = y.astype(jnp.float32)
  if cfg.output_bias:
    y = y + params["output_bias"].astype(jnp.float32)
  if cfg.output_norm:
    y = norms.rms_norm(y, params["output_norm_scale"], cfg.output_norm_epsilon)
  return y.astype(tokens.dtype)
