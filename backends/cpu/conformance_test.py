"""The shared conformance suite (conformance/suite.py) on the cpu backend.

The kernels are the best this CPU runs (cc/gemm.h); kernels_test.py runs
its own cases on the portable ones too.
"""

import functools
from unittest import mock

from jax import export

from backends.cpu import library
from conformance import suite


class CpuConformanceTest(suite.ConformanceTest):
  BACKEND = "cpu"

  def test_exported_layer_serializes_and_matches_live_call(self):
    # jax.export refuses custom calls outside its list of stable targets
    # unless each is named in disabled_checks; ours carry their calling
    # convention's version in the name (library.TARGETS), which is the
    # compatibility promise an exporter opts into here.
    checks = [
        export.DisabledSafetyCheck.custom_call(t) for t in library.TARGETS
    ]
    with mock.patch.object(
        export,
        "export",
        functools.partial(export.export, disabled_checks=checks),
    ):
      super().test_exported_layer_serializes_and_matches_live_call()


class CpuExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "cpu"


if __name__ == "__main__":
  suite.main()
