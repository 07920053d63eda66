"""A topology of GPUs or TPUs to compile for, from any host, and meshes.

The devices are XLA's description of chips that need not exist here: jit
lowers and compiles for them (`moe_core.aot.compile`), nothing runs. GPUs
need jax's CUDA plugin, TPUs `libtpu`. On a machine without the chips JAX
must run its own computations on the CPU; the first call here sees to that
when JAX has not started yet, and says how when it has.
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
          f"{self.num_devices} devices."
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


@dataclasses.dataclass(frozen=True)
class TpuTopology(Topology):
  """TPU chips of one generation: `slices` slices of a chip grid each.

  Attributes (beyond `Topology`'s; `hosts` and `gpus_per_host` are per
  slice: libtpu's hosts, and JAX devices per host):
    chips: the chip grid of one slice, "2x2" or "4x4x4".
  """

  chips: str = ""

  @property
  def spec(self) -> str:
    suffix = f"/{self.slices}" if self.slices > 1 else ""
    return f"{self.chips}{suffix}"

  @property
  def name(self) -> str:
    """The full name, "v5e:2x2" or "v5e:2x2/2"."""
    return f"{self.target.name}:{self.spec}"

  def single_device_mesh(self) -> jax.sharding.Mesh:
    """A one-device mesh of the target (for one-chip programs)."""
    return jax.sharding.Mesh(
        np.array(self.devices[:1]),
        ("tpu",),
        axis_types=(jax.sharding.AxisType.Auto,),
    )


_TPU_SPEC = re.compile(r"^(\d+(?:x\d+){1,2})(?:/(\d+))?$")


def parse_tpu_topology(target: str, spec: str) -> tuple[str, int]:
  """ "AxB[xC][/S]" -> (chip grid "AxB[xC]", slices) for a TPU `target`.

  The chip grid has the generation's dimensions (`TpuTarget.chip_dims`:
  "2x2" for v5e and v6e, "2x2x1" for v5p and tpu7x); "/S" asks for S such
  slices joined over the data-centre network (default 1).
  """
  tpu = targets_lib.TPU_TARGETS[target]
  match = _TPU_SPEC.match(spec.strip()) if isinstance(spec, str) else None
  dims = match.group(1).split("x") if match else []
  if (
      match is None
      or len(dims) != tpu.chip_dims
      or min(int(d) for d in dims) < 1
      or int(match.group(2) or 1) < 1
  ):
    example = "2x2" if tpu.chip_dims == 2 else "2x2x1"
    raise ValueError(
        f"topology for {target} must be a chip grid of {tpu.chip_dims} "
        f"dimensions, optionally '/S' slices (e.g. '{example}', "
        f"'{example}/2'; examples: {', '.join(tpu.topologies)}), got "
        f"{spec!r}."
    )
  return match.group(1), int(match.group(2) or 1)


def num_devices(target: str, spec: str) -> int:
  """The JAX devices of `spec` on `target` (GPU "SxHxG" or TPU "AxB/S")."""
  targets_lib.target(target)  # An unknown target, named as such.
  if targets_lib.is_tpu(target):
    chips, slices = parse_tpu_topology(target, spec)
    per_chip = targets_lib.TPU_TARGETS[target].devices_per_chip
    return math.prod(int(d) for d in chips.split("x")) * slices * per_chip
  return math.prod(parse_topology(spec))


def libtpu_installed() -> bool:
  """Whether libtpu, which tpu_topology needs, is installed."""
  return importlib.util.find_spec("libtpu") is not None


def tpu_topology(target: str, topology: str = "") -> TpuTopology:
  """The topology of `target` TPUs shaped as `topology` ("AxB[xC][/S]").

  Args:
    target: a name of `targets.TPU_TARGETS` ("v5e", "v6e", "v5p", "tpu7x").
    topology: the chip grid of a slice, and "/S" for S slices; default one
      chip.

  Example:
    topo = aot.tpu_topology("v5p", "4x4x4")   # 64 chips, 16 hosts
    mesh = topo.mesh({"data": 4, "expert": 16})
  """
  tpu = targets_lib.TPU_TARGETS.get(target)
  if tpu is None:
    raise ValueError(
        f"TPU target must be one of {sorted(targets_lib.TPU_TARGETS)}, got "
        f"{target!r}."
    )
  chips, slices = parse_tpu_topology(
      target, topology or "x".join(["1"] * tpu.chip_dims)
  )
  _prepare_host(tpu=True)
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental import topologies

  try:
    desc = topologies.get_topology_desc(
        f"{target}:{chips}",
        platform="tpu",
        num_slices=slices,
        chips_per_host_bounds=_chips_per_host(chips),
    )
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(
        f"cannot describe {target}:{chips} x {slices} slice(s) of TPUs here: "
        f"{e}. Compiling for TPUs needs libtpu (jax {jax.__version__}'s "
        "`tpu` extra: tools/setup.sh installs it on the newest leg) and, on "
        "a machine without a TPU, JAX_PLATFORMS=cpu set before jax starts."
    ) from e
  devices = tuple(desc.devices)
  processes = len({d.process_index for d in devices})
  return TpuTopology(
      tpu,
      slices,
      processes // slices,
      len(devices) // processes,
      devices,
      chips=chips,
  )


# libtpu's chips per host: a 2x2 block of the chip grid (v5e, v6e, v5p and
# tpu7x hosts of 4 chips).
_HOST_BLOCK = (2, 2, 1)


def _chips_per_host(chips: str) -> tuple[int, int, int]:
  """A host's block of a slice's chip grid (libtpu 0.0.48, jax 0.11.2's,
  refuses a grid smaller than its default block: one chip needs 1x1x1)."""
  dims = [int(d) for d in chips.split("x")] + [1]
  return tuple(min(d, b) for d, b in zip(dims[:3], _HOST_BLOCK))


def named_topology(name: str) -> Topology:
  """A topology by its full name: "v5e:2x2", "v5p:4x4x4/2", "h100:1x1x8".

  The part before ":" is a target of `targets.TARGETS`; after it, a TPU's
  chip grid (and "/S" slices) or a GPU's "SxHxG".
  """
  parts = name.partition(":") if isinstance(name, str) else ("", "", "")
  target, sep, spec = parts
  if not sep or target not in targets_lib.TARGETS:
    raise ValueError(
        "a topology's name must be '<target>:<shape>' with a target of "
        f"{sorted(targets_lib.TARGETS)} (e.g. 'v5e:2x2', 'h100:1x1x8'), got "
        f"{name!r}."
    )
  if targets_lib.is_tpu(target):
    return tpu_topology(target, spec)
  return gpu_topology(target, spec)


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
  if target not in targets_lib.GPU_TARGETS:
    raise ValueError(
        f"GPU target must be one of {sorted(targets_lib.GPU_TARGETS)}, got "
        f"{target!r}."
    )
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


def _prepare_host(tpu: bool = False) -> None:
  """Runs JAX's own computations on the CPU where no GPU is attached.

  With the CUDA plugin installed and no GPU, JAX's CUDA start-up check
  fails and the topology call then cannot find CUDA; on the CPU platform
  the plugin still describes GPU topologies. Only possible before JAX has
  started its backends. For TPUs, libtpu is told before it loads that
  other processes may hold it too (it otherwise takes a lock file in /tmp,
  and a second compiling process, a parallel test, fails with "Internal
  error when accessing libtpu multi-process lockfile").
  """
  if tpu:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if os.path.exists("/dev/nvidiactl") or (tpu and _has_tpu()):
    return  # A real accelerator: JAX's default platforms include it.
  # pylint: disable-next=g-import-not-at-top
  from jax._src import xla_bridge

  if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")


def _has_tpu() -> bool:
  """Whether a TPU is attached (its device files, as libtpu finds them)."""
  return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
