"""What the compile tests (gpu_compile_test.py, tpu_compile_test.py) ask of
a run's records, and where they keep them."""

from __future__ import annotations

import os

from bench.compile import driver


def skip_without(test, installed: bool, why: str) -> None:
  """Skips `test`, printing `why`, unless the compiler is `installed`."""
  if not installed:
    print(f"skipped: {why}")
    test.skipTest(why)


def keep(records: list[dict], name: str) -> None:
  """The records as <name>.json among Bazel's undeclared test outputs."""
  out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
  if out_dir:
    seconds = sum(r.get("compile_seconds", 0) for r in records)
    driver.write(os.path.join(out_dir, f"{name}.json"), records, seconds)


def assert_compiled(test, records: list[dict], expected) -> None:
  """The records are of the `expected` programs, in order; none failed,
  and each one compiled fits, with a peak above zero."""
  test.assertEqual([r["program"] for r in records], list(expected))
  failed = [driver.line(r) for r in records if r["status"] == "failed"]
  test.assertEmpty(failed)
  for r in records:
    if r["status"] == "ok":
      test.assertTrue(r["fits"], r["program"])
      test.assertGreater(r["peak_bytes"], 0, r["program"])
