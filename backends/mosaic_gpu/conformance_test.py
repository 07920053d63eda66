"""The shared conformance suite (conformance/suite.py) on mosaic_gpu, compiled.

The kernels are compiled for Hopper, so off a Hopper GPU every test skips
with the backend's reason. Its float32 cases raise NotImplementedError there
(wgmma takes float32 only as TF32). On the CPU the same kernels are checked
in Mosaic GPU's interpreter by interpret_test.py.
"""

from conformance import suite


class MosaicGpuConformanceTest(suite.ConformanceTest):
  BACKEND = "mosaic_gpu"


class MosaicGpuExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "mosaic_gpu"


if __name__ == "__main__":
  suite.main()
