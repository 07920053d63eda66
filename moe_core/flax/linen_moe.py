"""`LinenMoE`: the flax.linen twin of `moe_core.flax.MoE`.

Weights live in the "params" collection; the DeepSeek-V3 correction bias
lives in its own collection, "moe_state", so it gets no gradient, stays
float32 and is stepped by the aux-loss-free rule only when that collection
is mutable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen

import moe_core
from moe_core.flax.nnx_moe import BIAS_NAME

LINEN_STATE_COLLECTION = "moe_state"


def _weight_init(key, shape, dtype=jnp.float32):
  """moe_core.init_params's rule: truncated normal, std 1/sqrt(fan_in)."""
  std = shape[-2] ** -0.5
  return (
      std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
  ).astype(dtype)


class LinenMoE(linen.Module):
  """One dropless MoE block: x [..., D] -> (y [..., D], `moe_core.MoEAux`).

  Params are in the "params" collection, the correction bias in
  "moe_state" (pass `mutable=["moe_state"]` and `update_bias_rate` to step
  it).

  Attributes:
    cfg: the block's `moe_core.MoEConfig`.
    backend: a registered backend name or "auto".
    param_dtype: storage dtype of the weights.
  """

  cfg: moe_core.MoEConfig
  backend: str = "auto"
  param_dtype: jnp.dtype = jnp.float32

  @linen.compact
  def __call__(
      self, x: jax.Array, *, update_bias_rate: float | None = None
  ) -> tuple[jax.Array, moe_core.MoEAux]:
    """x [..., D] -> (y, aux); with `update_bias_rate`, also steps the bias."""
    params = {}
    for name, shape in moe_core.param_shapes(self.cfg).items():
      if name == BIAS_NAME:
        bias = self.variable(
            LINEN_STATE_COLLECTION, BIAS_NAME, jnp.zeros, shape, jnp.float32
        )
        params[name] = bias.value
      else:
        params[name] = self.param(name, _weight_init, shape, self.param_dtype)
    y, aux = moe_core.moe_layer(params, x, self.cfg, backend=self.backend)
    if (
        update_bias_rate is not None
        and self.cfg.correction_bias
        and self.is_mutable_collection(LINEN_STATE_COLLECTION)
        and not self.is_initializing()
    ):
      bias.value = moe_core.update_correction_bias(
          bias.value, aux.tokens_per_expert, update_bias_rate
      )
    return y, aux
