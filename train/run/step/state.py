"""The training state: its shapes and shardings, and its sharded initialisation.

The state is a dict pytree {"params", "opt_state", "bias"}: float32 master
weights (`nnx.Param`), the optax state, and the MoE correction biases
(`moe_flax.CorrectionBias`). `abstract` describes it without computing
anything; `initialise` computes it in one jitted program whose outputs
have the run's shardings, so each device computes and holds only its own
shards: no host, and no device, ever holds the whole model. The values do
not depend on the mesh: they are those of the model built eagerly on one
device from the same seed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import moe_core
from moe_core import flax as moe_flax
from train.models import scan_model
from train.models import transformer as model_lib
from train.parallel import mesh as mesh_lib
from train.parallel import sharding
from train.run.inputs import run_config
from train.run.step import steps


def mesh_sizes(mesh: jax.sharding.Mesh | None) -> dict[str, int]:
  """{axis: size} over `mesh_lib.AXES` (1 for an axis `mesh` lacks)."""
  shape = {} if mesh is None else dict(mesh.shape)
  return {axis: int(shape.get(axis, 1)) for axis in mesh_lib.AXES}


def make_model(run: run_config.RunConfig, mesh: jax.sharding.Mesh | None):
  """The run's model (scanned or unrolled), initialised from `run.seed`.

  Args:
    run: the run's config.
    mesh: the device mesh (any devices, real or a topology's), or None
      for one device. The MoE blocks run expert-parallel over it.
  """
  moe_mesh = None
  if mesh is not None:
    moe_mesh = {
        "mesh": mesh,
        "expert_axis": mesh_lib.EXPERT_AXIS,
        "data_axes": mesh_lib.MOE_DATA_AXES,
    }
    if run.ep_chunks > 1:
      moe_mesh["ep_options"] = moe_core.parallel.EPOptions(
          num_chunks=run.ep_chunks
      )
  kind = (
      scan_model.ScannedTransformer
      if run.scan_layers
      else model_lib.Transformer
  )
  return kind(
      run.model,
      backend=run.backend,
      compute_dtype=jnp.dtype(run.compute_dtype),
      remat=run.remat,
      rngs=nnx.Rngs(params=run.seed),
      moe_mesh=moe_mesh,
  )


def _initial_state(run: run_config.RunConfig, mesh):
  """(graphdef, state): the model's graph and its initial training state."""
  model = make_model(run, mesh)
  graphdef, params, bias = nnx.split(model, nnx.Param, moe_flax.CorrectionBias)
  opt_state = steps.make_optimizer(run).init(params)
  return graphdef, {"params": params, "opt_state": opt_state, "bias": bias}


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """What a run's training state is, before any of it exists.

  Attributes:
    graphdef: the nnx graph of the model (static: shapes, backend, mesh).
    state: the state as jax.ShapeDtypeStructs, each with its sharding
      (`sharding=None` without a mesh).
    placement: the `sharding.Placement` of the state and batches (None
      without a mesh).
  """

  graphdef: Any
  state: Any
  placement: sharding.Placement | None


def abstract(
    run: run_config.RunConfig, mesh: jax.sharding.Mesh | None
) -> StateSpec:
  """The state's shapes, dtypes and shardings; nothing is computed."""
  graphdef, shapes = nnx.eval_shape(lambda: _initial_state(run, mesh))
  placement = None
  if mesh is not None:
    placement = sharding.Placement.of(shapes, mesh, mesh_sizes(mesh))
    shapes = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        shapes,
        placement.state,
    )
  return StateSpec(graphdef, shapes, placement)


def initializer(run: run_config.RunConfig, spec: StateSpec):
  """The jitted function of no arguments that computes the initial state.

  Its outputs have the placement's shardings (`out_shardings`): XLA
  partitions the program, so each device draws and keeps only its shards
  (the random bits are partitionable: `jax_threefry_partitionable`, on by
  default since jax 0.5). Every process runs it; each ends up with its
  devices' shards.

  Args:
    run: the run's config.
    spec: `abstract(run, mesh)`.
  """
  mesh = None if spec.placement is None else spec.placement.mesh
  init = lambda: _initial_state(run, mesh)[1]
  if spec.placement is None:
    return jax.jit(init)
  return jax.jit(init, out_shardings=spec.placement.state)


def initialise(run: run_config.RunConfig, spec: StateSpec):
  """The initial state, computed where it lives (`initializer`).

  Returns:
    The state pytree of jax.Arrays, shaped and sharded as `spec.state`.
  """
  return initializer(run, spec)()
