"""The shared conformance suite (conformance/suite.py) on the example kernel
backend.

Copied to backends/<name>/: rename the classes and BACKEND. Backend options
(keyword arguments of your constructor) go in BACKEND_OPTIONS, as Python
values, with a comment saying why when they are not the defaults.
"""

from conformance import suite


class ExampleKernelConformanceTest(suite.ConformanceTest):
  BACKEND = "example_kernel"


class ExampleKernelExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "example_kernel"


if __name__ == "__main__":
  suite.main()
