"""The conformance suite on one accelerator, its tests run on threads.

One program at a time holds a TPU, so the suite cannot be sharded over processes
there (bench/on_device/gpu_conformance.py's way on a GPU host). Yet most of a
conformance test's time on a TPU is XLA's compile -- about 1.3 s a test, some 15
minutes a backend one test after another -- which runs on the host's CPU cores
and releases the GIL. So this runs a backend's conformance_test.py on a pool of
threads in one process, then runs every test that failed once more, alone:
process-wide state (warnings filters, `jax.config`) is not thread-safe, and a
test that fails only beside others is recorded as such, not as a pass or a
failure of the backend.

Each test's outcome is one line of --log as it ends ("<outcome> <seconds>
<test id>"), so a run killed at the caller's deadline still says how far it
got, and --resume takes such logs so the next call runs only the rest. On
the TPU host (set-up: ../shared/notes/tpu.md, docs/benchmarks.md):

  python -m bench.on_device.tpu_conformance --backends=xla,mosaic_tpu \\
      --threads=10 \\
      --deadline_s=520 --log="$OUT/conformance.log" \\
      --out="$OUT/conformance.json"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import json
import os
import sys
import threading
import time
import unittest

# Run as a script (python bench/on_device/tpu_conformance.py), only its
# folder is on sys.path.
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
import jax
from train import platforms

# pylint: enable=g-import-not-at-top,wrong-import-position

OUTCOMES = ("passed", "failed", "error", "skipped", "not_run")
# Outcomes that count against the backend (and that run again alone).
FAILING = ("failed", "error")
# Outcomes a resumed run keeps from an earlier log; the others run again.
_SETTLED = ("passed", "skipped")


def test_module(backend: str) -> str:
  """The module a backend's test ids start with (its conformance_test.py)."""
  return f"backends.{backend}.conformance_test"


def load_tests(backend: str, patterns=()) -> list[unittest.TestCase]:
  """Every test of a backend's conformance classes, one per test method.

  The classes of backends/<backend>/conformance_test.py that
  `suite.classes_to_run` picks (with the backend's options and tolerance
  overrides); where that file is not importable (it is a test, not part of
  the library: a Bazel test's runfiles hold only the library), the plain
  suite on the registered backend, under the same test ids. `patterns`
  picks tests as unittest's -k does (a pattern without "*" matches as a
  substring of "module.Class.method").
  """
  # Imported here, not at the top: the suites build arrays as they import,
  # which opens the device, and tpu_check's parent, which must leave the
  # chip to its children, reads this module's logs.
  from conformance import suite  # pylint: disable=g-import-not-at-top

  module_name = test_module(backend)
  try:
    module = importlib.import_module(module_name)
    classes = [getattr(module, n) for n in suite.classes_to_run(module)]
  except ModuleNotFoundError as e:
    # The file or its package is missing; not a dependency of the file.
    if not (module_name == e.name or module_name.startswith(f"{e.name}.")):
      raise
    kind = (
        suite.ExpertParallelTest
        if suite.runs_ep_suites()
        else suite.ConformanceTest
    )
    classes = [
        type(
            kind.__name__,
            (kind,),
            {"BACKEND": backend, "__module__": module_name},
        )
    ]
  loader = unittest.TestLoader()
  loader.testNamePatterns = [
      p if "*" in p else f"*{p}*" for p in patterns
  ] or None
  tests = []
  for cls in classes:
    tests.extend(_flatten(loader.loadTestsFromTestCase(cls)))
  return tests


def _flatten(tests) -> list[unittest.TestCase]:
  if isinstance(tests, unittest.TestCase):
    return [tests]
  return [t for child in tests for t in _flatten(child)]


def run_one(test: unittest.TestCase) -> dict:
  """{"outcome", "seconds", "detail"} of one test run by unittest."""
  result = unittest.TestResult()
  start = time.perf_counter()
  test.run(result)
  seconds = time.perf_counter() - start
  for outcome, found in (
      ("error", result.errors),
      ("failed", result.failures + result.unexpectedSuccesses),
  ):
    if found:
      # A subtest's or an unexpected success's entry may be a bare test.
      first = found[0]
      detail = first[1] if isinstance(first, tuple) else "unexpected success"
      return {"outcome": outcome, "seconds": seconds, "detail": detail}
  if result.skipped:
    return {
        "outcome": "skipped",
        "seconds": seconds,
        "detail": result.skipped[0][1],
    }
  return {"outcome": "passed", "seconds": seconds, "detail": ""}


def read_log(path: str) -> dict[str, dict]:
  """{test id: {"outcome", "seconds"}} from a --log file; later lines win."""
  records = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      parts = line.rstrip("\n").split("\t")
      if len(parts) >= 3 and parts[0] in OUTCOMES:
        records[parts[2]] = {"outcome": parts[0], "seconds": float(parts[1])}
  return records


class _Log:
  """The --log file, a line per test, flushed as each ends (threads share
  it)."""

  def __init__(self, path):
    self._file = open(path, "a", encoding="utf-8") if path else None
    self._lock = threading.Lock()

  def write(self, test_id, record, *, echo=False):
    line = f"{record['outcome']}\t{record['seconds']:.2f}\t{test_id}"
    with self._lock:
      if self._file:
        self._file.write(line + "\n")
        self._file.flush()
      if echo or record["outcome"] in FAILING:
        print(line, flush=True)

  def close(self):
    if self._file:
      self._file.close()


def run_tests(tests, *, threads: int, deadline: float, log: _Log) -> dict:
  """Runs `tests` on `threads` threads, then each failure again alone.

  Args:
    tests: TestCase instances.
    threads: the pool's size (1: one after another).
    deadline: time.monotonic() past which no test starts ("not_run").
    log: where each outcome goes as it ends.

  Returns:
    {test id: {"outcome", "seconds", "detail"[, "under_threads"]}}: a test
    that failed on the pool and passed alone has outcome "passed" and keeps
    its failure under "under_threads"; one that failed alone too keeps the
    alone run's failure.
  """

  def guarded(test):
    if time.monotonic() > deadline:
      return {"outcome": "not_run", "seconds": 0.0, "detail": "deadline"}
    record = run_one(test)
    log.write(test.id(), record)
    return record

  with concurrent.futures.ThreadPoolExecutor(max(threads, 1)) as pool:
    records = dict(zip([t.id() for t in tests], pool.map(guarded, tests)))
  if threads > 1:
    for test in tests:
      first = records[test.id()]
      if first["outcome"] not in FAILING:
        continue
      if time.monotonic() > deadline:
        break
      alone = run_one(test)
      log.write(test.id(), alone, echo=True)
      alone["under_threads"] = first
      records[test.id()] = alone
  return records


def summarise(records: dict) -> dict:
  counts = {o: 0 for o in OUTCOMES}
  for record in records.values():
    counts[record["outcome"]] += 1
  counts["passed_alone_only"] = sum(
      1
      for r in records.values()
      if r["outcome"] == "passed" and "under_threads" in r
  )
  return counts


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--backends", default="xla,mosaic_tpu")
  p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
  p.add_argument(
      "--deadline_s",
      type=float,
      default=520.0,
      help="no test starts after this many seconds; what ran is written",
  )
  p.add_argument("--log", default="", help="a line per test, appended")
  p.add_argument("--out", default="", help="the JSON report")
  p.add_argument(
      "--resume",
      default="",
      help="comma-separated earlier --log files: their passed and skipped "
      "tests are not run again and are counted in this report",
  )
  p.add_argument(
      "-k",
      dest="patterns",
      action="append",
      default=[],
      help="only tests whose id matches (unittest's -k; repeatable)",
  )
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  # absltest.TestCase reads flags (its temporary directories): none here.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  deadline = time.monotonic() + args.deadline_s
  earlier = {}
  for path in filter(None, args.resume.split(",")):
    earlier.update(read_log(path))
  log = _Log(args.log)
  report = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "jax": jax.__version__,
      "device": jax.devices()[0].device_kind,
      "platform": jax.default_backend(),
      "threads": args.threads,
      "argv": sys.argv[1:] if argv is None else list(argv),
      "backends": {},
  }
  status = 0
  try:
    for backend in filter(None, args.backends.split(",")):
      tests = load_tests(backend, args.patterns)
      kept = {
          t.id(): dict(earlier[t.id()], resumed=True)
          for t in tests
          if earlier.get(t.id(), {}).get("outcome") in _SETTLED
      }
      todo = [t for t in tests if t.id() not in kept]
      start = time.monotonic()
      records = run_tests(
          todo, threads=args.threads, deadline=deadline, log=log
      )
      records.update(kept)
      counts = summarise(records)
      report["backends"][backend] = {
          "counts": counts,
          "seconds": time.monotonic() - start,
          "tests": records,
      }
      print(
          f"conformance on {report['platform']}: {backend}: "
          + ", ".join(f"{n} {o}" for o, n in counts.items())
          + f" ({len(kept)} from earlier logs)",
          flush=True,
      )
      if counts["failed"] or counts["error"] or counts["not_run"]:
        status = 1
  finally:
    log.close()
    if args.out:
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, sort_keys=True)
  return status


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
