"""XlaBackend: no custom kernels; tile loops on CPU, ragged_dot elsewhere."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from backends.xla import grouped_gemm as gmm
from moe_core import backend
from moe_core import operands
from moe_core import precision
from moe_core import quantized_gemm


class XlaBackend(backend.Backend):
  """Portable grouped GEMM built from XLA ops.

  Args:
    levels: tile heights of the group-aligned tile loop, largest first.
    use_ragged_dot: None picks by platform: `jax.lax.ragged_dot` off the CPU
      (GPU and TPU have native lowerings), the tile loop on the CPU, where
      ragged_dot becomes a dense masked product.
    compute_dtype: what the tile loop multiplies in. None picks float32 on
      the CPU (XLA:CPU multiplies bfloat16 about half as fast as float32)
      and the operands' dtype elsewhere. Accumulation is float32 always.
  """

  name: ClassVar[str] = "xla"
  # FP8 recipes: the raw E4M3 values multiplied per K block, scales applied
  # after each block's product; MXFP8 and NVFP4 dequantised per block first
  # (`moe_core.quantized_gemm.scaled_grouped_gemm`).
  precisions: ClassVar[tuple[str, ...]] = precision.RECIPES

  def __init__(
      self,
      *,
      levels: tuple[int, ...] = gmm.DEFAULT_LEVELS,
      use_ragged_dot: bool | None = None,
      compute_dtype: str | None = None,
  ):
    levels = tuple(levels)
    if not levels or any(not isinstance(h, int) or h < 1 for h in levels):
      raise ValueError(f"levels must be positive ints, got {levels}.")
    if list(levels) != sorted(set(levels), reverse=True):
      raise ValueError(f"levels must be strictly decreasing, got {levels}.")
    self.levels = levels
    self.use_ragged_dot = use_ragged_dot
    self.compute_dtype = compute_dtype

  def _ragged(self) -> bool:
    """Whether products go through jax.lax.ragged_dot (not the tile loop)."""
    if self.use_ragged_dot is None:
      return jax.default_backend() != "cpu"
    return self.use_ragged_dot

  def _quantized_grouped_gemm(
      self, q: operands.QuantizedGemmOperands
  ) -> jax.Array:
    """This backend's float32 grouped GEMM, scaled per K block."""

    def gemm(rows, weights, group_sizes):
      return self._grouped_gemm(
          operands.GemmOperands(
              rows=rows,
              weights=weights,
              group_sizes=group_sizes,
              transpose_rhs=False,
              out_dtype=jnp.dtype(jnp.float32),
          )
      )

    return quantized_gemm.scaled_grouped_gemm(q, gemm)

  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    if self._ragged():
      return _ragged_dot(gemm)
    compute_dtype = self.compute_dtype
    if compute_dtype is None and jax.default_backend() == "cpu":
      compute_dtype = "float32"
    return gmm.grouped_gemm(
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
        gemm.transpose_rhs,
        gemm.out_dtype,
        self.levels,
        None if compute_dtype is None else jnp.dtype(compute_dtype),
    )


def _ragged_dot(gemm: operands.GemmOperands) -> jax.Array:
  """jax.lax.ragged_dot, with rows past sum(group_sizes) forced to zero.

  rows [M, C] x weights [E, C, N] ([E, N, C] if `transpose_rhs`) -> [M, N].
  """
  rows, weights, group_sizes = gemm.rows, gemm.weights, gemm.group_sizes
  if gemm.transpose_rhs:
    weights = jnp.swapaxes(weights, 1, 2)
  valid = jnp.arange(rows.shape[0])[:, None] < jnp.sum(group_sizes)
  # Zeroing the rows first keeps NaN in unused rows out of the gradients.
  rows = jnp.where(valid, rows, jnp.zeros((), rows.dtype))
  # float32 inputs ask for full float32 products (no TF32 on GPUs).
  precision = jax.lax.Precision.HIGHEST if rows.dtype == jnp.float32 else None
  out = jax.lax.ragged_dot(
      rows,
      weights,
      group_sizes,
      precision=precision,
      preferred_element_type=jnp.float32,
  )
  return jnp.where(valid, out, 0.0).astype(gemm.out_dtype)
