"""The shared conformance suite on triton, every kernel in Triton's interpreter.

The same @triton.jit kernels as on a GPU, run on the CPU through a host
callback (`launch`'s interpret mode: torch CPU tensors, so the py311 leg
only; elsewhere every test skips with the reason) with the interpreter's
small tiles (`configs.INTERPRET`), so the suite's cases hit tiles shared by
two groups, empty groups and partial tiles. The routing weights are applied
in the down GEMM's epilogue (`fuse_routing_weights`), the backend's least
conventional path, and the activation in the gated kernel's
(`fuse_activation`); the unfused routing weights are the default of
ops_interpret_test.

Not part of `bazel test //...` (tag `manual`): about 4 minutes on 2 cores,
more than CI's budget has room for. Run it on the py311 leg with
`PYTHONPATH=. .venvs/py311-jax0.10/bin/python -m pytest -q \
    backends/triton/interpret_conformance_test.py` (both classes, on the
8 devices the root conftest.py makes) or with Bazel by its name.
"""

from conformance import suite

_OPTIONS = {
    "interpret": True,
    "fuse_activation": True,
    "fuse_routing_weights": True,
}


class TritonInterpretConformanceTest(suite.ConformanceTest):
  BACKEND = "triton"
  BACKEND_OPTIONS = _OPTIONS


class TritonInterpretExpertParallelTest(suite.ExpertParallelTest):
  BACKEND = "triton"
  BACKEND_OPTIONS = _OPTIONS


if __name__ == "__main__":
  suite.main()
