"""The example backend, copied as a newcomer would, passes the suite.

conformance/example_backend/ is the template for a new backend whose
grouped GEMM is plain JAX. `template_check.check_copy` copies it under
another package name, registers it and runs its conformance_test.py in a
fresh process; the report must show tests run and none failed.

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

from absl.testing import absltest

from conformance import grouped_gemm_suite
from conformance import stages_suite
from conformance import template_check
from conformance import validation_suite

# What the child runs (see the module docstring).
_NAMES = template_check.conformance_test_names(
    (
        grouped_gemm_suite.GroupedGemmSuite,
        stages_suite.StagesSuite,
        validation_suite.ValidationSuite,
    ),
    ("test_gradients_match_reference_base_f32",),
)


class ExampleBackendTest(absltest.TestCase):

  def test_a_copy_of_the_template_passes_the_single_device_suites(self):
    template_check.check_copy(
        self,
        "example_backend",
        backend_name="example",
        backend_class="ExampleBackend",
        test_class="ExampleConformanceTest",
        names=_NAMES,
    )


if __name__ == "__main__":
  absltest.main()
