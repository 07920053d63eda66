"""tools/whole_skips.py on a made-up run: which targets skipped wholly."""

import io
import json
import shutil
import tempfile

from absl.testing import absltest

from tools import whole_skips

_RAN = '<testcase name="test_a" status="run" result="completed"/>'
_SKIP = '<testcase name="test_b" status="notrun" result="suppressed"/>'


class WholeSkipsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
    self.events = []
    # Nothing is installed here but a GPU; "torch" and "gpu" are known.
    self.probes = {
        "gpu": ("NVIDIA GPU", lambda: True),
        "torch": ("torch", lambda: False),
    }

  def _target(self, label, tags, shards, status="PASSED"):
    """Events of a target; `shards`: (JUnit testcases, log text) each."""
    self.events.append(
        {
            "id": {"targetConfigured": {"label": label}},
            "configured": {"tag": tags},
        }
    )
    for i, (cases, log) in enumerate(shards, 1):
      files = []
      for name, text in (
          (
              "test.xml",
              f"<testsuites><testsuite>{cases}</testsuite>" "</testsuites>",
          ),
          ("test.log", log),
      ):
        path = tempfile.mkstemp(dir=self.dir)[1]
        with open(path, "w") as fh:
          fh.write(text)
        files.append({"name": name, "uri": f"file://{path}"})
      self.events.append(
          {
              "id": {"testResult": {"label": label, "shard": i}},
              "testResult": {"status": status, "testActionOutput": files},
          }
      )
    self.events.append(
        {
            "id": {"testSummary": {"label": label}},
            "testSummary": {"overallStatus": status},
        }
    )

  def _check(self):
    out = io.StringIO()
    lines = [json.dumps(e) for e in self.events]
    return whole_skips.check(lines, out, self.probes), out.getvalue()

  def test_a_target_that_ran_a_test_is_not_listed(self):
    self._target("//a:ran", [], [(_SKIP, ""), (_RAN + _SKIP, "")])
    self.assertEqual(self._check(), (0, ""))

  def test_an_undeclared_whole_skip_fails_with_its_reason(self):
    log = (
        "[  SKIPPED ] T.test_b - no GPU: this device is cpu\n"
        "[  SKIPPED ] T.test_c0 (True, 'a - b') - no GPU: this device is cpu\n"
    )
    self._target("//a:skips", ["matrix"], [(_SKIP, log), (_SKIP * 2, log)])
    code, out = self._check()
    self.assertEqual(code, 1, out)
    self.assertIn(
        "skipped wholly: //a:skips (no GPU: this device is cpu)\n", out
    )
    self.assertIn("NOT EXPECTED here", out)

  def test_a_declared_whole_skip_passes_where_the_thing_is_missing(self):
    self._target("//a:torch", ["skips-without-torch"], [(_SKIP, "")])
    code, out = self._check()
    self.assertEqual(code, 0, out)
    self.assertIn("skipped wholly: //a:torch (no reason in the log)", out)
    self.assertIn("expected: skips-without-torch: no torch here", out)

  def test_a_declared_whole_skip_fails_where_the_thing_is_present(self):
    self._target("//a:gpu", ["skips-without-gpu"], [(_SKIP, "")])
    code, out = self._check()
    self.assertEqual(code, 1, out)
    self.assertIn("NOT EXPECTED here", out)

  def test_an_unknown_condition_fails(self):
    self._target("//a:typo", ["skips-without-tourch"], [(_SKIP, "")])
    code, out = self._check()
    self.assertEqual(code, 1, out)
    self.assertIn("UNKNOWN tag ['skips-without-tourch']", out)

  def test_a_target_that_ran_no_method_is_a_whole_skip(self):
    self._target("//a:empty", [], [("", "")])
    code, out = self._check()
    self.assertEqual(code, 1, out)
    self.assertIn("skipped wholly: //a:empty (ran no test method)", out)

  def test_failed_targets_are_left_to_bazel(self):
    self._target("//a:failed", [], [(_SKIP, "")], status="FAILED")
    self.assertEqual(self._check(), (0, ""))

  def test_the_last_attempt_of_a_flaky_shard_counts(self):
    self._target("//a:flaky", [], [(_SKIP, "")], status="FLAKY")
    first = self.events[1]
    first["id"]["testResult"]["attempt"] = 2
    retried = json.loads(json.dumps(first))
    retried["id"]["testResult"]["attempt"] = 1
    path = tempfile.mkstemp(dir=self.dir)[1]
    with open(path, "w") as fh:
      fh.write(f"<testsuites>{_RAN}</testsuites>")
    retried["testResult"]["testActionOutput"][0]["uri"] = f"file://{path}"
    self.events.insert(2, retried)  # An earlier attempt, reported later.
    code, out = self._check()
    self.assertEqual(code, 1, out)
    self.assertIn("skipped wholly: //a:flaky", out)

  def test_every_known_condition_probes(self):
    for what, (_, probe) in whole_skips.CONDITIONS.items():
      self.assertIsInstance(probe(), bool, what)


if __name__ == "__main__":
  absltest.main()
