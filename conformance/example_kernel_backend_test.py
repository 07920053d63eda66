"""The example kernel backend, copied as a newcomer would, passes the suite.

conformance/example_kernel_backend/ is the template for a backend that is
its kernels (Pallas gmm and tgmm), its tile table and a conformance test.
`template_check.check_copy` copies it under another package name,
registers it and runs its conformance_test.py in a fresh process; the
report must show tests run and none failed.

It runs what the template implements: every test of GroupedGemmSuite (the
forward, both gradients, NaN in unused rows, empty groups, E=1, M not a
multiple of the tile) through its kernels in Pallas' interpreter, and one
end-to-end test of the layer and its gradients, which runs them inside
dispatch, the expert FFN and combine. Everything else in the suite is
moe_core's, on the same grouped GEMM (conformance/example_backend_test.py
runs more of it). The 46 tests take about 19 s of wall time on the 2-core
machine (20 s on the oldest leg), so the grouped-GEMM suite runs whole.
"""

from absl.testing import absltest

from conformance import grouped_gemm_suite
from conformance import template_check

# What the child runs (see the module docstring).
_NAMES = template_check.conformance_test_names(
    (grouped_gemm_suite.GroupedGemmSuite,),
    ("test_gradients_match_reference_base_f32",),
)


class ExampleKernelBackendTest(absltest.TestCase):

  def test_a_copy_of_the_template_passes_the_grouped_gemm_suite(self):
    template_check.check_copy(
        self,
        "example_kernel_backend",
        backend_name="example_kernel",
        backend_class="ExampleKernelBackend",
        test_class="ExampleKernelConformanceTest",
        names=_NAMES,
    )


if __name__ == "__main__":
  absltest.main()
