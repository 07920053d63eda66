"""XlaBackend: no custom kernels; tile loops on CPU, ragged_dot elsewhere."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from backends.xla import grouped_gemm as gmm
from moe_core import backend
from moe_core import operands
from moe_core import precision
from moe_core import quantized_gemm
from moe_core.kernels import grouped_matmul


class XlaBackend(backend.Backend):
  """Portable grouped GEMM built from XLA ops.

  Args:
    levels: tile heights of the group-aligned tile loop, largest first.
    use_ragged_dot: None picks by the platform the program is lowered for
      (`jax.lax.platform_dependent`, not the host that traces it):
      `jax.lax.ragged_dot` off the CPU (GPU and TPU have native lowerings),
      the tile loop on the CPU, where ragged_dot becomes a dense masked
      product.
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

  def _quantized_grouped_gemm(
      self, q: operands.QuantizedGemmOperands
  ) -> jax.Array:
    """This backend's float32 grouped GEMM, scaled per K block."""
    return quantized_gemm.scaled_grouped_gemm(
        q, quantized_gemm.float32_gemm(self._grouped_gemm)
    )

  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    if self.use_ragged_dot is None:
      # Chosen for the platform the program is lowered for, not the host
      # that traces it: a step traced on a CPU host and compiled for GPUs
      # (moe_core.aot, jax.export) must multiply through ragged_dot there.
      return jax.lax.platform_dependent(
          cpu=lambda: self._tile_loop(gemm, on_cpu=True),
          default=lambda: _ragged_dot(gemm),
      )
    if self.use_ragged_dot:
      return _ragged_dot(gemm)
    return self._tile_loop(gemm, on_cpu=jax.default_backend() == "cpu")

  def _tile_loop(self, gemm: operands.GemmOperands, on_cpu: bool):
    compute_dtype = self.compute_dtype
    if compute_dtype is None and on_cpu:
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


@dataclasses.dataclass(frozen=True)
class RaggedDotKernels(grouped_matmul.GroupedKernels):
  """`jax.lax.ragged_dot` (forward, dX) and `ragged_dot_general` with the
  rows as the ragged contracting dimension (dW), as `GroupedKernels`.

  Rows past sum(group_sizes) are zeroed before every product, so NaN there
  never reaches a result, and zeroed in gmm's output.
  """

  def gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
    if transpose_rhs:
      rhs = jnp.swapaxes(rhs, 1, 2)
    valid = _used_rows(lhs, group_sizes)
    lhs = jnp.where(valid, lhs, jnp.zeros((), lhs.dtype))
    if rhs.shape[0] == 1:
      # One group is every used row: a plain dot. Not ragged_dot, which
      # XLA:TPU in libtpu 0.0.42 (JAX 0.10's) cannot compile for one group
      # with computed sizes: "RET_CHECK failure (.../custom_ops/
      # mask_aggregator.cc:271) get_lowered_(0)->memory_space() == kHbm ||
      # ... == kVmem" on the custom call MaskAggregatorBlock.
      out = jnp.dot(
          lhs,
          rhs[0],
          precision=_precision(lhs.dtype),
          preferred_element_type=jnp.float32,
      )
    else:
      out = jax.lax.ragged_dot(
          lhs,
          rhs,
          group_sizes,
          precision=_precision(lhs.dtype),
          preferred_element_type=jnp.float32,
      )
    return jnp.where(valid, out, 0.0).astype(out_dtype)

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    del num_groups  # group_sizes' length.
    valid = _used_rows(lhs, group_sizes)
    zero = jnp.zeros((), lhs.dtype)
    lhs = jnp.where(valid, lhs, zero)
    rhs = jnp.where(valid, rhs, zero)
    if group_sizes.shape[0] == 1:
      # One group: lhs^T @ rhs over the used rows (the MaskAggregatorBlock
      # failure of `gmm` above).
      out = jax.lax.dot_general(
          lhs,
          rhs,
          (((0,), (0,)), ((), ())),
          precision=_precision(lhs.dtype),
          preferred_element_type=jnp.float32,
      )[None]
      return out.astype(out_dtype)
    out = jax.lax.ragged_dot_general(
        lhs,
        rhs,
        group_sizes,
        jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())),
            lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[],
        ),
        precision=_precision(lhs.dtype),
        preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)


def _used_rows(rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """[M, 1] bool: the row lies in a group."""
  return jnp.arange(rows.shape[0])[:, None] < jnp.sum(group_sizes)


def _precision(dtype):
  # float32 inputs ask for full float32 products (no TF32 on GPUs).
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _ragged_dot(gemm: operands.GemmOperands) -> jax.Array:
  """jax.lax.ragged_dot, with rows past sum(group_sizes) forced to zero.

  rows [M, C] x weights [E, C, N] ([E, N, C] if `transpose_rhs`) -> [M, N],
  differentiable in both directions (`RaggedDotKernels`).
  """
  return grouped_matmul.gmm(
      RaggedDotKernels(),
      gemm.rows,
      gemm.weights,
      gemm.group_sizes,
      transpose_rhs=gemm.transpose_rhs,
      out_dtype=gemm.out_dtype,
  )
