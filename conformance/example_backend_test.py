"""The example backend, copied as a newcomer would, passes the suite.

conformance/example_backend/ is the template for a new backend. This test
copies it into a temporary directory under another package name, registers
it as an out-of-tree backend does (`moe_core.register_backend`; an in-repo
backend adds a line to moe_core/registry.py's table instead) and runs its
conformance_test.py in a fresh Python process, as Bazel runs a backend's
target: the file as `__main__`, `suite.main()`, an XML report. The report
must show tests run and none failed.

It runs a representative part of the single-device suites (the whole of
them took 4.3 minutes of wall time on the 2-core machine, 2.1 of CPU, more
than CI can spare): every test of the suites that exercise what the template
implements, its grouped GEMM (GroupedGemmSuite), the stages moe_core builds
on it, dispatch, expert FFN and combine (StagesSuite), and the checks of the
entry points (ValidationSuite), plus one end-to-end test of the layer and
its gradients. LayerSuite and RoutingSuite test moe_core's routing and
layer on top of those same stages; every in-repo backend's target runs
them. The expert-parallel suites are left out too: they need a process with
8 devices and test moe_core's exchange more than the backend.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from xml.etree import ElementTree

from absl.testing import absltest

import conformance
from conformance import grouped_gemm_suite
from conformance import stages_suite
from conformance import suite
from conformance import validation_suite

_TEMPLATE = os.path.join(
    os.path.dirname(conformance.__file__), "example_backend"
)
_REPO_ROOT = os.path.dirname(os.path.dirname(conformance.__file__))
# Not the template's own name: nothing in it may depend on where it lives.
_PACKAGE = "my_moe_backend"

# What the child runs (see the module docstring).
_WHOLE_SUITES = (
    grouped_gemm_suite.GroupedGemmSuite,
    stages_suite.StagesSuite,
    validation_suite.ValidationSuite,
)
_LAYER_TEST = "test_gradients_match_reference_base_f32"

# The child process: register the copy, then run its test file as __main__.
_DRIVER = f"""
import runpy
import sys

import moe_core

moe_core.register_backend("example", "{_PACKAGE}.backend:ExampleBackend")
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""

# What the child's absltest reads from the environment that belongs to this
# process: its sharding, its report, the EP switch.
_OWN_ENV = (
    suite.EP_ENV,
    "TEST_TOTAL_SHARDS",
    "TEST_SHARD_INDEX",
    "TEST_SHARD_STATUS_FILE",
    "TEST_PREMATURE_EXIT_FILE",
    "XML_OUTPUT_FILE",
)


def _test_names() -> list[str]:
  """The names, in suite.ConformanceTest, of the tests the child runs."""
  loader = unittest.TestLoader()
  wanted = {
      getattr(s, name)
      for s in _WHOLE_SUITES
      for name in loader.getTestCaseNames(s)
  }
  names = [
      name
      for name in loader.getTestCaseNames(suite.ConformanceTest)
      if getattr(suite.ConformanceTest, name) in wanted
  ]
  return names + [_LAYER_TEST]


def _run_suite(
    root: str, xml_path: str, names: list[str]
) -> subprocess.CompletedProcess:
  """The copy's conformance_test.py in a child process, reporting to xml."""
  env = {k: v for k, v in os.environ.items() if k not in _OWN_ENV}
  env["XML_OUTPUT_FILE"] = xml_path
  env["PYTHONPATH"] = os.pathsep.join(
      [root, _REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p]
  )
  test_file = os.path.join(root, _PACKAGE, "conformance_test.py")
  return subprocess.run(
      [sys.executable, "-c", _DRIVER, test_file]
      + [f"ExampleConformanceTest.{n}" for n in names],
      env=env,
      capture_output=True,
      text=True,
      check=False,
  )


class ExampleBackendTest(absltest.TestCase):

  def test_a_copy_of_the_template_passes_the_single_device_suites(self):
    # tempfile, not create_tempdir: plain pytest does not parse absl flags.
    root = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, root)
    shutil.copytree(_TEMPLATE, os.path.join(root, _PACKAGE))
    xml_path = os.path.join(root, "report.xml")

    names = _test_names()
    # A renamed case would otherwise fail in the child, less clearly.
    self.assertTrue(hasattr(suite.ConformanceTest, _LAYER_TEST), _LAYER_TEST)
    proc = _run_suite(root, xml_path, names)

    log = proc.stdout + proc.stderr
    self.assertTrue(os.path.exists(xml_path), f"no XML report:\n{log}")
    report = ElementTree.parse(xml_path).getroot()
    cases = report.findall(".//testcase")
    failed = [
        c.get("classname", "") + "." + c.get("name", "")
        for c in cases
        if c.find("failure") is not None or c.find("error") is not None
    ]
    self.assertEqual(failed, [], f"failed in the example backend:\n{log}")
    self.assertEqual(int(report.get("failures")), 0, log)
    self.assertEqual(int(report.get("errors")), 0, log)
    self.assertEqual(proc.returncode, 0, log)
    # absltest reports each subTest as a testcase too: count the tests.
    tests = [c for c in cases if "[" not in c.get("name")]
    self.assertEqual(
        {c.get("classname").rpartition(".")[2] for c in tests},
        {"ExampleConformanceTest"},
    )
    ran = [c for c in tests if c.get("result") == "completed"]
    skipped = [c.get("name") for c in tests if c.get("status") == "notrun"]
    self.assertEqual(skipped, [], log)
    self.assertNotEmpty(ran, log)
    self.assertCountEqual([c.get("name") for c in ran], names, log)


if __name__ == "__main__":
  absltest.main()
