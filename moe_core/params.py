"""The parameter layout of an MoE block and its initialiser."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_core import activations as activations_lib
from moe_core import config as config_lib

# The routed experts' biases (cfg.expert_bias); they start at zero.
BIAS_NAMES = ("b_gate", "b_up", "b_down")


def param_shapes(cfg: config_lib.MoEConfig) -> dict[str, tuple[int, ...]]:
  """Name -> shape of every parameter `cfg` needs; each matrix is used x @ W.

  router [D, E]; correction_bias [E] (if enabled) (E + num_zero_experts
  for the router and its [E] params); router_bias [E],
  router_norm_scale [D], expert_norm_scale [D], expert_output_scale [E],
  output_bias [D], output_norm_scale [D], hash_table [V, K] int32 (if their
  fields say so, `_router_extras`);
  w_gate, w_up [E, W, F]; w_down [E, F, W]; b_gate, b_up [E, F] and b_down
  [E, W] (if expert_bias), W = cfg.expert_width (D, or the latent L);
  latent_in [D, L], latent_out [L, D], latent_norm_scale [L],
  post_expert_norm_scale [W], latent_in_bias [L] and latent_out_bias [D]
  (if their fields say so); shared_w_gate, shared_w_up [D, Fs],
  shared_w_down [Fs, D] (if shared_ffn_size); shared_gate [D, 1] (if
  shared_expert_gate); shared_b_gate, shared_b_up [Fs] and shared_b_down
  [D] (if shared_expert_bias). A non-gated activation has no w_gate,
  b_gate, shared_w_gate or shared_b_gate.
  """
  if not isinstance(cfg, config_lib.MoEConfig):
    raise TypeError(f"cfg must be a moe_core.MoEConfig, got {type(cfg)}.")
  d, e, f = cfg.hidden_size, cfg.num_experts, cfg.expert_ffn_size
  w = cfg.expert_width
  # The router's [E] params span the zero experts too.
  shapes = {"router": (d, cfg.num_router_experts)}
  if cfg.correction_bias:
    shapes["correction_bias"] = (cfg.num_router_experts,)
  shapes.update(
      {name: shape for name, shape in _router_extras(cfg).items() if shape}
  )
  shapes.update(
      {name: shape for name, shape in _latent_params(cfg).items() if shape}
  )
  gated = activations_lib.get(cfg.activation).gated
  if gated:
    shapes["w_gate"] = (e, w, f)
  shapes.update(w_up=(e, w, f), w_down=(e, f, w))
  if cfg.expert_bias:
    if gated:
      shapes["b_gate"] = (e, f)
    shapes.update(b_up=(e, f), b_down=(e, w))
  if cfg.shared_ffn_size:
    fs = cfg.shared_ffn_size
    if gated:
      shapes["shared_w_gate"] = (d, fs)
    shapes.update(shared_w_up=(d, fs), shared_w_down=(fs, d))
    if cfg.shared_expert_gate:
      shapes["shared_gate"] = (d, 1)
    if cfg.shared_expert_bias:
      if gated:
        shapes["shared_b_gate"] = (fs,)
      shapes.update(shared_b_up=(fs,), shared_b_down=(d,))
  return shapes


def init_params(
    key: jax.Array, cfg: config_lib.MoEConfig, dtype=jnp.float32
) -> dict[str, jax.Array]:
  """Random parameters for `cfg` in the layout of `param_shapes`.

  Matrices are drawn from a truncated normal with std 1/sqrt(fan_in), fan_in
  being the contracted dimension; the correction bias starts at zero and stays
  float32 whatever `dtype` is (it is routing state, updated by a sign rule);
  expert biases start at zero, in `dtype`; the router bias starts at 0 and
  the router's scales at 1 (`CONSTANT_INIT`); the hash table (int32) holds
  K distinct random experts per token id.

  Args:
    key: a PRNG key (jax.random.key or the legacy uint32 [2] PRNGKey).
    cfg: the block's config.
    dtype: a floating dtype for everything but the correction bias.
  """
  shapes = param_shapes(cfg)
  _check_key(key)
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"dtype must be a floating dtype, got {dtype!r}.") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype, got {dtype.name}.")
  keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
  params = {}
  for name, shape in shapes.items():
    if name == "correction_bias":
      params[name] = jnp.zeros(shape, jnp.float32)
      continue
    if name in BIAS_NAMES:
      params[name] = jnp.zeros(shape, dtype)
      continue
    if name == "hash_table":
      params[name] = hash_table(keys[name], cfg)
      continue
    if name in CONSTANT_INIT:
      params[name] = jnp.full(shape, CONSTANT_INIT[name], dtype)
      continue
    fan_in = shape[-2]
    std = fan_in**-0.5
    params[name] = (
        std
        * jax.random.truncated_normal(keys[name], -2.0, 2.0, shape, jnp.float32)
    ).astype(dtype)
  return params


# Router, norm and bias params that start at a constant (a bias at 0, a scale
# at 1, so that a new block computes as it would without them).
CONSTANT_INIT = {
    "router_bias": 0.0,
    "router_norm_scale": 1.0,
    "expert_norm_scale": 1.0,
    "expert_output_scale": 1.0,
    "output_bias": 0.0,
    "output_norm_scale": 1.0,
    "latent_norm_scale": 1.0,
    "post_expert_norm_scale": 1.0,
    "latent_in_bias": 0.0,
    "latent_out_bias": 0.0,
    "shared_b_gate": 0.0,
    "shared_b_up": 0.0,
    "shared_b_down": 0.0,
}


def hash_table(key: jax.Array, cfg: config_lib.MoEConfig) -> jax.Array:
  """[V, K] int32: for each token id, K distinct experts drawn at random
  (a stand-in; a checkpoint's table replaces it)."""
  v, e = cfg.hash_vocab_size, cfg.num_router_experts
  draws = jax.random.uniform(key, (v, e))
  return jnp.argsort(draws, axis=-1)[:, : cfg.top_k].astype(jnp.int32)


def _router_extras(cfg: config_lib.MoEConfig) -> dict[str, tuple[int, ...]]:
  """The optional router and input-norm params: name -> shape, () where
  disabled."""
  d, e = cfg.hidden_size, cfg.num_router_experts
  return {
      "router_bias": (e,) if cfg.router_bias else (),
      "router_norm_scale": (d,) if cfg.router_input_norm else (),
      "expert_norm_scale": (d,) if cfg.expert_input_norm else (),
      "expert_output_scale": (e,) if cfg.expert_output_scale else (),
      "output_bias": (d,) if cfg.output_bias else (),
      "output_norm_scale": (d,) if cfg.output_norm else (),
      "hash_table": (
          (cfg.hash_vocab_size, cfg.top_k) if cfg.hash_vocab_size else ()
      ),
  }


def _latent_params(cfg: config_lib.MoEConfig) -> dict[str, tuple[int, ...]]:
  """The latent projections and the norms around the routed experts: name
  -> shape, () where disabled."""
  d, latent = cfg.hidden_size, cfg.expert_latent_size
  return {
      "latent_in": (d, latent) if latent else (),
      "latent_out": (latent, d) if latent else (),
      "latent_norm_scale": (latent,) if cfg.latent_norm else (),
      "post_expert_norm_scale": (
          (cfg.expert_width,) if cfg.post_expert_norm else ()
      ),
      "latent_in_bias": (latent,) if cfg.latent_bias else (),
      "latent_out_bias": (d,) if cfg.latent_bias else (),
  }


def _check_key(key) -> None:
  """A typed PRNG key array of shape (), or a legacy uint32 [2] key."""
  if not hasattr(key, "dtype") or not hasattr(key, "shape"):
    raise TypeError(
        f"key must be a PRNG key (jax.random.key(seed)), got {type(key)}."
    )
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"key must be a single key, got shape {key.shape}.")
    return
  if key.dtype != jnp.uint32 or key.shape != (2,):
    raise TypeError(
        "key must be a PRNG key (jax.random.key(seed), or a uint32 [2] "
        f"jax.random.PRNGKey), got {key.dtype}{list(key.shape)}."
    )
