"""Copies a backend template as a newcomer would and runs its suite.

conformance/example_backend/ and conformance/example_kernel_backend/ are
folders a newcomer copies to add a backend. `check_copy` copies one into a
temporary directory under another package name, registers it as an
out-of-tree backend does (`moe_core.register_backend`; an in-repo backend
adds a line to moe_core/registry.py's table instead) and runs its
conformance_test.py in a fresh Python process, as Bazel runs a backend's
target: the file as `__main__`, `suite.main()`, an XML report. The report
must show the asked-for tests run and none failed or skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from xml.etree import ElementTree

from absl.testing import absltest

import conformance
from conformance import suite

_CONFORMANCE_DIR = os.path.dirname(conformance.__file__)
_REPO_ROOT = os.path.dirname(_CONFORMANCE_DIR)
# Not a template's own name: nothing in it may depend on where it lives.
_PACKAGE = "my_moe_backend"

# The child process: register the copy, then run its test file as __main__.
_DRIVER = """
import runpy
import sys

import moe_core

moe_core.register_backend(sys.argv.pop(1), sys.argv.pop(1))
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


def template_dir(name: str) -> str:
  """The path of conformance/<name>/."""
  return os.path.join(_CONFORMANCE_DIR, name)


def conformance_test_names(suites, extra_tests=()) -> list[str]:
  """The names, in suite.ConformanceTest, of every test of `suites` (test
  classes it inherits from), then `extra_tests`."""
  loader = unittest.TestLoader()
  wanted = {
      getattr(s, name) for s in suites for name in loader.getTestCaseNames(s)
  }
  names = [
      name
      for name in loader.getTestCaseNames(suite.ConformanceTest)
      if getattr(suite.ConformanceTest, name) in wanted
  ]
  for name in extra_tests:
    # A renamed case would otherwise fail in the child, less clearly.
    if not hasattr(suite.ConformanceTest, name):
      raise ValueError(f"suite.ConformanceTest has no test {name!r}.")
  return names + list(extra_tests)


def _run_suite(
    root: str,
    xml_path: str,
    *,
    backend_name: str,
    backend_class: str,
    test_class: str,
    names: list[str],
) -> subprocess.CompletedProcess:
  """The copy's conformance_test.py in a child process, reporting to xml."""
  env = {k: v for k, v in os.environ.items() if k not in _OWN_ENV}
  env["XML_OUTPUT_FILE"] = xml_path
  env["PYTHONPATH"] = os.pathsep.join(
      [root, _REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p]
  )
  test_file = os.path.join(root, _PACKAGE, "conformance_test.py")
  return subprocess.run(
      [
          sys.executable,
          "-c",
          _DRIVER,
          backend_name,
          f"{_PACKAGE}.backend:{backend_class}",
          test_file,
      ]
      + [f"{test_class}.{n}" for n in names],
      env=env,
      capture_output=True,
      text=True,
      check=False,
  )


def check_copy(
    test: absltest.TestCase,
    template: str,
    *,
    backend_name: str,
    backend_class: str,
    test_class: str,
    names: list[str],
) -> None:
  """Copies conformance/<template>/, runs `names` of its `test_class`.

  Args:
    test: the calling test, whose assertions fail on a failed child run.
    template: the template folder's name under conformance/.
    backend_name: the registry name its backend.py's class has.
    backend_class: that class's name in backend.py.
    test_class: the class of its conformance_test.py to run.
    names: the tests of that class to run (`conformance_test_names`).
  """
  # tempfile, not create_tempdir: plain pytest does not parse absl flags.
  root = tempfile.mkdtemp()
  test.addCleanup(shutil.rmtree, root)
  shutil.copytree(template_dir(template), os.path.join(root, _PACKAGE))
  xml_path = os.path.join(root, "report.xml")
  proc = _run_suite(
      root,
      xml_path,
      backend_name=backend_name,
      backend_class=backend_class,
      test_class=test_class,
      names=names,
  )

  log = proc.stdout + proc.stderr
  test.assertTrue(os.path.exists(xml_path), f"no XML report:\n{log}")
  report = ElementTree.parse(xml_path).getroot()
  cases = report.findall(".//testcase")
  failed = [
      c.get("classname", "") + "." + c.get("name", "")
      for c in cases
      if c.find("failure") is not None or c.find("error") is not None
  ]
  test.assertEqual(failed, [], f"failed in the {template} copy:\n{log}")
  test.assertEqual(int(report.get("failures")), 0, log)
  test.assertEqual(int(report.get("errors")), 0, log)
  test.assertEqual(proc.returncode, 0, log)
  # absltest reports each subTest as a testcase too: count the tests.
  tests = [c for c in cases if "[" not in c.get("name")]
  test.assertEqual(
      {c.get("classname").rpartition(".")[2] for c in tests}, {test_class}
  )
  ran = [c for c in tests if c.get("result") == "completed"]
  skipped = [c.get("name") for c in tests if c.get("status") == "notrun"]
  test.assertEqual(skipped, [], log)
  test.assertNotEmpty(ran, log)
  test.assertCountEqual([c.get("name") for c in ran], names, log)
