"""Running a recorded launch in Triton's interpreter on torch CPU tensors,
from JAX through `jax.pure_callback`: the backend's interpret mode."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any

import jax
import numpy as np

from backends.triton import launch_record
from backends.triton.launch_record import LaunchRecord

# dtypes torch.from_numpy cannot take: they travel as same-width integers
# and are reinterpreted on the torch side.
_TORCH_VIEWED = {
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}


# The interpreter patches triton.language module-wide while a kernel runs:
# one interpreted launch at a time.
LOCK = threading.RLock()
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
  fn = launch_record.python_function(kernel)
  if fn not in _INTERPRETED:
    _INTERPRETED[fn] = interpreter.InterpretedFunction(fn)
  return _INTERPRETED[fn]


@contextlib.contextmanager
def fixes():
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
  with LOCK:
    inputs = [_to_torch(torch, np.asarray(a)) for a in arrays]
    outputs = [_output_tensor(torch, o) for o in record.out_types]
    with fixes():
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


def interpret(record: LaunchRecord, args) -> tuple[jax.Array, ...]:
  _interpreter_modules()  # The ImportError here, not inside the callback.
  outputs = jax.pure_callback(
      functools.partial(run_interpreted, record),
      record.out_types,
      *args,
      **_callback_options(),
  )
  return tuple(outputs)
