"""The shared conformance suite (conformance/suite.py) on mosaic_tpu.

Off a TPU the kernels run in Pallas' HLO interpreter (the backend's auto
there); on a TPU (bench/on_device/tpu_check.py) they run compiled with the
table's tiles.
"""

from conformance import suite
from moe_core.kernels import interpret as interpret_lib

# Off a TPU: 128-row tiles (the smallest a TPU block takes) and 128-wide K
# steps, with 128-row chunks of 256-row tiles in the forward and dW, so the
# suite's small cases hit tiles shared by several groups, chunks skipped,
# empty groups, padded K and N and several K steps. On a TPU: the table.
_SMALL = {
    "fwd": {"bm": 256, "bk": 128, "bn": 128, "chunk": 128},
    "dgrad": {"bm": 128, "bk": None, "bn": 128},
    "wgrad": {"bm": 256, "bk": 128, "bn": 128, "chunk": 128},
}
_OPTIONS = (
    {} if not interpret_lib.interprets(None, "tpu") else {"tiles": _SMALL}
)


class MosaicTpuConformanceTest(suite.ConformanceTest):
  BACKEND = "mosaic_tpu"
  BACKEND_OPTIONS = _OPTIONS


class MosaicTpuExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "mosaic_tpu"
  BACKEND_OPTIONS = _OPTIONS


if __name__ == "__main__":
  suite.main()
