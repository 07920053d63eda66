"""The conformance suites, and the two test classes a backend subclasses.

A backend's whole conformance test is one file, `conformance_test.py` in
its folder (conformance/example_backend/ is the folder to copy; the
checklist is in `moe_core.Backend`'s docstring), run by one
`moe_conformance_test` line in its BUILD: it subclasses `ConformanceTest`
(the single-device suites) and `ExpertParallelTest` (the expert-parallel
ones), sets BACKEND, BACKEND_OPTIONS and TOLERANCE_OVERRIDES, and ends
with `suite.main()`. Plain pytest runs both classes (the expert-parallel
one skips, with the reason, without 8 devices); Bazel runs one per target
(`main`).
"""

from __future__ import annotations

import os
import sys

from absl.testing import absltest

from conformance import bad_input_suite
from conformance import checkpoint_names_suite
from conformance import ep_suite
from conformance import grouped_gemm_suite
from conformance import layer_suite
from conformance import precision_suite
from conformance import routing_suite
from conformance import stages_suite
from conformance import transforms_suite
from conformance import validation_suite

# Every suite a backend must pass on one device. Adding one is one line
# here; a suite that needs a special environment (8 simulated devices,
# several processes) goes in EP_SUITES or a Bazel target of its own.
SUITES = [
    grouped_gemm_suite.GroupedGemmSuite,
    stages_suite.StagesSuite,
    layer_suite.LayerSuite,
    routing_suite.RoutingSuite,
    validation_suite.ValidationSuite,
    checkpoint_names_suite.CheckpointNamesSuite,
    bad_input_suite.BadInputSuite,
    precision_suite.PrecisionSuite,
    transforms_suite.TransformsSuite,
]

# Suites that need 8 devices (--xla_force_host_platform_device_count=8 on
# CPU, set before jax is imported): each backend's `<name>_ep` Bazel target.
EP_SUITES = [
    ep_suite.ExpertParallelSuite,
]

# moe_conformance_test (bazel/moe.bzl) sets this to "1" in the environment of
# its `<name>_ep` target: `main` then runs the expert-parallel classes.
EP_ENV = "CONFORMANCE_EP"


class ConformanceTest(*SUITES):
  """Every single-device suite. Subclass it and set BACKEND.

  A backend's conformance_test.py sets, as Python values, BACKEND (the
  registered name), BACKEND_OPTIONS (keyword arguments of
  moe_core.get_backend) and TOLERANCE_OVERRIDES (see `tolerances.lookup`;
  loosen only with the reason in a comment), and ends with `main()` under
  `if __name__ == "__main__":`.

  The suites' test names are disjoint (suite_test.py fails if a new suite
  hides another's test), so each test runs exactly once here.
  """


class ExpertParallelTest(*EP_SUITES):
  """Every expert-parallel suite. Subclass it and set BACKEND."""


def runs_ep_suites() -> bool:
  """True in a `<name>_ep` target (EP_ENV set to "1")."""
  return os.environ.get(EP_ENV) == "1"


def classes_to_run(module) -> list[str]:
  """The names of the test classes of `module` that this run runs.

  Its ExpertParallelTest subclasses if `runs_ep_suites()`, else its
  ConformanceTest subclasses.
  """
  kind = ExpertParallelTest if runs_ep_suites() else ConformanceTest
  return sorted(
      name
      for name, value in vars(module).items()
      if isinstance(value, type)
      and issubclass(value, kind)
      and value is not kind
  )


def main():
  """absltest.main() for a backend's conformance_test.py run as a program.

  Runs the single-device classes, or with CONFORMANCE_EP=1 the
  expert-parallel ones (`classes_to_run`); test names given on the command
  line replace that choice. absltest honours Bazel's sharding
  (TEST_TOTAL_SHARDS, TEST_SHARD_INDEX).
  """
  names = classes_to_run(sys.modules["__main__"])
  if not names:
    kind = "ExpertParallelTest" if runs_ep_suites() else "ConformanceTest"
    sys.exit(f"conformance: no subclass of suite.{kind} in this file.")
  absltest.main(defaultTest=names)
