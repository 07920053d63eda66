"""The shared conformance suite (conformance/suite.py) on the xla backend.

Default options: the tile loop on the CPU. The ragged_dot path, the default
elsewhere, has a file of its own: ragged_dot_conformance_test.py.
"""

from conformance import suite


class XlaConformanceTest(suite.ConformanceTest):
  BACKEND = "xla"


class XlaExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "xla"


if __name__ == "__main__":
  suite.main()
