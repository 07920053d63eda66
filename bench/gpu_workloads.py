"""gpu_check's workloads: shapes, correctness cases, timed problems, methods.

Every phase of bench/gpu_check.py (correctness, timing, lowering) reads its
shapes and builds its programs here, so that what is checked, what is timed
and what is lowered for CUDA are the same programs. Needs only jax and this
repository (no absl): it runs alone on the GPU machine.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

import moe_core
from bench import gemm_workloads
from moe_core import ffn

# Shapes: DeepSeek-V3 experts on the GPU; tiny ones for --dry_run on a CPU.
FULL = {"tokens": 4096, "top_k": 8, "hidden": 7168, "ffn": 2048, "experts": 32}
DRY = {"tokens": 64, "top_k": 8, "hidden": 256, "ffn": 128, "experts": 8}

# Correctness cases: (M, C, N, group sizes, transpose_rhs). Every case leaves
# padding rows (sum(group sizes) < M), filled with NaN.
GEMM_CASES = [
    (64, 32, 48, (10, 0, 23, 21), False),  # Shared tiles, padding rows.
    (200, 96, 160, (0, 70, 1, 64, 0, 40), False),
    (130, 64, 80, (33, 0, 60, 7), True),  # The dX layout.
    # 32 groups of 0-30 rows (465 of 512 rows), the first and last empty.
    (512, 256, 384, tuple(range(0, 31)) + (0,), False),
    # 288 rows per expert and N = 2048: in bf16 the GPU heuristic picks
    # gmm_bf16_large for the forward, as at the timed shapes.
    (1152, 128, 2048, (300, 0, 517, 211), False),
]
# Expert FFN cases: (M, D, F, group sizes), bf16, plain and with the fused
# activation. This one's fused gate+up forward runs gmm_bf16_large fitted to
# two accumulators (tiling.fit_gpu), as at the timed shapes.
FFN_CASES = [
    (1152, 128, 2048, (300, 0, 517, 211)),
]
# The MoE layer case: its config and the [batch, sequence] of its input.
LAYER_CONFIG = {
    "num_experts": 8,
    "top_k": 2,
    "hidden_size": 256,
    "expert_ffn_size": 512,
    "shared_ffn_size": 256,
}
LAYER_BATCH = (2, 256)

# The expert FFN's weights, the operand of every FFN method.
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


class Problem(NamedTuple):
  """One timed problem: the shapes of its operands and its forward FLOPs.

  kind is "gemm" (weights_shape [E, C, N]) or "ffn" (the weights are the
  expert FFN's, from `ffn_config`; weights_shape None).
  """

  name: str
  kind: str
  rows_shape: tuple[int, int]
  weights_shape: tuple[int, int, int] | None
  out_shape: tuple[int, int]
  fwd_flops: int


def _gemm_problem(name, m, c, n, e):
  """[M, C] x [E, C, N] -> [M, N]: 2*M*C*N FLOPs."""
  return Problem(name, "gemm", (m, c), (e, c, n), (m, n), 2 * m * c * n)


def problems(shape, skew):
  """(M, [E] group sizes, [Problem]) of the timed shapes.

  M = T * top_k rows; the gate/up-shaped and down-shaped grouped GEMMs, then
  the whole expert FFN (three such GEMMs).
  """
  m = shape["tokens"] * shape["top_k"]
  d, f, e = shape["hidden"], shape["ffn"], shape["experts"]
  sizes = gemm_workloads.skewed_group_sizes(skew, m, e)
  return (
      m,
      sizes,
      [
          _gemm_problem("gemm_up [M,D]x[E,D,F]", m, d, f, e),
          _gemm_problem("gemm_down [M,F]x[E,F,D]", m, f, d, e),
          Problem("expert_ffn", "ffn", (m, d), None, (m, d), 3 * 2 * m * d * f),
      ],
  )


def ffn_config(shape):
  """The MoEConfig of the timed expert FFN.

  The expert FFN reads only its sizes and activation; top_k only has to be
  valid (<= E) when --experts is small.
  """
  return moe_core.MoEConfig(
      num_experts=shape["experts"],
      top_k=min(shape["top_k"], shape["experts"]),
      hidden_size=shape["hidden"],
      expert_ffn_size=shape["ffn"],
  )


def expert_weights(params):
  """The expert FFN's weights out of a layer's params (or their shapes)."""
  return {k: params[k] for k in EXPERT_WEIGHTS}


def backends(on_gpu):
  """(pallas, pallas with the activation epilogue, xla) backends.

  on_gpu None lets pallas choose (interpreted off a GPU); True or False
  forces compiled or interpreted kernels (True: for the CUDA lowering).
  """
  interpret = None if on_gpu is None else (not on_gpu)
  pallas = moe_core.get_backend("pallas", interpret=interpret)
  fused = moe_core.get_backend(
      "pallas", interpret=interpret, fuse_activation=True
  )
  # On a GPU the xla backend is ragged_dot (with zeroed padding rows).
  xla = moe_core.get_backend("xla", use_ragged_dot=bool(on_gpu))
  return pallas, fused, xla


def gemm_methods(pallas, xla):
  """name -> f(rows, weights, group_sizes) -> [M, N]."""
  return {
      "dense": gemm_workloads.dense_gemm,
      "ragged_dot": gemm_workloads.ragged_dot_gemm,
      "xla": xla.grouped_gemm,
      "pallas": pallas.grouped_gemm,
  }


def ffn_methods(pallas, fused, xla, cfg):
  """name -> f(rows, expert weights, group_sizes) -> [M, D]."""

  def dense(x, p, g):
    del g  # Every row through one expert's [D, F], [D, F], [F, D].
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    gate = dot(x, p["w_gate"]).astype(x.dtype)
    up = dot(x, p["w_up"]).astype(x.dtype)
    h = ffn.gated(gate, up, cfg.activation)
    return dot(h, p["w_down"]).astype(x.dtype)

  return {
      "dense": dense,
      "xla": lambda x, p, g: xla.expert_ffn(x, g, p, cfg),
      "pallas": lambda x, p, g: pallas.expert_ffn(x, g, p, cfg),
      "pallas_fused_act": lambda x, p, g: fused.expert_ffn(x, g, p, cfg),
  }


def methods_for(kind, pallas, fused, xla, cfg):
  """The methods of a problem of `kind` ("gemm" or "ffn")."""
  if kind == "gemm":
    return gemm_methods(pallas, xla)
  return ffn_methods(pallas, fused, xla, cfg)


def output_and_grads(fn, x, w, cotangent):
  """(fn(x, w), d x, d w): the output and its VJP with `cotangent`."""
  out, vjp = jax.vjp(fn, x, w)
  return (out,) + vjp(cotangent)
