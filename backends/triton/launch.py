"""Launches @triton.jit kernels from JAX: jax-triton on a GPU, Triton's
interpreter on the CPU (interpreter.py), or the recorder (launch_record.py)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from backends.triton import configs as configs_lib
from backends.triton import interpreter
from backends.triton import launch_record
from backends.triton import target
from moe_core.kernels import gpu
from moe_core.kernels import interpret as interpret_lib

#     call(runner, kernel, args, out_types, grid, num_warps, num_stages, **c)
#       launch_record.recording()   appends a LaunchRecord, returns zeros
#       mode "gpu"    jax_triton.triton_call (0.3's out_shape= or 0.4's
#                     out_type=), compiled by Triton for the attached GPU
#       "interpret"   jax.pure_callback into Triton's interpreter on torch CPU
#                     tensors, with DOT_F32=True
#       "auto"        "gpu" when the program is lowered for a GPU, else
#                     "interpret" (`moe_core.kernels.interpret`)
#
# triton, torch and jax_triton are imported inside the functions that need
# them, so importing this module needs only jax.

MODES = ("gpu", "interpret", "auto")

# --- The runner --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Runner:
  """How the kernels of one backend run: static and hashable.

  Attributes:
    mode: "gpu" (jax-triton, an NVIDIA GPU of compute capability >= 8.0),
      "interpret" (Triton's interpreter on the CPU, through
      jax.pure_callback: slow, for tests at small shapes) or "auto" (one
      of them, by the platform the program is lowered for, when a kernel
      is traced: `moe_core.kernels.interpret`).
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
    """Whether the kernels traced now run in the interpreter."""
    if self.mode == "auto":
      return interpret_lib.interprets(interpret_lib.AUTO)
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

  def call(
      self,
      kernel,
      args,
      out_types,
      grid,
      config: configs_lib.Config,
      **constexprs,
  ) -> tuple[jax.Array, ...]:
    """`call` on this runner with `config`'s num_warps and num_stages.

    DOT_F32 is left to `call`: True in the interpreter, whose bf16 tl.dot
    is wrong (triton-lang/triton#11584), False on the GPU so that bf16
    feeds the tensor cores.
    """
    return call(
        self,
        kernel,
        args,
        out_types,
        grid,
        config.num_warps,
        config.num_stages,
        **constexprs,
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
    capability = gpu.probe(device).capability
    if capability is None:
      reasons.append(
          f"{device.device_kind} reports no CUDA compute capability "
          "(the kernels are built for NVIDIA GPUs)"
      )
    elif capability < 80:
      reasons.append(
          f"{device.device_kind} has compute capability "
          f"{gpu.capability_text(capability)} < 8.0 (bf16 tensor cores)"
      )
  if reasons:
    return False, "triton: " + "; ".join(reasons) + "."
  return True, ""


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
  the process (`backends.testing.triton_aot_compile`) then fails with "Could
  not create or locate cache dir". 0.4 unsets it: Triton then writes to
  ~/.triton, not to the cache the caller chose (tools/test.sh's, inside the
  clone).
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
          f"{launch_record.kernel_name(kernel)}: argument {i} must be an "
          "array (run-time values travel as arrays), got "
          f"{type(arg).__name__}."
      )
  if hasattr(out_types, "shape"):
    out_types = (out_types,)
  out_types = tuple(
      jax.ShapeDtypeStruct(tuple(o.shape), jnp.dtype(o.dtype))
      for o in out_types
  )
  grid = launch_record.check_grid(grid)
  bound = launch_record.bind_constexprs(
      kernel, len(args) + len(out_types), constexprs, runner.interpreting
  )
  record = launch_record.LaunchRecord(
      kernel=kernel,
      in_avals=tuple(
          jax.ShapeDtypeStruct(tuple(a.shape), jnp.dtype(a.dtype)) for a in args
      ),
      out_types=out_types,
      grid=grid,
      num_warps=num_warps,
      num_stages=num_stages,
      constexprs=bound,
      mode="interpret" if runner.interpreting else "gpu",
  )
  calls = launch_record.active_recording()
  empty = math.prod(grid) == 0 or all(
      math.prod(o.shape) == 0 for o in out_types
  )
  if calls is not None or empty:
    if calls is not None:
      calls.append(record)
    return tuple(jnp.zeros(o.shape, o.dtype) for o in out_types)
  if runner.interpreting:
    return interpreter.interpret(record, args)
  return _triton_call(record, args)


def _triton_call(
    record: launch_record.LaunchRecord, args
) -> tuple[jax.Array, ...]:
  jax_triton = _jax_triton()
  outputs = jax_triton.triton_call(
      *args,
      kernel=record.kernel,
      grid=record.grid,
      num_warps=record.num_warps,
      num_stages=record.num_stages,
      **{_out_keyword(jax_triton): list(record.out_types)},
      **target.options(jax_triton),
      **record.constexprs,
  )
  if hasattr(outputs, "shape"):
    return (outputs,)
  return tuple(outputs)
