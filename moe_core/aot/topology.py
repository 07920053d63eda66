"""A topology of GPUs to compile for, from any host, and meshes over it.

The devices are XLA's description of GPUs that need not exist here: jit
lowers and compiles for them (`moe_core.aot.compile`), nothing runs. On a
machine without a GPU JAX must run its own computations on the CPU; the
first call here sees to that when JAX has not started yet, and says how
when it has.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Mapping

import jax
import numpy as np

from moe_core.aot import targets as targets_lib

_SPEC = re.compile(r"^(\d+)x(\d+)x(\d+)$")


def parse_topology(spec: str) -> tuple[int, int, int]:
  """ "SxHxG" -> (slices, hosts per slice, GPUs per host), each >= 1."""
  match = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
  if match is None or min(int(g) for g in match.groups()) < 1:
    raise ValueError(
        "topology must be 'SxHxG' (slices x hosts x GPUs per host, each "
        f">= 1, e.g. '1x128x8' for 1,024 GPUs), got {spec!r}."
    )
  slices, hosts, gpus = (int(g) for g in match.groups())
  return slices, hosts, gpus


@dataclasses.dataclass(frozen=True)
class Topology:
  """GPUs of one kind in slices x hosts x GPUs per host.

  Attributes:
    target: the GPU model.
    slices, hosts, gpus_per_host: the shape ("1x128x8": 1 slice of 128
      hosts of 8 GPUs).
    devices: XLA's devices of the topology, host-major (each knows its
      `process_index`: its host).
  """

  target: targets_lib.GpuTarget
  slices: int
  hosts: int
  gpus_per_host: int
  devices: tuple

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  @property
  def spec(self) -> str:
    return f"{self.slices}x{self.hosts}x{self.gpus_per_host}"

  def mesh(self, axes: Mapping[str, int]) -> jax.sharding.Mesh:
    """A mesh over every device, axes in order, the last fastest.

    Axis sizes must multiply to the device count; one size may be -1 (the
    rest). The last axes run within a host first, so an axis that fits in
    `gpus_per_host` stays on NVLink. Axes are Auto (jit's sharding
    propagation, as the library's shard_map layers expect).
    """
    names = tuple(axes)
    sizes = [int(v) for v in axes.values()]
    if sizes.count(-1) > 1:
      raise ValueError(f"at most one axis size may be -1, got {dict(axes)}.")
    if -1 in sizes:
      known = math.prod(s for s in sizes if s != -1)
      sizes[sizes.index(-1)] = self.num_devices // max(known, 1)
    if math.prod(sizes) != self.num_devices or min(sizes, default=1) < 1:
      raise ValueError(
          f"mesh axes {dict(zip(names, sizes))} multiply to "
          f"{math.prod(sizes)}, but the topology {self.spec} has "
          f"{self.num_devices} GPUs."
      )
    return jax.sharding.Mesh(
        np.array(self.devices).reshape(sizes),
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(names),
    )

  def single_device_mesh(self) -> jax.sharding.Mesh:
    """A one-device mesh of the target (for one-GPU programs)."""
    return jax.sharding.Mesh(
        np.array(self.devices[:1]),
        ("gpu",),
        axis_types=(jax.sharding.AxisType.Auto,),
    )


def cuda_plugin_installed() -> bool:
  """Whether jax's CUDA 13 plugin, which gpu_topology needs, is installed."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
  except ModuleNotFoundError:  # No jax_plugins package at all.
    return False


def gpu_topology(target: str, topology: str = "1x1x1") -> Topology:
  """The topology of `target` GPUs shaped as `topology` ("SxHxG").

  Args:
    target: a name of `targets.TARGETS` ("h100", "h200", "b200").
    topology: slices x hosts per slice x GPUs per host.

  Example:
    topo = aot.gpu_topology("h100", "1x128x8")  # slices x hosts x GPUs/host
    mesh = topo.mesh({"data": 16, "expert": 64})
  """
  gpu = targets_lib.target(target)
  slices, hosts, gpus = parse_topology(topology)
  _prepare_host()
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental import topologies

  try:
    desc = topologies.get_topology_desc(
        platform="cuda",
        topology=f"{slices}x{hosts}x{gpus}",
        target_config=gpu.config_text(),
    )
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(
        f"cannot describe {topology} {gpu.device_kind} GPUs here: {e}. "
        "Compiling for GPUs needs the CUDA plugin of this jax version "
        f"(pip install jax-cuda13-plugin=={jax.__version__} "
        f"jax-cuda13-pjrt=={jax.__version__}) and, on a machine without a "
        "GPU, JAX_PLATFORMS=cpu set before jax starts."
    ) from e
  return Topology(gpu, slices, hosts, gpus, tuple(desc.devices))


def _prepare_host() -> None:
  """Runs JAX's own computations on the CPU where no GPU is attached.

  With the CUDA plugin installed and no GPU, JAX's CUDA start-up check
  fails and the topology call then cannot find CUDA; on the CPU platform
  the plugin still describes GPU topologies. Only possible before JAX has
  started its backends.
  """
  if os.path.exists("/dev/nvidiactl"):
    return  # A real GPU: JAX's default platforms include it.
  # pylint: disable-next=g-import-not-at-top
  from jax._src import xla_bridge

  if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")
