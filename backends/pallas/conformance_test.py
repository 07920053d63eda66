"""The shared conformance suite (conformance/suite.py) on the pallas backend.

On the CPU the kernels run interpreted (the backend's default there).
"""

from conformance import suite

# Tiles of 16 rows and 16 columns (bm: rows, bk: the contraction C, bn: the
# output N), far below the tuned sizes: the suite's small cases then hit
# tiles shared by two groups, empty groups, partial tiles, padded C and N,
# and several steps along C.
_OPTIONS = {"tiles": {"bm": 16, "bk": 16, "bn": 16}}


class PallasConformanceTest(suite.ConformanceTest):
  BACKEND = "pallas"
  BACKEND_OPTIONS = _OPTIONS


class PallasExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "pallas"
  BACKEND_OPTIONS = _OPTIONS


if __name__ == "__main__":
  suite.main()
