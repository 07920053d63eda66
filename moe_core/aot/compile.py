"""Compiling a JAX program for a GPU or TPU topology, and what XLA says.

`compile` runs XLA's whole GPU or TPU compiler on a program for a
`Topology`'s chips (SPMD partitioning, fusion, the latency-hiding
scheduler, rematerialisation against the target's memory, buffer
assignment, and each Pallas Triton, Mosaic GPU or Mosaic TPU kernel's own
compile) and returns a `CompiledProgram`: its peak bytes, whether it fits,
its custom calls, Mosaic TPU kernels, collectives and FLOPs. It does not
autotune (kernel choices are XLA's defaults), so the binary is right for
sizing, not for speed. XLA's TPU compiler refuses a program over the
chip's HBM (`HbmOomError`) and a kernel over its VMEM (a compile error
naming VMEM); its GPU compiler only warns, and `fits` says.

Where JAX's compilation cache is on (`jax_compilation_cache_dir`), what a
compile found is kept beside it (`results_cache.py`), keyed by the lowered
program, the options, the topology's devices and the compilers' versions:
JAX's own cache cannot serve a deviceless compile (it writes the
executable but cannot load one without a device), and the same program
compiled again by the same compiler gives the same answer.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import json
import re
import time
from typing import Any, Callable

import jax
import numpy as np

from moe_core.aot import results_cache
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
# A Mosaic TPU kernel: a "tpu_custom_call" whose backend config holds the
# kernel's MLIR module (base64 bytecode, the kernel's name among its
# strings) and the VMEM it takes. XLA's own ragged_dot is such a call too,
# so the call target alone says nothing about whose kernel it is.
TPU_CUSTOM_CALL = "tpu_custom_call"
_BACKEND_CONFIG = re.compile(r"backend_config=(\{.*\})\s*$")
_KERNEL_NAME = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_OOM = re.compile(
    r"CompileTimeHbmOom|Ran out of memory (on HBM|in memory space hbm)"
)
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
      kernels: "__gpu$xla.gpu.triton", "mosaic_gpu_v2", "tpu_custom_call").
    tpu_kernels: Mosaic TPU kernel name -> count (`tpu_kernels`): the
      `name` of each pallas_call, XLA's own ("ragged-dot-none") too.
    kernel_vmem_bytes: the most VMEM one Mosaic TPU kernel takes (its
      scoped buffers); 0 for GPUs.
    collective_bytes: collective op -> bytes of its operands, summed over
      the module's instructions (one execution of each).
    hbm_bytes, usable_bytes: the target's memory, and the share a plan may
      take (`targets.USABLE_FRACTION`).
    hlo_text: the compiled module's text (`Compiled.as_text()`; not in
      `to_json`).
    cached: whether the figures came from the results cache (then
      `compile_seconds` is the compile's that found them, and `compiled`
      is None).
    compiled: the `jax.stages.Compiled` (not serialised); None where
      `cached`.
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
  tpu_kernels: dict[str, int] = dataclasses.field(default_factory=dict)
  kernel_vmem_bytes: int = 0
  hlo_text: str = dataclasses.field(default="", repr=False)
  cached: bool = False
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
        if f.name not in ("compiled", "hlo_text", "cached")
    }
    if self.cached:  # Said only where it holds: older records lack the key.
      record["cached"] = True
    record["peak_bytes"] = self.peak_bytes
    record["fits"] = self.fits
    return record


class HbmOomError(ValueError):
  """XLA's TPU compiler refused a program over the chip's HBM.

  Attributes:
    required_bytes, available_bytes: its figures (None where its message
      gives none).
  """

  def __init__(self, message, required_bytes, available_bytes):
    super().__init__(message)
    self.required_bytes = required_bytes
    self.available_bytes = available_bytes


def _hbm_oom(error: Exception) -> HbmOomError | None:
  """The HbmOomError of a TPU compile's out-of-memory error, else None."""
  text = str(error)
  if not _OOM.search(text):
    return None

  def figure(after: str):
    match = re.search(after + r"[^(]*\(([0-9.]+)([KMGT]?)\)", text)
    if match is None:
      return None
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    return int(float(match.group(1)) * scale[match.group(2)])

  first = text.splitlines()[0] if text else ""
  return HbmOomError(
      f"XLA's TPU compiler: {first}",
      figure(r"required"),
      figure(r"available HBM"),
  )


def compile(  # pylint: disable=redefined-builtin
    fn: Callable,
    *args,
    topology: topology_lib.Topology | str,
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
    topology: from `gpu_topology` or `tpu_topology`, or a full name
      ("v5e:2x2", "h100:1x1x8": `topology_lib.topology`).
    mesh: the mesh the program's shardings and shard_maps use (a
      `topology.mesh`); None for a one-device program.
    name: a label for the record.
    xla_options: XLA debug options, over `DEVICELESS_OPTIONS` for a GPU
      (e.g. `QUICK_OPTIONS`, GPU options that a TPU compile ignores); None
      compiles with XLA's defaults otherwise.
    **jit_kwargs: in_shardings, out_shardings, donate_argnums,
      static_argnums...

  Example:
    topo = aot.gpu_topology("h100", "1x1x8")
    mesh = topo.mesh({"data": 2, "expert": 4})
    program = aot.compile(step, *abstract_args, topology=topo, mesh=mesh)
    program.peak_bytes, program.fits, program.custom_calls, program.flops
    aot.compile(f, x, topology="v5e:2x2").tpu_kernels  # {"my_kernel": 1}

  Raises:
    TypeError: `topology`, `mesh` or `xla_options` of the wrong kind.
    ValueError: an unknown topology name.
    HbmOomError: XLA's TPU compiler found the program over the HBM.
  """
  if xla_options is not None and not isinstance(xla_options, dict):
    raise TypeError(
        "xla_options must be None or a dict of XLA options (e.g. "
        f"aot.QUICK_OPTIONS), got {xla_options!r}."
    )
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
        "mesh must be None or a jax.sharding.Mesh (a Topology.mesh), got "
        f"{mesh!r}."
    )
  if isinstance(topology, str):
    topology = topology_lib.named_topology(topology)
  if not isinstance(topology, topology_lib.Topology):
    raise TypeError(
        "topology must be a Topology (aot.gpu_topology, aot.tpu_topology) "
        f"or a name such as 'v5e:2x2', got {topology!r}."
    )
  tpu = isinstance(topology, topology_lib.TpuTopology)
  options = {} if tpu else dict(DEVICELESS_OPTIONS)
  if not tpu or xla_options is not QUICK_OPTIONS:
    options.update(xla_options or {})
  if mesh is None and "in_shardings" not in jit_kwargs:
    # A one-device program's arguments without a sharding go to the
    # topology's first device (jit would place them on this host's CPU).
    first = jax.sharding.SingleDeviceSharding(topology.devices[0])
    args = jax.tree.map(
        lambda a: (
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=first)
            if isinstance(a, jax.ShapeDtypeStruct) and a.sharding is None
            else a
        ),
        args,
    )
  context_mesh = mesh if mesh is not None else topology.single_device_mesh()
  start = time.perf_counter()
  # Kernel lowerings (Pallas Triton, Mosaic GPU) read the GPU they compile
  # for from the context mesh's abstract device; the program's own mesh
  # names the target's devices, so its abstract mesh carries it.
  with _abstract_mesh(context_mesh):
    lowered = jax.jit(fn, **jit_kwargs).lower(*args)
  # The key hashes the whole lowered text (tens of MB for a full model):
  # only where the cache is on.
  key = None
  if results_cache.directory() is not None:
    key = results_cache.key(lowered.as_text(), options, topology, context_mesh)
    found = results_cache.read(key)
    if found is not None:
      return CompiledProgram(name=name, cached=True, **found)
  try:
    compiled = lowered.compile(options)
  except Exception as e:  # pylint: disable=broad-except
    oom = _hbm_oom(e) if tpu else None
    if oom is not None:
      raise oom from e
    raise
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  text = compiled.as_text()
  cost = _cost(compiled)
  program = CompiledProgram(
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
      tpu_kernels=tpu_kernels(text),
      kernel_vmem_bytes=max((v for _, v in _tpu_calls(text)), default=0),
      hlo_text=text,
      compiled=compiled,
  )
  if key is not None:
    results_cache.write(key, program.to_json() | {"hlo_text": text})
  return program


def tpu_kernels(hlo_text: str) -> dict[str, int]:
  """Mosaic TPU kernel name -> count of its calls in a compiled module.

  A kernel's name is the `name` its pallas_call was given (the function's
  otherwise): the symbol of the MLIR module in its call's backend config,
  which XLA keeps whatever it renames the instruction to.
  """
  return dict(collections.Counter(n for n, _ in _tpu_calls(hlo_text)))


def _tpu_calls(hlo_text: str):
  """(kernel name, scoped VMEM bytes) of each tpu_custom_call."""
  for line in hlo_text.splitlines():
    if f'custom_call_target="{TPU_CUSTOM_CALL}"' not in line:
      continue
    config = _BACKEND_CONFIG.search(line)
    try:
      parsed = json.loads(config.group(1)) if config else {}
    except ValueError:
      parsed = {}
    call = parsed.get("custom_call_config", {})
    name = _module_name(call.get("body", ""))
    if name is None:  # The instruction's own name, less XLA's ".N".
      match = re.match(r"\s*(?:ROOT\s+)?%([\w\-]+?)(?:\.\d+)?\s*=", line)
      name = match.group(1) if match else "?"
    vmem = sum(
        int(c.get("size", 0))
        for c in parsed.get("used_scoped_memory_configs", [])
    )
    yield name, vmem


def _module_name(body: str) -> str | None:
  """The kernel's name in a Mosaic module's base64 MLIR bytecode: the
  string after "sym_name", "function_type", "value" in its string table
  (the func's symbol), or None."""
  try:
    raw = base64.b64decode(body, validate=False)
  except ValueError:
    return None
  marker = b"sym_name\x00function_type\x00value\x00"
  at = raw.find(marker)
  if at < 0:
    return None
  match = _KERNEL_NAME.match(raw, at + len(marker))
  return match.group(0).decode() if match else None


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
