"""Triton kernels that sort token copies by expert and undo it, with grads.

With T tokens, K choices, D model width and A = T*K assignments a = t*K + k
in A sorted rows i (`assignment` [A] int32 maps row i to its assignment,
`position` [A] int32 is the inverse, both from `moe_core.permute.dispatch`;
`kept` and `invalid` are [A] int8 flags, 1 = true, in assignment order), the
kernels compute `moe_core.permute.dispatch`'s rows, `combine`, and their
vector-Jacobian products (see each kernel's docstring). Every kernel is a
gather: each program owns a block of output rows and a block of columns
(grid over D, no loop), except the weights gradient, which reduces over D
inside the program (grid over (tokens, K), loop over D); so every output
element has exactly one writer and no atomics are needed. Sums are taken in
float32; row offsets are computed in int64 (A*D can pass 2**31). `grid`
gives each kernel's launch grid; `signature` its types for `triton.compile`.
"""

from __future__ import annotations

import inspect

import numpy as np
import triton
import triton.language as tl

# NaN for invalid copies, as a constexpr global: kernels may read those,
# compiled or interpreted alike.
_NAN = tl.constexpr(float("nan"))

# The kernels' helpers below are @triton.jit functions: in Triton's
# interpreter they need `interpreter.fixes()` (the backend's interpret mode
# runs every launch inside it), since without TRITON_INTERPRET=1 set when
# triton was imported a bare `InterpretedFunction(kernel.fn)` refuses to
# call them.


@triton.jit
def _add(a, b):
  return a + b


@triton.jit
def _blocks(n, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
  """This program's (index block [BLOCK_N] of n, column block [BLOCK_D]) and
  their masks: (idx, cols, idx < n [BLOCK_N], cols < D [1, BLOCK_D])."""
  idx = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
  cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
  return idx, cols, idx < n, (cols < D)[None, :]


@triton.jit
def _copy(position_ptr, tokens, tok_ok, k, K: tl.constexpr):
  """Copy k of each token: (assignment a = t*K + k, its sorted row, int64)."""
  a = tokens * K + k
  return a, tl.load(position_ptr + a, mask=tok_ok, other=0).to(tl.int64)


@triton.jit
def _kept_invalid(kept_ptr, invalid_ptr, a, ok):
  """(kept[a], invalid[a]) as booleans [BLOCK], False where not ok."""
  keep = tl.load(kept_ptr + a, mask=ok, other=0) != 0
  return keep, tl.load(invalid_ptr + a, mask=ok, other=0) != 0


@triton.jit
def _store_rows(out_ptr, idx, cols, values, idx_ok, col_ok, D: tl.constexpr):
  """out[idx, cols] = values [BLOCK_N, BLOCK_D] in out's dtype, masked."""
  dst = idx.to(tl.int64)[:, None] * D + cols[None, :]
  tl.store(
      out_ptr + dst,
      values.to(out_ptr.dtype.element_ty),
      mask=idx_ok[:, None] & col_ok,
  )


@triton.jit
def permute_kernel(
    x_ptr,
    assignment_ptr,
    invalid_ptr,
    out_ptr,
    T: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
  """out[i] = x[assignment[i] // K], or NaN if that copy is invalid.

  x [T, D]; assignment [A] int32; invalid [A] int8; out [A, D] in x's dtype.
  Grid (cdiv(A, BLOCK_R), cdiv(D, BLOCK_D)).
  """
  rows, cols, row_ok, col_ok = _blocks(T * K, D, BLOCK_R, BLOCK_D)
  a = tl.load(assignment_ptr + rows, mask=row_ok, other=0)
  bad = tl.load(invalid_ptr + a, mask=row_ok, other=0) != 0
  src = (a // K).to(tl.int64)
  v = tl.load(
      x_ptr + src[:, None] * D + cols[None, :],
      mask=row_ok[:, None] & col_ok,
      other=0,
  )
  # The select is done in float32 (exact for bf16 and back): Triton's
  # interpreter has no bf16 scalar constants.
  v = tl.where(bad[:, None], _NAN, v.to(tl.float32))
  _store_rows(out_ptr, rows, cols, v, row_ok, col_ok, D)


@triton.jit
def permute_bwd_kernel(
    d_rows_ptr,
    position_ptr,
    invalid_ptr,
    dx_ptr,
    T: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
  """dx[t] = sum_k d_rows[position[t*K + k]], skipping invalid copies.

  d_rows [A, D]; position [A] int32; invalid [A] int8; dx [T, D] in
  d_rows' dtype, summed in float32. An invalid copy's row (NaN in the
  forward) is never read, so a NaN cotangent there cannot reach dx.
  Grid (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)).
  """
  tokens, cols, tok_ok, col_ok = _blocks(T, D, BLOCK_T, BLOCK_D)
  acc = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
  for k in range(K):
    a, pos = _copy(position_ptr, tokens, tok_ok, k, K)
    bad = tl.load(invalid_ptr + a, mask=tok_ok, other=1) != 0
    use = (tok_ok & ~bad)[:, None] & col_ok
    g = tl.load(
        d_rows_ptr + pos[:, None] * D + cols[None, :], mask=use, other=0
    )
    acc += g.to(tl.float32)
  _store_rows(dx_ptr, tokens, cols, acc, tok_ok, col_ok, D)


@triton.jit
def unpermute_kernel(
    rows_ptr,
    position_ptr,
    weights_ptr,
    kept_ptr,
    invalid_ptr,
    out_ptr,
    T: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
  """y[t] = sum_k weights[t, k] * v[t, k], as `moe_core.permute.combine`.

  v[t, k] = rows[position[a]] (a = t*K + k) if kept[a], else 0; NaN if
  invalid[a]. rows [A, D]; position [A] int32; weights [T, K] float32;
  kept, invalid [A] int8; y [T, D] in rows' dtype, summed in float32.
  A dropped copy's row is never read (it may hold NaN), but its weight
  is still multiplied in, so a NaN weight gives NaN, as in combine.
  Grid (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)).
  """
  tokens, cols, tok_ok, col_ok = _blocks(T, D, BLOCK_T, BLOCK_D)
  acc = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
  for k in range(K):
    a, pos = _copy(position_ptr, tokens, tok_ok, k, K)
    keep, bad = _kept_invalid(kept_ptr, invalid_ptr, a, tok_ok)
    w = tl.load(weights_ptr + a, mask=tok_ok, other=0.0)
    use = (tok_ok & keep)[:, None] & col_ok
    v = tl.load(rows_ptr + pos[:, None] * D + cols[None, :], mask=use, other=0)
    v = tl.where(bad[:, None], _NAN, v.to(tl.float32))
    acc += w[:, None] * v
  _store_rows(out_ptr, tokens, cols, acc, tok_ok, col_ok, D)


@triton.jit
def unpermute_bwd_rows_kernel(
    dy_ptr,
    assignment_ptr,
    weights_ptr,
    kept_ptr,
    invalid_ptr,
    d_rows_ptr,
    T: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
  """d_rows[i] = weights[a] * dy[a // K] (a = assignment[i]), or 0.

  The row is 0 when copy a is dropped or invalid, whatever its weight
  (NaN included): combine's `where`s cut the gradient there. dy [T, D];
  assignment [A] int32; weights [T, K] float32; kept, invalid [A] int8;
  d_rows [A, D] in dy's dtype (the product is rounded once, from float32).
  Every row is written. Grid (cdiv(A, BLOCK_R), cdiv(D, BLOCK_D)).
  """
  rows, cols, row_ok, col_ok = _blocks(T * K, D, BLOCK_R, BLOCK_D)
  a = tl.load(assignment_ptr + rows, mask=row_ok, other=0)
  keep = tl.load(kept_ptr + a, mask=row_ok, other=0) != 0
  bad = tl.load(invalid_ptr + a, mask=row_ok, other=1) != 0
  live = (keep & ~bad)[:, None]
  w = tl.load(weights_ptr + a, mask=row_ok, other=0.0)
  src = (a // K).to(tl.int64)
  g = tl.load(
      dy_ptr + src[:, None] * D + cols[None, :],
      mask=row_ok[:, None] & col_ok & live,
      other=0,
  )
  g = tl.where(live, w[:, None] * g.to(tl.float32), 0.0)
  _store_rows(d_rows_ptr, rows, cols, g, row_ok, col_ok, D)


@triton.jit
def unpermute_bwd_weights_kernel(
    dy_ptr,
    rows_ptr,
    position_ptr,
    kept_ptr,
    invalid_ptr,
    d_w_ptr,
    T: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
  """d_w[t, k] = sum_d dy[t, d] * v[t, k, d], v as in `unpermute_kernel`.

  dy [T, D]; rows [A, D]; position [A] int32; kept, invalid [A] int8;
  d_w [T, K] float32 (NaN for an invalid copy, 0 for a dropped one).
  Grid (cdiv(T, BLOCK_T), K): program (p, k) owns column k of a block of
  tokens and loops over D in BLOCK_D steps, so no partial sums cross
  programs.
  """
  tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
  k = tl.program_id(1)
  tok_ok = tokens < T
  a, pos = _copy(position_ptr, tokens, tok_ok, k, K)
  keep, bad = _kept_invalid(kept_ptr, invalid_ptr, a, tok_ok)
  use = (tok_ok & keep)[:, None]
  t64 = tokens.to(tl.int64)
  acc = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
  for d0 in range(0, D, BLOCK_D):
    cols = d0 + tl.arange(0, BLOCK_D)
    col_ok = (cols < D)[None, :]
    g = tl.load(
        dy_ptr + t64[:, None] * D + cols[None, :],
        mask=tok_ok[:, None] & col_ok,
        other=0,
    )
    v = tl.load(
        rows_ptr + pos[:, None] * D + cols[None, :],
        mask=use & col_ok,
        other=0,
    )
    acc += g.to(tl.float32) * v.to(tl.float32)
  total = tl.reduce(acc, 1, _add)
  total = tl.where(bad, _NAN, total)
  tl.store(d_w_ptr + a, total, mask=tok_ok)


KERNELS = {
    "permute": permute_kernel,
    "permute_bwd": permute_bwd_kernel,
    "unpermute": unpermute_kernel,
    "unpermute_bwd_rows": unpermute_bwd_rows_kernel,
    "unpermute_bwd_weights": unpermute_bwd_weights_kernel,
}

# The pointer parameters of each kind, the same in every kernel that takes
# them: "data" follows the activations' dtype.
_POINTERS = {
    "data": ("x_ptr", "rows_ptr", "dy_ptr", "out_ptr", "dx_ptr", "d_rows_ptr"),
    "i32": ("assignment_ptr", "position_ptr"),
    "fp32": ("weights_ptr", "d_w_ptr"),
    "i8": ("kept_ptr", "invalid_ptr"),
}

_DATA_TYPES = {"bfloat16": "bf16", "float32": "fp32"}


def constexpr_names(name: str) -> tuple[str, ...]:
  """Kernel `name`'s constexprs: T, K, D, then BLOCK_R or BLOCK_T, BLOCK_D."""
  return ("T", "K", "D") + (
      ("BLOCK_R", "BLOCK_D")
      if name in ("permute", "unpermute_bwd_rows")
      else ("BLOCK_T", "BLOCK_D")
  )


def signature(name: str, dtype, **constexprs) -> tuple[dict, dict]:
  """Types of kernel `name` for `triton.compile`'s `ASTSource`.

  Args:
    name: a key of `KERNELS`.
    dtype: the activations' dtype: "bfloat16" or "float32", or a dtype
      (numpy, jnp) of those names.
    **constexprs: exactly the kernel's constexprs: T, K, D and its two
      block sizes (BLOCK_R or BLOCK_T, and BLOCK_D).

  Returns:
    (signature, constexprs): {parameter: "*bf16" | "*fp32" | "*i32" | "*i8" |
    "constexpr"} in parameter order, and the constexpr values by name.
  """
  if name not in KERNELS:
    raise ValueError(f"name must be one of {sorted(KERNELS)}, got {name!r}.")
  dtype_name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
  if dtype_name not in _DATA_TYPES:
    raise NotImplementedError(
        f"permute kernels take {sorted(_DATA_TYPES)} data, got {dtype_name}."
    )
  want = constexpr_names(name)
  if set(constexprs) != set(want):
    raise ValueError(
        f"{name} needs constexprs {list(want)}, got {sorted(constexprs)}."
    )
  pointer_types = {
      param: "*" + (_DATA_TYPES[dtype_name] if kind == "data" else kind)
      for kind, params in _POINTERS.items()
      for param in params
  }
  kernel = KERNELS[name]
  sig = {  # In parameter order: the pointers, then the constexprs.
      param: "constexpr" if param in want else pointer_types[param]
      for param in inspect.signature(getattr(kernel, "fn", kernel)).parameters
  }
  return sig, {c: constexprs[c] for c in want}


def grid(name: str, **constexprs) -> tuple[int, int]:
  """The launch grid of kernel `name`, given its constexprs (as `signature`)."""
  t, k, d = constexprs["T"], constexprs["K"], constexprs["D"]
  if name in ("permute", "unpermute_bwd_rows"):
    return (
        triton.cdiv(t * k, constexprs["BLOCK_R"]),
        triton.cdiv(d, constexprs["BLOCK_D"]),
    )
  if name in ("permute_bwd", "unpermute"):
    return (
        triton.cdiv(t, constexprs["BLOCK_T"]),
        triton.cdiv(d, constexprs["BLOCK_D"]),
    )
  if name == "unpermute_bwd_weights":
    return (triton.cdiv(t, constexprs["BLOCK_T"]), k)
  raise ValueError(f"name must be one of {sorted(KERNELS)}, got {name!r}.")
