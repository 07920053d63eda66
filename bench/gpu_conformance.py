"""gpu_check's conformance phase: the shared suite on a backend, on the GPU.

The suite (conformance/) is absltest code; here it runs as a child process,
`python backends/<name>/conformance_test.py`, so that one failing or
hanging test cannot take the rest of gpu_check with it, and its counts go
into the JSON. Only for backends whose numerics the correctness phase does
not already cover case by case: te, where Transformer Engine is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# absltest's summary: "Ran 445 tests in 81.2s", then "OK (skipped=12)" or
# "FAILED (failures=1, errors=2, skipped=3)".
_RAN = re.compile(r"^Ran (\d+) tests? in ([\d.]+)s", re.MULTILINE)
_RUNNER_VARIABLES = (
    "TESTBRIDGE_TEST_ONLY",
    "TEST_TOTAL_SHARDS",
    "TEST_SHARD_INDEX",
    "TEST_SHARD_STATUS_FILE",
    "XML_OUTPUT_FILE",
    "TEST_PREMATURE_EXIT_FILE",
)
_COUNT = re.compile(r"(failures|errors|skipped|expected failures)=(\d+)")


def parse_summary(output: str) -> dict:
  """{"ran", "failures", "errors", "skipped"} from absltest's last lines.

  Missing counts are 0; "ran" is None when the run printed no summary (it
  crashed or was killed).
  """
  last = None
  for last in _RAN.finditer(output):
    pass
  counts = {"failures": 0, "errors": 0, "skipped": 0}
  tail = output[last.start() :] if last else ""
  for status_line in tail.splitlines()[1:4]:
    for name, value in _COUNT.findall(status_line):
      if name in counts:
        counts[name] = int(value)
  return {"ran": int(last.group(1)) if last else None, **counts}


def run_suite(backend: str, timeout_s: float, available: tuple[bool, str]):
  """Runs backends/<backend>/conformance_test.py; returns its JSON entry.

  Args:
    backend: the backend's folder and registered name, e.g. "te".
    timeout_s: the child is killed past this (the entry says so).
    available: (whether the backend can run here, why not): when it
      cannot, the suite is not started and the entry is "skipped" with the
      reason.

  Returns:
    {"backend", "status": "passed" | "failed" | "incomplete" (killed at
    the timeout: not a failure, the counts say how far it got) |
    "skipped", "reason" and/or the counts of `parse_summary`,
    "output_tail"}.
  """
  ok, why = available
  if not ok:
    return {"backend": backend, "status": "skipped", "reason": why}
  path = os.path.join(_REPO, "backends", backend, "conformance_test.py")
  # Not the parent's test-runner settings (a Bazel test's shard, filter and
  # XML file), which the child's absltest would obey.
  env = {k: v for k, v in os.environ.items() if k not in _RUNNER_VARIABLES}
  env["PYTHONPATH"] = _REPO
  try:
    done = subprocess.run(
        [sys.executable, path],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    output = done.stdout + done.stderr
    returncode = done.returncode
  except subprocess.TimeoutExpired as e:
    output = _text(e.stdout) + _text(e.stderr)
    returncode = None
  entry = {"backend": backend, **parse_summary(output)}
  if returncode is None:
    entry["status"] = "incomplete"
    entry["reason"] = f"killed after {timeout_s:.0f} s"
  elif returncode != 0 or entry["ran"] is None:
    entry["status"] = "failed"
    entry["reason"] = f"exit code {returncode}"
  elif not entry["ran"]:
    entry["status"] = "failed"
    entry["reason"] = "ran no test"
  else:
    entry["status"] = "passed"
  entry["output_tail"] = output[-4000:]
  return entry


def _text(data) -> str:
  if data is None:
    return ""
  return data.decode(errors="replace") if isinstance(data, bytes) else data


def print_summary(entries) -> None:
  for e in entries:
    if e["status"] == "skipped":
      print(f"conformance {e['backend']}: skipped: {e['reason']}")
    else:
      print(
          f"conformance {e['backend']}: {e['status']}: ran {e['ran']}, "
          f"failures {e['failures']}, errors {e['errors']}, skipped "
          f"{e['skipped']}" + (f" ({e['reason']})" if "reason" in e else "")
      )
