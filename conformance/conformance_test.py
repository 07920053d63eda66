"""Every conformance suite for every registered backend, under pytest."""

# python -m pytest conformance/ -q
# A backend that cannot be imported or run here is reported as skipped, with
# the reason (the root conftest.py lists the reasons). Bazel does not run
# this file: it runs one target per backend, `moe_conformance_test(backend =
# ...)`, built on conformance_main.py.

from absl.testing import absltest

import moe_core
from conformance import suite

for _backend in moe_core.registered_backends():
  # The EP suites skip, with the reason, unless 8 devices exist
  # (XLA_FLAGS=--xla_force_host_platform_device_count=8).
  globals().update(
      suite.make_test_classes(_backend, suites=suite.SUITES + suite.EP_SUITES)
  )

if __name__ == "__main__":
  absltest.main()
