"""The FFI custom calls as the cpu backend's `GroupedKernels`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu import library
from moe_core.kernels import grouped_matmul

# Registered at import (never raising), so that a program exported with
# these custom calls runs once this module is imported; AVAILABLE and
# WHY_NOT say whether that worked.
AVAILABLE, WHY_NOT = library.load()

# What the custom calls take and give; other out dtypes are cast from
# float32.
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _out_type(out_dtype) -> np.dtype:
  out_dtype = jnp.dtype(out_dtype)
  return out_dtype if out_dtype in DTYPES else jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class CpuKernels(grouped_matmul.GroupedKernels):
  """gmm and tgmm as the custom calls of `library` (registered first).

  `moe_core.kernels.grouped_matmul` differentiates them: forward and dX
  are `gmm` (dX with the weights' other layout), dW is `tgmm`. Operands are
  float32 or bfloat16, summed in float32.
  """

  def gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
    """lhs [M, C] x rhs [E, C, N] ([E, N, C] transposed) -> [M, N]."""
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    call = jax.ffi.ffi_call(
        library.GMM_TARGET,
        jax.ShapeDtypeStruct((lhs.shape[0], n), _out_type(out_dtype)),
    )
    out = call(
        lhs, rhs, group_sizes.astype(jnp.int32), transpose_rhs=transpose_rhs
    )
    return out.astype(out_dtype)

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    """Per group lhs_g^T rhs_g: [M, A] x [M, B] -> [E, A, B]."""
    call = jax.ffi.ffi_call(
        library.TGMM_TARGET,
        jax.ShapeDtypeStruct(
            (num_groups, lhs.shape[1], rhs.shape[1]), _out_type(out_dtype)
        ),
    )
    return call(lhs, rhs, group_sizes.astype(jnp.int32)).astype(out_dtype)
