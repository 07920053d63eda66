"""Where each parameter, optimiser moment and batch lives on the mesh.

One rule per parameter name (`spec_for`), applied by tree path to the
parameters and to AdamW's moments alike: routed experts split over expert
(and fsdp), attention and dense-MLP matrices Megatron-style over tensor,
every matrix also over fsdp x expert where the experts do not split it,
vectors replicated; batches split over data x fsdp x expert. The MoE
layer's shard_map gathers what it needs replicated (the router, the shared
expert, the expert weights' fsdp dimension).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from train.parallel import mesh as mesh_lib

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
EXPERT_BIASES = ("b_gate", "b_up", "b_down")
COLUMN_PARALLEL = (
    "wq",
    "wk",
    "wv",
    "wq_b",
    "wkv_b",
    "w_gate",
    "w_up",
    "shared_w_gate",
    "shared_w_up",
    "head",
)
ROW_PARALLEL = ("wo", "w_down", "shared_w_down")
# The axes the weights the experts do not split are split over: outside the
# MoE blocks the expert axis is a data axis, so those weights are split over
# it too (ZeRO-3 over every batch axis but data), as MaxText's fsdp does; for
# DeepSeek-V3 on 1,024 GPUs that is what keeps the non-expert state small
# (docs/scaling.md).
SHARDS = ("fsdp", "expert")
# The scanned model's stacks: their leaves are [layers, ...].
STACKS = ("dense_layers", "moe_layers")


def _name(path) -> str:
  """The parameter's name: the last string key of its tree path."""
  for key in reversed(path):
    name = getattr(key, "key", None)
    if isinstance(name, str):
      return name
  return ""


def spec_for(path, shape, sizes: dict[str, int]) -> P:
  """The PartitionSpec of the leaf at tree `path` with `shape`.

  One rule per parameter name, the same for AdamW's moments as for the
  parameters, so a moment is always split exactly like its parameter:

      routed experts  w_gate, w_up, w_down [E, ., .]  expert on E, fsdp on
                      dim 1
      expert biases   b_gate, b_up, b_down [E, .]     expert on E
      column-parallel wq, wk, wv, wq_b, wkv_b, dense w_gate / w_up, the
                      shared expert's gate / up, head   [in, out]: shards,
                      tensor
      row-parallel    wo, dense w_down, shared w_down   [in, out]: tensor,
                      shards
      other matrices  embed, router, wq_a, wkv_a        shards on dim 0
      vectors         norm scales, correction biases, step counts: replicated

  "shards" is fsdp x expert (`SHARDS`); where that does not divide the
  dimension, fsdp alone is tried, then nothing. An axis is used only where
  it divides the dimension (otherwise that dimension stays whole), so every
  model fits every mesh. A scanned model's stacked leaves keep their
  leading layer axis whole (every device holds its shard of every layer),
  and the rule applies to the rest.
  """
  if any(getattr(key, "key", None) in STACKS for key in path):
    return P(None, *_spec(path, shape[1:], sizes))
  return _spec(path, shape, sizes)


def _spec(path, shape, sizes: dict[str, int]) -> P:
  """`spec_for` of one layer's leaf (no layer axis)."""
  name = _name(path)
  if len(shape) == 3 and name in EXPERT_WEIGHTS:
    axes = ["expert", "fsdp", None]
  elif len(shape) == 2 and name in EXPERT_BIASES:
    axes = ["expert", None]
  elif len(shape) == 2 and name in COLUMN_PARALLEL:
    axes = [SHARDS, "tensor"]
  elif len(shape) == 2 and name in ROW_PARALLEL:
    axes = ["tensor", SHARDS]
  elif len(shape) >= 2:
    axes = [SHARDS] + [None] * (len(shape) - 1)
  else:
    return P()
  return P(*(_fit(a, dim, sizes) for a, dim in zip(axes, shape)))


def _fit(axis, dim: int, sizes: dict[str, int]):
  """`axis` (a name, SHARDS or None) as far as it divides `dim`."""
  if axis is None:
    return None
  if axis == SHARDS:
    used = tuple(a for a in SHARDS if sizes[a] > 1)
    if used and dim % math.prod(sizes[a] for a in used) == 0:
      return used if len(used) > 1 else used[0]
    axis = "fsdp"
  return axis if sizes[axis] > 1 and dim % sizes[axis] == 0 else None


def state_shardings(state, mesh: jax.sharding.Mesh, sizes: dict[str, int]):
  """A pytree like `state` (arrays or ShapeDtypeStructs) of NamedShardings."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(
          mesh, spec_for(path, np.shape(leaf), sizes)
      ),
      state,
  )


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Batches [B, T + 1]: rows split over data x fsdp x expert."""
  return NamedSharding(mesh, P(mesh_lib.BATCH_AXES, None))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def place(tree, shardings):
  """Host values (the same on every process) as global sharded arrays.

  Each process builds only the shards its own devices hold, so this works
  with any number of processes.
  """

  def one(value, sharding):
    host = np.asarray(value)
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index]
    )

  return jax.tree.map(one, tree, shardings)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a run's state and batches live on its mesh.

  Attributes:
    mesh: the device mesh.
    state: NamedShardings shaped like the training state.
    batch: the batches' sharding (`batch_sharding`).
    replicated: for the metrics every process reads.
  """

  mesh: jax.sharding.Mesh
  state: Any
  batch: NamedSharding
  replicated: NamedSharding

  @classmethod
  def of(cls, state, mesh: jax.sharding.Mesh, sizes: dict[str, int]):
    """The placement of `state` (host or device arrays) on `mesh`."""
    return cls(
        mesh=mesh,
        state=state_shardings(state, mesh, sizes),
        batch=batch_sharding(mesh),
        replicated=replicated(mesh),
    )

  def put_batch(self, batch) -> jax.Array:
    """A host batch [B, T+1] (the same on every process) on the mesh."""
    return place(batch, self.batch)

  def read_batch(self, sampler) -> jax.Array:
    """`sampler`'s next batch; each process reads only its own rows."""
    starts = sampler.next_starts()
    return jax.make_array_from_callback(
        (len(starts), sampler.window),
        self.batch,
        lambda index: sampler.read(starts[index[0]])[:, index[1]],
    )
