"""Flax wrappers around `moe_core.moe_layer`: an nnx.Module and a Linen one.

Both own the parameters in the library's layout (`moe_core.param_shapes`),
so a checkpoint of either is a `moe_layer` params dict, and return
`(y, aux)` exactly as `moe_layer` does. The DeepSeek-V3 correction bias is
not a trainable parameter: it lives in its own variable collection
(`CorrectionBias` in nnx, "moe_state" in Linen), gets no gradient, stays
float32, and is updated with `moe_core.update_correction_bias`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen
from flax import nnx

import moe_core

BIAS_NAME = "correction_bias"
LINEN_STATE_COLLECTION = "moe_state"


def set_value(variable: nnx.Variable, value: jax.Array) -> None:
  """Replaces a Variable's value (flax >= 0.11 deprecates `.value = `)."""
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:
    variable.value = value


class CorrectionBias(nnx.Variable):
  """Routing state [E] float32, updated by a rule, never by the optimiser."""


class MoE(nnx.Module):
  """One dropless MoE block: x [..., D] -> (y [..., D], `moe_core.MoEAux`).

  Attributes are named as in `moe_core.param_shapes(cfg)`: `router`,
  `w_gate`, `w_up`, `w_down`, the shared expert's weights when configured
  (all `nnx.Param`), and `correction_bias` (a `CorrectionBias`) when
  `cfg.correction_bias`.

  Args:
    cfg: the block's `moe_core.MoEConfig`.
    backend: a registered backend name or "auto" (see `moe_core.flags`).
    param_dtype: storage dtype of the weights (float32 master weights for
      mixed precision; compute follows the input's dtype).
    rngs: `nnx.Rngs` with a "params" stream.
  """

  def __init__(
      self,
      cfg: moe_core.MoEConfig,
      *,
      backend: str = "auto",
      param_dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    self.cfg = cfg
    self.backend = backend
    values = moe_core.init_params(rngs.params(), cfg, dtype=param_dtype)
    for name, value in values.items():
      wrap = CorrectionBias if name == BIAS_NAME else nnx.Param
      setattr(self, name, wrap(value))

  def params_dict(self) -> dict[str, jax.Array]:
    """The block's parameters as the dict `moe_core.moe_layer` takes."""
    return {
        name: getattr(self, name)[...]
        for name in moe_core.param_shapes(self.cfg)
    }

  def __call__(self, x: jax.Array) -> tuple[jax.Array, moe_core.MoEAux]:
    return moe_core.moe_layer(
        self.params_dict(), x, self.cfg, backend=self.backend
    )

  def update_correction_bias(
      self, tokens_per_expert: jax.Array, rate: float
  ) -> None:
    """Applies the aux-loss-free rule in place (a no-op without a bias).

    Args:
      tokens_per_expert: [E] (or [..., E], summed) assignments per expert.
      rate: the rule's step size.
    """
    if not self.cfg.correction_bias:
      return
    bias = getattr(self, BIAS_NAME)
    set_value(
        bias,
        moe_core.update_correction_bias(
            bias[...], tokens_per_expert, rate
        ).astype(jnp.float32),
    )


def _weight_init(key, shape, dtype=jnp.float32):
  """moe_core.init_params's rule: truncated normal, std 1/sqrt(fan_in)."""
  std = shape[-2] ** -0.5
  return (
      std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
  ).astype(dtype)


class LinenMoE(linen.Module):
  """The Linen twin of `MoE`: params in the "params" collection, the
  correction bias in "moe_state" (pass `mutable=["moe_state"]` to update it
  with `update_correction_bias`).

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
