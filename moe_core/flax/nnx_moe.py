"""`MoE`: a flax.nnx.Module around `moe_core.moe_layer`.

The DeepSeek-V3 correction bias is not a trainable parameter: it is a
`CorrectionBias` variable, not an `nnx.Param`, so optimisers that take
`nnx.Param` leave it alone. It gets no gradient, stays float32, and is
updated with the aux-loss-free rule (`MoE.update_correction_bias`).
DeepSeek-V4's hash table (token id -> experts, int32) is routing state too,
which nothing updates: a `HashTable`, a kind of `CorrectionBias`, so that
code which keeps the routing state apart from the weights (a filter on
`CorrectionBias`) keeps the table with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import moe_core

# The correction bias's and the hash table's names in
# `moe_core.param_shapes`.
BIAS_NAME = "correction_bias"
HASH_TABLE_NAME = "hash_table"


def set_value(variable: nnx.Variable, value: jax.Array) -> None:
  """Replaces a Variable's value (flax >= 0.11 deprecates `.value = `)."""
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:
    variable.value = value


class CorrectionBias(nnx.Variable):
  """Routing state [E] float32, updated by a rule, never by the optimiser."""


class HashTable(CorrectionBias):
  """Routing state [V, K] int32 (each token id's experts), never updated."""


class MoE(nnx.Module):
  """One dropless MoE block: x [..., D] -> (y [..., D], `moe_core.MoEAux`).

  Attributes are named as in `moe_core.param_shapes(cfg)`: `router`,
  `w_gate`, `w_up`, `w_down`, the shared expert's weights when configured
  (all `nnx.Param`), `correction_bias` (a `CorrectionBias`) when
  `cfg.correction_bias`, and `hash_table` (a `HashTable`) when
  `cfg.hash_vocab_size`.

  Args:
    cfg: the block's `moe_core.MoEConfig`.
    backend: a registered backend name or "auto" (see `moe_core.flags`).
    param_dtype: storage dtype of the weights (float32 master weights for
      mixed precision; compute follows the input's dtype).
    rngs: `nnx.Rngs` with a "params" stream.
    mesh: None for one device; a `jax.sharding.Mesh` runs the block with
      expert parallelism (`moe_core.moe_layer(..., mesh=mesh)`): experts
      split over `expert_axis`, tokens over `data_axes` x `expert_axis`.
      Static (part of the graph definition), like `backend`.
    expert_axis: the mesh axis the experts are split over.
    data_axes: further mesh axes the tokens are split over.
    ep_options: `moe_core.parallel.EPOptions` for the exchange (chunks,
      bounded buffers); None for the defaults. Static, with `mesh`.
  """

  def __init__(
      self,
      cfg: moe_core.MoEConfig,
      *,
      backend: str = "auto",
      param_dtype: jnp.dtype = jnp.float32,
      rngs: nnx.Rngs,
      mesh: jax.sharding.Mesh | None = None,
      expert_axis: str = "expert",
      data_axes: tuple[str, ...] = ("data",),
      ep_options: moe_core.parallel.EPOptions | None = None,
  ):
    self.cfg = cfg
    self.backend = backend
    self.mesh = mesh
    self.expert_axis = expert_axis
    self.data_axes = tuple(data_axes)
    self.ep_options = ep_options
    values = moe_core.init_params(rngs.params(), cfg, dtype=param_dtype)
    kinds = {BIAS_NAME: CorrectionBias, HASH_TABLE_NAME: HashTable}
    for name, value in values.items():
      setattr(self, name, kinds.get(name, nnx.Param)(value))

  def params_dict(self) -> dict[str, jax.Array]:
    """The block's parameters as the dict `moe_core.moe_layer` takes."""
    return {
        name: getattr(self, name)[...]
        for name in moe_core.param_shapes(self.cfg)
    }

  def __call__(
      self, x: jax.Array, token_ids: jax.Array | None = None
  ) -> tuple[jax.Array, moe_core.MoEAux]:
    """x [..., D] -> (y [..., D], aux).

    Args:
      x: the block's input.
      token_ids: [...] int, x's token ids (x.shape[:-1]); given iff the
        block routes by hash table (`cfg.hash_vocab_size`), which runs on
        one device only (`moe_core.moe_layer` refuses it with a mesh).
    """
    if self.mesh is None:
      return moe_core.moe_layer(
          self.params_dict(),
          x,
          self.cfg,
          backend=self.backend,
          token_ids=token_ids,
      )
    return moe_core.moe_layer(
        self.params_dict(),
        x,
        self.cfg,
        backend=self.backend,
        mesh=self.mesh,
        expert_axis=self.expert_axis,
        data_axes=self.data_axes,
        ep_options=self.ep_options,
        token_ids=token_ids,
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
