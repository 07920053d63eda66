"""interpret_test's tests on the Blackwell (tcgen05) kernels of mosaic_gpu.

A target of its own so that only the whole-suite CI leg runs it (the
Hopper kernels' interpret_test runs on every leg).
"""

from absl.testing import absltest

from backends.mosaic_gpu import interpret_test


class InterpretSm100Test(interpret_test.InterpretTest):
  """The same backend tests with generation="sm100"."""

  GENERATION = "sm100"


if __name__ == "__main__":
  absltest.main()
