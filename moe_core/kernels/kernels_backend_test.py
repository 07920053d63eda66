"""GroupedKernelsBackend: a backend made of one `GroupedKernels`.

Its grouped GEMM and gradients are the kernels' (through the primitive),
and its gate/up projections one fused call where the kernels fuse. The
Pallas kernels of conformance/example_kernel_backend/ run the conformance
suite through it (conformance/example_kernel_backend_test.py).
"""

from __future__ import annotations

import dataclasses

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import operands
from moe_core.kernels import grouped_matmul_test as gmt
from moe_core.kernels import kernels_backend

# Each fused_gmm call's products, appended while tracing.
_FUSED_CALLS = []


@dataclasses.dataclass(frozen=True)
class FusedLoopKernels(gmt.LoopKernels):
  """LoopKernels with a fused_gmm: one call summing its products."""

  def fused_gmm(
      self,
      lhs,
      rhs,
      group_sizes,
      *,
      products,
      transpose_rhs,
      num_outputs,
      out_dtype,
  ):
    _FUSED_CALLS.append(products)
    outs = []
    for o in range(num_outputs):
      outs.append(
          sum(
              self.gmm(
                  lhs[l],
                  rhs[r],
                  group_sizes,
                  transpose_rhs=transpose_rhs,
                  out_dtype=jnp.float32,
              )
              for l, r, out in products
              if out == o
          ).astype(out_dtype)
      )
    return tuple(outs)


class LoopBackend(kernels_backend.GroupedKernelsBackend):
  name = "loop"

  def __init__(self, kernels):
    self.kernels = kernels

  def grouped_kernels(self):
    return self.kernels


def _ffn_operands():
  rows, w_gate, sizes, _ = gmt._inputs()
  w_up = w_gate * 0.5 + 1.0
  return operands.FfnOperands(
      rows=rows,
      group_sizes=sizes,
      w_gate=w_gate,
      w_up=w_up,
      w_down=jnp.swapaxes(w_gate, 1, 2),
      activation="silu",
  )


class GroupedKernelsBackendTest(absltest.TestCase):

  def test_grouped_gemm_and_its_gradients_are_the_kernels(self):
    rows, weights, sizes, _ = gmt._inputs()
    backend = LoopBackend(gmt.KERNELS)

    def loss(rows, weights):
      return jnp.sum(backend.grouped_gemm(rows, weights, sizes) ** 2)

    def want_loss(rows, weights):
      return jnp.sum(gmt.oracle_gmm(rows, weights, sizes) ** 2)

    gmt._close(
        backend.grouped_gemm(rows, weights, sizes),
        gmt.oracle_gmm(rows, weights, sizes),
    )
    got = jax.grad(loss, argnums=(0, 1))(rows, weights)
    want = jax.grad(want_loss, argnums=(0, 1))(rows, weights)
    for g, w in zip(got, want):
      gmt._close(g, w)

  def test_gate_up_is_one_fused_call_where_the_kernels_fuse(self):
    ffn_in = _ffn_operands()
    want = LoopBackend(gmt.KERNELS)._gate_up(ffn_in)
    _FUSED_CALLS.clear()
    got = LoopBackend(FusedLoopKernels())._gate_up(ffn_in)
    self.assertEqual(_FUSED_CALLS, [((0, 0, 0), (0, 1, 1))])
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
