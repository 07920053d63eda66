"""Finds, loads and registers the cpu backend's FFI library, never raising.

The library (backends/cpu/cc/*.cc) is built by `pip install .`
(setup.py: backends/cpu/_ffi*.so) or by Bazel (`bazel build //backends/cpu`:
backends/cpu/libdropless_cpu.so); DROPLESS_CPU_LIBRARY names another file.
`load()` registers its custom-call targets with XLA's CPU platform once per
process and returns `(True, "")`, or `(False, why)` when there is no
library, or none that loads and suits the running jaxlib. Any CPU runs
it: the library picks its kernels at run time (cpuid on x86-64;
`kernels()` says which), and DROPLESS_CPU_KERNELS=portable (or avx2,
avx512, avx512-bf16) lowers the choice; DROPLESS_CPU_KERNELS=amx-emulated
runs the AMX kernel's bfloat16 path on an emulated tile unit, on any CPU
(for tests).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import jax
import jaxlib.version

# The custom-call targets. The suffix is the calling convention's version:
# a change to the operands, attributes or semantics registers new names, so
# that a program exported against the old ones fails to find its target
# instead of computing something else.
GMM_TARGET = "dropless_cpu_gmm_v1"
TGMM_TARGET = "dropless_cpu_tgmm_v1"
TARGETS = (GMM_TARGET, TGMM_TARGET)
# Environment variable naming the library to load instead of the built one.
LIBRARY_ENV = "DROPLESS_CPU_LIBRARY"

_HERE = os.path.dirname(os.path.abspath(__file__))
_BUILD_HINT = (
    "build it with `pip install .` (needs g++) or `bazel build "
    "//backends/cpu:libdropless_cpu.so` (tools/main.sh does)"
)


def library_paths() -> list[str]:
  """What `load` tries, in order: $DROPLESS_CPU_LIBRARY alone if set, else
  the libraries built here (pip's `_ffi*.so`, one per Python version built
  in place; Bazel's `libdropless_cpu.so` in a test's runfiles), then the
  one `bazel build` left in the source tree's bazel-bin (tools/main.sh)."""
  explicit = os.environ.get(LIBRARY_ENV)
  if explicit:
    return [explicit]
  found = []
  for pattern in ("_ffi*.so", "libdropless_cpu.so"):
    found += sorted(glob.glob(os.path.join(_HERE, pattern)))
  bazel_bin = os.path.join(
      _HERE, "..", "..", "bazel-bin", "backends", "cpu", "libdropless_cpu.so"
  )
  if os.path.exists(bazel_bin):
    found.append(os.path.normpath(bazel_bin))
  return found


def _version(text: str) -> tuple[int, ...]:
  """(0, 10, 2) from "0.10.2"; () if it is not a version."""
  parts = []
  for part in text.split("."):
    if not part.isdigit():
      break
    parts.append(int(part))
  return tuple(parts)


def _incompatible(lib, path: str) -> str:
  """Why the library must not be registered with this jaxlib, or "".

  XLA refuses a handler built against FFI headers newer than its own, and
  the refusal surfaces when the CPU client starts, breaking every CPU
  computation of the process: so a library built for a newer jaxlib than
  the running one is never registered. Older ones are accepted.
  """
  try:
    built_for = lib.DroplessCpuBuiltForJaxlib
  except AttributeError:
    return f"cpu: {path} does not say which jaxlib it was built for."
  built_for.restype = ctypes.c_char_p
  built = built_for().decode()
  running = jaxlib.version.__version__
  if not _version(built):
    return f"cpu: {path} does not say which jaxlib it was built for."
  if _version(built) > _version(running):
    return (
        f"cpu: {path} was built against jaxlib {built}'s FFI headers, newer "
        f"than the running jaxlib {running}, which would refuse it; "
        f"{_BUILD_HINT} against this jaxlib."
    )
  return ""


def _open(path: str):
  """(the loaded library, "") if `path` can be registered here, else
  (None, why not)."""
  try:
    lib = ctypes.CDLL(path)
  except OSError as e:
    return None, f"cpu: cannot load {path}: {e}; {_BUILD_HINT}."
  try:
    for symbol in ("DroplessCpuGmm", "DroplessCpuTgmm", "DroplessCpuKernels"):
      getattr(lib, symbol)
  except AttributeError as e:
    return None, f"cpu: {path} is not the dropless library: {e}."
  why = _incompatible(lib, path)
  if why:
    return None, why
  return lib, ""


_loaded = []  # The registered library, once `load` succeeds.


@functools.cache
def load() -> tuple[bool, str]:
  """(True, "") once the targets are registered, else (False, why not)."""
  paths = library_paths()
  if not paths:
    return False, f"cpu: the FFI library was not built; {_BUILD_HINT}."
  reasons = []
  for path in paths:
    lib, why = _open(path)
    if lib is None:
      reasons.append(why)
      continue
    try:
      for name, handler in (
          (GMM_TARGET, lib.DroplessCpuGmm),
          (TGMM_TARGET, lib.DroplessCpuTgmm),
      ):
        jax.ffi.register_ffi_target(
            name, jax.ffi.pycapsule(handler), platform="cpu"
        )
    except Exception as e:  # pylint: disable=broad-exception-caught
      return False, f"cpu: registering {path} with XLA failed: {e}."
    _loaded.append(lib)
    return True, ""
  return False, " ".join(reasons)


def _call_name(symbol: str, *args) -> str:
  """The string the loaded library's `symbol(*args)` returns; "" if none is
  loaded."""
  if not load()[0]:
    return ""
  fn = getattr(_loaded[0], symbol)
  fn.restype = ctypes.c_char_p
  return fn(*args).decode()


def kernels() -> str:
  """The kernel set the loaded library runs on this CPU: "amx",
  "avx512-bf16", "avx512", "avx2", "portable" (backends/cpu/cc/gemm.h) or,
  only where asked for, "amx-emulated"; "" if none is loaded."""
  return _call_name("DroplessCpuKernels")


def best_kernels() -> str:
  """The best kernel set this CPU runs, whatever DROPLESS_CPU_KERNELS asked
  for; "" if no library is loaded."""
  return _call_name("DroplessCpuBestKernels")


def use_kernels(name: str) -> str:
  """Runs the kernel set `name` from now on in this process (tests: every set
  of the CPU in one process); never one the CPU lacks (then its best;
  "amx-emulated" runs on every CPU). Returns the set now selected; "" if
  no library is loaded."""
  return _call_name("DroplessCpuUseKernels", name.encode())
