"""Compiling a JAX program for a GPU topology, and what the compiler says.

`compile` runs XLA's whole GPU compiler on a program for a `Topology`'s GPUs
(SPMD partitioning, fusion, the latency-hiding scheduler, rematerialisation
against the target's memory, buffer assignment, and each Pallas Triton or
Mosaic GPU kernel's own compile) and returns a `CompiledProgram`: its peak
bytes, whether it fits, its custom calls, collectives and FLOPs. It does not
autotune (kernel choices are XLA's defaults), so the binary is right for
sizing, not for speed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import time
from typing import Any, Callable

import jax
import numpy as np

from moe_core.aot import topology as topology_lib

# XLA rewrites large sorts into CUB's radix sort, whose scratch size it asks
# the CUDA runtime for while compiling: without a GPU that fails
# (cudaErrorInvalidDevice; every sort on a B200 target, large ones on an
# H100). XLA's own sort kernel needs no device.
DEVICELESS_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}

# A quicker compile for checks that a program compiles, holds its kernels
# and fits (CI's): XLA's own dense GEMMs go to cuBLAS instead of Triton GEMM
# fusions, and the autotuner, which cannot time anything without a GPU,
# stops compiling candidate tilings. The backends' kernels (Pallas Triton,
# Mosaic GPU, jax-triton) and the collectives compile as under the defaults;
# per-device peaks move by cuBLAS's workspace and XLA's other fusions
# (bench/results/README.md: 0.3-0.8x the compile time, the peaks compared).
# XLA's cost analysis counts no cuBLAS call: read flops under the defaults.
# Level 0 alone fails on jax 0.11.2 ("No supported config found" for the
# ragged_dot's Triton GEMM fusion); with the Triton GEMMs off it compiles.
QUICK_OPTIONS = {
    "xla_gpu_autotune_level": 0,
    "xla_gpu_enable_triton_gemm": False,
}

# Collectives whose operand bytes `CompiledProgram.collective_bytes` sums.
COLLECTIVES = (
    "all-to-all",
    "ragged-all-to-all",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "collective-permute",
)

_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f4e2m1fn": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")


@dataclasses.dataclass
class CompiledProgram:
  """One program compiled for a topology; every size is per device.

  Attributes:
    name: the caller's label.
    target: the GPU model's name; topology: "SxHxG".
    compile_seconds: wall time of lowering and compiling.
    argument_bytes, output_bytes, alias_bytes, temp_bytes, code_bytes:
      `memory_analysis()`: arguments, outputs, outputs aliasing (donated)
      arguments, temporaries, generated code.
    flops, bytes_accessed: XLA's cost analysis of the compiled module.
    custom_calls: custom-call target -> count in the compiled module (the
      kernels: "__gpu$xla.gpu.triton", "mosaic_gpu_v2", ...).
    collective_bytes: collective op -> bytes of its operands, summed over
      the module's instructions (one execution of each).
    hbm_bytes, usable_bytes: the target's memory, and the share a plan may
      take (`targets.USABLE_FRACTION`).
    compiled: the `jax.stages.Compiled` (not serialised).
  """

  name: str
  target: str
  topology: str
  compile_seconds: float
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  flops: float
  bytes_accessed: float
  custom_calls: dict[str, int]
  collective_bytes: dict[str, int]
  hbm_bytes: int
  usable_bytes: int
  compiled: Any = dataclasses.field(default=None, repr=False)

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs not aliased to them + temporaries + code."""
    return (
        self.argument_bytes
        + self.output_bytes
        - self.alias_bytes
        + self.temp_bytes
        + self.code_bytes
    )

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.usable_bytes

  def to_json(self) -> dict:
    record = {
        f.name: getattr(self, f.name)
        for f in dataclasses.fields(self)
        if f.name != "compiled"
    }
    record["peak_bytes"] = self.peak_bytes
    record["fits"] = self.fits
    return record


def compile(  # pylint: disable=redefined-builtin
    fn: Callable,
    *args,
    topology: topology_lib.Topology,
    mesh: jax.sharding.Mesh | None = None,
    name: str = "",
    xla_options: dict[str, Any] | None = None,
    **jit_kwargs,
) -> CompiledProgram:
  """`jax.jit(fn, **jit_kwargs)` compiled for `topology` on abstract args.

  Args:
    fn: the program.
    *args: its arguments as `jax.ShapeDtypeStruct`s (pytrees of them),
      with shardings over `topology`'s devices (or `in_shardings` given).
    topology: from `gpu_topology`.
    mesh: the mesh the program's shardings and shard_maps use (a
      `topology.mesh`); None for a one-GPU program.
    name: a label for the record.
    xla_options: XLA debug options over `DEVICELESS_OPTIONS` (e.g.
      `QUICK_OPTIONS`); None compiles with XLA's defaults otherwise.
    **jit_kwargs: in_shardings, out_shardings, donate_argnums,
      static_argnums...

  Example:
    topo = aot.gpu_topology("h100", "1x1x8")
    mesh = topo.mesh({"data": 2, "expert": 4})
    program = aot.compile(step, *abstract_args, topology=topo, mesh=mesh)
    program.peak_bytes, program.fits, program.custom_calls, program.flops
  """
  context_mesh = mesh if mesh is not None else topology.single_device_mesh()
  start = time.perf_counter()
  # Kernel lowerings (Pallas Triton, Mosaic GPU) read the GPU they compile
  # for from the context mesh's abstract device; the program's own mesh
  # names the target's devices, so its abstract mesh carries it.
  with _abstract_mesh(context_mesh):
    lowered = jax.jit(fn, **jit_kwargs).lower(*args)
  compiled = lowered.compile({**DEVICELESS_OPTIONS, **(xla_options or {})})
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  text = compiled.as_text()
  cost = _cost(compiled)
  return CompiledProgram(
      name=name,
      target=topology.target.name,
      topology=topology.spec,
      compile_seconds=round(seconds, 2),
      argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes),
      alias_bytes=int(memory.alias_size_in_bytes),
      temp_bytes=int(memory.temp_size_in_bytes),
      code_bytes=int(memory.generated_code_size_in_bytes),
      flops=float(cost.get("flops", 0.0)),
      bytes_accessed=float(cost.get("bytes accessed", 0.0)),
      custom_calls=dict(collections.Counter(_CUSTOM_CALL.findall(text))),
      collective_bytes=collective_bytes(text),
      hbm_bytes=topology.target.hbm_bytes,
      usable_bytes=topology.target.usable_bytes,
      compiled=compiled,
  )


def _abstract_mesh(mesh):
  use = getattr(jax.sharding, "use_abstract_mesh", None)
  return use(mesh.abstract_mesh) if use else contextlib.nullcontext()


def _cost(compiled) -> dict:
  """XLA's cost analysis of the compiled module (per device).

  The CUDA plugin's executable does not implement `cost_analysis()`; the
  same analysis of its optimised HLO module runs on the CPU client.
  """
  analysis = compiled.cost_analysis()
  if isinstance(analysis, list):  # jax < 0.11: one dict per module.
    analysis = analysis[0] if analysis else None
  if analysis:
    return dict(analysis)
  try:
    # pylint: disable-next=g-import-not-at-top
    from jax._src.lib import xla_client

    modules = compiled.runtime_executable().hlo_modules()
    return dict(
        xla_client._xla.hlo_module_cost_analysis(  # pylint: disable=protected-access
            jax.devices("cpu")[0].client, modules[0]
        )
    )
  except Exception:  # pylint: disable=broad-except
    return {}


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Collective op -> summed bytes of its result shapes in `hlo_text`.

  Each instruction counts once (a loop body's collective once, not per
  iteration); the "-start" halves of async collectives count, their
  "-done" halves do not.
  """
  totals = collections.Counter()
  for line in hlo_text.splitlines():
    if "=" not in line:
      continue
    lhs, rhs = line.split("=", 1)
    for op in COLLECTIVES:
      if re.search(rf"\s{op}(-start)?\(", rhs):
        totals[op] += _shape_bytes(rhs.split(op, 1)[0])
        break
  return dict(totals)


def _shape_bytes(shape_text: str) -> int:
  """Bytes of the array shapes in an HLO result type ("bf16[8,128]")."""
  total = 0
  for dtype, dims in _SHAPE.findall(shape_text):
    count = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    total += count * _BYTES[dtype]
  return total
