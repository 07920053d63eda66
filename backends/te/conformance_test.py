"""The shared conformance suite (conformance/suite.py) on te.

Transformer Engine's kernels run on NVIDIA GPUs only, so elsewhere every
test skips with the backend's reason (TE missing, or no GPU). On the CPU,
lowering_test.py checks the backend's CUDA lowering and helpers_test.py the
TE helpers that run there.
"""

from conformance import suite


class TeConformanceTest(suite.ConformanceTest):
  BACKEND = "te"


class TeExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "te"


if __name__ == "__main__":
  suite.main()
