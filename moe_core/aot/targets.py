"""The GPUs dropless compiles for ahead of time, as data.

Each target is a text `GpuTargetConfigProto` in `targets/` (NVIDIA's
published figures: SM count, memory, bandwidth, caches, compute capability)
plus what the library itself needs to know about it: the device kind JAX
reports (Pallas and Mosaic GPU read the compute capability from it), its
kernel generation, and how much of its memory a program may plan to use.
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


def target(name: str) -> GpuTarget:
  """The target called `name`; ValueError naming the known ones otherwise."""
  if name not in TARGETS:
    raise ValueError(f"target must be one of {sorted(TARGETS)}, got {name!r}.")
  return TARGETS[name]


@functools.lru_cache(maxsize=None)
def _read(file_name: str) -> str:
  path = os.path.join(os.path.dirname(__file__), "targets", file_name)
  with open(path, encoding="utf-8") as f:
    return f.read()
