"""`LinenMoE`: the flax.linen twin of `moe_core.flax.MoE`.

Weights live in the "params" collection; the routing state lives in its
own collection, "moe_state", so it gets no gradient: the DeepSeek-V3
correction bias, which stays float32 and is stepped by the aux-loss-free
rule when `update_bias_rate` is given (which needs that collection
mutable), and DeepSeek-V4's hash table (int32 expert ids per token id),
which nothing updates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import errors
from flax import linen

import moe_core
from moe_core import params as params_lib
from moe_core.flax.nnx_moe import BIAS_NAME
from moe_core.flax.nnx_moe import HASH_TABLE_NAME

LINEN_STATE_COLLECTION = "moe_state"


class ImmutableBiasError(errors.ModifyScopeVariableError):
  """`update_bias_rate` was given, but "moe_state" is not mutable.

  A `flax.errors.ModifyScopeVariableError`, which Linen raises for any
  write to an immutable collection, with a message that names the argument
  and the fix.
  """

  def __init__(self, rate):
    # Not ModifyScopeVariableError's own message, which names neither the
    # argument nor the fix. FlaxError links its page unless the message
    # does: link the page of the Linen error this one is.
    errors.FlaxError.__init__(
        self,
        f"LinenMoE: update_bias_rate={rate!r} steps the correction bias in "
        f'collection "{LINEN_STATE_COLLECTION}", which this apply() holds '
        f'immutable: pass mutable=["{LINEN_STATE_COLLECTION}"] (and keep '
        "the updated variables apply returns), or update_bias_rate=None. "
        f"({_FLAX_ERRORS_PAGE}#flax.errors.ModifyScopeVariableError)",
    )


_FLAX_ERRORS_PAGE = (
    "https://flax.readthedocs.io/en/latest/api_reference/flax.errors.html"
)


def _weight_init(key, shape, dtype=jnp.float32):
  """moe_core.init_params's rule: truncated normal, std 1/sqrt(fan_in)."""
  std = shape[-2] ** -0.5
  return (
      std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
  ).astype(dtype)


class LinenMoE(linen.Module):
  """One dropless MoE block: x [..., D] -> (y [..., D], `moe_core.MoEAux`).

  Params are in the "params" collection, the routing state (the correction
  bias, the hash table) in "moe_state" (pass `mutable=["moe_state"]` and
  `update_bias_rate` to step the bias).

  Attributes:
    cfg: the block's `moe_core.MoEConfig`.
    backend: a registered backend name or "auto".
    param_dtype: storage dtype of the weights.
    mesh: None for one device; a `jax.sharding.Mesh` runs the block with
      expert parallelism (`moe_core.moe_layer(..., mesh=mesh)`): experts
      split over `expert_axis`, tokens over `data_axes` x `expert_axis`.
      As in `moe_core.flax.MoE`.
    expert_axis: the mesh axis the experts are split over.
    data_axes: further mesh axes the tokens are split over.
  """

  cfg: moe_core.MoEConfig
  backend: str = "auto"
  param_dtype: jnp.dtype = jnp.float32
  mesh: jax.sharding.Mesh | None = None
  expert_axis: str = "expert"
  data_axes: tuple[str, ...] = ("data",)

  @linen.compact
  def __call__(
      self,
      x: jax.Array,
      token_ids: jax.Array | None = None,
      *,
      update_bias_rate: float | None = None,
  ) -> tuple[jax.Array, moe_core.MoEAux]:
    """x [..., D] -> (y, aux); with `update_bias_rate`, also steps the bias.

    Args:
      x: [..., D] activations.
      token_ids: [...] int, x's token ids (x.shape[:-1]); given iff the
        block routes by hash table (`cfg.hash_vocab_size`), as in
        `moe_core.flax.MoE`. The table is drawn at `init` from the "params"
        rng (`moe_core.params.hash_table`) and kept in "moe_state".
      update_bias_rate: None, or the aux-loss-free rule's step size: the
        correction bias then moves by it from this call's
        `aux.tokens_per_expert` (`moe_core.update_correction_bias`). Needs
        `mutable=["moe_state"]` in `apply` (else `ImmutableBiasError`, a
        `flax.errors.ModifyScopeVariableError`); ignored by `init`, and a
        no-op for a config without a correction bias.
    """
    params = {}
    for name, shape in moe_core.param_shapes(self.cfg).items():
      if name == BIAS_NAME:
        bias = self.variable(
            LINEN_STATE_COLLECTION, BIAS_NAME, jnp.zeros, shape, jnp.float32
        )
        params[name] = bias.value
      elif name == HASH_TABLE_NAME:  # Routing state, not a weight.
        params[name] = self.variable(
            LINEN_STATE_COLLECTION,
            HASH_TABLE_NAME,
            lambda: params_lib.hash_table(self.make_rng("params"), self.cfg),
        ).value
      elif name in params_lib.BIAS_NAMES:  # Expert biases start at 0.
        params[name] = self.param(
            name, linen.initializers.zeros, shape, self.param_dtype
        )
      elif name in params_lib.CONSTANT_INIT:
        value = params_lib.CONSTANT_INIT[name]
        params[name] = self.param(
            name,
            lambda _, s, d, v=value: jnp.full(s, v, d),
            shape,
            self.param_dtype,
        )
      else:
        params[name] = self.param(name, _weight_init, shape, self.param_dtype)
    step = (
        update_bias_rate is not None
        and self.cfg.correction_bias
        and not self.is_initializing()
    )
    # Before the layer runs: the caller learns of it at once.
    if step and not self.is_mutable_collection(LINEN_STATE_COLLECTION):
      raise ImmutableBiasError(update_bias_rate)
    layer_kwargs = {}
    if self.mesh is not None:
      layer_kwargs = dict(
          mesh=self.mesh,
          expert_axis=self.expert_axis,
          data_axes=tuple(self.data_axes),
      )
    y, aux = moe_core.moe_layer(
        params,
        x,
        self.cfg,
        backend=self.backend,
        token_ids=token_ids,
        **layer_kwargs,
    )
    if step:
      bias.value = moe_core.update_correction_bias(
          bias.value, aux.tokens_per_expert, update_bias_rate
      )
    return y, aux
