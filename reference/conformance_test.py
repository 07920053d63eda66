"""The shared conformance suite (conformance/suite.py) on the reference.

The reference is also the suite's oracle: the comparisons with itself skip,
and the float64 numpy checks (per-token recomputation, grouped GEMM, router)
test it instead.
"""

from conformance import suite


class ReferenceConformanceTest(suite.ConformanceTest):
  BACKEND = "reference"


class ReferenceExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "reference"


if __name__ == "__main__":
  suite.main()
