"""The shared conformance suite on the xla backend's jax.lax.ragged_dot path.

ragged_dot is the default off the CPU (GPU, TPU); it is forced here, where
XLA:CPU runs it as a dense masked product: slow, but the suite's shapes are
small. Bazel targets: conformance_test_ragged_dot and its _ep.
"""

from conformance import suite

_OPTIONS = {"use_ragged_dot": True}


class XlaRaggedDotConformanceTest(suite.ConformanceTest):
  BACKEND = "xla"
  BACKEND_OPTIONS = _OPTIONS


class XlaRaggedDotExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "xla"
  BACKEND_OPTIONS = _OPTIONS


if __name__ == "__main__":
  suite.main()
