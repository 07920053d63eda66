"""The triton kernels tied into differentiable ops with jax.custom_vjp.

grouped_gemm   y = x @ w[g]                dX: gmm(dy, w^T)   dW: tgmm(x, dy)
gated_gate_up  h = act(x @ wg[g]) * (x @ wu[g]), one kernel, two
               accumulators; backward recomputes gate and up with gmm, then
               dX = gmm(dgate, wg^T) + gmm(dup, wu^T), dW = tgmm(x, d...)
down_weighted  y[r] = s[r] * (h[r] @ w[g]), s in the gmm epilogue
               dh: gmm(dy, w^T) scaled by s   dW: tgmm(h, dy) scaled by s
               ds[r] = <dy[r], h[r] @ w[g]> (the product recomputed by gmm)
permute        rows[i] = x[assignment[i] // K]   dx: permute_bwd
unpermute      y[t] = sum_k w[t, k] rows[position[t*K + k]]
               d rows: unpermute_bwd_rows   d w: unpermute_bwd_weights

Every kernel is launched by `launch.call`, on the GPU through jax-triton or
on the CPU in Triton's interpreter; the tile list is built here on device,
so nothing waits on the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from backends.triton import configs
from backends.triton import launch
from moe_core import ffn

# Activations the gated kernel computes in its epilogue (kernels.py).
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _kernels():
  """backends.triton.kernels, imported on first use (it imports triton)."""
  # pylint: disable-next=g-import-not-at-top
  from backends.triton import kernels

  return kernels


def _permute_kernels():
  """backends.triton.permute_kernels, imported on first use."""
  # pylint: disable-next=g-import-not-at-top
  from backends.triton import permute_kernels

  return permute_kernels


def _call(runner, kernel, args, out_types, grid, config, **constexprs):
  """launch.call with the config's launch settings.

  DOT_F32 is left to `launch.call`: True in the interpreter, whose bf16
  tl.dot is wrong (triton-lang/triton#11584), False on the GPU so that bf16
  feeds the tensor cores.
  """
  return launch.call(
      runner,
      kernel,
      args,
      out_types,
      grid,
      config.num_warps,
      config.num_stages,
      **constexprs,
  )


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
  m, k = x.shape
  num_groups = w.shape[0]
  n = w.shape[1] if transpose_w else w.shape[2]
  out_dtype = jnp.dtype(out_dtype)
  if not (m and k and n):  # Nothing to launch: an empty sum is zero.
    return jnp.zeros((m, n), out_dtype)
  config = runner.config(kind, m, k, n, num_groups, x.dtype)
  offsets, group_ids, m_tile_ids, num_tiles = tile_list(
      group_sizes, m, config.block_m
  )
  has_scale = row_scale is not None
  scale = (
      row_scale.astype(jnp.float32)
      if has_scale
      else jnp.zeros((1,), jnp.float32)
  )
  (out,) = _call(
      runner,
      _kernels().gmm_kernel,
      (x, w, scale, offsets, group_ids, m_tile_ids, num_tiles),
      (jax.ShapeDtypeStruct((m, n), out_dtype),),
      (group_ids.shape[0], _cdiv(n, config.block_n)),
      config,
      M=m,
      K=k,
      N=n,
      E=num_groups,
      TRANSPOSE_W=bool(transpose_w),
      HAS_ROW_SCALE=has_scale,
      **configs.block_constexprs(kind, config),
  )
  return out


def gated_gmm(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    group_sizes: jax.Array,
    activation: str,
    runner: launch.Runner,
) -> jax.Array:
  """act(x @ w_gate[g]) * (x @ w_up[g]): [M, D] -> [M, F] in x's dtype."""
  m, d = x.shape
  num_groups, _, f = w_gate.shape
  if not (m and d and f):
    return jnp.zeros((m, f), x.dtype)
  config = runner.config("gated", m, d, f, num_groups, x.dtype)
  offsets, group_ids, m_tile_ids, num_tiles = tile_list(
      group_sizes, m, config.block_m
  )
  (out,) = _call(
      runner,
      _kernels().gated_gmm_kernel,
      (x, w_gate, w_up, offsets, group_ids, m_tile_ids, num_tiles),
      (jax.ShapeDtypeStruct((m, f), x.dtype),),
      (group_ids.shape[0], _cdiv(f, config.block_n)),
      config,
      M=m,
      K=d,
      N=f,
      E=num_groups,
      ACTIVATION=activation,
      **configs.block_constexprs("gated", config),
  )
  return out


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
  has_scale = row_scale is not None
  scale = (
      row_scale.astype(jnp.float32)
      if has_scale
      else jnp.zeros((1,), jnp.float32)
  )
  (out,) = _call(
      runner,
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


# --- grouped_gemm -------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def grouped_gemm(
    rows, weights, group_sizes, transpose_rhs: bool, out_dtype, runner
):
  """rows [M, C] x weights [E, C, N] ([E, N, C] transposed) -> [M, N].

  Rows past sum(group_sizes) come out as zeros and get zero gradient.

  Args:
    rows: [M, C] sorted by group.
    weights: [E, C, N] of rows' dtype, or [E, N, C] if `transpose_rhs`.
    group_sizes: [E] int32, sum <= M.
    transpose_rhs: contract with weights[e].T.
    out_dtype: the output's dtype (accumulation is float32).
    runner: a `launch.Runner` (GPU or interpreter, configs).
  """
  return gmm(rows, weights, group_sizes, transpose_rhs, out_dtype, runner)


def _grouped_gemm_fwd(
    rows, weights, group_sizes, transpose_rhs, out_dtype, runner
):
  out = gmm(rows, weights, group_sizes, transpose_rhs, out_dtype, runner)
  return out, (rows, weights, group_sizes)


def _grouped_gemm_bwd(transpose_rhs, out_dtype, runner, residuals, dy):
  del out_dtype
  rows, weights, group_sizes = residuals
  dy = dy.astype(rows.dtype)
  # dX: the same kernel reading the weights the other way round.
  d_rows = gmm(
      dy, weights, group_sizes, not transpose_rhs, rows.dtype, runner, "dgrad"
  )
  # dW[g] = x_g^T dy_g for [C, N] weights, dy_g^T x_g for [N, C].
  lhs, rhs = (dy, rows) if transpose_rhs else (rows, dy)
  d_weights = tgmm(lhs, rhs, group_sizes, weights.dtype, runner)
  return d_rows, d_weights, None


grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)


# --- gated_gate_up: the activation in the epilogue ----------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def gated_gate_up(rows, w_gate, w_up, group_sizes, activation: str, runner):
  """act(rows @ w_gate[g]) * (rows @ w_up[g]): [M, D] -> h [M, F].

  One kernel: two float32 accumulators share each rows tile and only h is
  written. The backward pass recomputes gate and up (two gmm calls) rather
  than keeping them, so the forward's memory traffic stays one [M, F]
  output.

  Args:
    rows: [M, D] sorted by group.
    w_gate, w_up: [E, D, F] of rows' dtype.
    group_sizes: [E] int32, sum <= M.
    activation: one of GATED_ACTIVATIONS.
    runner: a `launch.Runner`.
  """
  if activation not in GATED_ACTIVATIONS:
    raise ValueError(
        f"activation must be one of {GATED_ACTIVATIONS} to run in the gated "
        f"kernel's epilogue, got {activation!r}."
    )
  return gated_gmm(rows, w_gate, w_up, group_sizes, activation, runner)


def _gated_fwd(rows, w_gate, w_up, group_sizes, activation, runner):
  h = gated_gate_up(rows, w_gate, w_up, group_sizes, activation, runner)
  return h, (rows, w_gate, w_up, group_sizes)


def _gated_bwd(activation, runner, residuals, d_h):
  rows, w_gate, w_up, group_sizes = residuals
  f32 = jnp.float32
  # Recomputed in float32, as the kernel's epilogue saw them.
  gate = gmm(rows, w_gate, group_sizes, False, f32, runner)
  up = gmm(rows, w_up, group_sizes, False, f32, runner)
  _, act_vjp = jax.vjp(lambda g, u: ffn.gated(g, u, activation), gate, up)
  d_gate, d_up = act_vjp(d_h.astype(f32))
  d_gate = d_gate.astype(rows.dtype)
  d_up = d_up.astype(rows.dtype)
  # Both dX products summed in float32, rounded once.
  d_rows = gmm(d_gate, w_gate, group_sizes, True, f32, runner, "dgrad") + gmm(
      d_up, w_up, group_sizes, True, f32, runner, "dgrad"
  )
  d_w_gate = tgmm(rows, d_gate, group_sizes, w_gate.dtype, runner)
  d_w_up = tgmm(rows, d_up, group_sizes, w_up.dtype, runner)
  return d_rows.astype(rows.dtype), d_w_gate, d_w_up, None


gated_gate_up.defvjp(_gated_fwd, _gated_bwd)


# --- down_weighted: the routing weights in the epilogue -----------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def down_weighted(h, w_down, group_sizes, row_scale, runner):
  """out[r] = row_scale[r] * (h[r] @ w_down[g]): [M, F] -> [M, D].

  The scale multiplies the float32 accumulator before the cast, so a
  combine that follows needs unit weights. Rows past sum(group_sizes) come
  out as zeros and get zero gradient in h and row_scale, whatever h,
  row_scale or the cotangent hold there.

  Args:
    h: [M, F] sorted by group.
    w_down: [E, F, D] of h's dtype.
    group_sizes: [E] int32, sum <= M.
    row_scale: [M] float32, one weight per row.
    runner: a `launch.Runner`.
  """
  return gmm(
      h, w_down, group_sizes, False, h.dtype, runner, row_scale=row_scale
  )


def _down_weighted_fwd(h, w_down, group_sizes, row_scale, runner):
  out = down_weighted(h, w_down, group_sizes, row_scale, runner)
  return out, (h, w_down, group_sizes, row_scale)


def _down_weighted_bwd(runner, residuals, dy):
  h, w_down, group_sizes, row_scale = residuals
  m = h.shape[0]
  dy = dy.astype(h.dtype)
  scale = row_scale.astype(jnp.float32)
  # d h = (s * dy) @ w^T: s applied in the dgrad kernel's epilogue.
  d_h = gmm(
      dy, w_down, group_sizes, True, h.dtype, runner, "dgrad", row_scale=scale
  )
  d_w = tgmm(h, dy, group_sizes, w_down.dtype, runner, row_scale=scale)
  # d s[r] = <dy[r], h[r] @ w[g]>, the unscaled product recomputed in
  # float32 (zero past the groups, where dy may hold anything).
  product = gmm(h, w_down, group_sizes, False, jnp.float32, runner)
  used = jnp.arange(m) < jnp.sum(group_sizes)
  d_scale = jnp.where(
      used, jnp.sum(dy.astype(jnp.float32) * product, axis=1), 0.0
  )
  return d_h, d_w, None, d_scale.astype(row_scale.dtype)


down_weighted.defvjp(_down_weighted_fwd, _down_weighted_bwd)


# --- permute / unpermute ------------------------------------------------------


def _call_permute(runner, name, args, out_types, tokens, top_k, width, dtype):
  """One permute kernel: block_m rows (or tokens) by block_n columns."""
  kernels = _permute_kernels()
  kernel = kernels.KERNELS[name]
  config = runner.config("permute", tokens * top_k, width, width, 1, dtype)
  constexprs = dict(
      T=tokens,
      K=top_k,
      D=width,
      **configs.block_constexprs("permute", config, kernel),
  )
  return _call(
      runner,
      kernel,
      args,
      out_types,
      kernels.grid(name, **constexprs),
      config,
      **constexprs,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def permute(x, assignment, position, invalid, top_k: int, runner):
  """rows[i] = x[assignment[i] // K], NaN for invalid copies: [T, D] -> [A, D].

  Equal to `moe_core.permute.dispatch(...).rows` and its gradient.

  Args:
    x: [T, D] tokens.
    assignment: [A] int32 (A = T*K), the assignment of each sorted row.
    position: [A] int32, its inverse (used by the backward pass).
    invalid: [A] int8 in assignment order, 1 where the expert id was out
      of range.
    top_k: K (static).
    runner: a `launch.Runner`.
  """
  del position
  tokens, width = x.shape
  if not (tokens and width):
    return jnp.zeros((tokens * top_k, width), x.dtype)
  (rows,) = _call_permute(
      runner,
      "permute",
      (x, assignment, invalid),
      (jax.ShapeDtypeStruct((tokens * top_k, width), x.dtype),),
      tokens,
      top_k,
      width,
      x.dtype,
  )
  return rows


def _permute_fwd(x, assignment, position, invalid, top_k, runner):
  rows = permute(x, assignment, position, invalid, top_k, runner)
  return rows, (position, invalid)


def _permute_bwd(top_k, runner, residuals, d_rows):
  position, invalid = residuals
  tokens = position.shape[0] // top_k
  width, dtype = d_rows.shape[1], d_rows.dtype  # x's width and dtype.
  if not (tokens and width):
    return jnp.zeros((tokens, width), dtype), None, None, None
  (dx,) = _call_permute(
      runner,
      "permute_bwd",
      (d_rows, position, invalid),
      (jax.ShapeDtypeStruct((tokens, width), dtype),),
      tokens,
      top_k,
      width,
      dtype,
  )
  return dx, None, None, None


permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def unpermute(rows, weights, position, assignment, kept, invalid, runner):
  """y[t] = sum_k weights[t, k] * v[t, k]: rows [A, D] -> y [T, D].

  v[t, k] = rows[position[t*K + k]] if kept, else 0; NaN if invalid. Summed
  in float32, returned in rows' dtype: `moe_core.permute.combine`, and its
  gradients in rows and weights.

  Args:
    rows: [A, D] expert outputs in sorted order.
    weights: [T, K] float32.
    position: [A] int32, the sorted row of each assignment.
    assignment: [A] int32, its inverse (used by the backward pass).
    kept: [A] int8 in assignment order (1: the copy counts).
    invalid: [A] int8 in assignment order (1: NaN for the token).
    runner: a `launch.Runner`.
  """
  del assignment
  tokens, top_k = weights.shape
  width = rows.shape[1]
  if not (tokens and width):
    return jnp.zeros((tokens, width), rows.dtype)
  (y,) = _call_permute(
      runner,
      "unpermute",
      (rows, position, weights, kept, invalid),
      (jax.ShapeDtypeStruct((tokens, width), rows.dtype),),
      tokens,
      top_k,
      width,
      rows.dtype,
  )
  return y


def _unpermute_fwd(rows, weights, position, assignment, kept, invalid, runner):
  y = unpermute(rows, weights, position, assignment, kept, invalid, runner)
  return y, (rows, weights, position, assignment, kept, invalid)


def _unpermute_bwd(runner, residuals, dy):
  rows, weights, position, assignment, kept, invalid = residuals
  tokens, top_k = weights.shape
  width = rows.shape[1]
  if not (tokens and width):
    return (
        jnp.zeros_like(rows),
        jnp.zeros_like(weights),
        None,
        None,
        None,
        None,
    )
  dy = dy.astype(rows.dtype)
  (d_rows,) = _call_permute(
      runner,
      "unpermute_bwd_rows",
      (dy, assignment, weights, kept, invalid),
      (jax.ShapeDtypeStruct(rows.shape, rows.dtype),),
      tokens,
      top_k,
      width,
      rows.dtype,
  )
  (d_weights,) = _call_permute(
      runner,
      "unpermute_bwd_weights",
      (dy, rows, position, kept, invalid),
      (jax.ShapeDtypeStruct((tokens, top_k), jnp.float32),),
      tokens,
      top_k,
      width,
      rows.dtype,
  )
  return d_rows, d_weights.astype(weights.dtype), None, None, None, None


unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)
