"""Exports a program for CUDA on any machine, a CPU-only one included.

`jax.export` runs the whole Pallas -> Triton lowering in Python, so a kernel
that would not lower for the GPU fails here without a GPU. Used by
backends/pallas/lowering_test.py, moe_core/parallel/exchange_test.py and
`bench/on_device/gpu_check.py --lower_only`; the last runs alone on a GPU
machine, so this module needs only jax (no absl).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Callable, Sequence

import jax
from jax import export

from moe_core import compat

# The custom-call target of a Pallas Triton kernel.
TRITON_CALL = compat.triton_call_target()


@dataclasses.dataclass(frozen=True)
class AbstractGpu:
  """A GPU as Mosaic GPU's lowering reads it: with a compute capability.

  `jax.sharding.AbstractDevice` has no compute capability, and Mosaic GPU
  then targets sm_90; its lowering reads `compute_capability` from the
  context mesh's abstract device when there is one, so this duck-typed
  device makes a CPU-host export target another GPU generation.
  """

  device_kind: str = "NVIDIA B200"
  num_cores: int = 148
  compute_capability: str = "10.0"
  platform: str = "gpu"


def export_for_cuda(
    fn: Callable,
    *args,
    disabled_custom_calls: Sequence[str] = (),
    device_kind: str | None = "NVIDIA H200",
    abstract_gpu: AbstractGpu | None = None,
) -> export.Exported:
  """`jax.export` of `jax.jit(fn)(*args)` for platform "cuda".

  Triton kernels are not export-stable custom calls (jax >= 0.8), so their
  safety check is always disabled; the Pallas Triton deprecation warning of
  jax >= 0.11 is swallowed and counted (`compat.filter_triton_deprecation`).

  Args:
    fn: the program; traced and lowered here.
    *args: its arguments: arrays or `jax.ShapeDtypeStruct`s (pytrees of).
    disabled_custom_calls: more custom-call targets to allow, e.g.
      "ragged_all_to_all".
    device_kind: the GPU the Pallas Triton kernels are lowered for, given as
      an abstract device (`compat.abstract_gpu_mesh`), so no GPU is needed.
      None lowers without it: for a program with a shard_map over a concrete
      mesh, which must match the context mesh. (So on jax >= 0.11.2 and no
      GPU, this cannot export a program with both a concrete-mesh shard_map
      and a Pallas Triton kernel.)
    abstract_gpu: instead of `device_kind`, this device (with a compute
      capability) for Mosaic GPU kernels of another generation (sm_100).

  Returns:
    The `jax.export.Exported`; `.mlir_module()` is its StableHLO text.
  """
  names = (TRITON_CALL, *disabled_custom_calls)
  if abstract_gpu is not None:
    mesh = jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract_gpu)
    )
  elif device_kind is not None:
    mesh = compat.abstract_gpu_mesh(device_kind)
  else:
    mesh = contextlib.nullcontext()
  with compat.filter_triton_deprecation(), mesh:
    return export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[
            export.DisabledSafetyCheck.custom_call(n) for n in names
        ],
    )(*args)


def custom_calls(module_text: str) -> list[str]:
  """The custom-call targets in StableHLO text, in program order."""
  return re.findall(r"custom_call @([\w$.]+)", module_text)
