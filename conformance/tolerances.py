"""The conformance tolerances: one (atol, rtol) table by dtype."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

# A comparison passes when, element by element,
#
#     |actual - expected| <= atol * max|expected| + rtol * |expected|
#
# `atol` is relative to the largest magnitude of the expected tensor, so a
# sum over a large D that cancels to a small value is judged against the size
# of its terms, not against that small value. An expected tensor that is all
# zeros must be matched exactly.
#
# The oracle (the reference backend, or float64 numpy) works in float32 or
# better from the same inputs, so the error budget is the backend's own
# rounding. With u the unit roundoff of the dtype (2^-p for p significant
# bits):
#
# * bfloat16, p = 8, u = 2^-8 ~ 3.9e-3. A backend may round each intermediate
#   to bfloat16 (the gate and up projections, act(gate) * up, each expert's
#   output, and y), each a relative error of at most u; through the layer that
#   is about 5u of the summands' size, and we allow 6u. The backward pass
#   rounds about twice as many tensors (the cotangent, its products with each
#   weight, and the recomputed activations), so gradients get 12u. rtol is 2u:
#   the final rounding of a value plus one intermediate.
# * float32, p = 24, u ~ 6e-8. Backends differ from the reference only in the
#   order of float32 sums; for sums of n <= 512 terms the worst case is about
#   n * u ~ 3e-5 of the summands' size and the typical error is sqrt(n) * u.
#   We allow 2e-5 (forward) and 5e-5 (gradients, two GEMMs deep).
# * tfloat32: XLA's default precision for float32 dots on NVIDIA GPUs rounds
#   the inputs to TF32 (p = 11, u = 2^-11 ~ 4.9e-4) and accumulates in float32
#   (docs.jax.dev, "Matmul precision"). float32 comparisons on a GPU use this
#   row. On a TPU the default is one bfloat16 pass: the bfloat16 row.
# Measured on the CPU (jax 0.10.2), the xla backend's worst case uses about a
# fifth of the bfloat16 budgets and a hundredth of the float32 ones.
#
# A backend loosens only in its test subclass, with the reason:
# `TOLERANCE_OVERRIDES = {"bfloat16": (4e-2, 2e-2)}  # split-K` (both kinds),
# or `{"bfloat16": {"gradient": (4e-2, 2e-2)}}` (one kind).

KINDS = ("forward", "gradient")


class Tolerance(NamedTuple):
  atol: float  # Times max|expected|.
  rtol: float  # Times |expected|, element by element.


_U_BF16 = 2.0**-8
_U_TF32 = 2.0**-11

TABLE: dict[str, dict[str, Tolerance]] = {
    "float32": {
        "forward": Tolerance(atol=2e-5, rtol=1e-5),
        "gradient": Tolerance(atol=5e-5, rtol=1e-5),
    },
    "bfloat16": {
        "forward": Tolerance(atol=6 * _U_BF16, rtol=2 * _U_BF16),
        "gradient": Tolerance(atol=12 * _U_BF16, rtol=2 * _U_BF16),
    },
    "tfloat32": {
        "forward": Tolerance(atol=6 * _U_TF32, rtol=2 * _U_TF32),
        "gradient": Tolerance(atol=12 * _U_TF32, rtol=2 * _U_TF32),
    },
}

# What float32 dots default to, per platform (the tfloat32 note above).
_FLOAT32_ROW = {
    "cpu": "float32",
    "gpu": "tfloat32",
    "cuda": "tfloat32",
    "rocm": "tfloat32",
    "tpu": "bfloat16",
}


def row_for(dtype, platform: str | None = None) -> str:
  """The TABLE row for a comparison of `dtype` values on `platform`."""
  name = np.dtype(dtype).name
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"dtype must be float32 or bfloat16, got {name}.")
  if name == "float32":
    return _FLOAT32_ROW.get(platform or jax.default_backend(), "float32")
  return name


def lookup(
    dtype, kind: str, overrides: dict | None = None, platform: str | None = None
) -> Tolerance:
  """The tolerance of `kind` ("forward" or "gradient") for `dtype`.

  Args:
    dtype: the dtype the backend computed in (the inputs' dtype).
    kind: "forward" or "gradient".
    overrides: a backend's TOLERANCE_OVERRIDES, keyed by dtype name or by
      TABLE row ("tfloat32"): a (atol, rtol) pair for both kinds, or a dict
      kind -> (atol, rtol).
    platform: jax platform; jax.default_backend() by default.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  row = row_for(dtype, platform)
  tol = TABLE[row][kind]
  for key in (np.dtype(dtype).name, row):
    override = (overrides or {}).get(key)
    if isinstance(override, dict):
      override = override.get(kind)
    if override is not None:
      tol = Tolerance(*override)
  return tol


def float32_at_highest(kind: str, overrides: dict | None = None) -> Tolerance:
  """The tolerance of float32 computed under
  `jax.default_matmul_precision("highest")`: the float32 row on every
  platform (a GPU's and a TPU's float32 products are then exact float32
  too), with a backend's "float32" overrides, against an oracle on the same
  platform (the same transcendentals)."""
  return lookup("float32", kind, overrides, platform="cpu")


def clamp_gradient_precision(cfg, dtype, platform: str | None = None):
  """ "highest" where a float32 gradient through swiglu_limit's clamp must
  be compared at full float32 products; None elsewhere.

  The clamp's derivative jumps between 1 and 0 at the limit. Where float32
  products default to fewer bits (a TPU's one bfloat16 pass, a GPU's
  tfloat32), a pre-activation the backend computes a few bf16 units away
  from the oracle's (which multiplies at HIGHEST) can land across the limit,
  and that element's gradient then differs by its whole size: no tolerance
  tells that from a wrong derivative. On the TPU v5e (JAX 0.10.2) both xla
  and mosaic_tpu missed the reference so on 1 to 19 elements of the four
  swiglu_limit cases' gradients (d shared_w_up 0.48 against 1.29), and
  matched it under jax.default_matmul_precision("highest"). The forward
  and the unclamped cases stay at the platform's default.

  Args:
    cfg: the case's config (MoEConfig or the stage suite's FFN config).
    dtype: the dtype the backend computes in.
    platform: jax platform; jax.default_backend() by default.
  """
  clamped = getattr(cfg, "swiglu_limit", None) is not None
  loose = row_for(dtype, platform) != np.dtype(dtype).name
  return "highest" if clamped and loose else None


# Routing runs in float32 with its products at HIGHEST on every platform,
# so it is judged by the float32 forward row, except on a TPU. There the
# float32 transcendentals (exp in softmax and sigmoid, log, the reciprocal
# in the divisions) are approximations a few hundred units in the last
# place off, not the CPU's nearly correctly rounded ones: on a TPU v5e
# (JAX 0.10.2) the combine weights missed float64 numpy by up to ~4e-5 of
# their value (0.490055 against 0.490074), where the float32 row allows 2e-5
# of the largest plus 1e-5 of the value. The TPU row allows 1e-4 of each,
# 2.5x that measured worst case; it still catches a wrong score function
# or normalisation, which is off by percents.
_ROUTING = {
    "tpu": Tolerance(atol=1e-4, rtol=1e-4),
}


def routing(platform: str | None = None) -> Tolerance:
  """The tolerance of the float32 routing outputs (router logits and
  probabilities, combine weights, the losses) against an oracle, on
  `platform` (jax.default_backend() by default)."""
  return _ROUTING.get(
      platform or jax.default_backend(), TABLE["float32"]["forward"]
  )


def violation(actual, expected, tol: Tolerance) -> str | None:
  """None if `actual` is within `tol` of `expected`, else what is wrong."""
  actual = np.asarray(actual).astype(np.float64)
  expected = np.asarray(expected).astype(np.float64)
  if actual.shape != expected.shape:
    return f"shape {actual.shape} != expected {expected.shape}"
  if not np.all(np.isfinite(actual)):
    bad = np.argwhere(~np.isfinite(actual))[0]
    return (
        f"{np.sum(~np.isfinite(actual))} non-finite values, first at "
        f"{tuple(bad)}"
    )
  if actual.size == 0:
    return None
  # Routing runs in float32: an expected value below float32's smallest
  # normal (a float64 oracle's sigmoid(-110) = 1.7e-48) is 0 there, so the
  # scale never drops below it.
  scale = max(np.max(np.abs(expected)), np.finfo(np.float32).tiny)
  err = np.abs(actual - expected)
  allowed = tol.atol * scale + tol.rtol * np.abs(expected)
  if np.all(err <= allowed):
    return None
  worst = np.unravel_index(np.argmax(err - allowed), err.shape)
  return (
      f"{np.sum(err > allowed)} of {err.size} values off; worst at "
      f"{tuple(int(i) for i in worst)}: actual {actual[worst]:.6g}, "
      f"expected {expected[worst]:.6g}; max|err| / max|expected| = "
      f"{np.max(err) / scale if scale else np.inf:.3g} "
      f"(atol={tol.atol:.3g}, rtol={tol.rtol:.3g})"
  )


# --- Quantised GEMMs (moe_core.precision) -------------------------------------
#
# A quantised GEMM is judged against the exact (float64) product of the
# UNquantised operands, within a bound derived from the element format and
# the block. Quantising one element a of a block whose largest magnitude is
# amax_b, in a tensor (or group) whose largest is amax_t, errs by at most
#
#     |q(a) - a| <= u * |a| + kappa_b * amax_b + kappa_t * amax_t
#
# * u, the element format's relative rounding: half its spacing relative to
#   the value, 2^-(m+1) for m mantissa bits. E4M3 (m = 3): 2^-4. E2M1
#   (m = 1): 2^-2.
# * kappa_b, what the scale leaves near zero and at the top: values below
#   the smallest normal fall on the subnormal grid (spacing d: 2^-9 for
#   E4M3, 0.5 for E2M1), an absolute error of s * d / 2 where the block's
#   scale s maps amax_b onto at most the element maximum V (448, 6) and at
#   least V / r: s <= r * amax_b / V. r = 1 for the float32 scales
#   (fp8_tensor, fp8_block; plus 2^-20 for the float32 rounding of
#   amax / 448, which may push amax_b one float32 ulp over V and clip it),
#   r = 2 for MXFP8's E8M0 scale rounded up to a power of two. NVFP4's block
#   scale is itself rounded to E4M3 (nearest, relative error <= 2^-4), so
#   the block's largest value may land up to 2^-4 above 6 and be clipped:
#   kappa_b = (1 + 2^-4) * 0.5 / 2 / 6 + 2^-4.
# * kappa_t, NVFP4 only: a block scale below E4M3's smallest normal (2^-6)
#   is coarse, and its block may be clipped or flushed almost entirely; such
#   a block's amax_b < 2^-6 * 6 * amax_t / (6 * 448), which bounds its error:
#   kappa_t = 2^-6 / 448.
#
# The product of quantised operands then errs, per output element, by at
# most sum_k (e_a,k |w_k| + |a_k| e_w,k + e_a,k e_w,k) plus the float32
# accumulation, 4 * K * 2^-24 * sum_k |a_k w_k| (slack for the order of the
# sums), plus, for bfloat16 outputs, one bfloat16 rounding of the result
# (2^-8 relative).
#
# A backend multiplies the SAME quantised operands as the reference (the
# Backend template quantises for all), so backend against reference is
# judged by the float32/bfloat16 rows above, not by this bound.


class QuantizationError(NamedTuple):
  """Per-element quantisation error bound of a recipe (see above)."""

  u: float
  kappa_block: float
  kappa_tensor: float
  block: int | None  # Block length along the contraction; None: the tensor.
  weight_block_2d: bool  # Weights in block x block tiles (fp8_block).


_E4M3_SUBNORMAL_HALF = 2.0**-10 / 448  # (d / 2) / V for E4M3.

QUANTIZATION: dict[str, QuantizationError] = {
    "fp8_tensor": QuantizationError(
        u=2.0**-4,
        kappa_block=0.0,
        kappa_tensor=_E4M3_SUBNORMAL_HALF + 2.0**-20,
        block=None,
        weight_block_2d=False,
    ),
    "fp8_block": QuantizationError(
        u=2.0**-4,
        kappa_block=_E4M3_SUBNORMAL_HALF + 2.0**-20,
        kappa_tensor=0.0,
        block=128,
        weight_block_2d=True,
    ),
    "mxfp8": QuantizationError(
        u=2.0**-4,
        kappa_block=2 * _E4M3_SUBNORMAL_HALF,
        kappa_tensor=0.0,
        block=32,
        weight_block_2d=False,
    ),
    "nvfp4": QuantizationError(
        u=2.0**-2,
        kappa_block=(1 + 2.0**-4) * 0.25 / 6 + 2.0**-4,
        kappa_tensor=2.0**-6 / 448,
        block=16,
        weight_block_2d=False,
    ),
}


def _block_amax(x: np.ndarray, block: int | None, axis: int) -> np.ndarray:
  """max|x| over each block of `block` along `axis`, broadcast back to x."""
  x = np.moveaxis(np.abs(x), axis, -1)
  if block is None:
    amax = np.broadcast_to(np.max(x, axis=-1, keepdims=True), x.shape)
  else:
    length = x.shape[-1]
    padded = -(-length // block) * block
    x_pad = np.zeros(x.shape[:-1] + (padded,))
    x_pad[..., :length] = x
    blocks = x_pad.reshape(x.shape[:-1] + (padded // block, block))
    amax = np.repeat(np.max(blocks, axis=-1), block, axis=-1)[..., :length]
  return np.moveaxis(amax, -1, axis)


def quantization_error(
    x: np.ndarray,
    recipe: str,
    *,
    axis: int,
    tensor_axes: tuple[int, ...],
    block_axis: int | None = None,
) -> np.ndarray:
  """The per-element error bound of quantising x (float64, x's shape).

  Args:
    x: the unquantised values (float64).
    recipe: a key of QUANTIZATION.
    axis: the contraction axis (blocks run along it).
    tensor_axes: the axes one per-tensor scale spans (all but the batch).
    block_axis: for 2-D weight blocks (fp8_block), the output axis.
  """
  spec = QUANTIZATION[recipe]
  x = np.abs(np.asarray(x, np.float64))
  amax_t = np.max(x, axis=tensor_axes, keepdims=True) if x.size else x
  if spec.block is None:
    amax_b = np.broadcast_to(amax_t, x.shape)
  else:
    amax_b = _block_amax(x, spec.block, axis)
    if block_axis is not None and spec.weight_block_2d:
      amax_b = _block_amax(amax_b, spec.block, block_axis)
  return spec.u * x + spec.kappa_block * amax_b + spec.kappa_tensor * amax_t
