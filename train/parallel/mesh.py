"""The training program's device mesh: `--mesh` to a `jax.sharding.Mesh`.

Axes, outermost first (`AXES`): data (pure data parallelism), fsdp (data
parallelism with weights and optimiser state split too), expert (expert
parallelism) and tensor (Megatron-style splits of attention and the dense
MLPs). The batch is split over data x fsdp x expert (`BATCH_AXES`), so
those three sizes must divide the batch; `expert` must divide the number
of experts (`check_run`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import pkgutil

import jax
import numpy as np

from train.models import model_config
from train.presets import sizing

# Outermost first (the innermost gets the closest devices):
#   data    pure data parallelism: the batch is split, weights replicated;
#   fsdp    data parallelism with weights and optimiser state split too
#           (gathered for compute, as ZeRO-3 / FSDP do);
#   expert  expert parallelism: each device holds E / expert experts, and
#           the batch is split over it too (tokens travel all-to-all);
#   tensor  Megatron-style splits of the attention and dense-MLP matrices
#           (XLA inserts the collectives); the MoE block is replicated
#           over it.
AXES = sizing.MESH_AXES  # ("data", "fsdp", "expert", "tensor")
# The batch is split over these, so their sizes must divide the batch.
BATCH_AXES = ("data", "fsdp", "expert")
EXPERT_AXIS = "expert"
# Token axes of the MoE layer other than the expert axis.
MOE_DATA_AXES = ("data", "fsdp")


def parse(spec: str) -> dict[str, int]:
  """'data=2,expert=4' -> {'data': 2, 'fsdp': 1, 'expert': 4, 'tensor': 1}."""
  return sizing.parse_mesh(spec)


def _split_axes(sizes: dict[str, int]) -> str:
  """'data=2,expert=4': the axes of size > 1, in AXES order; '' if none."""
  return ",".join(f"{a}={sizes[a]}" for a in AXES if sizes[a] > 1)


def canonical(sizes: dict[str, int]) -> str:
  """The --mesh spelling of `sizes`: 'data=2,expert=4', or 'data=1'."""
  return _split_axes(sizes) or "data=1"


def describe(sizes: dict[str, int]) -> str:
  """'data=2,expert=4' for people; 'single device' for a one-device mesh."""
  return _split_axes(sizes) or "single device"


def num_devices(sizes: dict[str, int]) -> int:
  return math.prod(sizes[a] for a in AXES)


def batch_shards(sizes: dict[str, int]) -> int:
  """How many ways the batch is split (data x fsdp x expert)."""
  return math.prod(sizes[a] for a in BATCH_AXES)


def accelerator_plugins() -> list[str]:
  """The installed JAX accelerator plugins (CUDA, ROCm, TPU), by name.

  Looked up without initialising JAX's backends, which would fix the
  number of CPU devices before `simulate_cpu_devices` can set it.
  """
  found = []
  try:
    import jax_plugins  # pylint: disable=g-import-not-at-top

    found += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  except ImportError:
    pass
  if importlib.util.find_spec("libtpu") is not None:
    found.append("libtpu")
  return found


def _cpu_only() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return set(platforms.lower().split(",")) == {"cpu"}
  return not accelerator_plugins()


def simulate_cpu_devices(sizes: dict[str, int], num_processes: int) -> str:
  """On a machine without accelerators, gives this process enough CPU devices.

  Each of `num_processes` processes then has num_devices(sizes) /
  num_processes simulated CPU devices (what
  `--xla_force_host_platform_device_count` does). Must run before JAX's
  backends initialise; does nothing where an accelerator plugin is
  installed, where XLA_FLAGS already sets the count, or for one device.

  Returns:
    A line saying what it did, or "" if nothing.
  """
  total = num_devices(sizes)
  if total == 1 or not _cpu_only():
    return ""
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return ""
  if total % num_processes:
    raise ValueError(
        f"--mesh={describe(sizes)} has {total} devices, which "
        f"{num_processes} processes cannot share equally; give a mesh whose "
        f"size is a multiple of --num_processes={num_processes}."
    )
  local = total // num_processes
  try:
    jax.config.update("jax_num_cpu_devices", local)
  except RuntimeError:  # Backends already up: build() names the mismatch.
    return ""
  return (
      f"no accelerator found: simulating {local} CPU devices per process "
      "(--xla_force_host_platform_device_count) for --mesh="
      f"{describe(sizes)}"
  )


def build(sizes: dict[str, int], devices=None) -> jax.sharding.Mesh | None:
  """The mesh over every process's devices; None for one device.

  A one-device mesh (the default, data=1) runs on the default device
  whatever the device count, exactly as a run without a mesh.

  Args:
    sizes: {axis: size} (`parse`).
    devices: the devices, process by process (default `jax.devices()`);
      e.g. a `moe_core.aot` topology's, to compile for GPUs that are not
      here. Given, even one device makes a mesh.

  Raises:
    ValueError: the sizes do not multiply to the number of devices.
  """
  total = num_devices(sizes)
  if devices is None:
    if total == 1 and jax.process_count() == 1:
      return None  # The default device, as before meshes existed.
    devices = jax.devices()
  devices = list(devices)
  if total != len(devices):
    raise ValueError(
        f"--mesh={describe(sizes)} multiplies to {total} devices, but "
        f"there are {len(devices)} ({_processes(devices)} process(es) x "
        f"{len(devices) // _processes(devices)} {devices[0].platform} "
        f"devices); give axis sizes whose product is {len(devices)}."
    )
  # jax.devices() lists each process's devices together, so the innermost
  # axes (tensor, then expert) stay within a process where they fit.
  grid = np.array(devices).reshape([sizes[a] for a in AXES])
  return jax.sharding.Mesh(grid, AXES)


def _processes(devices) -> int:
  return len({d.process_index for d in devices})


def check_run(
    sizes: dict[str, int],
    model: model_config.ModelConfig,
    batch_size: int,
    microbatches: int = 1,
) -> None:
  """The model and batch split over `sizes`, or a ValueError naming the flag.

  Each of the `microbatches` equal parts of the batch is split over the
  data-parallel devices.
  """
  shards = batch_shards(sizes)
  if batch_size % shards:
    raise ValueError(
        f"--batch_size={batch_size} must be divisible by the data-parallel "
        f"size data x fsdp x expert = {shards} of --mesh={describe(sizes)}."
    )
  if microbatches < 1 or batch_size % (microbatches * shards):
    raise ValueError(
        f"--microbatches must be >= 1 and split --batch_size={batch_size} "
        f"into microbatches that divide over data x fsdp x expert = "
        f"{shards} devices of --mesh={describe(sizes)}, got "
        f"--microbatches={microbatches}."
    )
  expert = sizes[EXPERT_AXIS]
  if expert > 1 and model.moe is None:
    raise ValueError(
        f"--mesh={describe(sizes)} splits experts, but model {model.name} "
        "is dense (no MoE layers); use data or fsdp instead."
    )
  if model.moe is not None and model.moe.num_experts % expert:
    raise ValueError(
        f"--mesh expert={expert} must divide the number of experts, "
        f"{model.moe.num_experts}, of model {model.name}."
    )
