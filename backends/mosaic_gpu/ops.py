"""The Mosaic GPU kernels tied into differentiable ops with jax.custom_vjp.

grouped_gemm   y = x @ w[g]           forward, dX: Mosaic GPU gmm
                                      dW: the Pallas Triton tgmm
gate_up        gate, up = x @ wg[g], x @ wu[g] in one pass over x (two
               accumulators); dX: one gmm summing both products; dW: one
               tgmm, two outputs
gated_gate_up  h = act(x @ wg[g]) * (x @ wu[g]), the activation in the
               epilogue; the same backward after the activation's VJP.

dW stays on the Pallas Triton kernel (`backends.pallas.kernels.tgmm`):
tokamax's H100 autotuning data has a Mosaic GPU dW at about 114 TFLOP/s
against 500-725 for Triton. Under the Mosaic GPU interpreter it runs under
Pallas' interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from backends.mosaic_gpu import kernels
from backends.mosaic_gpu import kernels_sm100
from backends.mosaic_gpu import tiling
from backends.pallas import kernels as triton_kernels
from backends.pallas import tiling as triton_tiling
from moe_core import ffn


@dataclasses.dataclass(frozen=True)
class Launch:
  """What every op needs besides its arrays (static, hashable).

  Attributes:
    tiles: the caller's gmm tiles per kind; unset kinds use the table.
    interpret: False (compiled for the GPU) or Mosaic GPU's
      `InterpretGPUParams` (the CPU).
    generation: "sm90" (wgmma, `kernels`) or "sm100" (tcgen05,
      `kernels_sm100`): which kernel, and the table's key.
  """

  tiles: tiling.TileConfig = tiling.TileConfig()
  interpret: Any = False
  generation: str = "sm90"

  @property
  def interpreting(self) -> bool:
    return self.interpret is not False

  def gmm(
      self,
      kind,
      lhs,
      rhs,
      group_sizes,
      *,
      transpose_rhs=False,
      products=((0, 0, 0),),
      epilogue=kernels.identity,
      num_outputs=None,
      out_dtype=None,
  ):
    """One Mosaic GPU gmm call with the tiles of `kind` ("fwd"/"dgrad")."""
    num_accs = 1 + max(a for _, _, a in products)
    tiles = tiling.choose(
        self.tiles,
        kind,
        lhs[0].shape[0],
        rhs[0].shape[0],
        lhs[0].dtype,
        num_lhs=len(lhs),
        num_rhs=len(rhs),
        num_accs=num_accs,
        num_outputs=num_accs if num_outputs is None else num_outputs,
        generation_name=self.generation,
    )
    if self.generation == "sm100":
      kernels_sm100.check_tiles(tiles, num_accs)
      gmm = kernels_sm100.gmm
    else:
      gmm = kernels.gmm
    return gmm(
        lhs,
        rhs,
        group_sizes,
        tiles=tiles,
        products=products,
        epilogue=epilogue,
        num_outputs=num_outputs,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        interpret=self.interpret,
    )

  def tgmm(self, lhs, rhs, group_sizes, num_groups, out_dtype):
    """dW on the Pallas Triton kernel: lhs_g^T rhs_g per group -> [E, C, N]."""
    m, c = lhs.shape
    tiles = triton_tiling.choose(
        triton_tiling.TileConfig(),
        "wgrad",
        m,
        c,
        rhs[0].shape[1],
        num_groups,
        lhs.dtype,
        interpret=self.interpreting,
        num_operands=len(rhs),
    )
    return triton_kernels.tgmm(
        lhs,
        list(rhs),
        group_sizes,
        tiles=tiles,
        interpret=self.interpreting,
        out_dtype=out_dtype,
    )


# --- grouped_gemm -------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def grouped_gemm(
    rows, weights, group_sizes, transpose_rhs: bool, out_dtype, launch: Launch
):
  """rows [M, C] x weights [E, C, N] ([E, N, C] transposed) -> [M, N].

  Rows past sum(group_sizes) come out as zeros and get zero gradient.
  """
  (out,) = launch.gmm(
      "fwd",
      [rows],
      [weights],
      group_sizes,
      transpose_rhs=transpose_rhs,
      out_dtype=out_dtype,
  )
  return out


def _grouped_gemm_fwd(
    rows, weights, group_sizes, transpose_rhs, out_dtype, launch
):
  out = grouped_gemm(
      rows, weights, group_sizes, transpose_rhs, out_dtype, launch
  )
  return out, (rows, weights, group_sizes)


def _grouped_gemm_bwd(transpose_rhs, out_dtype, launch, residuals, dy):
  del out_dtype
  rows, weights, group_sizes = residuals
  dy = dy.astype(rows.dtype)
  # dX: the same kernel reading the weights the other way round.
  (d_rows,) = launch.gmm(
      "dgrad",
      [dy],
      [weights],
      group_sizes,
      transpose_rhs=not transpose_rhs,
      out_dtype=rows.dtype,
  )
  # dW[g] = x_g^T dy_g for [C, N] weights, dy_g^T x_g for [N, C] ones.
  lhs, rhs = (dy, rows) if transpose_rhs else (rows, dy)
  (d_weights,) = launch.tgmm(
      lhs, [rhs], group_sizes, weights.shape[0], weights.dtype
  )
  return d_rows, d_weights, None


grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)


# --- gate and up projections in one pass ------------------------------------


def _gate_up_bwd_from(rows, w_gate, w_up, group_sizes, launch, d_gate, d_up):
  """Cotangents of (rows, w_gate, w_up, group_sizes) given dgate and dup."""
  d_gate = d_gate.astype(rows.dtype)
  d_up = d_up.astype(rows.dtype)
  # dX = dgate @ wg[g]^T + dup @ wu[g]^T, both products in one accumulator.
  (d_rows,) = launch.gmm(
      "dgrad",
      [d_gate, d_up],
      [w_gate, w_up],
      group_sizes,
      transpose_rhs=True,
      products=((0, 0, 0), (1, 1, 0)),
      out_dtype=rows.dtype,
  )
  d_w_gate, d_w_up = launch.tgmm(
      rows, [d_gate, d_up], group_sizes, w_gate.shape[0], w_gate.dtype
  )
  return d_rows, d_w_gate, d_w_up, None


def _gate_up_kernel(rows, w_gate, w_up, group_sizes, launch, epilogue, outs):
  return launch.gmm(
      "fwd",
      [rows],
      [w_gate, w_up],
      group_sizes,
      products=((0, 0, 0), (0, 1, 1)),
      epilogue=epilogue,
      num_outputs=outs,
      out_dtype=rows.dtype,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def gate_up(rows, w_gate, w_up, group_sizes, launch: Launch):
  """(rows @ w_gate[g], rows @ w_up[g]), each [M, F], in one pass over rows.

  Args:
    rows: [M, D] sorted by group.
    w_gate, w_up: [E, D, F] of rows' dtype.
    group_sizes: [E] int32.
    launch: tiles and interpret mode.
  """
  return _gate_up_kernel(
      rows, w_gate, w_up, group_sizes, launch, kernels.identity, 2
  )


def _gate_up_fwd(rows, w_gate, w_up, group_sizes, launch):
  out = gate_up(rows, w_gate, w_up, group_sizes, launch)
  return out, (rows, w_gate, w_up, group_sizes)


def _gate_up_bwd(launch, residuals, cotangents):
  return _gate_up_bwd_from(*residuals, launch, *cotangents)


gate_up.defvjp(_gate_up_fwd, _gate_up_bwd)


# --- the activation fused in the epilogue -----------------------------------

# Activations the Mosaic GPU lowering computes on the accumulators (it has
# exp, logistic and tanh; the exact "gelu" needs erf).
EPILOGUE_ACTIVATIONS = ("silu", "gelu_tanh")


def _gated_epilogue(activation, with_inputs):
  act = ffn.activation(activation)

  def epilogue(accs):
    gate, up = accs
    h = act(gate) * up  # On the float32 accumulators.
    return (h, gate, up) if with_inputs else (h,)

  return epilogue


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def gated_gate_up(
    rows, w_gate, w_up, group_sizes, activation: str, launch: Launch
):
  """act(rows @ w_gate[g]) * (rows @ w_up[g]): [M, D] -> [M, F], one pass.

  Under differentiation the kernel also writes gate and up, the residuals
  of the activation's gradient.
  """
  if activation not in EPILOGUE_ACTIVATIONS:
    raise ValueError(
        f"activation must be one of {EPILOGUE_ACTIVATIONS} to run in the "
        f"kernel epilogue, got {activation!r}."
    )
  (h,) = _gate_up_kernel(
      rows,
      w_gate,
      w_up,
      group_sizes,
      launch,
      _gated_epilogue(activation, False),
      1,
  )
  return h


def _gated_fwd(rows, w_gate, w_up, group_sizes, activation, launch):
  h, gate, up = _gate_up_kernel(
      rows,
      w_gate,
      w_up,
      group_sizes,
      launch,
      _gated_epilogue(activation, True),
      3,
  )
  return h, (rows, w_gate, w_up, group_sizes, gate, up)


def _gated_bwd(activation, launch, residuals, d_h):
  rows, w_gate, w_up, group_sizes, gate, up = residuals
  _, act_vjp = jax.vjp(
      lambda g, u: ffn.gated(g.astype(jnp.float32), u, activation), gate, up
  )
  d_gate, d_up = act_vjp(d_h.astype(jnp.float32))
  return _gate_up_bwd_from(
      rows, w_gate, w_up, group_sizes, launch, d_gate, d_up
  )


gated_gate_up.defvjp(_gated_fwd, _gated_bwd)
