"""The shared conformance suite (conformance/suite.py) on triton, compiled.

The kernels go through jax-triton to an NVIDIA GPU, so off one every test
skips with the backend's reason. On the CPU the same kernels run in
Triton's interpreter in ops_interpret_test.py.
"""

from conformance import suite


class TritonConformanceTest(suite.ConformanceTest):
  BACKEND = "triton"


class TritonExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "triton"


if __name__ == "__main__":
  suite.main()
