"""The expert-FFN hooks of a backend built on a tile-list kernel module.

`pallas` and `mosaic_gpu` (and a new kernel backend written like them)
expose the same functions in their `ops` module, each taking the backend's
launch settings last:

    grouped_gemm(rows, weights, group_sizes, transpose_rhs, out_dtype, launch)
    gate_up(rows, w_gate, w_up, group_sizes, launch)
    gated_gate_up(rows, w_gate, w_up, group_sizes, activation, launch)
    EPILOGUE_ACTIVATIONS   the activations its fused epilogue computes

`TileKernelBackend` maps `moe_core.Backend`'s hooks onto them, so such a
backend writes its kernels, its tile table, `availability()` and its
options, not this glue again.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import jax

from moe_core import backend
from moe_core import operands


class TileKernelBackend(backend.Backend):
  """`Backend` whose grouped GEMM and expert-FFN hooks are `ops`' kernels.

  Subclasses set `ops` (the module) and, in __init__, `self.launch` (what
  every ops function takes last) and `self.fuse_activation` (bool: act(gate)
  * up in the gate/up kernel's epilogue, for `ops.EPILOGUE_ACTIVATIONS`).
  """

  ops: ClassVar[ModuleType]
  launch: Any
  fuse_activation: bool

  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    return self.ops.grouped_gemm(
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
        gemm.transpose_rhs,
        gemm.out_dtype,
        self.launch,
    )

  def _gate_up(
      self, ffn_in: operands.FfnOperands
  ) -> tuple[jax.Array, jax.Array]:
    """Gate and up in one kernel pass over the rows: two [M, F] outputs."""
    return self.ops.gate_up(*_gate_up_operands(ffn_in), self.launch)

  def _fuses_activation(self, activation: str) -> bool:
    return self.fuse_activation and activation in self.ops.EPILOGUE_ACTIVATIONS

  def _gated_gate_up(self, ffn_in: operands.FfnOperands) -> jax.Array:
    """act(gate) * up in the gate/up kernel's epilogue: one [M, F] output."""
    return self.ops.gated_gate_up(
        *_gate_up_operands(ffn_in), ffn_in.activation, self.launch
    )


def _gate_up_operands(ffn_in: operands.FfnOperands) -> tuple[jax.Array, ...]:
  """(rows, w_gate, w_up, group_sizes): the gate/up kernels' operands."""
  return ffn_in.rows, ffn_in.w_gate, ffn_in.w_up, ffn_in.group_sizes
