"""Triton kernels of the grouped GEMM: gmm (forward, dX, gated), tgmm (dW).

Rows are sorted by group: group e owns rows [offsets[e], offsets[e + 1]),
offsets = [0, cumsum(group_sizes)], and the rows at or past offsets[E] form
a tail pseudo-group, numbered E, whose outputs are exact zeros whatever the
rows hold (every load is masked with `other=0`). gmm walks a static-length
tile list (`tile_list`, one entry per (group, row tile) pair; each visit
stores only its own rows, so every output element has one writer and no
atomics are needed), with an ACTIVATION as the gated gate/up pass; tgmm
runs one program per (group, output block) and loops over the group's rows
(docs/triton.md, "What runs where"). Shapes and tiles are constexprs, all
run-time counts int32 device arrays. This module imports triton at the top;
import it lazily. Over 400 lines because it is one job: the kernels share
their tile helpers, and the tile list and signatures are built for them.
"""

import inspect

import numpy as np
import triton
import triton.language as tl

# gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x +
# 0.044715 x^3): the sigmoid form needs no tanh, which `tl` lacks on some
# versions, and has no cancellation near 1 + tanh(u) = 0.
# Globals a kernel reads must be constexprs.
_TWO_SQRT_2_OVER_PI = tl.constexpr(1.5957691216057308)
_SQRT_HALF = tl.constexpr(0.7071067811865476)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
  """acc + a @ b in float32; a [BM, BK], b [BK, BN] of one dtype.

  `DOT_F32` upcasts both operands to float32: Triton's interpreter gets bf16
  `tl.dot` wrong (triton-lang/triton#11584), so it is always set there; on a
  GPU it is False and bf16 goes to the tensor cores. Float32 operands use
  IEEE products ("ieee"), not TF32, matching the reference.
  """
  if DOT_F32:
    a = a.to(tl.float32)
    b = b.to(tl.float32)
  if a.dtype == tl.float32:
    # Triton's default for float32 operands is TF32 (10-bit mantissas).
    return tl.dot(a, b, acc, input_precision="ieee")
  return tl.dot(a, b, acc)


@triton.jit
def _visit(
    group_offsets_ptr,
    group_ids_ptr,
    m_tile_ids_ptr,
    t,
    M: tl.constexpr,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
  """Entry t of the tile list: (group, first row of the tile, row mask).

  The mask [BLOCK_M] selects the tile's rows that the group owns; for the
  tail pseudo-group E those are the rows [offsets[E], M).
  """
  g = tl.load(group_ids_ptr + t)
  start = tl.load(group_offsets_ptr + g)
  end = tl.load(group_offsets_ptr + tl.minimum(g + 1, E))
  end = tl.where(g < E, end, M)
  r0 = tl.multiple_of(tl.load(m_tile_ids_ptr + t) * BLOCK_M, BLOCK_M)
  rows = r0 + tl.arange(0, BLOCK_M)
  row_ok = (rows >= start) & (rows < end)
  return g, r0, row_ok


@triton.jit
def _columns(pid, BLOCK: tl.constexpr):
  """The offsets [BLOCK] of column block pid (contiguous, aligned)."""
  cols = pid * BLOCK + tl.arange(0, BLOCK)
  return tl.max_contiguous(tl.multiple_of(cols, BLOCK), BLOCK)


@triton.jit
def _weight_tile_ptrs(
    w_ptr, g, rk, rn, K: tl.constexpr, N: tl.constexpr, TRANSPOSE_W
):
  """Pointers [BLOCK_K, BLOCK_N] to w[g][k, n] (or w[g][n, k] transposed)."""
  # E * K * N passes 2^31 for large MoEs: the expert offset is 64-bit.
  w_base = w_ptr + g.to(tl.int64) * (K * N)
  if TRANSPOSE_W:
    return w_base + rn[None, :] * K + rk[:, None]
  return w_base + rk[:, None] * N + rn[None, :]


@triton.jit
def _tanh(x):
  """tanh(x) = 2 sigmoid(2x) - 1: `tl` has no tanh on the pinned versions."""
  return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gated(
    gate,
    up,
    ACTIVATION: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr,
    SWIGLU_ALPHA: tl.constexpr,
    GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr,
):
  """h = f(gate, up) in float32 (`moe_core.activations`); every f maps 0 to
  0 (softcapped_silu and the clamp too; gpt_oss_glu's (up + 1) multiplies
  gate * sigmoid(alpha * gate), which is 0 at gate 0).

  SWIGLU_LIMIT > 0 first clamps gate to (-inf, L] and up to [-L, L]; 0 means
  no clamp (a config's limit is > 0). SWIGLU_ALPHA is gpt_oss_glu's alpha,
  GATE_SOFTCAP and UP_SOFTCAP softcapped_silu's caps; each is read only by
  its activation.
  """
  if SWIGLU_LIMIT > 0:
    gate = tl.minimum(gate, SWIGLU_LIMIT)
    up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
  if ACTIVATION == "silu":
    h = gate * tl.sigmoid(gate) * up
  elif ACTIVATION == "gelu":
    h = 0.5 * gate * (1.0 + tl.math.erf(gate * _SQRT_HALF)) * up
  elif ACTIVATION == "gelu_tanh":
    inner = gate + 0.044715 * gate * gate * gate
    h = gate * tl.sigmoid(inner * _TWO_SQRT_2_OVER_PI) * up
  elif ACTIVATION == "gpt_oss_glu":
    h = (up + 1.0) * gate * tl.sigmoid(SWIGLU_ALPHA * gate)
  elif ACTIVATION == "softcapped_silu":
    # The sigmoid sees the raw gate; only the linear factors are capped.
    capped_gate = GATE_SOFTCAP * _tanh(gate / GATE_SOFTCAP)
    capped_up = UP_SOFTCAP * _tanh(up / UP_SOFTCAP)
    h = capped_gate * tl.sigmoid(gate) * capped_up
  else:
    tl.static_assert(
        False,
        "ACTIVATION must be silu, gelu, gelu_tanh, gpt_oss_glu or "
        "softcapped_silu",
    )
  return h


@triton.jit
def gmm_kernel(
    x_ptr,
    w_ptr,
    w_up_ptr,
    row_scale_ptr,
    group_offsets_ptr,
    group_ids_ptr,
    m_tile_ids_ptr,
    num_tiles_ptr,
    out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    E: tl.constexpr,
    TRANSPOSE_W: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr = 0.0,
    SWIGLU_ALPHA: tl.constexpr = 0.0,
    GATE_SOFTCAP: tl.constexpr = 0.0,
    UP_SOFTCAP: tl.constexpr = 0.0,
):
  """out[r] = row_scale[r] * (x[r] @ w[g(r)]) for the rows of one visit;
  with an ACTIVATION, act(x[r] @ w[g(r)]) * (x[r] @ w_up[g(r)]) instead.

  x [M, K]; w [E, K, N] ([E, N, K] if TRANSPOSE_W); w_up like w, read only
  with an ACTIVATION (any array of x's dtype otherwise); row_scale [M]
  float32 (any [1] array when not HAS_ROW_SCALE); group_offsets [E + 1]
  int32; group_ids, m_tile_ids [T] and num_tiles [1] int32, the tile list;
  out [M, N]. ACTIVATION: "" (the plain product), "silu", "gelu" (erf
  form), "gelu_tanh", "gpt_oss_glu" or "softcapped_silu", with the clamp
  and options of `_gated` (SWIGLU_LIMIT, SWIGLU_ALPHA, GATE_SOFTCAP,
  UP_SOFTCAP; 0 where unused); the gated form's two products share each x
  tile and are combined in float32 before the one cast to out's dtype. A
  constexpr switch: the plain kernel compiles without the second product.
  Grid (T, cdiv(N, BLOCK_N)); program (t, j) writes the rows of entry t
  and columns block j, zeros for the tail pseudo-group E.
  """
  t = tl.program_id(0)
  if t >= tl.load(num_tiles_ptr):
    return
  g, r0, row_ok = _visit(
      group_offsets_ptr, group_ids_ptr, m_tile_ids_ptr, t, M, E, BLOCK_M
  )
  is_group = g < E
  rm = tl.arange(0, BLOCK_M)
  rk = tl.arange(0, BLOCK_K)
  rn = _columns(tl.program_id(1), BLOCK_N)
  col_ok = rn < N
  # M * K and M * N can pass 2^31: the tile's row offset is 64-bit, the
  # offsets inside the tile stay 32-bit.
  x_ptrs = x_ptr + r0.to(tl.int64) * K + rm[:, None] * K + rk[None, :]
  weight = tl.minimum(g, E - 1)
  w_ptrs = _weight_tile_ptrs(w_ptr, weight, rk, rn, K, N, TRANSPOSE_W)
  w_step = BLOCK_K if TRANSPOSE_W else BLOCK_K * N
  acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
  if ACTIVATION != "":
    up_ptrs = _weight_tile_ptrs(w_up_ptr, weight, rk, rn, K, N, TRANSPOSE_W)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
  # The tail's visits skip the products: their output is zeros.
  for kb in range(0, tl.where(is_group, tl.cdiv(K, BLOCK_K), 0)):
    k_ok = rk < K - kb * BLOCK_K
    x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    w_mask = k_ok[:, None] & col_ok[None, :]
    acc = _dot(x, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, DOT_F32)
    if ACTIVATION != "":
      up = _dot(x, tl.load(up_ptrs, mask=w_mask, other=0.0), up, DOT_F32)
    x_ptrs += BLOCK_K
    w_ptrs += w_step
    if ACTIVATION != "":
      up_ptrs += w_step
  if ACTIVATION != "":
    acc = _gated(
        acc,
        up,
        ACTIVATION,
        SWIGLU_LIMIT,
        SWIGLU_ALPHA,
        GATE_SOFTCAP,
        UP_SOFTCAP,
    )
  if HAS_ROW_SCALE:
    # The tail's scales may be NaN: masked to 0, times the zero acc. A
    # select, not row_ok & is_group: Triton 3.9's interpreter splats the
    # scalar is_group as int32 and then rejects the int32 mask.
    scale_ok = tl.where(is_group, row_ok, False)
    scale = tl.load(row_scale_ptr + r0 + rm, mask=scale_ok, other=0.0)
    acc = acc * scale[:, None]
  out_ptrs = out_ptr + r0.to(tl.int64) * N + rm[:, None] * N + rn[None, :]
  tl.store(
      out_ptrs,
      acc.to(out_ptr.dtype.element_ty),
      mask=row_ok[:, None] & col_ok[None, :],
  )


@triton.jit
def tgmm_kernel(
    a_ptr,
    b_ptr,
    row_scale_ptr,
    group_offsets_ptr,
    out_ptr,
    M: tl.constexpr,
    P: tl.constexpr,
    Q: tl.constexpr,
    E: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    DOT_F32: tl.constexpr,
):
  """out[e] = sum over group e's rows r of a[r]^T (row_scale[r] * b[r]).

  a [M, P]; b [M, Q]; row_scale [M] float32 (any [1] array when not
  HAS_ROW_SCALE); group_offsets [E + 1] int32; out [E, P, Q]. Grid (E,
  cdiv(P, BLOCK_P), cdiv(Q, BLOCK_Q)). An empty group stores zeros; rows
  outside the group (the tail included) never enter a product. With a row
  scale and bf16 operands (DOT_F32 False), row_scale * b is rounded to bf16
  before the product, as an unfused scale-then-tgmm would be.
  """
  e = tl.program_id(0)
  start = tl.load(group_offsets_ptr + e)
  end = tl.load(group_offsets_ptr + e + 1)
  rp = _columns(tl.program_id(1), BLOCK_P)
  rq = _columns(tl.program_id(2), BLOCK_Q)
  p_ok = rp < P
  q_ok = rq < Q
  ri = tl.arange(0, BLOCK_M)
  acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
  # Row tiles start at the group's first row: alignment of a row does not
  # matter (the contiguous axis is P or Q), and a group of n rows then
  # takes cdiv(n, BLOCK_M) steps, none shared with a neighbour.
  for step in range(0, tl.cdiv(end - start, BLOCK_M)):
    m0 = start + step * BLOCK_M
    row_ok = ri < end - m0
    base = m0.to(tl.int64)
    # a^T's tile [BLOCK_P, BLOCK_M], loaded transposed.
    a = tl.load(
        a_ptr + base * P + ri[None, :] * P + rp[:, None],
        mask=p_ok[:, None] & row_ok[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + base * Q + ri[:, None] * Q + rq[None, :],
        mask=row_ok[:, None] & q_ok[None, :],
        other=0.0,
    )
    if HAS_ROW_SCALE:
      scale = tl.load(row_scale_ptr + m0 + ri, mask=row_ok, other=0.0)
      b = b.to(tl.float32) * scale[:, None]
      if not DOT_F32:
        b = b.to(a.dtype)
    acc = _dot(a, b, acc, DOT_F32)
  out_ptrs = out_ptr + e.to(tl.int64) * (P * Q) + rp[:, None] * Q + rq[None, :]
  tl.store(
      out_ptrs,
      acc.to(out_ptr.dtype.element_ty),
      mask=p_ok[:, None] & q_ok[None, :],
  )


KERNELS = {
    "gmm": gmm_kernel,
    "tgmm": tgmm_kernel,
}

# Pointer parameters that are not the operand or output dtype.
_FIXED_POINTERS = {
    "row_scale_ptr": "*fp32",
    "group_offsets_ptr": "*i32",
    "group_ids_ptr": "*i32",
    "m_tile_ids_ptr": "*i32",
    "num_tiles_ptr": "*i32",
}
_DEFAULT_CONSTEXPRS = {
    "TRANSPOSE_W": False,
    "HAS_ROW_SCALE": False,
    "ACTIVATION": "",
    "DOT_F32": False,
    "SWIGLU_LIMIT": 0.0,
    "SWIGLU_ALPHA": 0.0,
    "GATE_SOFTCAP": 0.0,
    "UP_SOFTCAP": 0.0,
}
_TRITON_DTYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "bf16": "bf16",
    "fp16": "fp16",
    "fp32": "fp32",
}


def _triton_dtype(dtype) -> str:
  """Triton's name ("bf16", "fp16", "fp32") of a dtype or dtype name."""
  name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
  if name not in _TRITON_DTYPES:
    raise ValueError(
        "The Triton GEMM kernels take bfloat16, float16 or float32 operands, "
        f"got {dtype!r}."
    )
  return _TRITON_DTYPES[name]


def _parameters(kernel) -> list[tuple[str, bool]]:
  """(name, is_constexpr) of each parameter of a jitted kernel, in order."""
  fn = getattr(kernel, "fn", kernel)
  return [
      (p.name, "constexpr" in str(p.annotation))
      for p in inspect.signature(fn).parameters.values()
  ]


def signature(
    name: str, dtype, out_dtype, **constexprs
) -> tuple[dict[str, str], dict[str, object]]:
  """triton.compile's signature and constexprs for one kernel of `KERNELS`.

  Args:
    name: "gmm" or "tgmm".
    dtype: the operands' dtype (x and w, or a and b): bfloat16, float16 or
      float32, as a dtype or its name.
    out_dtype: out's dtype, likewise.
    **constexprs: every constexpr parameter of the kernel (M, K, N, E,
      BLOCK_*, ...); TRANSPOSE_W, HAS_ROW_SCALE and DOT_F32 default to
      False, ACTIVATION to "" (no activation: the plain product), the
      activation's options (SWIGLU_LIMIT, ...) to 0.0 (unused).

  Returns:
    ({parameter: "*bf16" | "*fp32" | "*i32" | "constexpr"}, {constexpr
    parameter: value}), for `triton.compiler.ASTSource(fn=KERNELS[name],
    signature=..., constexprs=...)`.
  """
  if name not in KERNELS:
    raise ValueError(f"signature needs one of {sorted(KERNELS)}, got {name!r}.")
  operand = "*" + _triton_dtype(dtype)
  output = "*" + _triton_dtype(out_dtype)
  params = _parameters(KERNELS[name])
  wanted = [p for p, is_constexpr in params if is_constexpr]
  unknown = sorted(set(constexprs) - set(wanted))
  if unknown:
    raise ValueError(
        f"{name} has the constexprs {wanted}, got unknown ones {unknown}."
    )
  values = {
      p: constexprs.get(p, _DEFAULT_CONSTEXPRS.get(p))
      for p in wanted
      if p in constexprs or p in _DEFAULT_CONSTEXPRS
  }
  missing = [p for p in wanted if p not in values]
  if missing:
    raise ValueError(f"{name} needs the constexprs {missing}.")
  types = {}
  for p, is_constexpr in params:
    if is_constexpr:
      types[p] = "constexpr"
    elif p == "out_ptr":
      types[p] = output
    else:
      types[p] = _FIXED_POINTERS.get(p, operand)
  return types, values


def pointer_attrs(name: str) -> dict[tuple[int, ...], list]:
  """ASTSource `attrs` declaring every pointer of a kernel 16-byte aligned.

  A launch through the JIT (or jax-triton) specialises aligned pointers this
  way; an AOT compile without it assumes unaligned pointers, which rules out
  vector loads and cp.async, so the K loop is not pipelined.
  """
  params = _parameters(KERNELS[name])
  return {
      (i,): [["tt.divisibility", 16]]
      for i, (_, is_constexpr) in enumerate(params)
      if not is_constexpr
  }


def tile_list(
    group_sizes, m: int, block_m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The tile list of gmm_kernel, in numpy.

  For each group g in 0..E with rows (g = E: the tail [offsets[E], m)), in
  order, one entry per row tile it touches: tiles floor(start / block_m) to
  cdiv(end, block_m) - 1. The list is padded with zeros to the static length
  T = cdiv(m, block_m) + E, which bounds it: neighbouring groups share at
  most one tile.

  Args:
    group_sizes: [E] non-negative ints, sum <= m.
    m: the number of rows M.
    block_m: rows per tile.

  Returns:
    group_offsets [E + 1], group_ids [T], m_tile_ids [T], num_tiles [1], all
    int32.
  """
  sizes = np.asarray(group_sizes, np.int64).reshape(-1)
  if np.any(sizes < 0) or sizes.sum() > m:
    raise ValueError(
        f"tile_list needs group sizes >= 0 summing to at most m={m}, got "
        f"{sizes.tolist()}."
    )
  num_groups = sizes.size
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  length = -(-m // block_m) + num_groups
  group_ids = np.zeros(length, np.int32)
  m_tile_ids = np.zeros(length, np.int32)
  ends = np.append(offsets[1:], m)
  count = 0
  for g, (start, end) in enumerate(zip(offsets, ends)):
    if end <= start:
      continue
    for tile in range(start // block_m, -(-end // block_m)):
      group_ids[count] = g
      m_tile_ids[count] = tile
      count += 1
  return (
      offsets.astype(np.int32),
      group_ids,
      m_tile_ids,
      np.array([count], np.int32),
  )
