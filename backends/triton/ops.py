"""The triton kernels as differentiable ops (`moe_core.kernels`).

`grouped_gemm`, `gate_up`, `gated_gate_up` (one kernel, two accumulators)
and `down_weighted` (the routing weight in the gmm epilogue), with
EPILOGUE_ACTIVATIONS, are what `tile_backend.TileKernelBackend` (in
`moe_core.kernels`) maps the backend's hooks onto; `moe_core.kernels`
differentiates the raw kernels in forward and reverse mode alike (each op's
docstring says which kernels its derivatives run). The permutation's kernels
are `permute_ops`' (`TritonPermutationKernels`, also bound here). Every
kernel is launched by `launch.Runner.call`, on the GPU through jax-triton or
on the CPU in Triton's interpreter; the tile list is built here on device,
so nothing waits on the host. Over 400 lines because it is one job: the GEMM
kernels' tile list, their launches and their differentiable forms, each
built on the one before.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from backends.triton import configs
from backends.triton import launch
from backends.triton import permute_ops
from moe_core import activations
from moe_core.kernels import expert_ops
from moe_core.kernels import grouped_matmul

# Activations the gated kernel computes in its epilogue (kernels.py), each
# with any clamp; EPILOGUE_ACTIVATIONS is `moe_core.kernels.tile_backend`'s
# name for them. Registered activations are arbitrary JAX: unfused.
GATED_ACTIVATIONS = (
    "silu",
    "gelu",
    "gelu_tanh",
    "gpt_oss_glu",
    "softcapped_silu",
)
EPILOGUE_ACTIVATIONS = GATED_ACTIVATIONS

TritonPermutationKernels = permute_ops.TritonPermutationKernels


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _kernels():
  """backends.triton.kernels, imported on first use (it imports triton)."""
  # pylint: disable-next=g-import-not-at-top
  from backends.triton import kernels

  return kernels


# --- The tile list ------------------------------------------------------------


def group_offsets(group_sizes: jax.Array, m: int) -> jax.Array:
  """[E + 1] int32 CSR offsets [0, cumsum(group_sizes)], clipped to m."""
  ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends.astype(jnp.int32)])


# Jitted: op by op, one dispatch instead of one per jnp call.
@functools.partial(jax.jit, static_argnums=(1, 2))
def tile_list(
    group_sizes: jax.Array, m: int, block_m: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The gmm kernels' tile list, on device, of static length.

  Group g (0..E-1) owns rows [offsets[g], offsets[g+1]); the tail
  pseudo-group E owns [offsets[E], m) and is written as zeros. Each
  non-empty group, in order, gets one entry per row tile it touches
  (tiles offsets[g] // block_m .. cdiv(end, block_m) - 1), so a tile
  shared by two groups is listed once per group and no tile is written by
  two programs on the same rows.

  Args:
    group_sizes: [E] int32 rows per group, sum <= m.
    m: rows (static).
    block_m: rows per tile (static).

  Returns:
    (group_offsets [E+1], group_ids [T], m_tile_ids [T], num_tiles [1]), all
    int32, with T = cdiv(m, block_m) + E; entries from num_tiles[0] on are 0.
  """
  num_groups = group_sizes.shape[0]
  offsets = group_offsets(group_sizes, m)
  starts = offsets  # Groups 0..E, E being the tail.
  ends = jnp.concatenate([offsets[1:], jnp.full((1,), m, jnp.int32)])
  first = starts // block_m
  counts = jnp.where(ends > starts, (ends + block_m - 1) // block_m - first, 0)
  cumulative = jnp.cumsum(counts).astype(jnp.int32)
  num_tiles = cumulative[-1]
  length = _cdiv(m, block_m) + num_groups
  i = jnp.arange(length, dtype=jnp.int32)
  # Entry i belongs to the first group whose running count passes i.
  group = jnp.minimum(
      jnp.searchsorted(cumulative, i, side="right"), num_groups
  ).astype(jnp.int32)
  tile = first[group] + i - (cumulative[group] - counts[group])
  used = i < num_tiles
  return (
      offsets,
      jnp.where(used, group, 0).astype(jnp.int32),
      jnp.where(used, tile, 0).astype(jnp.int32),
      num_tiles.reshape(1),
  )


# --- Kernel calls -------------------------------------------------------------


def _row_scale(row_scale: jax.Array | None) -> tuple[bool, jax.Array]:
  """(HAS_ROW_SCALE, the kernel's row_scale: [M] float32, or a [1] dummy)."""
  if row_scale is None:
    return False, jnp.zeros((1,), jnp.float32)
  return True, row_scale.astype(jnp.float32)


def _tile_list_call(
    kind: str,
    x: jax.Array,
    weights: tuple[jax.Array, jax.Array, jax.Array],
    group_sizes: jax.Array,
    n: int,
    out_dtype,
    runner: launch.Runner,
    **constexprs,
) -> jax.Array:
  """One launch of `kernels.gmm_kernel`: x [M, K] -> [M, N].

  Args:
    kind: the config kind: "fwd", "dgrad" or "gated".
    x: [M, K] rows sorted by group.
    weights: (w, w_up, row_scale), the kernel's arrays between x and the
      tile list; w is [E, ...].
    group_sizes: [E] int32, sum <= M.
    n: out's width N.
    out_dtype: out's dtype.
    runner: a `launch.Runner`.
    **constexprs: TRANSPOSE_W, HAS_ROW_SCALE and ACTIVATION.
  """
  m, k = x.shape
  num_groups = weights[0].shape[0]
  if not (m and k and n):  # Nothing to launch: an empty sum is zero.
    return jnp.zeros((m, n), out_dtype)
  config = runner.config(kind, m, k, n, num_groups, x.dtype)
  offsets, group_ids, m_tile_ids, num_tiles = tile_list(
      group_sizes, m, config.block_m
  )
  (out,) = runner.call(
      _kernels().gmm_kernel,
      (x, *weights, offsets, group_ids, m_tile_ids, num_tiles),
      (jax.ShapeDtypeStruct((m, n), out_dtype),),
      (group_ids.shape[0], _cdiv(n, config.block_n)),
      config,
      M=m,
      K=k,
      N=n,
      E=num_groups,
      **constexprs,
      **configs.block_constexprs(kind, config),
  )
  return out


def gmm(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    transpose_w: bool,
    out_dtype,
    runner: launch.Runner,
    kind: str = "fwd",
    row_scale: jax.Array | None = None,
) -> jax.Array:
  """One gmm kernel call: x [M, K] x w [E, K, N] ([E, N, K]) -> [M, N].

  Not differentiable (the ops below are). Rows at or past sum(group_sizes)
  come out as zeros; with `row_scale` [M] float32, out[r] is multiplied by
  row_scale[r] in the epilogue.
  """
  has_scale, scale = _row_scale(row_scale)
  return _tile_list_call(
      kind,
      x,
      # w_up is unread without an activation: w again, no new buffer.
      (w, w, scale),
      group_sizes,
      w.shape[1] if transpose_w else w.shape[2],
      jnp.dtype(out_dtype),
      runner,
      TRANSPOSE_W=bool(transpose_w),
      HAS_ROW_SCALE=has_scale,
      ACTIVATION="",
  )


def _activation_constexprs(settings: activations.Settings) -> dict:
  """The gated kernel's constexprs for `settings`: 0.0 for an unset option
  (a set limit, alpha or cap is > 0: `MoEConfig` checks)."""
  options = {
      "SWIGLU_LIMIT": settings.swiglu_limit,
      "SWIGLU_ALPHA": settings.swiglu_alpha,
      "GATE_SOFTCAP": settings.gate_softcap,
      "UP_SOFTCAP": settings.up_softcap,
  }
  return {
      "ACTIVATION": settings.name,
      **{k: 0.0 if v is None else float(v) for k, v in options.items()},
  }


def gated_gmm(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    group_sizes: jax.Array,
    activation: activations.Settings,
    runner: launch.Runner,
) -> jax.Array:
  """f(x @ w_gate[g], x @ w_up[g]): [M, D] -> [M, F] in x's dtype, f the
  gated activation of `activation` (clamp and options included)."""
  _, no_scale = _row_scale(None)
  return _tile_list_call(
      "gated",
      x,
      (w_gate, w_up, no_scale),
      group_sizes,
      w_gate.shape[2],
      x.dtype,
      runner,
      TRANSPOSE_W=False,
      HAS_ROW_SCALE=False,
      **_activation_constexprs(activation),
  )


def tgmm(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    out_dtype,
    runner: launch.Runner,
    row_scale: jax.Array | None = None,
) -> jax.Array:
  """Per-group a^T b: a [M, P], b [M, Q] -> [E, P, Q] of out_dtype.

  out[e] = sum over group e's rows r of a[r]^T (row_scale[r] * b[r]),
  summed in float32; rows past sum(group_sizes) are never read and empty
  groups give zeros.
  """
  m, p = a.shape
  q = b.shape[1]
  num_groups = group_sizes.shape[0]
  out_dtype = jnp.dtype(out_dtype)
  if not (m and p and q):
    return jnp.zeros((num_groups, p, q), out_dtype)
  # The wgrad config is indexed like the forward's (m, k, n) = (M, P, Q):
  # block_m rows summed per step, dW blocks [block_k, block_n].
  config = runner.config("wgrad", m, p, q, num_groups, a.dtype)
  has_scale, scale = _row_scale(row_scale)
  (out,) = runner.call(
      _kernels().tgmm_kernel,
      (a, b, scale, group_offsets(group_sizes, m)),
      (jax.ShapeDtypeStruct((num_groups, p, q), out_dtype),),
      (num_groups, _cdiv(p, config.block_k), _cdiv(q, config.block_n)),
      config,
      M=m,
      P=p,
      Q=q,
      E=num_groups,
      HAS_ROW_SCALE=has_scale,
      **configs.block_constexprs("wgrad", config),
  )
  return out


# --- The kernels, differentiated by moe_core.kernels -------------------------


@dataclasses.dataclass(frozen=True)
class TritonKernels(grouped_matmul.GroupedKernels):
  """The gmm and tgmm kernels as `GroupedKernels` (one product per call).

  `moe_core.kernels.grouped_matmul` differentiates them: dX is the gmm
  kernel against the transposed weights (the "dgrad" configs), dW the tgmm
  kernel.
  """

  runner: launch.Runner

  def gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
    kind = "dgrad" if transpose_rhs else "fwd"
    return gmm(
        lhs, rhs, group_sizes, transpose_rhs, out_dtype, self.runner, kind
    )

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    del num_groups  # group_sizes' length.
    return tgmm(lhs, rhs, group_sizes, out_dtype, self.runner)


def grouped_gemm(
    rows, weights, group_sizes, transpose_rhs: bool, out_dtype, runner
):
  """rows [M, C] x weights [E, C, N] ([E, N, C] transposed) -> [M, N].

  Rows past sum(group_sizes) come out as zeros and get zero gradient;
  differentiable in both directions (dX: gmm(dy, w^T); dW: tgmm(x, dy)).

  Args:
    rows: [M, C] sorted by group.
    weights: [E, C, N] of rows' dtype, or [E, N, C] if `transpose_rhs`.
    group_sizes: [E] int32, sum <= M.
    transpose_rhs: contract with weights[e].T.
    out_dtype: the output's dtype (accumulation is float32).
    runner: a `launch.Runner` (GPU or interpreter, configs).
  """
  return grouped_matmul.gmm(
      TritonKernels(runner),
      rows,
      weights,
      group_sizes,
      transpose_rhs=transpose_rhs,
      out_dtype=out_dtype,
  )


def gate_up(rows, w_gate, w_up, group_sizes, runner):
  """(rows @ w_gate[g], rows @ w_up[g]), each [M, F] in rows' dtype.

  Two `grouped_gemm` calls: the triton kernels have no two-output gate/up
  pass (`gated_gate_up` fuses the activation instead).
  """
  return tuple(
      grouped_gemm(rows, w, group_sizes, False, rows.dtype, runner)
      for w in (w_gate, w_up)
  )


@dataclasses.dataclass(frozen=True)
class _FusedGated:
  """The gated kernel: h only; its derivatives recompute gate and up."""

  runner: launch.Runner
  keeps_inputs: ClassVar[bool] = False

  def __call__(
      self, rows, w_gate, w_up, group_sizes, *, activation, with_inputs
  ):
    del with_inputs  # keeps_inputs is False: never asked for them.
    return (
        gated_gmm(rows, w_gate, w_up, group_sizes, activation, self.runner),
    )


@dataclasses.dataclass(frozen=True)
class _RowScaledGmm:
  """The gmm kernel with a per-row scale in its epilogue."""

  runner: launch.Runner

  def __call__(self, h, w_down, group_sizes, row_scale):
    return (
        gmm(
            h,
            w_down,
            group_sizes,
            False,
            h.dtype,
            self.runner,
            row_scale=row_scale,
        ),
    )


def gated_gate_up(
    rows,
    w_gate,
    w_up,
    group_sizes,
    activation: str | activations.Settings,
    runner,
):
  """act(rows @ w_gate[g]) * (rows @ w_up[g]): [M, D] -> h [M, F].

  One kernel: two float32 accumulators share each rows tile and only h is
  written. Its derivatives recompute gate and up (two gmm calls) where
  they need them rather than keeping them, so the forward's memory traffic
  stays one [M, F] output (`moe_core.kernels.expert_ops`); then
  dX = gmm(dgate, wg^T) + gmm(dup, wu^T) and dW is a tgmm.

  Args:
    rows: [M, D] sorted by group.
    w_gate, w_up: [E, D, F] of rows' dtype.
    group_sizes: [E] int32, sum <= M.
    activation: one of GATED_ACTIVATIONS, a name or its
      `activations.Settings` (clamp and options).
    runner: a `launch.Runner`.
  """
  settings = expert_ops.check_epilogue_activation(activation, GATED_ACTIVATIONS)
  return expert_ops.gated_gate_up(
      TritonKernels(runner),
      _FusedGated(runner),
      rows,
      w_gate,
      w_up,
      group_sizes,
      settings,
  )


def down_weighted(h, w_down, group_sizes, row_scale, runner):
  """out[r] = row_scale[r] * (h[r] @ w_down[g]): [M, F] -> [M, D].

  The scale multiplies the float32 accumulator before the cast, so a
  combine that follows needs unit weights. Rows past sum(group_sizes) come
  out as zeros and get zero gradient in h and row_scale, whatever h,
  row_scale or the cotangent hold there. Derivatives: dh = gmm(s dy, w^T),
  dW = tgmm(h, s dy), ds[r] = <dy[r], h[r] @ w[g]> (the product recomputed
  by gmm).

  Args:
    h: [M, F] sorted by group.
    w_down: [E, F, D] of h's dtype.
    group_sizes: [E] int32, sum <= M.
    row_scale: [M] float32, one weight per row.
    runner: a `launch.Runner`.
  """

  return expert_ops.row_scaled_gmm(
      TritonKernels(runner),
      _RowScaledGmm(runner),
      h,
      w_down,
      group_sizes,
      row_scale,
  )
