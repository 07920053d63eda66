"""A kernel launch as data: its kernel's parameters, `LaunchRecord`, and
`recording()`, under which `launch.call` records launches instead of
running them."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from typing import Any

import jax
import numpy as np

# --- Kernel parameters -------------------------------------------------------


def python_function(kernel):
  """The Python function under a @triton.jit kernel (or an autotuner)."""
  fn = kernel
  while hasattr(fn, "fn"):
    fn = fn.fn
  return fn


def kernel_name(kernel) -> str:
  return python_function(kernel).__name__


def parameters(kernel) -> list[tuple[str, bool, Any]]:
  """(name, is_constexpr, default or inspect.Parameter.empty) per parameter.

  A parameter is a constexpr when its annotation mentions constexpr, the
  rule Triton itself applies (annotations may be strings).
  """
  signature = inspect.signature(python_function(kernel))
  return [
      (p.name, "constexpr" in str(p.annotation), p.default)
      for p in signature.parameters.values()
  ]


def bind_constexprs(
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


def check_grid(grid) -> tuple[int, ...]:
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
    mode: how it runs, "gpu" or "interpret" (the runner's mode, "auto"
      resolved).
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


def active_recording() -> list | None:
  """The list `recording()` appends to, or None outside it."""
  return _RECORDER.get()
