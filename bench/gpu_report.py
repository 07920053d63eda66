"""gpu_check's JSON report: versions, errors as text, writing, failures.

The report is one dict, rewritten whole after every phase (`write`), so a
crash or a lost machine still leaves the last complete one. Needs only jax
(no absl): it runs alone on the GPU machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform

import jax

# Error messages kept in the JSON, in characters.
MAX_ERROR_CHARS = 500


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


def versions() -> dict:
  """Versions of python, jax, jaxlib, triton, jax-triton; platform, device."""
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
      "platform": jax.default_backend(),
      "device": device,
  }


def versions_line(v: dict) -> str:
  """The one line of `versions()` printed first."""
  return (
      f"python {v['python']}, jax {v['jax']}, jaxlib {v['jaxlib']}, "
      f"triton {v['triton']}, jax-triton {v['jax_triton']}; default "
      f"backend {v['platform']}, device {v['device']}"
  )


def write(path: str, report: dict) -> None:
  """Writes the report whole or not at all (a crash keeps the last one)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as fh:
    json.dump(report, fh, indent=1, default=str)
  os.replace(tmp, path)


def failures(report: dict) -> list[str]:
  """What failed, one line each: checks, timed methods, whole phases.

  Skipped correctness cases (ok, with "skipped"), timed problems skipped
  past the time budget and missed goals are not failures.
  """
  out = [
      f"correctness {r['case']} {r['dtype']} {r['quantity']}"
      for r in report.get("correctness", [])
      if not r["ok"]
  ]
  for row in report.get("timing", []):
    problem = " ".join(p for p in (row.get("workload"), row["problem"]) if p)
    if "error" in row:
      out.append(f"timing {problem}: {row['error']}")
    for method, e in row["methods"].items():
      if "error" in e:
        out.append(f"timing {problem} {method}: {e['error']}")
      if not e.get("check", {"ok": True})["ok"]:
        out.append(f"check {problem} {method}")
  if "fatal_error" in report:
    out.append(f"fatal: {report['fatal_error']}")
  return out
