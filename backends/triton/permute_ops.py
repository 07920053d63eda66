"""The permute kernels as `moe_core.kernels.permutation`'s kernels.

gather, scatter, combine, spread and row_dots are the permute, permute_bwd,
unpermute and unpermute_bwd_* kernels (`TritonPermutationKernels`), each the
others' transpose; `moe_core.kernels.permutation` differentiates them.
Each is launched by `launch.Runner.call`, like the GEMM kernels (`ops`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from backends.triton import configs
from backends.triton import launch
from moe_core.kernels import permutation


def _permute_kernels():
  """backends.triton.permute_kernels, imported on first use."""
  # pylint: disable-next=g-import-not-at-top
  from backends.triton import permute_kernels

  return permute_kernels


@dataclasses.dataclass(frozen=True)
class TritonPermutationKernels(permutation.PermutationKernels):
  """The five gather kernels of `permute_kernels` as `PermutationKernels`.

  Each kernel reads `invalid` flags; an op that wants 0 rather than NaN for
  an invalid copy passes it as dropped (kept 0, invalid 0) where dropped
  copies give 0, or zeroes the copy's row after the gather.
  """

  runner: launch.Runner

  def _launch(self, name, args, plan, top_k, *, per_copy=False, out=None):
    """Kernel `name` on `args` (args[0]: the data, [A or T, D]) -> its output.

    The output is `out` (shape, dtype) if given, else one row of D per copy
    ([A, D], `per_copy`) or per token ([T, D]), in the data's dtype. The
    blocks are the "permute" config's: block_m rows (or tokens) by block_n
    columns.
    """
    copies = plan.position.shape[0]
    tokens = copies // top_k
    data = args[0]
    width = data.shape[1]
    shape, dtype = out or ((copies if per_copy else tokens, width), data.dtype)
    if not (tokens and width):  # Nothing to launch: empty sums are zero.
      return jnp.zeros(shape, dtype)
    kernels = _permute_kernels()
    kernel = kernels.KERNELS[name]
    config = self.runner.config(
        "permute", tokens * top_k, width, width, 1, data.dtype
    )
    constexprs = dict(
        T=tokens,
        K=top_k,
        D=width,
        **configs.block_constexprs("permute", config, kernel),
    )
    (result,) = self.runner.call(
        kernel,
        args,
        (jax.ShapeDtypeStruct(shape, dtype),),
        kernels.grid(name, **constexprs),
        config,
        **constexprs,
    )
    return result

  def gather(self, x, plan, *, top_k, nan_invalid):
    args = (x, plan.assignment, plan.invalid)
    rows = self._launch("permute", args, plan, top_k, per_copy=True)
    if nan_invalid:
      return rows
    bad = (plan.invalid != 0)[plan.assignment][:, None]
    return jnp.where(bad, jnp.zeros((), x.dtype), rows)

  def scatter(self, rows, plan, *, top_k):
    args = (rows, plan.position, plan.invalid)
    return self._launch("permute_bwd", args, plan, top_k)

  def combine(self, rows, weights, plan, *, top_k, nan_invalid):
    kept, invalid = _flags(plan, nan_invalid)
    weights = weights.astype(jnp.float32)
    args = (rows, plan.position, weights, kept, invalid)
    return self._launch("unpermute", args, plan, top_k)

  def spread(self, dy, weights, plan, *, top_k):
    weights = weights.astype(jnp.float32)
    args = (dy, plan.assignment, weights, plan.kept, plan.invalid)
    return self._launch("unpermute_bwd_rows", args, plan, top_k, per_copy=True)

  def row_dots(self, dy, rows, plan, *, top_k, nan_invalid):
    kept, invalid = _flags(plan, nan_invalid)
    args = (dy, rows, plan.position, kept, invalid)
    out = ((plan.position.shape[0] // top_k, top_k), jnp.float32)
    return self._launch("unpermute_bwd_weights", args, plan, top_k, out=out)


def _flags(plan, nan_invalid):
  """(kept, invalid) for a kernel: an invalid copy that should give 0
  rather than NaN is passed as dropped instead."""
  if nan_invalid:
    return plan.kept, plan.invalid
  kept = jnp.where(plan.invalid != 0, 0, plan.kept).astype(jnp.int8)
  return kept, jnp.zeros_like(plan.invalid)
