"""The GPUs and TPUs dropless compiles for ahead of time, as data.

Each GPU target is a text `GpuTargetConfigProto` in `targets/` (NVIDIA's
published figures: SM count, memory, bandwidth, caches, compute capability)
plus what the library itself needs to know about it: the device kind JAX
reports (Pallas and Mosaic GPU read the compute capability from it), its
kernel generation, and how much of its memory a program may plan to use.
Each TPU target (`TpuTarget`) is its generation's figures per JAX device
(HBM, VMEM, peak FLOP/s) and how XLA's TPU compiler names its topologies
(libtpu describes the chips themselves).
"""

from __future__ import annotations

import dataclasses
import functools
import os

# The share of HBM a compiled program's peak may take. XLA's
# memory_analysis() counts the program's buffers only: the CUDA context,
# cuBLAS/cuDNN workspaces, NCCL's buffers and the allocator's fragmentation
# come on top (about 1-3 GiB on an 80 GB part in practice), so a plan is
# held to 95% of the datasheet's capacity.
USABLE_FRACTION = 0.95


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """One GPU model to compile for.

  Attributes:
    name: the short name ("h100", "h200", "b200").
    device_kind: as `jax.Device.device_kind` spells it.
    num_cores: streaming multiprocessors.
    hbm_bytes: device memory, the datasheet's capacity.
    generation: "sm90" (Hopper: wgmma) or "sm100" (Blackwell: tcgen05),
      what the kernel backends pick their kernels by.
    config_file: the target-config text proto's file name in `targets/`.
  """

  name: str
  device_kind: str
  num_cores: int
  hbm_bytes: int
  generation: str
  config_file: str

  @property
  def usable_bytes(self) -> int:
    """The memory a program's peak may take (`USABLE_FRACTION` of HBM)."""
    return int(self.hbm_bytes * USABLE_FRACTION)

  def config_text(self) -> str:
    """The target-config text proto XLA's GPU compiler reads."""
    return _read(self.config_file)


_GIB = 2**30

TARGETS = {
    t.name: t
    for t in (
        GpuTarget(
            "h100",
            "NVIDIA H100 80GB HBM3",
            132,
            80 * _GIB,
            "sm90",
            "h100_sxm.txtpb",
        ),
        GpuTarget("h200", "NVIDIA H200", 132, 141 * _GIB, "sm90", "h200.txtpb"),
        GpuTarget(
            "b200", "NVIDIA B200", 148, 180 * _GIB, "sm100", "b200.txtpb"
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class TpuTarget:
  """One TPU generation to compile for; every figure is per JAX device.

  A JAX device is a chip, except on tpu7x, where each of a chip's two
  TensorCores is one (with half its HBM and FLOP/s).

  Attributes:
    name: the short name, also the prefix of XLA's topology names
      ("v5e", "v6e", "v5p", "tpu7x").
    device_kind: as `jax.Device.device_kind` spells it.
    hbm_bytes: the device's HBM, the published figure.
    usable_bytes: what XLA's TPU compiler lets a program take of it
      ("available HBM" of its out-of-memory error, libtpu 0.0.50): a
      program over it fails to compile.
    vmem_bytes: VMEM per TensorCore.
    scoped_vmem_bytes: the VMEM a Mosaic kernel's scoped buffers (its
      blocks, double-buffered, and scratch) may take by default (libtpu
      0.0.50's limit; a kernel raises it with `vmem_limit_bytes`): over it
      the compile fails ("CompileTimeScopedVmemOom").
    peak_flops: bf16 dense FLOP/s.
    devices_per_chip: JAX devices per chip.
    chip_dims: 2 ("AxB": v5e, v6e) or 3 ("AxBxC": v5p, tpu7x), the
      dimensions of a slice's chip grid.
    topologies: example topologies, one chip to a pod ("v5e:16x16").
    generation: what a TPU kernel backend picks its tiles by.
  """

  name: str
  device_kind: str
  hbm_bytes: int
  usable_bytes: int
  vmem_bytes: int
  scoped_vmem_bytes: int
  peak_flops: float
  devices_per_chip: int
  chip_dims: int
  topologies: tuple[str, ...]
  generation: str


GPU_TARGETS = TARGETS
_MIB = 2**20
# Published figures (Google's TPU pages, `jax._src.tpu_info`); usable_bytes
# as libtpu 0.0.50's compiler reports it for one device of each.
TPU_TARGETS = {
    t.name: t
    for t in (
        TpuTarget(
            "v5e",
            "TPU v5 lite",
            16 * _GIB,
            int(15.75 * _GIB),
            128 * _MIB,
            16 * _MIB,
            197e12,
            1,
            2,
            ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v5e:16x16"),
            "v5e",
        ),
        TpuTarget(
            "v6e",
            "TPU v6 lite",
            32 * _GIB,
            int(31.24 * _GIB),
            128 * _MIB,
            32 * _MIB,
            918e12,
            1,
            2,
            ("v6e:1x1", "v6e:2x2", "v6e:2x4", "v6e:16x16"),
            "v6e",
        ),
        TpuTarget(
            "v5p",
            "TPU v5",
            103 * 10**9,
            int(95.73 * _GIB),
            64 * _MIB,
            16 * _MIB,
            459e12,
            1,
            3,
            ("v5p:1x1x1", "v5p:2x2x1", "v5p:2x2x2", "v5p:8x16x16"),
            "v5p",
        ),
        TpuTarget(
            "tpu7x",
            "TPU7x",
            103 * 10**9,
            int(94.74 * _GIB),
            64 * _MIB,
            32 * _MIB,
            2307e12 / 2,
            2,
            3,
            ("tpu7x:1x1x1", "tpu7x:2x2x1", "tpu7x:2x2x2", "tpu7x:8x16x16"),
            "tpu7x",
        ),
    )
}
TARGETS = {**GPU_TARGETS, **TPU_TARGETS}


def is_tpu(name: str) -> bool:
  """Whether `name` is a TPU target (of `TPU_TARGETS`)."""
  return name in TPU_TARGETS


def target(name: str) -> GpuTarget | TpuTarget:
  """The target called `name`; ValueError naming the known ones otherwise."""
  if name not in TARGETS:
    raise ValueError(f"target must be one of {sorted(TARGETS)}, got {name!r}.")
  return TARGETS[name]


@functools.lru_cache(maxsize=None)
def _read(file_name: str) -> str:
  path = os.path.join(os.path.dirname(__file__), "targets", file_name)
  with open(path, encoding="utf-8") as f:
    return f.read()
