"""gpu_check's JSON report: versions, errors as text, writing.

The report is one dict, rewritten whole after every phase (`write`), so a
crash or a lost machine still leaves the last complete one. Needs only jax
(no absl): it runs alone on the GPU machine. `provide_jax_triton` puts the
jax-triton wheel carried in bench/wheels/ on sys.path where none imports.
"""

from __future__ import annotations

import datetime
import glob
import importlib
import importlib.metadata
import json
import os
import platform
import sys

import jax

# Error messages kept in the JSON, in characters.
MAX_ERROR_CHARS = 500
# The pure-Python wheels gpu_check carries (bench/wheels/README.md).
WHEELS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "wheels"
)
# "jax_triton_from": where jax_triton came from, as `provide_jax_triton`
# found it (absent: not asked yet); `versions` reports it.
_FOUND = {}


def error_text(e: BaseException) -> str:
  """ "Type: message" of an exception, cut to MAX_ERROR_CHARS."""
  return f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]


def _installed_version(distribution):
  """The installed version of a pip distribution, None if it is absent.

  Read from its metadata, not imported: jax-triton 0.3.1 raises at import
  without a GPU build of jax, and the Pallas Triton lowering needs neither.
  """
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _import_error(module: str) -> str | None:
  """error_text of `import module`, or None if it imports."""
  try:
    importlib.import_module(module)
  except Exception as e:  # pylint: disable=broad-except
    return error_text(e)
  return None


def _forget(package: str) -> None:
  """Drops a package and its submodules from sys.modules (a failed import
  leaves the submodules it had imported)."""
  for name in [n for n in sys.modules if n.split(".")[0] == package]:
    del sys.modules[name]


def _carried(wheels_dir: str, distribution: str) -> str | None:
  """The newest pure-Python wheel of `distribution` in wheels_dir, or None."""
  found = sorted(glob.glob(os.path.join(wheels_dir, f"{distribution}-*.whl")))
  return found[-1] if found else None


def provide_jax_triton(wheels_dir: str = WHEELS_DIR) -> str:
  """Makes `import jax_triton` work if it can; returns where it came from.

  An installed jax_triton that imports is used as it is. Otherwise the
  carried wheel (bench/wheels/, pure Python: importable from the zip on
  sys.path, no pip needed) goes first on sys.path, with the carried absl-py
  wheel where absl does not import (jax-triton 0.3.1 logs through it). If
  jax_triton still does not import (a CPU jaxlib: it needs the CUDA
  plugin), sys.path and sys.modules are put back as they were. Call it
  before anything imports jax_triton; `versions` reports the result.

  Returns:
    "installed: <path>", "carried: <wheel> (installed: <why not>)", or
    "not importable: <why>".
  """
  _FOUND["jax_triton_from"] = _provide_jax_triton(wheels_dir)
  return _FOUND["jax_triton_from"]


def _provide_jax_triton(wheels_dir: str) -> str:
  installed_error = _import_error("jax_triton")
  if installed_error is None:
    return f"installed: {os.path.dirname(sys.modules['jax_triton'].__file__)}"
  _forget("jax_triton")
  wheel = _carried(wheels_dir, "jax_triton")
  if wheel is None:
    return f"not importable: {installed_error}; no wheel in {wheels_dir}"
  added = [wheel]
  absl = _carried(wheels_dir, "absl_py")
  if absl is not None and _import_error("absl.logging") is not None:
    _forget("absl")
    added.append(absl)
  sys.path[:0] = added
  importlib.invalidate_caches()
  carried_error = _import_error("jax_triton")
  if carried_error is None:
    return f"carried: {wheel} (installed: {installed_error})"
  for path in added:
    sys.path.remove(path)
    _forget("absl" if path == absl else "jax_triton")
  importlib.invalidate_caches()
  return (
      f"not importable: installed: {installed_error}; carried "
      f"{os.path.basename(wheel)}: {carried_error}"
  )


def versions() -> dict:
  """Versions of python, jax, jaxlib, triton, jax-triton (and where it came
  from: `provide_jax_triton`); platform, device."""
  jaxlib = getattr(jax.lib, "__version__", None)
  if jaxlib is None:
    try:
      jaxlib = __import__("jaxlib").__version__
    except Exception:  # pylint: disable=broad-except
      pass
  try:
    device = jax.devices()[0].device_kind
  except Exception as e:  # pylint: disable=broad-except
    device = error_text(e)
  return {
      "jax": jax.__version__,
      "jaxlib": jaxlib,
      "python": platform.python_version(),
      "triton": _installed_version("triton"),
      "jax_triton": _installed_version("jax-triton"),
      "jax_triton_from": _FOUND.get("jax_triton_from"),
      "platform": jax.default_backend(),
      "device": device,
  }


def versions_line(v: dict) -> str:
  """The one line of `versions()` printed first."""
  return (
      f"python {v['python']}, jax {v['jax']}, jaxlib {v['jaxlib']}, "
      f"triton {v['triton']}, jax-triton {v['jax_triton']} "
      f"({v['jax_triton_from']}); default backend {v['platform']}, device "
      f"{v['device']}"
  )


def write(path: str, report: dict) -> None:
  """Writes the report whole or not at all (a crash keeps the last one)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as fh:
    json.dump(report, fh, indent=1, default=str)
  os.replace(tmp, path)


def save(path: str, report: dict) -> None:
  """`write`s the report, making its folder first, and says where."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  write(path, report)
  print(f"wrote {path}")


def save_run(out_dir: str, kind: str, report: dict, device=True) -> str:
  """Saves a benchmark run's `report` as
  <out_dir>/<kind>_<platform>_<UTC time>.json, headed by the date, jax's
  version, the platform, the device's kind (unless not `device`), the host
  and its CPU count; returns the path."""
  now = datetime.datetime.now(datetime.timezone.utc)
  backend = jax.default_backend()
  head = {"date": now.isoformat(), "jax": jax.__version__, "platform": backend}
  if device:
    head["device"] = jax.devices()[0].device_kind
  head.update(host=platform.node(), cpu_count=os.cpu_count())
  path = os.path.join(out_dir, f"{kind}_{backend}_{now:%Y%m%d_%H%M%S}.json")
  save(path, {**head, **report})
  return path
