"""Launches @triton.jit kernels from JAX: jax-triton, interpreter, recorder."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import os
import struct
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from backends.triton import configs as configs_lib

#     call(runner, kernel, args, out_types, grid, num_warps, num_stages, **c)
#       recording()   appends a LaunchRecord and returns zeros (no kernel runs)
#       mode "gpu"    jax_triton.triton_call (0.3's out_shape= or 0.4's
#                     out_type=), compiled by Triton for the attached GPU
#       "interpret"   jax.pure_callback into Triton's interpreter on torch CPU
#                     tensors, with DOT_F32=True
#     compile_for(record, capability)   triton.compile for sm_<capability> on
#                     any host: shared memory and registers of the cubin
#
# triton, torch and jax_triton are imported inside the functions that need
# them, so importing this module needs only jax.

MODES = ("gpu", "interpret")
# Resource limits of one program (a CUDA thread block) by compute capability
# (major * 10 + minor): shared memory a block may opt into, registers.
SHARED_BYTES_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_BLOCK = 64 * 1024
# Registers are allocated per warp in units of 256, i.e. per thread in
# multiples of 8.
REGISTER_ALLOCATION_UNIT = 8
# jax-triton tells Triton every array is 16-byte aligned; the AOT compile
# assumes the same, so that it vectorises loads as the launched kernel does.
POINTER_ALIGNMENT = 16

# Triton's pointer element types by numpy/ml_dtypes dtype name.
_TRITON_TYPES = {
    "bool": "i1",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}
# dtypes torch.from_numpy cannot take: they travel as same-width integers
# and are reinterpreted on the torch side.
_TORCH_VIEWED = {
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}


# --- The runner --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Runner:
  """How the kernels of one backend run: static and hashable.

  Attributes:
    mode: "gpu" (jax-triton, an NVIDIA GPU of compute capability >= 8.0)
      or "interpret" (Triton's interpreter on the CPU, through
      jax.pure_callback: slow, for tests at small shapes).
    configs: the caller's override (anything `configs.parse` takes),
      stored parsed: None or a `configs.Overrides`.
    generation: "sm90", "sm100" or None (TABLE's key; None uses the
      heuristic).
  """

  mode: str = "gpu"
  configs: Any = None
  generation: str | None = None

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(
          f"Runner.mode must be one of {MODES}, got {self.mode!r}."
      )
    object.__setattr__(self, "configs", configs_lib.parse(self.configs))
    configs_lib.check_generation(self.generation)

  @property
  def interpreting(self) -> bool:
    return self.mode == "interpret"

  def config(
      self, kind: str, m: int, k: int, n: int, num_groups: int, dtype
  ) -> configs_lib.Config:
    """`configs.choose` with this runner's override, generation and mode."""
    return configs_lib.choose(
        self.configs,
        self.generation,
        kind,
        m,
        k,
        n,
        num_groups,
        dtype,
        interpret=self.interpreting,
    )


def compilable() -> tuple[bool, str]:
  """(True, "") if Triton can compile the kernels here, else (False, why).

  With TRITON_INTERPRET=1, @triton.jit makes every kernel an
  InterpretedFunction, which Triton's interpreter runs and neither
  `triton.compile` nor jax-triton can compile (no cache_key, no params).
  The interpret mode needs no such variable (`_interpreted`).
  """
  try:
    # pylint: disable-next=g-import-not-at-top
    import triton
  except ImportError as e:
    return False, f"triton: not installed, nothing to compile ({e})."
  runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
  if runtime is not None:
    interpreting = bool(runtime.interpret)
  else:
    value = os.environ.get("TRITON_INTERPRET", "")
    interpreting = value.strip().lower() in ("1", "true", "yes", "on", "y")
  if interpreting:
    return False, (
        "triton: TRITON_INTERPRET is set, so @triton.jit made every kernel "
        "an interpreted function, which neither triton.compile nor "
        "jax-triton can compile; unset it to compile (interpret=True runs "
        "the kernels in the interpreter without it)."
    )
  return True, ""


def availability(runner: Runner) -> tuple[bool, str]:
  """(True, "") if `runner` can launch kernels here, else (False, why not)."""
  if runner.interpreting:
    missing = []
    for name in ("torch", "triton"):
      try:
        __import__(name)
      except ImportError:
        missing.append(name)
    if missing:
      return False, (
          "triton: interpret mode runs the kernels in Triton's interpreter "
          f"on torch CPU tensors; {' and '.join(missing)} "
          f"{'is' if len(missing) == 1 else 'are'} not installed "
          f"(pip install {' '.join(missing)})."
      )
    return True, ""
  reasons = []
  try:
    _jax_triton()
  except ImportError as e:
    reasons.append(str(e).removeprefix("triton: ").rstrip("."))
  else:
    ok, why = compilable()
    if not ok:
      reasons.append(why.removeprefix("triton: ").rstrip("."))
  device = jax.devices()[0]
  if device.platform != "gpu":
    reasons.append(
        f"no GPU: this device is {device.platform}; pass interpret=True to "
        "run the kernels in Triton's interpreter"
    )
  else:
    capability = _capability(device)
    if capability is None:
      reasons.append(
          f"{device.device_kind} reports no CUDA compute capability "
          "(the kernels are built for NVIDIA GPUs)"
      )
    elif capability < (8, 0):
      reasons.append(
          f"{device.device_kind} has compute capability "
          f"{'.'.join(map(str, capability))} < 8.0 (bf16 tensor cores)"
      )
  if reasons:
    return False, "triton: " + "; ".join(reasons) + "."
  return True, ""


def _capability(device) -> tuple[int, int] | None:
  text = str(getattr(device, "compute_capability", "") or "")
  parts = text.split(".")
  if len(parts) != 2 or not all(p.isdigit() for p in parts):
    return None
  return int(parts[0]), int(parts[1])


def _jax_triton():
  """The jax_triton module, or ImportError saying what to install."""
  cache_dir = os.environ.get("TRITON_CACHE_DIR")
  try:
    # pylint: disable-next=g-import-not-at-top
    import jax_triton
  except Exception as e:  # pylint: disable=broad-except
    # jax-triton 0.3 raises ValueError (not ImportError) on a jaxlib
    # without its GPU Triton library, e.g. a CPU-only install.
    raise ImportError(
        "triton: jax_triton is not importable "
        f"({type(e).__name__}: {e}); the GPU mode needs jax-triton and a "
        "CUDA build of jax (pip install '.[triton]')."
    ) from e
  finally:
    _restore_cache_dir(cache_dir)
  _adapt_dce_rule(jax_triton)
  return jax_triton


def _restore_cache_dir(cache_dir: str | None) -> None:
  """Puts TRITON_CACHE_DIR back as it was before jax-triton's import.

  jax-triton 0.3 sets it to "" at import: every later `triton.compile` in
  the process (`compile_kernel`) then fails with "Could not create or
  locate cache dir". 0.4 unsets it: Triton then writes to ~/.triton, not
  to the cache the caller chose (tools/test.sh's, inside the clone).
  """
  if cache_dir is not None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
  elif os.environ.get("TRITON_CACHE_DIR") == "":
    del os.environ["TRITON_CACHE_DIR"]


def _positional_count(fn) -> int:
  return sum(
      p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
      for p in inspect.signature(fn).parameters.values()
  )


def _adapt_dce_rule(jax_triton) -> None:
  """Registers jax-triton's DCE rule in the form this jax calls.

  jax 0.12 calls a primitive's dead-code rule as (used_outputs, live_ins,
  eqn); jax-triton 0.4.1 registers one taking (used_outputs, eqn), so any
  jitted program whose jaxpr holds a triton_call failed to lower
  ("_triton_kernel_call_dce_rule() takes 2 positional arguments but 3 were
  given"): the kernel primitives' eager path, and a direct triton_call.
  The adapter calls jax-triton's own rule; nothing changes where the two
  agree (jax 0.11, or a fixed jax-triton).
  """
  # pylint: disable-next=g-import-not-at-top
  from jax.interpreters import partial_eval as pe

  primitive = getattr(
      getattr(jax_triton, "triton_lib", None), "triton_kernel_call_p", None
  )
  rule = pe.dce_rules.get(primitive) if primitive is not None else None
  if rule is None or getattr(rule, "_dropless_adapted", False):
    return
  jax_arity = _positional_count(pe.dce_jaxpr_closed_call_rule)
  if jax_arity != 3 or _positional_count(rule) != 2:
    return

  def dce_rule(used_outputs, live_ins, eqn):
    del live_ins  # jax-triton's rule keeps every input and the call.
    return rule(used_outputs, eqn)

  dce_rule._dropless_adapted = True  # pylint: disable=protected-access
  pe.dce_rules[primitive] = dce_rule


def _out_keyword(jax_triton) -> str:
  """The name of triton_call's output-type argument: out_type (jax-triton
  0.4) or out_shape (0.3)."""
  parameters = inspect.signature(jax_triton.triton_call).parameters
  for name in ("out_type", "out_shape"):
    if name in parameters:
      return name
  version = getattr(jax_triton, "__version__", "?")
  raise ImportError(
      f"triton: jax_triton {version}'s triton_call takes neither out_type= "
      "nor out_shape=; the backend supports jax-triton 0.3 and 0.4."
  )


# --- Kernel parameters -------------------------------------------------------


def _python_function(kernel):
  """The Python function under a @triton.jit kernel (or an autotuner)."""
  fn = kernel
  while hasattr(fn, "fn"):
    fn = fn.fn
  return fn


def kernel_name(kernel) -> str:
  return _python_function(kernel).__name__


def parameters(kernel) -> list[tuple[str, bool, Any]]:
  """(name, is_constexpr, default or inspect.Parameter.empty) per parameter.

  A parameter is a constexpr when its annotation mentions constexpr, the
  rule Triton itself applies (annotations may be strings).
  """
  signature = inspect.signature(_python_function(kernel))
  return [
      (p.name, "constexpr" in str(p.annotation), p.default)
      for p in signature.parameters.values()
  ]


def _bind_constexprs(
    kernel, num_arrays: int, constexprs: dict, interpreting: bool
) -> dict:
  """Every constexpr of `kernel`, checked: given, defaulted or DOT_F32.

  DOT_F32 is True when interpreting (the interpreter's bf16 tl.dot is wrong,
  triton-lang/triton#11584); on the GPU it is the caller's, else False.
  """
  params = parameters(kernel)
  name = kernel_name(kernel)
  pointers = [p for p, is_constexpr, _ in params if not is_constexpr]
  if len(pointers) != num_arrays:
    raise ValueError(
        f"{name} takes {len(pointers)} arrays ({', '.join(pointers)}): the "
        f"inputs, then one per output; got {num_arrays}."
    )
  known = {p: default for p, is_constexpr, default in params if is_constexpr}
  unknown = sorted(set(constexprs) - set(known))
  if unknown:
    raise ValueError(
        f"{name} has the constexprs {sorted(known)}; got unknown {unknown}."
    )
  bound = dict(constexprs)
  if "DOT_F32" in known and (interpreting or "DOT_F32" not in bound):
    bound["DOT_F32"] = interpreting
  missing = []
  for p, default in known.items():
    if p in bound:
      continue
    if default is inspect.Parameter.empty:
      missing.append(p)
    else:
      bound[p] = getattr(default, "value", default)
  if missing:
    raise ValueError(f"{name} needs the constexprs {missing}.")
  return {p: bound[p] for p in known}


def _check_grid(grid) -> tuple[int, ...]:
  grid = (grid,) if isinstance(grid, int) else tuple(grid)
  if not 1 <= len(grid) <= 3 or not all(
      isinstance(g, (int, np.integer)) and not isinstance(g, bool) and g >= 0
      for g in grid
  ):
    raise ValueError(
        f"grid must be 1 to 3 non-negative Python ints, got {grid!r}."
    )
  return tuple(int(g) for g in grid)


# --- The recorder ------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class LaunchRecord:
  """One kernel launch as `call` would make it.

  Attributes:
    kernel: the @triton.jit kernel.
    in_avals: a ShapeDtypeStruct per input array, in order.
    out_types: a ShapeDtypeStruct per output, in order.
    grid: the launch grid.
    num_warps, num_stages: Triton's launch options.
    constexprs: every constexpr of the kernel by name, DOT_F32 included.
    mode: the runner's mode.
  """

  kernel: Any
  in_avals: tuple[jax.ShapeDtypeStruct, ...]
  out_types: tuple[jax.ShapeDtypeStruct, ...]
  grid: tuple[int, ...]
  num_warps: int
  num_stages: int
  constexprs: dict[str, Any]
  mode: str

  @property
  def name(self) -> str:
    return kernel_name(self.kernel)


_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "triton_launch_recorder", default=None
)


@contextlib.contextmanager
def recording():
  """Within it, `call` records each launch and returns zeros.

  Yields:
    The list the LaunchRecords are appended to. Launches happen when JAX
    traces the ops, so a jitted function records once per trace.
  """
  calls = []
  token = _RECORDER.set(calls)
  try:
    yield calls
  finally:
    _RECORDER.reset(token)


# --- call --------------------------------------------------------------------


def call(
    runner: Runner,
    kernel,
    args,
    out_types,
    grid,
    num_warps: int,
    num_stages: int,
    **constexprs,
) -> tuple[jax.Array, ...]:
  """Launches `kernel` on `args`; returns its outputs.

  Args:
    runner: how to run it (mode, configs, generation).
    kernel: a @triton.jit kernel whose array parameters are the inputs in
      order, then one pointer per output, then the constexprs.
    args: the input arrays (run-time values travel as arrays: a Python
      scalar would be compiled into the kernel).
    out_types: a ShapeDtypeStruct (or anything with shape and dtype) per
      output, or one of them.
    grid: the launch grid, 1 to 3 Python ints.
    num_warps, num_stages: Triton's launch options (ignored when
      interpreting).
    **constexprs: the kernel's constexprs; DOT_F32 is set by `call` when
      interpreting (see `_bind_constexprs`), defaults fill the rest.

  Returns:
    A tuple with one array per output. A grid with no programs returns
    zeros without launching (CUDA rejects an empty grid); so does a call
    whose outputs are all empty.
  """
  if not isinstance(runner, Runner):
    raise TypeError(
        f"runner must be a launch.Runner, got {type(runner).__name__}."
    )
  args = tuple(args)
  for i, arg in enumerate(args):
    if not (hasattr(arg, "shape") and hasattr(arg, "dtype")):
      raise TypeError(
          f"{kernel_name(kernel)}: argument {i} must be an array (run-time "
          f"values travel as arrays), got {type(arg).__name__}."
      )
  if hasattr(out_types, "shape"):
    out_types = (out_types,)
  out_types = tuple(
      jax.ShapeDtypeStruct(tuple(o.shape), jnp.dtype(o.dtype))
      for o in out_types
  )
  grid = _check_grid(grid)
  bound = _bind_constexprs(
      kernel, len(args) + len(out_types), constexprs, runner.interpreting
  )
  record = LaunchRecord(
      kernel=kernel,
      in_avals=tuple(
          jax.ShapeDtypeStruct(tuple(a.shape), jnp.dtype(a.dtype)) for a in args
      ),
      out_types=out_types,
      grid=grid,
      num_warps=num_warps,
      num_stages=num_stages,
      constexprs=bound,
      mode=runner.mode,
  )
  calls = _RECORDER.get()
  empty = math.prod(grid) == 0 or all(
      math.prod(o.shape) == 0 for o in out_types
  )
  if calls is not None or empty:
    if calls is not None:
      calls.append(record)
    return tuple(jnp.zeros(o.shape, o.dtype) for o in out_types)
  if runner.interpreting:
    return _interpret(record, args)
  return _triton_call(record, args)


def _triton_call(record: LaunchRecord, args) -> tuple[jax.Array, ...]:
  jax_triton = _jax_triton()
  outputs = jax_triton.triton_call(
      *args,
      kernel=record.kernel,
      grid=record.grid,
      num_warps=record.num_warps,
      num_stages=record.num_stages,
      **{_out_keyword(jax_triton): list(record.out_types)},
      **_target_options(jax_triton),
      **record.constexprs,
  )
  if hasattr(outputs, "shape"):
    return (outputs,)
  return tuple(outputs)


# --- The GPU compiled for ----------------------------------------------------

# Compute capability by GPU model, for a GPU known by its kind alone: the
# abstract device of a topology that `moe_core.aot` compiles for. Longer
# names first ("GB200" before "B200").
_KIND_CAPABILITIES = (
    ("GB200", 100),
    ("GB300", 103),
    ("GH200", 90),
    ("B200", 100),
    ("B300", 103),
    ("H100", 90),
    ("H200", 90),
    ("H800", 90),
)


def target_device():
  """The abstract GPU the program is being lowered for, or None.

  `moe_core.aot.compile` lowers inside the target topology's abstract mesh,
  whose abstract device names the GPU. jax-triton would otherwise compile
  each kernel for the local GPU (none on a CPU host, or another model).
  """
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  device = getattr(get(), "abstract_device", None) if get else None
  if device is None or getattr(device, "platform", None) not in ("gpu", "cuda"):
    return None
  return device


def target_capability() -> int | None:
  """The compute capability of the target GPU (90 for an H100), or None.

  None when no target is set or its kind is not one of
  `_KIND_CAPABILITIES`: jax-triton then asks the local GPU.
  """
  device = target_device()
  kind = str(getattr(device, "device_kind", "") or "")
  for fragment, capability in _KIND_CAPABILITIES:
    if fragment in kind:
      return capability
  return None


@functools.lru_cache(maxsize=None)
def _plugin_ptx_version() -> int | None:
  """The newest PTX ISA that XLA's CUDA plugin compiles, e.g. 90.

  jax-triton hands XLA the kernels' PTX, which XLA assembles with the PTX
  compiler of the CUDA its plugin was built with (or a newer ptxas): PTX
  ISA 9.0 for CUDA 13.0, by Triton's own CUDA -> PTX mapping. None when
  that is unknown (no CUDA plugin).
  """
  try:
    # pylint: disable=g-import-not-at-top
    from jax._src.lib import cuda_versions
    from triton.backends.nvidia import compiler as nvidia
    # pylint: enable=g-import-not-at-top

    build = int(cuda_versions.cuda_runtime_build_version())
  except Exception:  # pylint: disable=broad-except
    return None
  if build <= 0:
    return None
  return nvidia.ptx_get_version(f"{build // 1000}.{build % 1000 // 10}")


@functools.lru_cache(maxsize=None)
def _triton_ptx_version(capability: int) -> int | None:
  """The PTX ISA Triton emits for sm_<capability> by default (its ptxas')."""
  try:
    # pylint: disable-next=g-import-not-at-top
    from triton.backends.nvidia import compiler as nvidia

    return nvidia.ptx_get_version(nvidia.get_ptxas(capability).version)
  except Exception:  # pylint: disable=broad-except
    return None


def ptx_version(capability: int | None) -> int | None:
  """The PTX ISA to ask Triton for, or None to leave Triton's default.

  Triton labels its PTX with the ISA of the ptxas it ships (9.4 from
  Triton 3.9's CUDA 13.4 ptxas), but XLA assembles it with the CUDA
  plugin's (9.0 for CUDA 13.0), which refuses a newer ISA ("Unsupported
  .version 9.4; current version is '9.0'"). Asking Triton for the
  plugin's ISA keeps it within what both accept.
  """
  plugin = _plugin_ptx_version()
  triton_default = _triton_ptx_version(capability or 90)
  if plugin is None or triton_default is None or triton_default <= plugin:
    return None
  return plugin


def _target_options(jax_triton) -> dict:
  """triton_call's compute_capability and PTX ISA for the target GPU."""
  parameters = inspect.signature(jax_triton.triton_call).parameters
  capability = target_capability()
  options = {}
  if capability is not None and "compute_capability" in parameters:
    options["compute_capability"] = capability
  ptx = ptx_version(capability)
  if ptx is not None and "backend_options" in parameters:
    options["backend_options"] = {"ptx_version": ptx}
  return options


# --- The interpreter path ----------------------------------------------------

# The interpreter patches triton.language module-wide while a kernel runs:
# one interpreted launch at a time.
_INTERPRETER_LOCK = threading.RLock()
_INTERPRETED: dict[Any, Any] = {}


def _interpreter_modules():
  """(torch, triton.runtime.interpreter), or ImportError naming them."""
  try:
    # pylint: disable=g-import-not-at-top
    import torch
    from triton.runtime import interpreter
    from triton.runtime import jit as triton_jit
    # pylint: enable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "triton: interpret mode runs the kernels in Triton's interpreter on "
        f"torch CPU tensors; {e} (pip install torch triton)."
    ) from e
  return torch, interpreter, triton_jit


def _interpreted(kernel):
  """Triton's InterpretedFunction over a kernel's Python function, cached."""
  _, interpreter, _ = _interpreter_modules()
  fn = _python_function(kernel)
  if fn not in _INTERPRETED:
    _INTERPRETED[fn] = interpreter.InterpretedFunction(fn)
  return _INTERPRETED[fn]


@contextlib.contextmanager
def _interpreter_fixes():
  """Three corrections to Triton's interpreter (3.6 to 3.9), for one run.

  Device functions: without TRITON_INTERPRET=1 at import, every @triton.jit
  function (the kernels' helpers, and tl.zeros and the like from Triton's
  standard library) is a JITFunction, which refuses to be called from
  Python. A call on one goes to its interpreted twin instead, as if the
  variable had been set at import; unlike InterpretedFunction.__call__, it
  undoes its patches of triton.language when it returns (left in place,
  those of tl.core break every later triton.compile in the process).

  Rounding: the interpreter casts float32 to bfloat16 by truncation; the GPU
  (and XLA) round to nearest even, which the cast here does too, through
  ml_dtypes.

  Loop bounds: Triton 3.6 turns a scalar into a Python int with int() of
  its one-element array, which NumPy 2.4 refuses ("only 0-dimensional
  arrays can be converted to Python scalars"), so every loop with a
  run-time bound failed; 3.8 and 3.9 take the element first, as this does.
  """
  _, interpreter, triton_jit = _interpreter_modules()
  # pylint: disable=g-import-not-at-top
  import ml_dtypes
  import triton.language as tl
  # pylint: enable=g-import-not-at-top
  original_call = triton_jit.JITFunction.__call__
  builder = interpreter.InterpreterBuilder
  original_cast = builder.cast_impl
  original_patch_lang = interpreter._patch_lang  # pylint: disable=protected-access

  def patch_lang(fn):
    scope = original_patch_lang(fn)
    if hasattr(scope, "set_attr"):  # Restored with the interpreter's own.
      scope.set_attr(
          tl.core.tensor,
          "__index__",
          lambda self: int(np.asarray(self.handle.data).item()),
      )
    return scope

  def device_call(self, *args, **kwargs):
    interpreted = _interpreted(self)
    scope = interpreter._patch_lang(interpreted.fn)  # pylint: disable=protected-access
    try:
      return interpreted.rewrite()(*args, **kwargs)
    finally:
      if hasattr(scope, "restore"):
        scope.restore()

  def cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
      data = np.asarray(src.data, np.float32).astype(ml_dtypes.bfloat16)
      return interpreter.TensorHandle(data.view(np.uint16), dst_type.scalar)
    return original_cast(self, src, dst_type)

  triton_jit.JITFunction.__call__ = device_call
  builder.cast_impl = cast_impl
  interpreter._patch_lang = patch_lang  # pylint: disable=protected-access
  try:
    yield
  finally:
    triton_jit.JITFunction.__call__ = original_call
    builder.cast_impl = original_cast
    interpreter._patch_lang = original_patch_lang  # pylint: disable=protected-access


def _to_torch(torch, array: np.ndarray):
  """A torch CPU tensor holding a writable copy of `array`."""
  array = np.array(array, copy=True, order="C")
  viewed = _TORCH_VIEWED.get(array.dtype.name)
  if viewed is None:
    return torch.from_numpy(array)
  carrier = np.dtype(f"uint{8 * array.dtype.itemsize}")
  return torch.from_numpy(array.view(carrier)).view(getattr(torch, viewed))


def _output_tensor(torch, out_type):
  """An output buffer: NaN (floats) or the minimum (integers), so that an
  element no program writes shows up in the result."""
  dtype = np.dtype(out_type.dtype)
  name = _TORCH_VIEWED.get(dtype.name, dtype.name)
  tensor = torch.empty(tuple(out_type.shape), dtype=getattr(torch, name))
  if tensor.is_floating_point():
    tensor.fill_(float("nan"))
  elif tensor.dtype != torch.bool:
    tensor.fill_(torch.iinfo(tensor.dtype).min)
  return tensor


def _to_numpy(torch, tensor, dtype) -> np.ndarray:
  dtype = np.dtype(dtype)
  if dtype.name not in _TORCH_VIEWED:
    return tensor.numpy()
  carrier = getattr(torch, f"uint{8 * dtype.itemsize}")
  return tensor.view(carrier).numpy().view(dtype)


def run_interpreted(record: LaunchRecord, *arrays) -> tuple[np.ndarray, ...]:
  """Runs `record`'s launch in Triton's interpreter on numpy `arrays`.

  Args:
    record: the launch (kernel, grid, constexprs, out_types).
    *arrays: the inputs as numpy arrays (bfloat16 and float8 as ml_dtypes).

  Returns:
    The outputs as numpy arrays of `record.out_types`' dtypes.
  """
  torch, _, _ = _interpreter_modules()
  with _INTERPRETER_LOCK:
    inputs = [_to_torch(torch, np.asarray(a)) for a in arrays]
    outputs = [_output_tensor(torch, o) for o in record.out_types]
    with _interpreter_fixes():
      _interpreted(record.kernel)[record.grid](
          *inputs, *outputs, **record.constexprs
      )
  return tuple(
      _to_numpy(torch, t, o.dtype) for t, o in zip(outputs, record.out_types)
  )


def _callback_options() -> dict:
  parameters = inspect.signature(jax.pure_callback).parameters
  if "vmap_method" in parameters:
    # Batched (vmapped) calls run the kernel once per element.
    return {"vmap_method": "sequential"}
  return {"vectorized": False}


def _interpret(record: LaunchRecord, args) -> tuple[jax.Array, ...]:
  _interpreter_modules()  # The ImportError here, not inside the callback.
  outputs = jax.pure_callback(
      functools.partial(run_interpreted, record),
      record.out_types,
      *args,
      **_callback_options(),
  )
  return tuple(outputs)


# --- Ahead-of-time compilation ---------------------------------------------


def triton_type(dtype) -> str:
  """Triton's element type name of a dtype ("bf16", "fp32", "i32", ...)."""
  name = np.dtype(dtype).name
  if name not in _TRITON_TYPES:
    raise ValueError(
        f"No Triton pointer type for {name}; known: {sorted(_TRITON_TYPES)}."
    )
  return _TRITON_TYPES[name]


@dataclasses.dataclass(frozen=True)
class CompiledInfo:
  """What one compiled kernel needs of the GPU.

  Attributes:
    name: the kernel's name.
    capability: the target, e.g. 90 for sm_90.
    num_warps, num_stages: the launch options compiled with.
    shared_bytes: dynamic shared memory one program requests (Triton's
      metadata: what the launch asks the driver for).
    registers: registers per thread (the cubin's EIATTR_REGCOUNT).
    local_bytes: per-thread stack frame (spills), from EIATTR_FRAME_SIZE.
  """

  name: str
  capability: int
  num_warps: int
  num_stages: int
  shared_bytes: int
  registers: int
  local_bytes: int

  @property
  def threads(self) -> int:
    return 32 * self.num_warps

  def violations(self) -> list[str]:
    """The GPU limits this kernel breaks; empty if it fits."""
    if self.capability not in SHARED_BYTES_LIMIT:
      raise ValueError(
          f"No limits known for capability {self.capability}; known: "
          f"{sorted(SHARED_BYTES_LIMIT)}."
      )
    found = []
    shared_limit = SHARED_BYTES_LIMIT[self.capability]
    if self.shared_bytes > shared_limit:
      found.append(f"shared memory {self.shared_bytes} > {shared_limit} bytes")
    if self.registers > MAX_REGISTERS_PER_THREAD:
      found.append(
          f"{self.registers} registers per thread > {MAX_REGISTERS_PER_THREAD}"
      )
    unit = REGISTER_ALLOCATION_UNIT
    per_block = -(-self.registers // unit) * unit * self.threads
    if per_block > REGISTERS_PER_BLOCK:
      found.append(
          f"{per_block} registers per block ({self.registers} x "
          f"{self.threads} threads) > {REGISTERS_PER_BLOCK}"
      )
    return found


def compile_kernel(
    kernel,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    capability: int,
    num_warps: int,
    num_stages: int,
) -> CompiledInfo:
  """triton.compile for sm_<capability>, on any host (no GPU needed).

  Args:
    kernel: a @triton.jit kernel.
    signature: {parameter: "*bf16" | "*fp32" | ... | "constexpr"} for every
      parameter.
    constexprs: the constexpr values by name.
    capability: 90 (Hopper), 100 (Blackwell), ...
    num_warps, num_stages: Triton's options.

  Returns:
    The kernel's CompiledInfo.
  """
  # pylint: disable=g-import-not-at-top
  import triton
  from triton.backends import compiler as triton_backends
  # pylint: enable=g-import-not-at-top

  names = [p for p, _, _ in parameters(kernel)]
  # Pointers get the alignment jax-triton promises (attrs keyed by index).
  attrs = {
      (names.index(p),): [["tt.divisibility", POINTER_ALIGNMENT]]
      for p, kind in signature.items()
      if kind.startswith("*")
  }
  source = triton.compiler.ASTSource(
      fn=kernel,
      signature=dict(signature),
      constexprs=dict(constexprs),
      attrs=attrs,
  )
  # Not while an interpreted launch (a host callback, maybe still running
  # on another thread) has triton.language patched: the code generator
  # would meet the interpreter's functions ("'value' object has no
  # attribute 'dtype'").
  with _INTERPRETER_LOCK:
    compiled = triton.compile(
        source,
        target=triton_backends.GPUTarget("cuda", capability, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
  name = compiled.metadata.name
  registers, frame = cubin_resources(compiled.asm["cubin"], name)
  return CompiledInfo(
      name=name,
      capability=capability,
      num_warps=num_warps,
      num_stages=num_stages,
      shared_bytes=int(compiled.metadata.shared),
      registers=registers,
      local_bytes=frame,
  )


def compile_for(record: LaunchRecord, capability: int) -> CompiledInfo:
  """Compiles a recorded launch (its dtypes, constexprs and options)."""
  types = iter(record.in_avals + record.out_types)
  signature = {}
  for p, is_constexpr, _ in parameters(record.kernel):
    signature[p] = (
        "constexpr" if is_constexpr else "*" + triton_type(next(types).dtype)
    )
  return compile_kernel(
      record.kernel,
      signature,
      record.constexprs,
      capability,
      record.num_warps,
      record.num_stages,
  )


# EIATTR attributes of a cubin's .nv.info section (CUDA's ELF notes): each
# record is a format byte, an attribute byte, then per format: nothing, one
# byte or a 16-bit value (all padded to 4 bytes), or (format 4) a 16-bit
# size and that many bytes. REGCOUNT and FRAME_SIZE hold (symbol index,
# value), two 32-bit words.
_EIFMT_SVAL = 0x04
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F


def _elf_sections(cubin: bytes) -> list[tuple[str, tuple]]:
  """(name, header) of each section of a 64-bit little-endian ELF file.

  header: (name, type, flags, addr, offset, size, link, info, align,
  entsize), as Elf64_Shdr.
  """
  if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
    raise ValueError("Not a 64-bit little-endian ELF file (a cubin).")
  (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
  entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
  headers = [
      struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize)
      for i in range(count)
  ]
  names_offset = headers[names_index][4]

  def string(offset, base=names_offset):
    end = cubin.index(b"\0", base + offset)
    return cubin[base + offset : end].decode()

  return [(string(h[0]), h) for h in headers]


def cubin_resources(cubin: bytes, kernel: str) -> tuple[int, int]:
  """(registers per thread, stack frame bytes) of `kernel` in a cubin.

  Read from the ELF file itself (the .nv.info attributes that cuobjdump
  --dump-resource-usage prints), so no CUDA tool or GPU is needed.
  """
  sections = _elf_sections(cubin)
  by_name = dict(sections)
  symtab = by_name[".symtab"]
  strtab = sections[symtab[6]][1]
  symbol = None
  for i in range(symtab[5] // 24):
    (name_offset,) = struct.unpack_from("<I", cubin, symtab[4] + 24 * i)
    end = cubin.index(b"\0", strtab[4] + name_offset)
    if cubin[strtab[4] + name_offset : end].decode() == kernel:
      symbol = i
      break
  if symbol is None:
    raise ValueError(f"No symbol {kernel!r} in the cubin.")
  info = by_name[".nv.info"]
  data = cubin[info[4] : info[4] + info[5]]
  values = {}
  at = 0
  while at + 4 <= len(data):
    fmt, attr = data[at], data[at + 1]
    if fmt != _EIFMT_SVAL:
      at += 4
      continue
    (size,) = struct.unpack_from("<H", data, at + 2)
    if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
      owner, value = struct.unpack_from("<II", data, at + 4)
      if owner == symbol:
        values[attr] = value
    at += 4 + size
  if _EIATTR_REGCOUNT not in values:
    raise ValueError(f"The cubin has no register count for {kernel!r}.")
  return values[_EIATTR_REGCOUNT], values.get(_EIATTR_FRAME_SIZE, 0)
