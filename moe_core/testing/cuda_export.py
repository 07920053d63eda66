"""Exports a program for CUDA on any machine, a CPU-only one included.

`jax.export` runs the whole Pallas -> Triton lowering in Python, so a kernel
that would not lower for the GPU fails here without a GPU. Used by
backends/pallas/lowering_test.py, moe_core/parallel/exchange_test.py and
`bench/gpu_check.py --lower_only`; the last runs alone on a GPU machine,
so this module needs only jax (no absl).
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Sequence

import jax
from jax import export

from moe_core import compat

# The custom-call target of a Pallas Triton kernel.
TRITON_CALL = compat.triton_call_target()


def export_for_cuda(
    fn: Callable,
    *args,
    disabled_custom_calls: Sequence[str] = (),
    device_kind: str | None = "NVIDIA H200",
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

  Returns:
    The `jax.export.Exported`; `.mlir_module()` is its StableHLO text.
  """
  names = (TRITON_CALL, *disabled_custom_calls)
  mesh = (
      compat.abstract_gpu_mesh(device_kind)
      if device_kind is not None
      else contextlib.nullcontext()
  )
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
