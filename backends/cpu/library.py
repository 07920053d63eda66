"""Finds, loads and registers the cpu backend's FFI library, never raising.

The library (cc/grouped_gemm.cc, cc/gemm.cc) is built by `pip install .`
(setup.py: backends/cpu/_ffi*.so) or by Bazel (`bazel build //backends/cpu`:
backends/cpu/libdropless_cpu.so); DROPLESS_CPU_LIBRARY names another file.
`load()` registers its custom-call targets with XLA's CPU platform once per
process and returns `(True, "")`, or `(False, why)` when there is no
library, it does not load, or this CPU lacks the instructions it uses.
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
    "//backends/cpu:libdropless_cpu.so`"
)


def library_path() -> str | None:
  """The library `load` uses: $DROPLESS_CPU_LIBRARY, else one built here."""
  explicit = os.environ.get(LIBRARY_ENV)
  if explicit:
    return explicit
  for pattern in ("_ffi*.so", "libdropless_cpu.so"):
    found = sorted(glob.glob(os.path.join(_HERE, pattern)))
    if found:
      return found[0]
  return None


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


@functools.cache
def load() -> tuple[bool, str]:
  """(True, "") once the targets are registered, else (False, why not)."""
  path = library_path()
  if path is None:
    return False, f"cpu: the FFI library was not built; {_BUILD_HINT}."
  try:
    lib = ctypes.CDLL(path)
  except OSError as e:
    return False, f"cpu: cannot load {path}: {e}; {_BUILD_HINT}."
  try:
    missing_features = lib.DroplessCpuMissingFeatures
    gmm, tgmm = lib.DroplessCpuGmm, lib.DroplessCpuTgmm
  except AttributeError as e:
    return False, f"cpu: {path} is not the dropless library: {e}."
  why = _incompatible(lib, path)
  if why:
    return False, why
  missing_features.restype = ctypes.c_char_p
  missing = missing_features().decode()
  if missing:
    return False, (
        f"cpu: the kernels need AVX-512 (F, BW, VL, BF16) and FMA; this CPU "
        f"lacks {missing}."
    )
  try:
    for name, handler in ((GMM_TARGET, gmm), (TGMM_TARGET, tgmm)):
      jax.ffi.register_ffi_target(
          name, jax.ffi.pycapsule(handler), platform="cpu"
      )
  except Exception as e:  # pylint: disable=broad-exception-caught
    return False, f"cpu: registering {path} with XLA failed: {e}."
  return True, ""
