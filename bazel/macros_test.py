"""Checks the environment the macros promise: CPU JAX, N devices, venv.

bazel/BUILD runs this file through moe_py_test (1 and 4 devices) and through
moe_conformance_test, whose `<name>` target must run the single-device
suites on 1 device and whose `<name>_ep` target the expert-parallel suites
on 8.
"""

import os
import sys

from absl import flags
from absl.testing import absltest

from conformance import ep_suite
from conformance import suite

_EXPECTED_DEVICES = flags.DEFINE_integer(
    "expected_devices",
    None,
    "How many CPU devices the target asked for. Default: 1, or the "
    "expert-parallel suites' 8 where the target selects them (the `_ep` "
    "target of moe_conformance_test).",
)
_EXTRA_XLA_FLAG = flags.DEFINE_string(
    "extra_xla_flag", "", "An XLA flag the target's env adds, if any."
)


def _expected_devices() -> int:
  # A target that selects the EP suites must have their 8 devices: they
  # skip without them, and the target would pass having tested nothing.
  if _EXPECTED_DEVICES.value is not None:
    return _EXPECTED_DEVICES.value
  return ep_suite.NUM_DEVICES if suite.runs_ep_suites() else 1


def _runfile(path):
  return os.path.join(os.environ["TEST_SRCDIR"], path)


@absltest.skipUnless(
    "TEST_SRCDIR" in os.environ,
    "checks the environment that Bazel's moe_py_test sets up (runfiles, "
    "JAX_PLATFORMS, device-count flags); run it with bazel test.",
)
class MoePyTestEnvTest(absltest.TestCase):

  def test_runs_under_the_toolchain_interpreter(self):
    with open(_runfile("local_python/python_bin_path.txt")) as f:
      configured = f.read().strip()
    self.assertEqual(sys.executable, configured)

  def test_jax_is_on_cpu(self):
    # JAX_PLATFORMS must be in the environment before JAX starts.
    self.assertEqual(os.environ.get("JAX_PLATFORMS"), "cpu")
    import jax  # pylint: disable=g-import-not-at-top

    self.assertEqual(jax.default_backend(), "cpu")

  def test_device_count(self):
    import jax  # pylint: disable=g-import-not-at-top

    self.assertLen(jax.devices("cpu"), _expected_devices())

  def test_env_xla_flags_are_kept(self):
    if not _EXTRA_XLA_FLAG.value:
      self.skipTest("this target adds no XLA flag of its own.")
    xla_flags = os.environ.get("XLA_FLAGS", "").split()
    self.assertIn(_EXTRA_XLA_FLAG.value, xla_flags)
    self.assertIn(
        "--xla_force_host_platform_device_count=%d" % _expected_devices(),
        xla_flags,
    )

  def test_cpu_tests_compile_quickly(self):
    # moe.bzl's QUICK_CPU_XLA_FLAGS (the root conftest.py's under pytest).
    xla_flags = os.environ.get("XLA_FLAGS", "").split()
    self.assertIn("--xla_backend_optimization_level=0", xla_flags)
    self.assertIn("--xla_llvm_disable_expensive_passes=true", xla_flags)

  def test_workspace_root_is_importable(self):
    import moe_core  # pylint: disable=g-import-not-at-top

    self.assertEqual(
        os.path.basename(os.path.dirname(moe_core.__file__)), "moe_core"
    )


if __name__ == "__main__":
  absltest.main()
