"""gpu_check's conformance phase: the shared suites on every variant.

Each variant of bench/workloads/programs.py (its backend's defaults and options;
a recipe is its backend's precision suite) runs the absltest suites of
conformance/suite.py in child processes that subclass `suite.ConformanceTest`
with the variant's backend and options (`DROPLESS_CONFORMANCE_VARIANT=mosaic_gpu
python -m bench.on_device.gpu_conformance`), sharded over the host's cores, so
that one failing or hanging test cannot take the rest of gpu_check with it;
their counts go into the JSON. Where a GPU is, the suites add the shapes the
timing runs (conformance/cases.py's GPU cases); a variant whose backend cannot
run here (`availability()`) is recorded as skipped, with the reason.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import time

from train import platforms

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VARIANT_ENV = "DROPLESS_CONFORMANCE_VARIANT"
INTERPRET_ENV = "DROPLESS_CONFORMANCE_INTERPRET"
# "1": the child prints a line per test as it ends (unittest's verbosity
# 2), so a child killed at the deadline still says how far it got.
VERBOSE_ENV = "DROPLESS_CONFORMANCE_VERBOSE"
# absltest's summary: "Ran 445 tests in 81.2s", then "OK (skipped=12)" or
# "FAILED (failures=1, errors=2, skipped=3)".
_RAN = re.compile(r"^Ran (\d+) tests? in ([\d.]+)s", re.MULTILINE)
_COUNT = re.compile(r"(failures|errors|skipped|expected failures)=(\d+)")
# Not the parent's test-runner settings (a Bazel test's shard, filter and
# XML file), which the child's absltest would obey.
_RUNNER_VARIABLES = (
    "TESTBRIDGE_TEST_ONLY",
    "TEST_TOTAL_SHARDS",
    "TEST_SHARD_INDEX",
    "TEST_SHARD_STATUS_FILE",
    "XML_OUTPUT_FILE",
    "TEST_PREMATURE_EXIT_FILE",
)
# A failing test's first line in absltest's output.
_FAILED = re.compile(r"^(?:FAIL|ERROR): (\S+)", re.MULTILINE)
# A verbose child's line per test: "test_x (module.Class.test_x) ... ok".
_VERBOSE = re.compile(
    r"^(test\w*) \(.*?\) \.\.\. ?(?:.*\n)*?.*?\b(ok|FAIL|ERROR|skipped)\b",
    re.MULTILINE,
)


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


def verbose_counts(output: str) -> dict:
  """{"ran", "failures", "errors", "skipped", "failed_tests"} counted from
  a verbose child's per-test lines (one killed, or crashed, before its
  summary)."""
  counts = {"ran": 0, "failures": 0, "errors": 0, "skipped": 0}
  failed = []
  key = {"FAIL": "failures", "ERROR": "errors", "skipped": "skipped"}
  for name, outcome in _VERBOSE.findall(output):
    counts["ran"] += 1
    if outcome in key:
      counts[key[outcome]] += 1
    if outcome in ("FAIL", "ERROR"):
      failed.append(name)
  return {**counts, "failed_tests": failed}


def _run_shard(
    variant,
    index,
    shards,
    interpret,
    deadline,
    extra_path,
    test_filter,
    verbose=False,
):
  """(returncode or None if killed, output) of one shard of one variant."""
  env = {k: v for k, v in os.environ.items() if k not in _RUNNER_VARIABLES}
  if test_filter:  # unittest -k patterns, split like a shell's words.
    env["TESTBRIDGE_TEST_ONLY"] = test_filter
  env.update(
      {
          VARIANT_ENV: variant,
          INTERPRET_ENV: "1" if interpret else "0",
          VERBOSE_ENV: "1" if verbose else "0",
          "PYTHONPATH": os.pathsep.join([_REPO, *extra_path]),
          "TEST_TOTAL_SHARDS": str(shards),
          "TEST_SHARD_INDEX": str(index),
          # Shards share the GPU: each takes the memory it uses.
          "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
      }
  )
  try:
    done = subprocess.run(
        [sys.executable, "-m", "bench.on_device.gpu_conformance"],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=max(deadline - time.monotonic(), 1.0),
        check=False,
    )
    return done.returncode, done.stdout + done.stderr
  except subprocess.TimeoutExpired as e:
    return None, _text(e.stdout) + _text(e.stderr)


def run_suites(
    variants,
    timeout_s: float,
    *,
    available,
    interpret: bool = False,
    shards: int = 1,
    workers: int = 1,
    extra_path=(),
    test_filter=None,
    verbose=False,
):
  """The suites on each variant; returns one JSON entry per variant.

  Args:
    variants: `programs.Variant`s.
    timeout_s: every child still running then is killed (its variant is
      "incomplete": not a failure, the counts say how far it got).
    available: variant -> (runs here, why not); a variant that cannot run
      is "skipped" with the reason, not started (one that raises: failed).
    interpret: run the kernels interpreted (a CPU rehearsal).
    shards: absltest shards per variant.
    workers: children at a time.
    extra_path: more sys.path entries for the children (carried wheels).
    test_filter: only the tests matching these unittest -k patterns.
    verbose: a line per test, so a killed child's tests are counted
      (`verbose_counts`).

  Returns:
    [{"variant", "status": "passed" | "failed" | "incomplete" | "skipped",
    "reason", the summed counts of `parse_summary`, "failed_tests"}].
  """
  deadline = time.monotonic() + timeout_s
  entries, jobs = [], []
  with concurrent.futures.ThreadPoolExecutor(max(workers, 1)) as pool:
    for variant in variants:
      try:
        ok, why = available(variant)
      except Exception as e:  # pylint: disable=broad-except
        entries.append(
            {"variant": variant.name, "status": "failed", "reason": repr(e)}
        )
        continue
      if not ok:
        entries.append(
            {"variant": variant.name, "status": "skipped", "reason": why}
        )
        continue
      futures = [
          pool.submit(
              _run_shard,
              variant.name,
              i,
              shards,
              interpret,
              deadline,
              extra_path,
              test_filter,
              verbose,
          )
          for i in range(shards)
      ]
      entry = {"variant": variant.name}
      entries.append(entry)
      jobs.append((entry, futures))
    for entry, futures in jobs:
      entry.update(_merge([f.result() for f in futures]))
  return entries


def _merge(results) -> dict:
  """One variant's entry from its shards' (returncode, output)."""
  merged = {"ran": 0, "failures": 0, "errors": 0, "skipped": 0}
  status, reasons, failed = "passed", [], []
  for returncode, output in results:
    counts = parse_summary(output)
    if counts["ran"] is None:  # Killed, or crashed, before its summary.
      partial = verbose_counts(output)
      if partial["ran"]:
        failed += partial.pop("failed_tests")
        counts = partial
    for key in merged:
      merged[key] += counts[key] or 0
    failed += _FAILED.findall(output)
    if returncode is None:
      status = "incomplete" if status == "passed" else status
      reasons.append("killed at the time budget")
    elif returncode != 0 or counts["ran"] is None:
      status = "failed"
      reasons.append(f"exit code {returncode}: {output[-1500:]}")
  if status == "passed" and not merged["ran"]:
    status, reasons = "failed", ["ran no test"]
  entry = {"status": status, **merged, "failed_tests": failed}
  if reasons:
    entry["reason"] = "; ".join(sorted(set(reasons)))[:4000]
  return entry


def _text(data) -> str:
  if data is None:
    return ""
  return data.decode(errors="replace") if isinstance(data, bytes) else data


def print_summary(entries) -> None:
  for e in entries:
    if e["status"] == "skipped":
      print(f"conformance {e['variant']}: skipped: {e['reason']}")
      continue
    print(
        f"conformance {e['variant']}: {e['status']}: ran {e['ran']}, "
        f"failures {e['failures']}, errors {e['errors']}, skipped "
        f"{e['skipped']}"
    )
    for name in e["failed_tests"]:
      print(f"  failed: {name}")


def _main() -> None:
  """A child: the single-device suites on the variant of VARIANT_ENV."""
  # pylint: disable-next=g-import-not-at-top
  from absl.testing import absltest

  from bench.workloads import programs  # pylint: disable=g-import-not-at-top
  from conformance import suite  # pylint: disable=g-import-not-at-top

  name = os.environ[VARIANT_ENV]
  # A backend outside the GPU table (mosaic_tpu): its default variant.
  variant = {v.name: v for v in programs.variants()}.get(name) or (
      programs.Variant(name, name)
  )
  interpret = os.environ.get(INTERPRET_ENV) == "1"
  options = {
      **programs.platform_options(variant.backend, interpret),
      **dict(variant.options),
  }
  # The class unittest loads, as if this module had defined it.
  globals()["ConformanceTest"] = type(
      "ConformanceTest",
      (suite.ConformanceTest,),
      {"BACKEND": variant.backend, "BACKEND_OPTIONS": options},
  )
  verbose = {"verbosity": 2} if os.environ.get(VERBOSE_ENV) == "1" else {}
  absltest.main(defaultTest="ConformanceTest", **verbose)


if __name__ == "__main__":
  platforms.set_default_platforms()
  _main()
