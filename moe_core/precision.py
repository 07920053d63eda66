"""Low-precision recipes for the expert GEMMs: quantize and dequantize.

Over 400 lines because it is one job: the four element formats' scale rules
(per tensor, 128-blocks, MX, NVFP4) share the padding, amax and NaN policy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

# No quantisation: the expert GEMMs run in the activation dtype (float32
# inputs stay float32).
UNQUANTIZED = "unquantized"
RECIPES = (UNQUANTIZED, "fp8_tensor", "fp8_block", "mxfp8", "nvfp4")
QUANTIZED_RECIPES = RECIPES[1:]
# Deprecated recipe names -> the recipe they mean. `check_recipe` (and so
# every public argument that takes a recipe) accepts them with a
# DeprecationWarning; no code past it sees them. "bf16" was UNQUANTIZED's
# name, though the recipe never cast anything to bfloat16.
DEPRECATED_ALIASES = {"bf16": UNQUANTIZED}
# Elements per block along the contraction axis (recipes with block scales).
BLOCK = {"fp8_block": 128, "mxfp8": 32, "nvfp4": 16}
# fp8_block weights: elements per block along the output axis.
WEIGHT_BLOCK = 128
# The largest finite element of each element dtype, keyed by numpy dtype
# (`ELEMENT_MAX[q.data.dtype]` or `ELEMENT_MAX[jnp.dtype(...)]`).
ELEMENT_MAX = {
    jnp.dtype(jnp.float8_e4m3fn): 448.0,
    jnp.dtype(jnp.float8_e5m2): 57344.0,
    jnp.dtype(jnp.float4_e2m1fn): 6.0,
    jnp.dtype(jnp.bfloat16): float(jnp.finfo(jnp.bfloat16).max),
}

_E4M3_MAX = ELEMENT_MAX[jnp.dtype(jnp.float8_e4m3fn)]
_E2M1_MAX = ELEMENT_MAX[jnp.dtype(jnp.float4_e2m1fn)]
# UNQUANTIZED's: what `quantize` casts to (its GEMMs never call it).
_ELEMENTS = {
    UNQUANTIZED: jnp.bfloat16,
    "fp8_tensor": jnp.float8_e4m3fn,
    "fp8_block": jnp.float8_e4m3fn,
    "mxfp8": jnp.float8_e4m3fn,
    "nvfp4": jnp.float4_e2m1fn,
}
_INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Smallest normal float32: the floor of float32 scales (see `quantize`).
_F32_TINY = float(np.finfo(np.float32).tiny)

# The scale rules that are choices, not formats (docs/precision.md,
# "Scale floors and rounding"; precision_test.py pins each against the
# quantiser).
#
# nvfp4: every E4M3 block scale is at least 2^-9, E4M3's smallest positive
# (subnormal) value, so no block, all-zero ones included, gets a zero scale
# (x / 0 would be Inf). A block whose amax / 6 / tensor_scale is below it
# is quantised on the coarser grid 6 * 2^-9 * tensor_scale allows.
NVFP4_BLOCK_SCALE_FLOOR = 2.0**-9
# nvfp4: the float32 tensor scale is at least 2^-117, so that
# block_scale * tensor_scale >= 2^-9 * 2^-117 = 2^-126 stays a normal
# float32 (XLA flushes subnormals to zero on the CPU).
NVFP4_TENSOR_SCALE_FLOOR = 2.0**-117
# mxfp8: how a block's E8M0 scale rounds amax / 448 to a power of two.
# "ceil": 2^ceil(log2(amax / 448)), as NVIDIA's MXFP8 recipe and qwix do,
# so the block's largest element lands in (224, 448] and never clips. The
# OCP MX v1.0 spec's 2^(floor(log2(amax)) - 8) rounds down instead, leaving
# amax / scale in [256, 512), which clips above 448.
MXFP8_SCALE_ROUNDING = "ceil"
# mxfp8: the E8M0 exponents scales are clamped to. 2^-126 is float32's
# smallest normal (2^-127 is valid E8M0 but a float32 subnormal), 2^127
# E8M0's largest; an all-zero block gets 2^0.
MXFP8_SCALE_EXPONENTS = (-126, 127)


def check_recipe(recipe, *, stacklevel: int = 1) -> str:
  """The canonical name of recipe `recipe` (one of RECIPES).

  A deprecated alias (DEPRECATED_ALIASES: "bf16") gives the recipe it
  names, with a DeprecationWarning.

  Args:
    recipe: a name of RECIPES or DEPRECATED_ALIASES.
    stacklevel: which frame the warning names: 1 the caller of
      check_recipe, 2 its caller, and so on. A public function that takes
      a recipe passes the depth of its own caller.

  Raises:
    TypeError: `recipe` is not a str.
    ValueError: `recipe` names no recipe (the message lists RECIPES).
  """
  if not isinstance(recipe, str):
    raise TypeError(
        f"precision must be a str, one of {RECIPES}, got "
        f"{type(recipe).__name__} {recipe!r}."
    )
  if recipe in DEPRECATED_ALIASES:
    canonical = DEPRECATED_ALIASES[recipe]
    warnings.warn(
        f"precision {recipe!r} is deprecated: use {canonical!r}, the same "
        f"recipe. {recipe!r} never cast to bfloat16: without quantisation "
        "the GEMMs run in the activation dtype (float32 stays float32).",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return canonical
  if recipe not in RECIPES:
    raise ValueError(f"precision must be one of {RECIPES}, got {recipe!r}.")
  return recipe


def element_dtype(recipe: str):
  """The default element dtype of `recipe` (unquantized: bfloat16, what
  `quantize` casts it to)."""
  return _ELEMENTS[check_recipe(recipe, stacklevel=2)]


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """A quantised tensor: x ~= data * scales (* tensor_scale), then unpadded.

  A JAX pytree: `data`, `scales` and `tensor_scale` are its children, the
  other fields static.

  Attributes:
    data: the elements (float8_e4m3fn, float8_e5m2 or float4_e2m1fn;
      bfloat16 for "unquantized"): x's shape padded with zeros along `axis`
      (and along `block_axis` for 2-D weight blocks) to whole blocks.
    scales: float32 (fp8_tensor, fp8_block, unquantized), float8_e8m0fnu
      (mxfp8) or float8_e4m3fn (nvfp4). Block recipes: x's shape with
      `axis` (and `block_axis`) replaced by its number of blocks.
      Per-tensor recipes: [*batch, 1, ..., 1]; [M, 1] (one per row) from
      `quantize_grouped_rows`.
    tensor_scale: float32 second-level scale (nvfp4), [*batch, 1, ..., 1]
      ([M, 1] from `quantize_grouped_rows`); ones for other recipes.
    recipe: one of RECIPES.
    axis: the non-negative contraction axis.
    size: x.shape[axis] before padding.
    block_axis: the output axis of 2-D weight blocks (fp8_block weights),
      else None.
    block_size: elements per block along `block_axis` (128), else None.
    block_axis_size: x.shape[block_axis] before padding, else None.
  """

  data: jax.Array
  scales: jax.Array
  tensor_scale: jax.Array
  recipe: str
  axis: int
  size: int
  block_axis: int | None = None
  block_size: int | None = None
  block_axis_size: int | None = None

  @property
  def dequantized_shape(self) -> tuple[int, ...]:
    """x's shape: data's shape without the padding."""
    shape = list(self.data.shape)
    shape[self.axis] = self.size
    if self.block_axis is not None:
      shape[self.block_axis] = self.block_axis_size
    return tuple(shape)


jax.tree_util.register_dataclass(
    QuantizedArray,
    data_fields=["data", "scales", "tensor_scale"],
    meta_fields=[
        "recipe",
        "axis",
        "size",
        "block_axis",
        "block_size",
        "block_axis_size",
    ],
)


# --- Validation ---------------------------------------------------------------


def _check_input(x, name):
  """x as a jax array of float32 / bfloat16 / float16 with ndim >= 1."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be a jax or numpy array, got {type(x)}.")
  if not any(x.dtype == d for d in _INPUT_DTYPES):
    raise TypeError(
        f"{name} must be float32, bfloat16 or float16, got {x.dtype}."
    )
  if x.ndim < 1:
    raise ValueError(f"{name} must have at least 1 axis, got {x.shape=}.")
  return jnp.asarray(x)


def _check_int(value, name):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
  return int(value)


def _element_dtype_for(recipe, elements):
  if elements is None:
    return _ELEMENTS[recipe]
  if elements == "e5m2" and recipe == "fp8_tensor":
    return jnp.float8_e5m2
  raise ValueError(
      "elements must be None or 'e5m2' (fp8_tensor only), got "
      f"elements={elements!r} with precision={recipe!r}."
  )


def _normalize_axes(shape, axis, batch_dims):
  """(axis, batch_dims) as non-negative ints, axis past the batch axes."""
  ndim = len(shape)
  axis = _check_int(axis, "axis")
  batch_dims = _check_int(batch_dims, "batch_dims")
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis must lie in [-{ndim}, {ndim}), got {axis=}.")
  axis %= ndim
  if not 0 <= batch_dims < ndim or axis < batch_dims:
    raise ValueError(
        "batch_dims must lie in [0, ndim) and leave the contraction axis "
        f"out of the batch axes, got {batch_dims=}, {axis=}, shape={shape}."
    )
  return axis, batch_dims


def _weight_block_axis(shape, axis, batch_dims):
  """fp8_block weights: the last axis that is neither `axis` nor batch."""
  others = [a for a in range(batch_dims, len(shape)) if a != axis]
  if not others:
    raise ValueError(
        "weight=True with fp8_block needs an output axis besides the "
        f"contraction and batch axes, got shape={shape}, {axis=}, "
        f"{batch_dims=}."
    )
  return others[-1]


# --- Amax and blocks ----------------------------------------------------------


def _abs_or_inf(x):
  """|x| with NaN and +-Inf as +Inf: a max over it is Inf iff one was bad."""
  return jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.inf)


def _nan_where_bad(amax):
  """amax reduced from `_abs_or_inf`, with a bad block's Inf made NaN."""
  return jnp.where(jnp.isinf(amax), jnp.nan, amax)


def _tensor_amax(x, batch_dims):
  """amax over all non-batch axes, [*batch, 1, ..., 1]; NaN if any is bad."""
  axes = tuple(range(batch_dims, x.ndim))
  return _nan_where_bad(jnp.max(_abs_or_inf(x), axis=axes, keepdims=True))


def _pad_to_blocks(x, axis, block):
  """x padded with zeros along `axis` to a multiple of `block`."""
  pad = -x.shape[axis] % block
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _block_max(v, axis, block):
  """Max over consecutive blocks of `block` along `axis` (a multiple)."""
  shape = v.shape[:axis] + (v.shape[axis] // block, block) + v.shape[axis + 1 :]
  return jnp.max(v.reshape(shape), axis=axis + 1)


def _expand(scales, axis, block):
  """Each block's scale repeated over the `block` elements it covers."""
  return jnp.repeat(scales, block, axis=axis)


# --- Scales -------------------------------------------------------------------


def _reciprocal32(value):
  """1 / value rounded once to float32 (a Python constant)."""
  return float(np.float32(1) / np.float32(value))


def _reciprocal(scale):
  """1 / scale elementwise, on the scale's own (unbroadcast) shape."""
  return 1.0 / scale


def _linear_scale(amax, element_max, floor=_F32_TINY):
  """amax / element_max in float32 (amax 0 -> 1, bad -> NaN), >= floor."""
  scale = jnp.maximum(amax * _reciprocal32(element_max), floor)
  scale = jnp.where(amax > 0, scale, 1.0)
  return jnp.where(jnp.isnan(amax), jnp.nan, scale)


def _power_of_two(exponent):
  """2^exponent as float32, exactly, for int32 exponents in [-126, 127]."""
  bits = (exponent + 127).astype(jnp.int32) << 23
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _mx_exponent(amax, element_max):
  """ceil(log2(amax / element_max)), exact, clamped; 0 where amax is 0.

  The rounding is MXFP8_SCALE_ROUNDING ("ceil"), the clamp
  MXFP8_SCALE_EXPONENTS.

  With amax = m * 2^e (m in [0.5, 1), from frexp) and element_max = m0 *
  2^e0, amax / element_max = (m / m0) * 2^(e - e0) with m / m0 in (0.5, 2):
  the ceiling is e - e0 when m <= m0 and e - e0 + 1 otherwise.
  """
  m0, e0 = math.frexp(element_max)
  m, e = jnp.frexp(amax)
  exponent = e - e0 + (m > m0).astype(jnp.int32)
  exponent = jnp.clip(exponent, *MXFP8_SCALE_EXPONENTS)
  return jnp.where(amax > 0, exponent, 0)


def _mx_scale(amax, element_max):
  """The mxfp8 scale 2^ceil(log2(amax / element_max)) in float32."""
  scale = _power_of_two(_mx_exponent(amax, element_max))
  return jnp.where(jnp.isnan(amax), jnp.nan, scale)


def _nvfp4_block_scale(block_amax, tensor_scale):
  """e4m3(clip(amax / 6 * encode, 2^-9, 448)), encode = 1 / tensor_scale.

  2^-9 is NVFP4_BLOCK_SCALE_FLOOR; the E4M3 cast rounds to nearest.

  encode is TE's global encode scale (6 * 448 / amax(tensor)); NaN if bad.
  """
  encode = _reciprocal(tensor_scale)
  ratio = block_amax * _reciprocal32(_E2M1_MAX) * encode
  scale = jnp.clip(ratio, NVFP4_BLOCK_SCALE_FLOOR, _E4M3_MAX)
  scale = jnp.where(jnp.isnan(ratio), jnp.nan, scale)
  return _narrow(scale, jnp.float8_e4m3fn)


def _narrow(x, dtype):
  """x cast to a narrow format (E4M3, E2M1), held there.

  XLA may drop a round trip f32 -> narrow -> f32 inside one program (its
  `xla_allow_excess_precision`, on by default, lets the simplifier remove
  convert pairs). On a TPU v5e it does, for E4M3 and E2M1 too: the
  dequantised operands of a quantised GEMM were then the unrounded values,
  not the recipe's, and a block scale read back in the same program was not
  the one stored. The barrier keeps the narrow array a value of its own, so
  every reader sees the rounded one on every platform.
  """
  return jax.lax.optimization_barrier(x.astype(dtype))


def _to_elements(x, inverse_scale, dtype):
  """dtype(clip(x * inverse_scale, -max, max)), the product in float32."""
  emax = ELEMENT_MAX[jnp.dtype(dtype)]
  return _narrow(jnp.clip(x * inverse_scale, -emax, emax), dtype)


# --- Recipes ------------------------------------------------------------------
# Each takes x in float32 (padding rows already zeroed) and the per-tensor amax
# [*batch, 1, ..., 1] or [M, 1] (NaN if bad), and returns a QuantizedArray.


def _quantize_unscaled(x, tensor_amax, axis):
  ones = jnp.ones(tensor_amax.shape, jnp.float32)
  return QuantizedArray(
      x.astype(jnp.bfloat16), ones, ones, UNQUANTIZED, axis, x.shape[axis]
  )


def _quantize_per_tensor(x, tensor_amax, axis, dtype):
  scale = _linear_scale(tensor_amax, ELEMENT_MAX[jnp.dtype(dtype)])
  return QuantizedArray(
      _to_elements(x, _reciprocal(scale), dtype),
      scale,
      jnp.ones_like(scale),
      "fp8_tensor",
      axis,
      x.shape[axis],
  )


def _quantize_fp8_block(x, tensor_amax, axis, block_axis):
  """DeepSeek-V3: 1x128 tiles, or 128x128 blocks when block_axis is set."""
  blocks = [(axis, BLOCK["fp8_block"])]
  if block_axis is not None:
    blocks.append((block_axis, WEIGHT_BLOCK))
  padded = x
  for a, block in blocks:
    padded = _pad_to_blocks(padded, a, block)
  amax = _abs_or_inf(padded)
  for a, block in blocks:
    amax = _block_max(amax, a, block)
  scales = _linear_scale(_nan_where_bad(amax), _E4M3_MAX)
  inverse = _reciprocal(scales)
  for a, block in blocks:
    inverse = _expand(inverse, a, block)
  return QuantizedArray(
      _to_elements(padded, inverse, jnp.float8_e4m3fn),
      scales,
      jnp.ones_like(tensor_amax),
      "fp8_block",
      axis,
      x.shape[axis],
      block_axis,
      None if block_axis is None else WEIGHT_BLOCK,
      None if block_axis is None else x.shape[block_axis],
  )


def _quantize_mxfp8(x, tensor_amax, axis):
  padded = _pad_to_blocks(x, axis, BLOCK["mxfp8"])
  amax = _nan_where_bad(_block_max(_abs_or_inf(padded), axis, BLOCK["mxfp8"]))
  scales = _mx_scale(amax, _E4M3_MAX)
  inverse = _expand(_reciprocal(scales), axis, BLOCK["mxfp8"])  # Exact.
  return QuantizedArray(
      _to_elements(padded, inverse, jnp.float8_e4m3fn),
      scales.astype(jnp.float8_e8m0fnu),
      jnp.ones_like(tensor_amax),
      "mxfp8",
      axis,
      x.shape[axis],
  )


def _quantize_nvfp4(x, tensor_amax, axis):
  tensor_scale = _linear_scale(
      tensor_amax, _E2M1_MAX * _E4M3_MAX, NVFP4_TENSOR_SCALE_FLOOR
  )
  padded = _pad_to_blocks(x, axis, BLOCK["nvfp4"])
  amax = _nan_where_bad(_block_max(_abs_or_inf(padded), axis, BLOCK["nvfp4"]))
  scales = _nvfp4_block_scale(amax, tensor_scale)
  inverse = _reciprocal(scales.astype(jnp.float32) * tensor_scale)
  inverse = _expand(inverse, axis, BLOCK["nvfp4"])
  return QuantizedArray(
      _to_elements(padded, inverse, jnp.float4_e2m1fn),
      scales,
      tensor_scale,
      "nvfp4",
      axis,
      x.shape[axis],
  )


def _quantize_with_amax(x, tensor_amax, recipe, axis, block_axis, dtype):
  """Dispatches to the recipe, given x in float32 and its tensor amax."""
  if recipe == UNQUANTIZED:
    return _quantize_unscaled(x, tensor_amax, axis)
  if recipe == "fp8_tensor":
    return _quantize_per_tensor(x, tensor_amax, axis, dtype)
  if recipe == "fp8_block":
    return _quantize_fp8_block(x, tensor_amax, axis, block_axis)
  if recipe == "mxfp8":
    return _quantize_mxfp8(x, tensor_amax, axis)
  return _quantize_nvfp4(x, tensor_amax, axis)


# --- Public entry points ------------------------------------------------------


def quantize(
    x, recipe, axis=-1, *, weight=False, batch_dims=0, elements=None
) -> QuantizedArray:
  """Quantises x with `recipe`, blocks running along `axis`.

  Jit-compatible: only shapes and the static arguments pick the code path.

  A recipe turns a float tensor into low-precision elements and scales, with
  x ~= data * scale. Blocks run along `axis`, the contraction dimension of the
  GEMM that will consume the tensor, so one scale multiplies a whole partial
  dot product. Every recipe follows the same numerics rules:

  * x is scaled in float32, clipped to the element format's +-max and only
    then cast: an E4M3 cast above its range gives NaN, and clipping keeps NaN.
    "x / scale" and "amax / 448" are computed as products with a float32
    reciprocal rounded once (x * (1 / scale), amax * fl(1 / 448)). XLA's
    algebraic simplifier rewrites a division by a broadcast or constant into
    exactly that product, for some shapes and not others; writing it out makes
    every recipe round the same way eager, under jit and on every backend. It
    differs from a true division by at most an ulp of float32, and not at all
    for power-of-two scales.
  * A scale comes from the amax of the elements it covers. An all-zero block
    gets a finite scale (documented per recipe) and dequantises to zeros.
  * NaN or +-Inf anywhere in a scale's block makes that scale NaN, so every
    element it covers is NaN after dequantisation; for a per-tensor scale that
    is the whole tensor (or the whole group, in `quantize_grouped_rows`).
  * A length that is not a multiple of the block is padded with zeros, which
    never change a scale (an amax is at least 0).
  * Scales are floored where needed so that they stay normal float32 numbers:
    XLA flushes float32 subnormals to zero on CPU (and may on GPU), and a
    zero scale would turn x / scale into Inf.

  Recipes:

  "unquantized" (deprecated alias "bf16"): no scales: data is x cast to
    bfloat16, scales are ones, and NaN / Inf stay where they are (there is no
    scale to poison). The recipe's GEMMs never call `quantize`: they run in
    the activation dtype.

  "fp8_tensor": per-tensor current scaling. Elements E4M3 (max 448), or E5M2
    (max 57344, `elements="e5m2"`, for gradients), as the OCP 8-bit Floating
    Point Specification (OFP8) r1.0 defines them. One float32 scale per tensor,
    scale = amax / max (amax 0 -> 1): not rounded, the element's full range is
    used and float32 keeps the scale's own error near 2^-24.

  "fp8_block": DeepSeek-V3's fine-grained scaling (the DeepSeek-V3 technical
    report, arXiv 2412.19437, section 3.3; deepseek-ai/DeepSeek-V3
    README_WEIGHTS.md). E4M3 elements; activations get one scale per 1x128
    tile (128 consecutive elements along the contraction axis), weights
    (`weight=True`) one per 128x128 block (128 along the contraction axis x
    128 along the output axis). Scales are float32, amax / 448 (amax 0 -> 1),
    not rounded: the report keeps them in float32 and uses the whole range.

  "mxfp8": OCP Microscaling Formats (MX) v1.0. Blocks of 32 along the
    contraction axis, E4M3 elements, one E8M0 scale (a power of two,
    jnp.float8_e8m0fnu) per block. The spec's scale, 2^(floor(log2(amax)) -
    8), leaves amax / scale anywhere in [256, 512), and above 448 the largest
    element clips; we round UP instead (MXFP8_SCALE_ROUNDING = "ceil"),
    scale = 2^ceil(log2(amax / 448)), as NVIDIA's MXFP8 recipe and qwix do,
    so it never saturates. The exponent is computed exactly from jnp.frexp,
    not through a float log2. Exponents are clamped to [-126, 127]
    (MXFP8_SCALE_EXPONENTS; 2^-127 is representable in E8M0 but is a
    float32 subnormal); an all-zero block gets 2^0.

  "nvfp4": NVIDIA's NVFP4 as Transformer Engine's
    docs/features/low_precision_training/nvfp4 describes it. E2M1 elements
    (jnp.float4_e2m1fn, max 6) in blocks of 16 along the contraction axis, one
    E4M3 scale per block, and one float32 `tensor_scale` per tensor. With the
    decode tensor scale ts = amax(tensor) / (6 * 448) (amax 0 -> 1; TE's
    global encode scale is 1 / ts), block_scale = e4m3(clip(amax(block) / 6 /
    ts, 2^-9, 448)), data = e2m1(clip(x / (block_scale * ts), -6, 6)) and
    x ~= data * block_scale * ts. ts is floored at 2^-117
    (NVFP4_TENSOR_SCALE_FLOOR) so that block_scale * ts stays a normal
    float32. The block scale rounds to nearest, as TE does, so the largest
    element of a block may saturate at 6: by at most 1/16 relative while the
    block scale is a normal E4M3 number, by up to 1/3 when it is subnormal
    (block amax below 6 * 2^-6 * ts, about 2^-15 of the tensor's amax). It
    is floored at 2^-9 (NVFP4_BLOCK_SCALE_FLOOR), E4M3's smallest
    subnormal, so no block (all-zero ones included) gets a zero scale. E2M1
    has no NaN: a NaN element casts to a number, so NaN lives in the scales.

  Args:
    x: float32, bfloat16 or float16 array, [*batch, ...].
    recipe: one of RECIPES (above), or a deprecated alias.
    axis: the contraction axis of the GEMM that consumes x; not a batch axis.
    weight: use the recipe's weight layout: fp8_block's 128x128 blocks over
      (`axis`, the last other non-batch axis). Other recipes ignore it.
    batch_dims: this many leading axes index independent tensors, each with
      its own per-tensor scale (weights [E, K, N]: 1, one per expert).
    elements: None (the recipe's element type) or "e5m2" (fp8_tensor only,
      for gradients).

  Returns:
    A QuantizedArray; `dequantize` gives back x's shape.
  """
  recipe = check_recipe(recipe, stacklevel=2)
  x = _check_input(x, "x")
  if not isinstance(weight, bool):
    raise TypeError(f"weight must be a bool, got {type(weight).__name__}.")
  dtype = _element_dtype_for(recipe, elements)
  axis, batch_dims = _normalize_axes(x.shape, axis, batch_dims)
  block_axis = None
  if weight and recipe == "fp8_block":
    block_axis = _weight_block_axis(x.shape, axis, batch_dims)
  return _quantize(x, recipe, axis, block_axis, batch_dims, dtype)


# One compiled function per shape and static choice: run eagerly, the recipes
# would otherwise dispatch (and compile) dozens of small ops one by one.
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _quantize(x, recipe, axis, block_axis, batch_dims, dtype):
  x = x.astype(jnp.float32)
  tensor_amax = _tensor_amax(x, batch_dims)
  return _quantize_with_amax(x, tensor_amax, recipe, axis, block_axis, dtype)


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
  """data * scales (* tensor_scale) in float32, unpadded, cast to `dtype`.

  Args:
    q: a QuantizedArray from `quantize` or the grouped functions.
    dtype: the output dtype.

  Returns:
    [*q.dequantized_shape] in `dtype`.
  """
  if not isinstance(q, QuantizedArray):
    raise TypeError(f"q must be a QuantizedArray, got {type(q).__name__}.")
  return _dequantize(q, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(q, dtype):
  data = q.data.astype(jnp.float32)
  scales = q.scales.astype(jnp.float32)
  if q.recipe in BLOCK:
    scales = _expand(scales, q.axis, BLOCK[q.recipe])
    if q.block_axis is not None:
      scales = _expand(scales, q.block_axis, q.block_size)
  # nvfp4: data * block scale is exact (2 x 4 significant bits); one rounding.
  x = data * scales * q.tensor_scale
  x = jax.lax.slice_in_dim(x, 0, q.size, axis=q.axis)
  if q.block_axis is not None:
    x = jax.lax.slice_in_dim(x, 0, q.block_axis_size, axis=q.block_axis)
  return x.astype(dtype)


def row_groups(group_sizes, num_rows, *, clamp_tail: bool = False):
  """Group id of each row [M] int32 of group sizes [E].

  Rows past sum(group_sizes) get E, a group of their own, or with
  `clamp_tail` the last group, E - 1 (for a lookup of per-group values).
  """
  ends = jnp.cumsum(group_sizes)
  rows = jnp.arange(num_rows, dtype=ends.dtype)
  groups = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
  if clamp_tail:
    groups = jnp.minimum(groups, group_sizes.shape[0] - 1)
  return groups


def _group_amax(row_amax, groups, num_groups):
  """Each row's group amax [M, 1] from row amaxes [M, 1]; NaN if bad.

  Rows in no group form group `num_groups` of their own, so they never
  reach a real group's amax.
  """
  # segment_max's handling of NaN is unspecified: Inf marks a bad row.
  flat = jnp.where(jnp.isnan(row_amax[:, 0]), jnp.inf, row_amax[:, 0])
  per_group = jax.ops.segment_max(
      flat, groups, num_segments=num_groups + 1, indices_are_sorted=True
  )
  return _nan_where_bad(per_group[groups][:, None])


def quantize_grouped_rows(
    rows, group_sizes, recipe, *, elements=None
) -> QuantizedArray:
  """Quantises rows sorted by group, with per-GROUP per-tensor scales.

  Group e owns rows [sum(group_sizes[:e]), sum(group_sizes[:e+1])). Rows at
  or past sum(group_sizes) are padding (they may hold NaN): they quantise to
  zeros and never change a scale. Block scales lie within a row, so groups
  matter only for fp8_tensor's scale and nvfp4's tensor_scale, which are the
  amax of that group's rows alone, stored per row as [M, 1].

  Args:
    rows: [M, K] float32 / bfloat16 / float16, K the contraction axis.
    group_sizes: [E] integer, may be traced; entries assumed non-negative
      with a sum <= M (moe_core.validation checks that upstream).
    recipe: one of RECIPES (or a deprecated alias).
    elements: as in `quantize` (None, or "e5m2" with fp8_tensor).

  Returns:
    A QuantizedArray with axis=1; scales [M, 1] for fp8_tensor and
    unquantized, tensor_scale [M, 1].
  """
  recipe = check_recipe(recipe, stacklevel=2)
  rows = _check_input(rows, "rows")
  if rows.ndim != 2:
    raise ValueError(f"rows must be [M, K], got {rows.shape=}.")
  if not hasattr(group_sizes, "dtype") or not jnp.issubdtype(
      group_sizes.dtype, jnp.integer
  ):
    raise TypeError(
        "group_sizes must be an integer array, got "
        f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)}."
    )
  if group_sizes.ndim != 1:
    raise ValueError(f"group_sizes must be [E], got {group_sizes.shape=}.")
  dtype = _element_dtype_for(recipe, elements)
  return _quantize_grouped_rows(rows, group_sizes, recipe, dtype)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _quantize_grouped_rows(rows, group_sizes, recipe, dtype):
  groups = row_groups(group_sizes, rows.shape[0])
  in_group = (groups < group_sizes.shape[0])[:, None]
  x = jnp.where(in_group, rows.astype(jnp.float32), 0.0)
  row_amax = _tensor_amax(x, batch_dims=1)
  tensor_amax = _group_amax(row_amax, groups, group_sizes.shape[0])
  return _quantize_with_amax(x, tensor_amax, recipe, 1, None, dtype)


def quantize_grouped_weights(w, recipe, *, contract_axis) -> QuantizedArray:
  """Quantises expert weights, one tensor per expert, in the weight layout.

  Args:
    w: [E, K, N] (contract_axis=1) or [E, N, K] (contract_axis=2), float32 /
      bfloat16 / float16.
    recipe: one of RECIPES (or a deprecated alias).
    contract_axis: 1 or 2, the axis of K.

  Returns:
    `quantize(w, recipe, contract_axis, weight=True, batch_dims=1)`.
  """
  w = _check_input(w, "w")
  if w.ndim != 3:
    raise ValueError(f"w must be [E, K, N] or [E, N, K], got {w.shape=}.")
  if contract_axis not in (1, 2) or isinstance(contract_axis, bool):
    raise ValueError(f"contract_axis must be 1 or 2, got {contract_axis!r}.")
  recipe = check_recipe(recipe, stacklevel=2)
  return quantize(w, recipe, contract_axis, weight=True, batch_dims=1)
