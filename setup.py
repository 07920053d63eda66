"""Builds the cpu backend's FFI library during `pip install .`.

Everything else about the package is in pyproject.toml; this file exists
only because a C++ build needs jaxlib's FFI headers, whose path is found at
build time (`_jaxlib`). The library is optional: without a C++17 compiler,
or if it fails to compile, the install goes on without it, says so, and
the cpu backend reports `availability() == (False, why)`.
"""

import os
import sys

import setuptools
from setuptools.command import build_ext


def _jaxlib():
  """(include dir, version) of the build environment's jaxlib, or None.

  That jaxlib is the one pyproject.toml's build requirements install (the
  oldest supported one): XLA accepts handlers built against its own FFI
  version or older, so that build runs on every supported jaxlib.
  """
  try:
    import jaxlib  # pylint: disable=import-outside-toplevel
    import jaxlib.version  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
  if not os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
    return None
  return include, jaxlib.version.__version__


class _OptionalBuildExt(build_ext.build_ext):
  """Builds the library if it can; otherwise says why, and goes on."""

  def run(self):
    try:
      super().run()
    except Exception as e:  # pylint: disable=broad-exception-caught
      _skipped(f"the build failed ({e})")

  def build_extension(self, ext):
    try:
      super().build_extension(ext)
    except Exception as e:  # pylint: disable=broad-exception-caught
      _skipped(f"compiling {ext.name} failed ({e})")


def _skipped(why):
  print(
      f"dropless: the cpu backend's FFI library was NOT built: {why}. The "
      "package works without it; `cpu` reports itself unavailable and "
      "backend='auto' uses `xla`. Install g++ (Debian: apt-get install g++) "
      "and reinstall to get it.",
      file=sys.stderr,
  )


def _extensions():
  found = _jaxlib()
  if found is None:
    _skipped("jaxlib's FFI headers are not in the build environment")
    return []
  include, version = found
  return [
      setuptools.Extension(
          "backends.cpu._ffi",
          sources=[
              "backends/cpu/cc/gemm.cc",
              "backends/cpu/cc/gemm_amx.cc",
              "backends/cpu/cc/gemm_avx2.cc",
              "backends/cpu/cc/gemm_portable.cc",
              "backends/cpu/cc/grouped_gemm.cc",
          ],
          include_dirs=[".", include],
          extra_compile_args=[
              "-std=c++17",
              "-O3",
              # Python's CFLAGS carry -g: 1.7 MB of debug info otherwise.
              "-g0",
              f'-DDROPLESS_JAXLIB_VERSION="{version}"',
          ],
          language="c++",
          optional=True,
      )
  ]


setuptools.setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": _OptionalBuildExt},
)
