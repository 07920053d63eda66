"""A run's train step on a mesh, built without allocating anything.

`build` returns the pure train step, its `jax.jit` arguments and its
abstract state and batch, for a mesh over this host's devices or a
`moe_core.aot` topology's. The training program uses the same object
(`train.run.training.trainer.Trainer`): what the dry run compiles is what
the run runs (`compiled_step_memory`: XLA's memory figures of it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from train.parallel import mesh as mesh_lib
from train.run.inputs import run_config
from train.run.step import state as state_lib
from train.run.step import steps


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The train step of one run on one mesh, and its abstract arguments.

  Attributes:
    fn: the step, (state, batch) -> (state, metrics); pure, not jitted.
    state: the training state as jax.ShapeDtypeStructs with their
      shardings (`state_lib.abstract`): params, optimiser state and biases.
    batch: the batch [B, T+1] int32 as a jax.ShapeDtypeStruct, its rows
      split over data x fsdp x expert.
    jit_kwargs: `jax.jit`'s in_shardings, out_shardings (on a mesh) and
      donate_argnums (the state) for `fn`.
    program: the `steps.Program` that `fn` belongs to (its jitted
      `train_step`, eval step, optimiser).
    spec: the `state_lib.StateSpec` (graphdef, state, placement).
  """

  fn: Callable
  state: Any
  batch: jax.ShapeDtypeStruct
  jit_kwargs: dict
  program: steps.Program
  spec: state_lib.StateSpec

  def lower(self) -> jax.stages.Lowered:
    """The step lowered for `state` and `batch`, with `jit_kwargs`."""
    return self.program.train_step.lower(self.state, self.batch)


def batch_like(run: run_config.RunConfig, placement) -> jax.ShapeDtypeStruct:
  """What a batch [B, T+1] of `run` is, to compile the step for it."""
  return jax.ShapeDtypeStruct(
      (run.batch_size, run.seq_len + 1),
      jnp.int32,
      sharding=None if placement is None else placement.batch,
  )


def build(
    run: run_config.RunConfig, mesh: jax.sharding.Mesh | None
) -> TrainStep:
  """The train step of `run` on `mesh`, with abstract arguments.

  Nothing is computed or allocated: the model and optimiser are traced
  abstractly.

      step = step_builder.build(run, mesh)
      compiled = step.lower().compile()            # on the mesh's devices
      # or for GPUs that are not here (moe_core.aot):
      topo = aot.gpu_topology("h100", "1x128x8")
      mesh = mesh_lib.build(sizes, devices=topo.devices)
      step = step_builder.build(run, mesh)
      aot.compile(step.fn, step.state, step.batch, topology=topo, mesh=mesh,
                  **step.jit_kwargs)

  Args:
    run: the run's config.
    mesh: a mesh with axes `mesh_lib.AXES` (an axis it lacks counts as
      size 1) over any devices: this host's, or a topology's
      (`moe_core.aot`, via `mesh_lib.build(sizes, devices=...)`); None for
      one device.

  Raises:
    ValueError: the run does not split over the mesh (batch, experts,
      microbatches).
  """
  mesh_lib.check_run(
      state_lib.mesh_sizes(mesh), run.model, run.batch_size, run.microbatches
  )
  spec = state_lib.abstract(run, mesh)
  program = steps.program(run, spec.graphdef, spec.placement)
  return TrainStep(
      fn=program.step_fn,
      state=spec.state,
      batch=batch_like(run, spec.placement),
      jit_kwargs=program.train_jit_kwargs(),
      program=program,
      spec=spec,
  )


def compiled_step_memory(
    run: run_config.RunConfig,
) -> steps.StepMemory | None:
  """XLA's memory figures for `run`'s train step, compiled for its mesh.

  Builds the step abstractly (nothing allocated) and compiles the very
  step a Trainer of `run` compiles: the figures are those of the run.
  Needs the mesh's devices (simulated CPU devices will do).

  Raises:
    ValueError: the mesh does not fit the devices, or the run the mesh.
  """
  sizes = mesh_lib.parse(run.mesh)
  step = build(run, mesh_lib.build(sizes))
  return step.program.train_step_memory(step.state, step.batch)
