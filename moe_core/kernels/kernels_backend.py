"""The grouped-GEMM hooks of a backend whose compute is one `GroupedKernels`.

A kernel backend (the cpu backend, conformance/example_kernel_backend/)
writes its raw gmm and tgmm kernels as a `grouped_matmul.GroupedKernels`
and returns them from `grouped_kernels()`; `GroupedKernelsBackend` turns
them into `moe_core.Backend`'s hooks, differentiable in both directions
(`grouped_matmul.gmm`), so such a backend writes no glue of its own.
"""

from __future__ import annotations

import abc

import jax

from moe_core import backend
from moe_core import operands
from moe_core.kernels import expert_ops
from moe_core.kernels import grouped_matmul


class GroupedKernelsBackend(backend.Backend):
  """`Backend` whose grouped GEMM is `grouped_kernels()`' gmm and tgmm.

  Subclasses set `name` and `dtypes` and implement `grouped_kernels()` and,
  if they cannot run everywhere, `availability()`. The forward and dX run
  the kernels' gmm, dW their tgmm. Kernels with a `fused_gmm` also compute
  the gate and up projections in one call (one read of the rows, one dX).
  """

  @abc.abstractmethod
  def grouped_kernels(self) -> grouped_matmul.GroupedKernels:
    """The backend's kernels: hashable by value (a frozen dataclass)."""

  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    return grouped_matmul.gmm(
        self.grouped_kernels(),
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
        transpose_rhs=gemm.transpose_rhs,
        out_dtype=gemm.out_dtype,
    )

  def _gate_up(
      self, ffn_in: operands.FfnOperands
  ) -> tuple[jax.Array, jax.Array]:
    """rows [M, D] -> (gate, up), each [M, F].

    One `expert_ops.gate_up` call where the kernels fuse products; else
    the default's two grouped GEMMs (the same products, each on its own).
    """
    kernels = self.grouped_kernels()
    if kernels.fused_gmm is None:
      return super()._gate_up(ffn_in)
    return expert_ops.gate_up(
        kernels, ffn_in.rows, ffn_in.w_gate, ffn_in.w_up, ffn_in.group_sizes
    )
