"""Tests of tpu_conformance.py: outcomes, the alone re-run, the log."""

import functools
import json
import os
import tempfile
import threading
import time
import unittest

from absl.testing import absltest

from bench.on_device import tpu_conformance


@functools.cache
def _cases():
  """One test per outcome the runner records. Made here, not at the top
  level (nor held by a module attribute), so that neither absltest nor
  pytest collects it as a test."""

  class _Cases(unittest.TestCase):
    """Run by the tests below."""

    calls = {}
    lock = threading.Lock()

    def _count(self):
      with self.lock:
        self.calls[self.id()] = self.calls.get(self.id(), 0) + 1
        return self.calls[self.id()]

    def test_passes(self):
      self._count()

    def test_fails(self):
      self._count()
      self.assertEqual(1, 2)

    def test_errs(self):
      self._count()
      raise RuntimeError("boom")

    def test_skips(self):
      self._count()
      self.skipTest("not here")

    def test_fails_only_the_first_time(self):
      # Stands for a test that fails beside others (process-wide state) and
      # passes alone.
      self.assertGreater(self._count(), 1)

  return _Cases


def _tempdir(test):
  # tempfile, not create_tempdir: plain pytest does not parse absl flags.
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return tmp.name


def _tests(*names):
  return [_cases()(n) for n in names]


class RunTestsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    _cases().calls.clear()
    self.log_path = os.path.join(_tempdir(self), "log")

  def _run(self, tests, threads=2, deadline=None):
    log = tpu_conformance._Log(self.log_path)
    try:
      return tpu_conformance.run_tests(
          tests,
          threads=threads,
          deadline=deadline or time.monotonic() + 60,
          log=log,
      )
    finally:
      log.close()

  def test_each_outcome_and_the_alone_rerun(self):
    names = (
        "test_passes",
        "test_fails",
        "test_errs",
        "test_skips",
        "test_fails_only_the_first_time",
    )
    records = self._run(_tests(*names))
    by_name = {k.rsplit(".", 1)[1]: v for k, v in records.items()}
    self.assertEqual(
        {n: r["outcome"] for n, r in by_name.items()},
        {
            "test_passes": "passed",
            "test_fails": "failed",
            "test_errs": "error",
            "test_skips": "skipped",
            "test_fails_only_the_first_time": "passed",
        },
    )
    self.assertIn("AssertionError", by_name["test_fails"]["detail"])
    self.assertIn("boom", by_name["test_errs"]["detail"])
    self.assertEqual(by_name["test_skips"]["detail"], "not here")
    # Failures ran twice (the second time alone), the rest once.
    self.assertEqual(
        {k.rsplit(".", 1)[1]: v for k, v in _cases().calls.items()},
        {
            "test_passes": 1,
            "test_fails": 2,
            "test_errs": 2,
            "test_skips": 1,
            "test_fails_only_the_first_time": 2,
        },
    )
    flaky = by_name["test_fails_only_the_first_time"]
    self.assertEqual(flaky["under_threads"]["outcome"], "failed")
    counts = tpu_conformance.summarise(records)
    self.assertEqual(
        counts,
        {
            "passed": 2,
            "failed": 1,
            "error": 1,
            "skipped": 1,
            "not_run": 0,
            "passed_alone_only": 1,
        },
    )
    # The log's last line per test is its final outcome.
    logged = tpu_conformance.read_log(self.log_path)
    self.assertEqual(
        {k: v["outcome"] for k, v in logged.items()},
        {k: v["outcome"] for k, v in records.items()},
    )

  def test_one_thread_runs_no_test_twice(self):
    records = self._run(_tests("test_fails"), threads=1)
    self.assertEqual(list(_cases().calls.values()), [1])
    self.assertNotIn("under_threads", list(records.values())[0])

  def test_past_the_deadline_nothing_starts(self):
    records = self._run(
        _tests("test_passes", "test_fails"), deadline=time.monotonic() - 1
    )
    self.assertEqual(
        [r["outcome"] for r in records.values()], ["not_run", "not_run"]
    )
    self.assertEqual(_cases().calls, {})


class LoadTestsTest(absltest.TestCase):

  def test_a_backend_without_its_test_file_gets_the_plain_suite(self):
    # reference's suite lives in reference/, not backends/reference/: here
    # as in a Bazel test's runfiles, where no conformance_test.py is.
    tests = tpu_conformance.load_tests("reference")
    ids = [t.id() for t in tests]
    self.assertGreater(len(ids), 100)
    self.assertTrue(
        all(
            i.startswith("backends.reference.conformance_test.ConformanceTest.")
            for i in ids
        ),
        ids[:3],
    )
    self.assertEqual({t.BACKEND for t in tests}, {"reference"})

  def test_patterns_pick_tests_like_unittest_k(self):
    every = [t.id() for t in tpu_conformance.load_tests("reference")]
    for patterns, want in (
        # Without "*": a substring of module.Class.method.
        (["softcap_f32_inf"], [i for i in every if "softcap_f32_inf" in i]),
        (
            ["softcap_f32_inf__with_jit", "zzz_none"],
            [i for i in every if "softcap_f32_inf__with_jit" in i],
        ),
        # With "*": the whole name, fnmatch.
        (
            ["*ConformanceTest.test_bad_input_config_gate_softcap_f32_inf*"],
            [
                i
                for i in every
                if ".test_bad_input_config_gate_softcap_f32_inf" in i
            ],
        ),
        (["*f32_inf"], [i for i in every if i.endswith("f32_inf")]),
    ):
      with self.subTest(patterns):
        got = [
            t.id() for t in tpu_conformance.load_tests("reference", patterns)
        ]
        self.assertEqual(sorted(got), sorted(want))
    # Not vacuous: a pattern picks some tests, not all.
    picked = tpu_conformance.load_tests("reference", ["softcap_f32_inf"])
    self.assertBetween(len(picked), 1, len(every) - 1)


class MainTest(absltest.TestCase):

  def test_a_resumed_run_keeps_what_passed_and_runs_the_rest(self):
    tmp = _tempdir(self)
    first_log, out = os.path.join(tmp, "1.log"), os.path.join(tmp, "r.json")
    k = ["-k", "test_bad_input_config_gate_softcap_f32_inf"]
    code = tpu_conformance.main(
        ["--backends=xla", "--threads=2", f"--log={first_log}", *k]
    )
    self.assertEqual(code, 0)
    first = tpu_conformance.read_log(first_log)
    self.assertLen(first, 2)  # With and without jit.
    self.assertEqual({r["outcome"] for r in first.values()}, {"passed"})
    # Forget one of the two: the resumed run runs it alone and keeps the
    # other from the log.
    kept, dropped = sorted(first)
    with open(first_log, "w") as f:
      f.write(f"passed\t0.01\t{kept}\n")
    second_log = os.path.join(tmp, "2.log")
    code = tpu_conformance.main(
        [
            "--backends=xla",
            f"--resume={first_log}",
            f"--log={second_log}",
            f"--out={out}",
            *k,
        ]
    )
    self.assertEqual(code, 0)
    self.assertEqual(list(tpu_conformance.read_log(second_log)), [dropped])
    with open(out) as f:
      report = json.load(f)["backends"]["xla"]
    self.assertEqual(report["counts"]["passed"], 2)
    self.assertTrue(report["tests"][kept]["resumed"])
    self.assertNotIn("resumed", report["tests"][dropped])


if __name__ == "__main__":
  absltest.main()
