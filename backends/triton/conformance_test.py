"""The shared conformance suite (conformance/suite.py) on triton, compiled.

The kernels go through jax-triton to an NVIDIA GPU, so off one every test
skips with the backend's reason. On the CPU the same kernels run in
Triton's interpreter in ops_interpret_test.py.
"""

from conformance import suite

# The fused activation epilogue, as this suite has run it on GPUs (it was
# the default until the epilogue became opt-in).
_OPTIONS = {"fuse_activation": True}


class TritonConformanceTest(suite.ConformanceTest):
  BACKEND = "triton"
  BACKEND_OPTIONS = _OPTIONS


class TritonExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "triton"
  BACKEND_OPTIONS = _OPTIONS


if __name__ == "__main__":
  suite.main()
