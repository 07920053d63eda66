"""moe_core.precision against hand-built blocks, numpy/ml_dtypes and math.

Over 450 lines because it is one job, as precision.py is: every recipe's
scale rule against one numpy model of the recipes (`_model_scales`,
`_model_dequantize`), on shared inputs so that each recipe compiles once
per shape (compiling dominates the runtime; split files would each pay it).
"""

import fractions
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moe_core import config as config_lib
from moe_core import precision

_RECIPES = [dict(recipe=r) for r in precision.RECIPES]
_QUANTIZED = [dict(recipe=r) for r in precision.QUANTIZED_RECIPES]
_F32 = np.float32
_E4M3 = ml_dtypes.float8_e4m3fn
_E2M1 = ml_dtypes.float4_e2m1fn
# Most tests share these inputs, so that each recipe compiles once per shape
# (compiling dominates this file's runtime). [6, 200]: one tensor per row
# (batch_dims=1), blocks along the last axis; 200 is a multiple of no block.
_SHAPE = (6, 200)
# [2, 100, 40]: contraction axis 1, one tensor per leading index.
_SHAPE3 = (2, 100, 40)


def _np(a):
  """An array as float32 numpy (exact for every element and scale dtype)."""
  return np.asarray(a).astype(_F32)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def _random(shape, seed, spread=12):
  """Normal values; each last-axis row scaled by a power of two, 2^+-spread."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(_F32)
  rows = rng.integers(-spread, spread, shape[:-1] + (1,))
  return (x * np.exp2(rows)).astype(_F32)


def _ceil_log2_ratio(amax, denominator):
  """The smallest integer s with amax / denominator <= 2^s, in exact math."""
  ratio = fractions.Fraction(float(amax)) / fractions.Fraction(denominator)
  s = 0
  while fractions.Fraction(2) ** s < ratio:
    s += 1
  while fractions.Fraction(2) ** (s - 1) >= ratio:
    s -= 1
  return s


# --- An independent numpy model of each recipe on [R, L] inputs --------------
# One row is one tensor and blocks run along the last axis; every scale is
# built from the recipe's definition, block by block. As `precision.quantize`
# documents, a division by a scale is a product with its float32 reciprocal.


def _inv(value):
  """1 / value, rounded once to float32."""
  return _F32(1) / _F32(value)


def _model_scales(x, recipe):
  """(per-element scale [R, L] float32, per-row tensor scale [R, 1])."""
  rows, length = x.shape
  ones = np.ones((rows, 1), _F32)
  if recipe == "unquantized":
    return np.ones_like(x), ones
  if recipe == "fp8_tensor":
    amax = np.abs(x).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax * _inv(448), _F32(1))
    return np.broadcast_to(scale, x.shape), ones
  block = precision.BLOCK[recipe]
  tensor_amax = np.abs(x).max(axis=1, keepdims=True)
  tensor = np.where(tensor_amax > 0, tensor_amax * _inv(6 * 448), _F32(1))
  scale = np.zeros_like(x)
  for r in range(rows):
    for start in range(0, length, block):
      amax = np.abs(x[r, start : start + block]).max()
      if recipe == "fp8_block":
        value = amax * _inv(448) if amax > 0 else _F32(1)
      elif recipe == "mxfp8":
        exponent = _ceil_log2_ratio(amax, 448) if amax > 0 else 0
        value = _F32(2.0 ** max(-126, exponent))
      else:
        ratio = amax * _inv(6) * _inv(tensor[r, 0])
        value = np.clip(ratio, _F32(2.0**-9), _F32(448)).astype(_E4M3)
      scale[r, start : start + block] = value
  if recipe != "nvfp4":
    tensor = ones
  return scale, tensor.astype(_F32)


def _model_dequantize(x, recipe):
  """dequantize(quantize(x)) for [R, L] float32 x, in numpy."""
  if recipe == "unquantized":
    return x.astype(ml_dtypes.bfloat16).astype(_F32)
  scale, tensor = _model_scales(x, recipe)
  dtype, top = (_E2M1, 6) if recipe == "nvfp4" else (_E4M3, 448)
  inverse = _F32(1) / (scale * tensor)
  data = np.clip(x * inverse, -top, top).astype(dtype).astype(_F32)
  return data * scale * tensor


def _model_block_weights(w):
  """fp8_block weight round trip of [E, K, N] w, one 128x128 block at a time."""
  out = np.zeros_like(w)
  for e in range(w.shape[0]):
    for i in range(0, w.shape[1], 128):
      for j in range(0, w.shape[2], 128):
        block = w[e, i : i + 128, j : j + 128]
        scale = np.abs(block).max() * _inv(448)
        data = np.clip(block * _inv(scale), -448, 448).astype(_E4M3)
        out[e, i : i + 128, j : j + 128] = data.astype(_F32) * scale
  return out


def _per_element_scale(q):
  """q's scales (times tensor_scale) repeated over the elements they cover."""
  scales = _np(q.scales)
  if q.recipe in precision.BLOCK:
    scales = np.repeat(scales, precision.BLOCK[q.recipe], axis=q.axis)
    if q.block_axis is not None:
      scales = np.repeat(scales, q.block_size, axis=q.block_axis)
  full = np.broadcast_to(scales * _np(q.tensor_scale), q.data.shape)
  return full[tuple(slice(0, n) for n in q.dequantized_shape)]


def _round_trip(x, recipe, **kwargs):
  q = precision.quantize(x, recipe, **kwargs)
  return q, _np(precision.dequantize(q))


_CFG_FIELDS = dict(num_experts=4, top_k=2, hidden_size=8, expert_ffn_size=8)


class RecipeNamesTest(parameterized.TestCase):

  def test_the_config_takes_exactly_the_recipes(self):
    for recipe in precision.RECIPES:
      self.assertEqual(
          config_lib.MoEConfig(**_CFG_FIELDS, precision=recipe).precision,
          recipe,
      )
    with self.assertRaisesRegex(ValueError, "precision must be one of"):
      config_lib.MoEConfig(**_CFG_FIELDS, precision="fp16_tensor")

  @parameterized.parameters(_RECIPES)
  def test_check_recipe_accepts_every_recipe(self, recipe):
    self.assertEqual(precision.check_recipe(recipe), recipe)

  def test_check_recipe_rejects_an_unknown_name_listing_the_recipes(self):
    with self.assertRaisesRegex(
        ValueError,
        r"precision must be one of \('unquantized', .*'nvfp4'\), got 'fp4'",
    ) as raised:
      precision.check_recipe("fp4")
    # The canonical names only: the deprecated alias is not offered.
    self.assertNotIn("bf16", str(raised.exception))

  def test_the_unquantized_recipe_comes_first(self):
    self.assertEqual(precision.RECIPES[0], precision.UNQUANTIZED)
    self.assertEqual(precision.UNQUANTIZED, "unquantized")
    self.assertNotIn(precision.UNQUANTIZED, precision.QUANTIZED_RECIPES)

  def test_check_recipe_rejects_a_non_string(self):
    with self.assertRaisesRegex(TypeError, "precision must be a str.*int 8"):
      precision.check_recipe(8)

  def test_element_max_is_each_formats_largest_finite_value(self):
    for dtype in (_E4M3, ml_dtypes.float8_e5m2, _E2M1, ml_dtypes.bfloat16):
      with self.subTest(dtype=dtype.__name__):
        self.assertEqual(
            precision.ELEMENT_MAX[jnp.dtype(dtype)],
            float(ml_dtypes.finfo(dtype).max),
        )

  def test_element_dtype(self):
    self.assertEqual(precision.element_dtype("nvfp4"), jnp.float4_e2m1fn)
    self.assertEqual(precision.element_dtype("mxfp8"), jnp.float8_e4m3fn)
    self.assertEqual(precision.element_dtype("fp8_block"), jnp.float8_e4m3fn)
    # What `quantize` casts to without a recipe's scales.
    self.assertEqual(precision.element_dtype("unquantized"), jnp.bfloat16)


class DeprecatedAliasTest(parameterized.TestCase):
  """The deprecated alias "bf16" of "unquantized": accepted where a recipe
  is passed, with a DeprecationWarning, and normalised."""

  def assertWarnsAlias(self):
    """A context expecting one DeprecationWarning that names the new recipe
    and why, attributed to this file (the caller, not the library)."""
    return self.assertWarnsRegex(
        DeprecationWarning,
        r"'bf16' is deprecated: use 'unquantized'.*never cast to bfloat16",
    )

  def _assert_points_here(self, caught):
    self.assertEqual(caught.filename, __file__)

  def test_check_recipe_names_the_canonical_recipe(self):
    with self.assertWarnsAlias() as caught:
      self.assertEqual(precision.check_recipe("bf16"), "unquantized")
    self._assert_points_here(caught)

  def test_alias_is_not_a_recipe(self):
    self.assertNotIn("bf16", precision.RECIPES)
    self.assertEqual(
        precision.DEPRECATED_ALIASES, {"bf16": precision.UNQUANTIZED}
    )

  def test_canonical_names_do_not_warn(self):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      for recipe in precision.RECIPES:
        self.assertEqual(precision.check_recipe(recipe), recipe)

  def test_config_stores_the_canonical_recipe(self):
    with self.assertWarnsAlias() as caught:
      cfg = config_lib.MoEConfig(**_CFG_FIELDS, precision="bf16")
    self._assert_points_here(caught)
    self.assertEqual(cfg.precision, "unquantized")
    self.assertEqual(
        cfg, config_lib.MoEConfig(**_CFG_FIELDS, precision="unquantized")
    )
    with self.assertWarnsAlias():
      self.assertEqual(cfg.replace(precision="bf16").precision, "unquantized")

  def test_quantize_gives_the_unquantized_arrays(self):
    x = _random(_SHAPE, seed=21)
    want = precision.quantize(x, "unquantized", batch_dims=1)
    with self.assertWarnsAlias() as caught:
      got = precision.quantize(x, "bf16", batch_dims=1)
    self._assert_points_here(caught)
    self.assertEqual(got.recipe, "unquantized")
    for name in ("data", "scales", "tensor_scale"):
      np.testing.assert_array_equal(
          _bits(getattr(got, name)), _bits(getattr(want, name))
      )

  def test_grouped_quantizers_and_element_dtype_take_it(self):
    rows = _random((8, 40), seed=22)
    sizes = jnp.array([3, 5], jnp.int32)
    with self.assertWarnsAlias() as caught:
      q_rows = precision.quantize_grouped_rows(rows, sizes, "bf16")
    self._assert_points_here(caught)
    with self.assertWarnsAlias() as caught:
      q_w = precision.quantize_grouped_weights(
          rows.reshape(2, 4, 40), "bf16", contract_axis=1
      )
    self._assert_points_here(caught)
    self.assertEqual((q_rows.recipe, q_w.recipe), ("unquantized",) * 2)
    with self.assertWarnsAlias():
      self.assertEqual(
          precision.element_dtype("bf16"),
          precision.element_dtype("unquantized"),
      )


class RandomInputTest(parameterized.TestCase):
  """Random inputs against the numpy model (bit for bit) and the math."""

  @parameterized.parameters(_RECIPES)
  def test_round_trip_matches_numpy_model(self, recipe):
    x = _random(_SHAPE, seed=1)
    q, out = _round_trip(x, recipe, batch_dims=1)
    np.testing.assert_array_equal(out, _model_dequantize(x, recipe))
    scale, tensor = _model_scales(x, recipe)
    np.testing.assert_array_equal(_per_element_scale(q), scale * tensor)
    if recipe != "unquantized":  # A guard against a recipe that does nothing.
      self.assertFalse(np.array_equal(out, x))

  # Half an ulp of the element format, relative for normal values and in
  # units of the scale below: E4M3 has 3 mantissa bits (2^-4 relative) and
  # subnormal spacing 2^-9 (2^-10 absolute); E2M1 has 1 mantissa bit (2^-2
  # relative for scaled values >= 1, and a block maximum saturated from up
  # to 6.4 to 6 stays within it) and spacing 0.5 below 1 (0.25 absolute);
  # bfloat16 has 7 (2^-8 relative).
  _BOUNDS = {
      "unquantized": (2.0**-8, 0.0),
      "fp8_tensor": (2.0**-4, 2.0**-10),
      "fp8_block": (2.0**-4, 2.0**-10),
      "mxfp8": (2.0**-4, 2.0**-10),
      "nvfp4": (2.0**-2, 0.25),
  }

  @parameterized.parameters(_RECIPES)
  def test_error_within_half_an_element_ulp(self, recipe):
    # Rows spread over 2^+-4 put small values in the subnormal range; nvfp4
    # block scales stay normal E4M3 numbers (see `precision.quantize`).
    x = _random(_SHAPE3, seed=9, spread=4)
    q, out = _round_trip(x, recipe, axis=1, batch_dims=1)
    relative, absolute = self._BOUNDS[recipe]
    bound = np.maximum(relative * np.abs(x), absolute * _per_element_scale(q))
    # x * (1 / scale) and data * scale each round once more in float32.
    excess = np.abs(out - x) - bound * (1 + 2.0**-20)
    self.assertLessEqual(excess.max(), 0)

  @parameterized.parameters(_RECIPES)
  def test_shapes_and_dtypes(self, recipe):
    x = _random(_SHAPE3, seed=9, spread=4)
    q = precision.quantize(x, recipe, axis=1, batch_dims=1)
    self.assertEqual(q.dequantized_shape, x.shape)
    as_bf16 = jax.eval_shape(lambda q: precision.dequantize(q, jnp.bfloat16), q)
    self.assertEqual((as_bf16.shape, as_bf16.dtype), (x.shape, jnp.bfloat16))
    self.assertEqual(q.data.dtype, precision.element_dtype(recipe))
    self.assertEqual(q.tensor_scale.shape, (2, 1, 1))
    self.assertEqual(q.tensor_scale.dtype, jnp.float32)
    self.assertEqual((q.axis, q.size, q.block_axis), (1, 100, None))
    if recipe in precision.BLOCK:
      blocks = -(-100 // precision.BLOCK[recipe])
      self.assertEqual(q.scales.shape, (2, blocks, 40))
      self.assertEqual(q.data.shape, (2, blocks * precision.BLOCK[recipe], 40))
    else:
      self.assertEqual(q.scales.shape, (2, 1, 1))
      self.assertEqual(q.data.shape, x.shape)
    scale_dtypes = {"mxfp8": jnp.float8_e8m0fnu, "nvfp4": jnp.float8_e4m3fn}
    self.assertEqual(q.scales.dtype, scale_dtypes.get(recipe, jnp.float32))

  @parameterized.parameters(("nvfp4", jnp.bfloat16), ("fp8_block", jnp.float16))
  def test_low_precision_inputs_match_their_float32_values(self, recipe, dtype):
    low = jnp.asarray(_random(_SHAPE, seed=3), dtype)
    np.testing.assert_array_equal(
        _round_trip(low, recipe, batch_dims=1)[1],
        _round_trip(_np(low), recipe, batch_dims=1)[1],
    )

  def test_jit_equals_eager(self):
    x = _random(_SHAPE, seed=7)
    x[2, 50] = np.inf  # Poisoned values must match too.

    def all_recipes(v):
      return {
          r: precision.quantize(v, r, batch_dims=1) for r in precision.RECIPES
      }

    jitted = jax.jit(all_recipes)(x)
    jitted_out = jax.jit(
        lambda qs: jax.tree.map(
            precision.dequantize,
            qs,
            is_leaf=lambda q: isinstance(q, precision.QuantizedArray),
        )
    )(jitted)
    for recipe in precision.RECIPES:
      eager, eager_out = _round_trip(x, recipe, batch_dims=1)
      for name in ("data", "scales", "tensor_scale"):
        with self.subTest(recipe=recipe, field=name):
          np.testing.assert_array_equal(
              _bits(getattr(eager, name)), _bits(getattr(jitted[recipe], name))
          )
      np.testing.assert_array_equal(eager_out, _np(jitted_out[recipe]))
      self.assertTrue(np.isnan(eager_out[2, 50]) or recipe == "unquantized")

  @parameterized.parameters(_RECIPES)
  def test_negation_negates_the_elements(self, recipe):
    x = _random(_SHAPE, seed=11)
    q = precision.quantize(x, recipe, batch_dims=1)
    q_neg = precision.quantize(-x, recipe, batch_dims=1)
    np.testing.assert_array_equal(_np(q_neg.data), -_np(q.data))
    np.testing.assert_array_equal(_bits(q_neg.scales), _bits(q.scales))

  def test_quantized_array_is_a_pytree(self):
    q = precision.quantize(_random(_SHAPE, seed=0), "mxfp8", batch_dims=1)
    leaves, tree = jax.tree_util.tree_flatten(q)
    self.assertLen(leaves, 3)
    rebuilt = jax.tree_util.tree_unflatten(tree, leaves)
    self.assertEqual(
        (rebuilt.recipe, rebuilt.axis, rebuilt.size), ("mxfp8", 1, 200)
    )
    through_jit = jax.jit(lambda q: q)(q)
    self.assertIsInstance(through_jit, precision.QuantizedArray)
    np.testing.assert_array_equal(_bits(through_jit.scales), _bits(q.scales))


class ExactBlocksTest(parameterized.TestCase):
  """Hand-built blocks whose round trip is exact, and their scales."""

  # E4M3 at scale 1: 448 (the max), powers of two from 2^-9 (the smallest
  # subnormal) to 2^8, subnormals k * 2^-9, and normals with 3 mantissa bits,
  # with mixed signs.
  _E4M3_VALUES = (
      [448.0, -448.0, 1.75, -1.875, 3 * 2.0**-9, -5 * 2.0**-9, 7 * 2.0**-9]
      + [2.0**k for k in range(-9, 9)]
      + [-(2.0**k) for k in range(-9, 9, 3)]
  )

  @parameterized.product(
      recipe=["fp8_tensor", "fp8_block", "mxfp8"], shift=[0, -40, 60]
  )
  def test_e4m3_grid_values_round_trip_exactly(self, recipe, shift):
    x = np.zeros((1, 128), _F32)
    x[0, : len(self._E4M3_VALUES)] = self._E4M3_VALUES
    x *= _F32(2.0**shift)
    q, out = _round_trip(x, recipe)
    np.testing.assert_array_equal(out, x)
    # amax 448 * 2^shift: the first block's scale is exactly 2^shift; mxfp8's
    # other blocks (of 32) are all zero, with scale 2^0.
    scales = _np(q.scales)[0]
    np.testing.assert_array_equal(scales[0], 2.0**shift)
    np.testing.assert_array_equal(scales[1:], 1.0)

  def test_unquantized_powers_of_two_round_trip_exactly(self):
    x = np.array([[2.0**k for k in range(-120, 120, 7)]], _F32)
    signs = np.array([[1, -1] * 17 + [1]], _F32)
    q, out = _round_trip(x * signs, "unquantized")
    self.assertEqual(q.data.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(np.abs(out), x)
    np.testing.assert_array_equal(_np(q.scales), 1.0)

  @parameterized.parameters(0, -30, 40)
  def test_nvfp4_grid_values_round_trip_exactly(self, shift):
    grid = np.array([6, 4, 3, 2, 1.5, 1, 0.5, 0], _F32)
    grid = np.concatenate([grid, -grid])  # Mixed signs, E2M1's subnormal 0.5.
    # Block 0 sets the tensor amax 6 * 448 (tensor scale 2^shift, block
    # scale 448); the others have block scales 2^m (exact in E4M3, 2^-9 its
    # smallest subnormal), and an all-zero block gets the floor 2^-9.
    exponents = [-3, None, 5, -9]
    blocks = [grid * 448] + [
        np.zeros(16, _F32) if m is None else grid * 2.0**m for m in exponents
    ]
    x = (np.concatenate(blocks) * _F32(2.0**shift))[None]
    q, out = _round_trip(x, "nvfp4")
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(_np(q.tensor_scale), [[2.0**shift]])
    np.testing.assert_array_equal(
        _np(q.scales), [[448, 2.0**-3, 2.0**-9, 2.0**5, 2.0**-9]]
    )

  @parameterized.parameters(
      448.0,
      447.0,
      449.0,
      256.0,
      512.0,
      1.0,
      3.0,
      2.0**-100,
      2.0**100,
      2.0**-118,
      2.0**-119,
      2.0**-124,
      3.0e38,
      1e-30,
      7 * 2.0**-20,
      float(np.nextafter(_F32(448), _F32(1e9))),
      float(np.nextafter(_F32(448), _F32(0))),
      float(np.nextafter(_F32(2.0**-50 * 448), _F32(1))),
  )
  def test_mxfp8_exponent_is_ceil_log2_of_amax_over_448(self, amax):
    x = np.zeros((1, 32), _F32)
    x[0, 3], x[0, 7] = -amax, amax / 3
    q = precision.quantize(x, "mxfp8")
    exponent = int(_bits(q.scales)[0, 0]) - 127  # E8M0: a biased exponent.
    # Clamped at -126: 2^-127 would be a float32 subnormal.
    self.assertEqual(exponent, max(-126, _ceil_log2_ratio(_F32(amax), 448)))
    largest = np.abs(_np(q.data)).max()
    self.assertLessEqual(largest, 448)
    if amax >= 2.0**-118:  # Above the clamp, amax lands in [224, 448].
      self.assertGreaterEqual(largest, 224)

  @parameterized.parameters(_QUANTIZED)
  def test_all_zero_blocks_give_zeros_and_finite_scales(self, recipe):
    x = np.zeros(_SHAPE, _F32)
    x[1, :64] = _random((1, 64), seed=1)
    q, out = _round_trip(x, recipe, batch_dims=1)
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_array_equal(out[1, 128:], 0)
    for scales in (_np(q.scales), _np(q.tensor_scale)):
      self.assertTrue(np.isfinite(scales).all())
      self.assertGreater(scales.min(), 0)

  @parameterized.parameters(_RECIPES)
  def test_padding_never_changes_a_scale(self, recipe):
    x = _random(_SHAPE, seed=5)
    padded = np.pad(x, [(0, 0), (0, 56)])  # 256: whole blocks everywhere.
    q = precision.quantize(x, recipe, batch_dims=1)
    q_padded = precision.quantize(padded, recipe, batch_dims=1)
    blocks = q.scales.shape[1]
    np.testing.assert_array_equal(
        _bits(q.scales), _bits(q_padded.scales)[:, :blocks]
    )
    np.testing.assert_array_equal(
        _bits(q.tensor_scale), _bits(q_padded.tensor_scale)
    )
    data = _np(q.data)
    np.testing.assert_array_equal(data, _np(q_padded.data)[:, : data.shape[1]])
    np.testing.assert_array_equal(data[:, 200:], 0)
    self.assertEqual(precision.dequantize(q).shape, _SHAPE)


class ScaleRulesTest(absltest.TestCase):
  """The named scale floors and rounding rule, against the quantiser."""

  def test_nvfp4_block_scale_floor_is_e4m3s_smallest_subnormal(self):
    self.assertEqual(precision.NVFP4_BLOCK_SCALE_FLOOR, 2.0**-9)
    self.assertEqual(
        precision.NVFP4_BLOCK_SCALE_FLOOR,
        float(ml_dtypes.finfo(_E4M3).smallest_subnormal),
    )
    # Tensor amax 6 * 448: tensor scale 1. Block 1 is all zero, block 2's
    # amax / 6 = 2^-12 asks for a scale under the floor, block 3's
    # amax / 6 = 2^-9 sits on it and block 4's = 2^-8 is above it.
    x = np.zeros((1, 80), _F32)
    x[0, 0] = 6 * 448
    x[0, 32], x[0, 48], x[0, 64] = 6 * 2.0**-12, 6 * 2.0**-9, -6 * 2.0**-8
    q, out = _round_trip(x, "nvfp4")
    floor = precision.NVFP4_BLOCK_SCALE_FLOOR
    np.testing.assert_array_equal(_np(q.tensor_scale), [[1.0]])
    np.testing.assert_array_equal(
        _np(q.scales), [[448, floor, floor, floor, 2 * floor]]
    )
    # Under the floor, 6 * 2^-12 is 0.75 elements of 2^-9: E2M1 rounds it
    # to 1 (ties to even between 0.5 and 1), so it comes back as 2^-9.
    np.testing.assert_array_equal(
        out[0, [32, 48, 64]], [floor, 6 * floor, -6 * 2 * floor]
    )

  def test_nvfp4_tensor_scale_floor_keeps_products_normal(self):
    self.assertEqual(precision.NVFP4_TENSOR_SCALE_FLOOR, 2.0**-117)
    self.assertEqual(
        precision.NVFP4_BLOCK_SCALE_FLOOR * precision.NVFP4_TENSOR_SCALE_FLOOR,
        float(np.finfo(_F32).tiny),
    )
    x = np.zeros((1, 16), _F32)
    x[0, 0] = 2.0**-120  # amax / (6 * 448) is about 2^-131.6.
    q = precision.quantize(x, "nvfp4")
    np.testing.assert_array_equal(
        _np(q.tensor_scale), [[precision.NVFP4_TENSOR_SCALE_FLOOR]]
    )

  def test_mxfp8_scale_rounds_up_never_clipping(self):
    self.assertEqual(precision.MXFP8_SCALE_ROUNDING, "ceil")
    low, high = precision.MXFP8_SCALE_EXPONENTS
    self.assertEqual((low, high), (-126, 127))
    self.assertEqual(2.0**low, float(np.finfo(_F32).tiny))
    self.assertEqual(
        2.0**high, float(ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu).max)
    )
    # amax 480: "ceil" gives 2^ceil(log2(480 / 448)) = 2, and 480 / 2 = 240
    # is an E4M3 value; the OCP spec's 2^(floor(log2(480)) - 8) = 1 would
    # clip 480 to 448. amax 2^-120: ceil(log2(2^-120 / 448)) = -128,
    # clamped to -126.
    for amax, exponent in (
        (480.0, 1),
        (448.0, 0),
        (256.0, 0),
        (2.0**-120, low),
    ):
      x = np.zeros((1, 32), _F32)
      x[0, 5] = amax
      q, out = _round_trip(x, "mxfp8")
      self.assertEqual(int(_bits(q.scales)[0, 0]) - 127, exponent, amax)
      if amax >= 1:
        self.assertEqual(out[0, 5], amax, "the block's largest element clipped")
    # An all-zero block: 2^0.
    q = precision.quantize(np.zeros((1, 32), _F32), "mxfp8")
    self.assertEqual(int(_bits(q.scales)[0, 0]) - 127, 0)


class SaturationTest(parameterized.TestCase):
  """Values at and above the element maximum saturate, never NaN."""

  @parameterized.parameters("fp8_tensor", "fp8_block")
  def test_amax_element_lands_exactly_on_448(self, recipe):
    # One tensor/tile per row, amax anywhere in float32's range: x / scale
    # may round just above 448, and must be clipped there.
    rng = np.random.default_rng(0)
    amax = np.exp2(rng.uniform(-100, 127, 256)).astype(_F32)
    x = (rng.uniform(-1, 1, (256, 128)) * amax[:, None]).astype(_F32)
    x[:, 0] = -amax
    data = _np(precision.quantize(x, recipe, batch_dims=1).data)
    np.testing.assert_array_equal(data[:, 0], -448)
    self.assertLessEqual(np.abs(data).max(), 448)

  @parameterized.parameters(_QUANTIZED)
  def test_huge_values_stay_finite(self, recipe):
    # (A value within an element ulp of float32's max, 3.4e38, may round up
    # to 2^128 and dequantise to Inf, as any rounding to float32 would.)
    pattern = [3.0e38, -2.5e38, 1e30, -1e20, 1.0, 0.0, 2.9e38, -1.5e38]
    x = np.resize(np.array(pattern, _F32), _SHAPE)
    q, out = _round_trip(x, recipe, batch_dims=1)
    self.assertTrue(np.isfinite(out).all())
    self.assertTrue(np.isfinite(_np(q.data)).all())
    big = np.abs(x) >= 1e38
    np.testing.assert_allclose(out[big], x[big], rtol=2.0**-2)

  def test_nvfp4_block_scale_rounded_down_saturates_at_6(self):
    # Tensor amax 6 * 448 gives tensor scale 1. Block 1's amax 1800 asks for
    # block scale 300, which E4M3 rounds to 288: 1800 / 288 = 6.25 -> 6.
    x = np.zeros((1, 32), _F32)
    x[0, 0], x[0, 16], x[0, 17] = 2688, 1800, -1800
    q, out = _round_trip(x, "nvfp4")
    np.testing.assert_array_equal(_np(q.scales), [[448, 288]])
    np.testing.assert_array_equal(_np(q.data)[0, 16:18], [6, -6])
    np.testing.assert_array_equal(out[0, 16:18], [1728, -1728])

  def test_e5m2_elements_for_gradients(self):
    x = _random(_SHAPE, seed=2)
    q, out = _round_trip(x, "fp8_tensor", batch_dims=1, elements="e5m2")
    self.assertEqual(q.data.dtype, jnp.float8_e5m2)
    amax = np.abs(x).max(axis=1, keepdims=True)
    np.testing.assert_array_equal(_np(q.scales), amax * _inv(57344))
    np.testing.assert_array_equal(np.abs(_np(q.data)).max(axis=1), 57344)
    # E5M2: 2 mantissa bits (2^-3 relative), subnormal spacing 2^-16.
    bound = np.maximum(2.0**-3 * np.abs(x), _np(q.scales) * 2.0**-17)
    self.assertLessEqual((np.abs(out - x) - bound * (1 + 2.0**-20)).max(), 0)


class NonFiniteTest(parameterized.TestCase):
  """NaN / +-Inf make every element their scale covers NaN, nothing else."""

  def _covered(self, recipe, batch_dims, where):
    """Mask of the elements sharing a scale with x[where], x of _SHAPE."""
    mask = np.zeros(_SHAPE, bool)
    r, c = where
    if recipe == "unquantized":
      mask[r, c] = True
    elif recipe in ("fp8_tensor", "nvfp4"):  # One scale per tensor.
      mask[r if batch_dims else slice(None)] = True
    else:
      block = precision.BLOCK[recipe]
      mask[r, c // block * block : (c // block + 1) * block] = True
    return mask

  @parameterized.product(
      recipe=precision.RECIPES, bad=[np.nan, np.inf, -np.inf], batch_dims=[1]
  )
  def test_bad_value_poisons_exactly_its_scales_elements(
      self, recipe, bad, batch_dims
  ):
    self._check(recipe, bad, batch_dims)

  @parameterized.product(recipe=["fp8_tensor", "nvfp4"], bad=[np.nan, np.inf])
  def test_bad_value_poisons_the_whole_tensor(self, recipe, bad):
    self._check(recipe, bad, batch_dims=0)

  def _check(self, recipe, bad, batch_dims):
    x = _random(_SHAPE, seed=4)
    where = (1, 140)
    poisoned, clean = x.copy(), x.copy()
    poisoned[where], clean[where] = bad, 0
    out = _round_trip(poisoned, recipe, batch_dims=batch_dims)[1]
    expected = _round_trip(clean, recipe, batch_dims=batch_dims)[1]
    covered = self._covered(recipe, batch_dims, where)
    if recipe == "unquantized":  # No scale: the value itself passes through.
      covered &= bool(np.isnan(bad))
      self.assertTrue(np.isnan(out[where]) or out[where] == bad)
    np.testing.assert_array_equal(np.isnan(out), covered)
    rest = ~covered
    rest[where] = False
    np.testing.assert_array_equal(out[rest], expected[rest])


class WeightLayoutTest(parameterized.TestCase):

  def test_fp8_block_weights_get_128x128_blocks(self):
    w = _random((2, 200, 130), seed=12)  # [E, K, N], neither a multiple.
    q, out = _round_trip(w, "fp8_block", axis=1, weight=True, batch_dims=1)
    self.assertEqual(
        (q.block_axis, q.block_size, q.block_axis_size), (2, 128, 130)
    )
    self.assertEqual(q.scales.shape, (2, 2, 2))
    self.assertEqual(q.data.shape, (2, 256, 256))
    for e in range(2):
      for i in range(2):
        for j in range(2):
          block = w[e, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
          self.assertEqual(
              _np(q.scales)[e, i, j], np.abs(block).max() * _inv(448)
          )
    np.testing.assert_array_equal(out, _model_block_weights(w))

  def test_weight_block_axis_for_transposed_weights(self):
    w = _random((2, 130, 200), seed=13)  # [E, N, K]
    q, out = _round_trip(w, "fp8_block", axis=2, weight=True, batch_dims=1)
    self.assertEqual(q.block_axis, 1)
    self.assertEqual(q.scales.shape, (2, 2, 2))
    np.testing.assert_array_equal(
        out, np.swapaxes(_model_block_weights(np.swapaxes(w, 1, 2)), 1, 2)
    )

  @parameterized.parameters(
      [dict(recipe=r, contract_axis=1) for r in precision.RECIPES]
      + [dict(recipe="fp8_block", contract_axis=2)]
  )
  def test_grouped_weights_quantize_each_expert_alone(
      self, recipe, contract_axis
  ):
    w = _random((3, 40, 136), seed=15)
    q = precision.quantize_grouped_weights(
        w, recipe, contract_axis=contract_axis
    )
    expected_block_axis = {1: 2, 2: 1}[contract_axis]
    self.assertEqual(
        q.block_axis, expected_block_axis if recipe == "fp8_block" else None
    )
    for e in range(3):
      alone = precision.quantize(
          w[e : e + 1], recipe, contract_axis, weight=True
      )
      for name in ("data", "scales", "tensor_scale"):
        with self.subTest(expert=e, field=name):
          np.testing.assert_array_equal(
              _bits(getattr(q, name))[e], _bits(getattr(alone, name))[0]
          )

  @parameterized.parameters("fp8_tensor", "mxfp8", "nvfp4", "unquantized")
  def test_other_recipes_ignore_weight(self, recipe):
    w = _random((1, 40, 136), seed=14)
    plain = precision.quantize(w, recipe, 1)
    as_weight = precision.quantize(w, recipe, 1, weight=True)
    self.assertIsNone(as_weight.block_axis)
    np.testing.assert_array_equal(_bits(plain.data), _bits(as_weight.data))
    np.testing.assert_array_equal(_bits(plain.scales), _bits(as_weight.scales))


class GroupedRowsTest(parameterized.TestCase):
  # Empty groups first, in the middle and last; 6 padding rows full of NaN.
  _SIZES = (0, 5, 0, 9, 4, 0)
  _ROWS = 24

  def _rows(self):
    rows = _random((self._ROWS, 48), seed=16)
    rows[sum(self._SIZES) :] = np.nan
    rows[7, 3] = np.inf  # Poisons group 3's per-tensor scales only.
    return rows

  @parameterized.parameters(_RECIPES)
  def test_each_group_matches_quantizing_its_rows_alone(self, recipe):
    rows = self._rows()
    q = precision.quantize_grouped_rows(
        rows, jnp.array(self._SIZES, jnp.int32), recipe
    )
    self.assertEqual(q.tensor_scale.shape, (self._ROWS, 1))
    start = 0
    for size in self._SIZES:
      mine = slice(start, start + size)
      # The group's rows alone, as one tensor. Zero rows change no scale
      # (test_padding_never_changes_a_scale), so every group is quantised
      # at one shape and this compiles once.
      alone = np.zeros_like(rows)
      alone[mine] = rows[mine]
      q_alone = precision.quantize(alone, recipe)
      for name in ("data", "scales", "tensor_scale"):
        with self.subTest(group_start=start, field=name):
          full = _np(getattr(q, name))
          expected = np.broadcast_to(_np(getattr(q_alone, name)), full.shape)
          np.testing.assert_array_equal(full[mine], expected[mine])
      start += size

  @parameterized.parameters(_RECIPES)
  def test_padding_rows_are_zero_and_change_nothing(self, recipe):
    rows = self._rows()
    zeroed = rows.copy()
    zeroed[sum(self._SIZES) :] = 0
    sizes = jnp.array(self._SIZES, jnp.int32)
    q = precision.quantize_grouped_rows(rows, sizes, recipe)
    q_zeroed = precision.quantize_grouped_rows(zeroed, sizes, recipe)
    for name in ("data", "scales", "tensor_scale"):
      with self.subTest(field=name):
        np.testing.assert_array_equal(
            _bits(getattr(q, name)), _bits(getattr(q_zeroed, name))
        )
    np.testing.assert_array_equal(_np(q.data)[sum(self._SIZES) :], 0)
    self.assertTrue(np.isfinite(_np(q.scales)[sum(self._SIZES) :]).all())

  def test_under_jit_with_traced_group_sizes(self):
    rows = self._rows()
    sizes = jnp.array(self._SIZES, jnp.int32)
    grouped = lambda r, s: precision.quantize_grouped_rows(r, s, "nvfp4")
    eager, jitted = grouped(rows, sizes), jax.jit(grouped)(rows, sizes)
    for name in ("data", "scales", "tensor_scale"):
      with self.subTest(field=name):
        np.testing.assert_array_equal(
            _bits(getattr(eager, name)), _bits(getattr(jitted, name))
        )

  def test_all_groups_empty_gives_zeros(self):
    rows = np.full((self._ROWS, 48), np.nan, _F32)
    sizes = jnp.zeros(len(self._SIZES), jnp.int32)
    q = precision.quantize_grouped_rows(rows, sizes, "nvfp4")
    np.testing.assert_array_equal(_np(precision.dequantize(q)), 0)

  def test_e5m2_gradient_rows(self):
    rows = _random((6, 32), seed=17)
    q = precision.quantize_grouped_rows(
        rows, jnp.array([2, 4]), "fp8_tensor", elements="e5m2"
    )
    self.assertEqual(q.data.dtype, jnp.float8_e5m2)
    amax = [np.abs(rows[:2]).max(), np.abs(rows[2:]).max()]
    np.testing.assert_array_equal(
        _np(q.scales)[:, 0], np.repeat(amax, [2, 4]) * _inv(57344)
    )


class BadInputTest(parameterized.TestCase):

  def test_integer_input(self):
    with self.assertRaisesRegex(TypeError, "x must be float32.*got int32"):
      precision.quantize(jnp.ones((4, 32), jnp.int32), "fp8_tensor")

  def test_axis_out_of_range(self):
    with self.assertRaisesRegex(ValueError, r"axis must lie in \[-2, 2\).*2"):
      precision.quantize(jnp.ones((4, 32)), "mxfp8", axis=2)

  def test_contraction_axis_in_batch(self):
    with self.assertRaisesRegex(ValueError, "batch_dims.*batch_dims=1, axis=0"):
      precision.quantize(jnp.ones((4, 32)), "mxfp8", axis=0, batch_dims=1)

  def test_weight_blocks_need_an_output_axis(self):
    with self.assertRaisesRegex(ValueError, "weight=True with fp8_block"):
      precision.quantize(
          jnp.ones((4, 32)), "fp8_block", weight=True, batch_dims=1
      )

  @parameterized.parameters(("mxfp8", "e5m2"), ("fp8_tensor", "e4m3x"))
  def test_bad_elements(self, recipe, elements):
    with self.assertRaisesRegex(ValueError, "elements must be None or 'e5m2'"):
      precision.quantize(jnp.ones((4, 32)), recipe, elements=elements)

  def test_unknown_recipe(self):
    with self.assertRaisesRegex(ValueError, "precision must be one of"):
      precision.quantize(jnp.ones((4, 32)), "int8")

  def test_grouped_rows_shapes_and_types(self):
    with self.assertRaisesRegex(ValueError, r"rows must be \[M, K\]"):
      precision.quantize_grouped_rows(jnp.ones(4), jnp.ones(2, int), "nvfp4")
    with self.assertRaisesRegex(TypeError, "group_sizes must be an integer"):
      precision.quantize_grouped_rows(jnp.ones((4, 8)), jnp.ones(2), "nvfp4")

  def test_grouped_weights_contract_axis(self):
    with self.assertRaisesRegex(ValueError, "contract_axis must be 1 or 2"):
      precision.quantize_grouped_weights(
          jnp.ones((2, 8, 8)), "mxfp8", contract_axis=0
      )

  def test_dequantize_needs_a_quantized_array(self):
    with self.assertRaisesRegex(TypeError, "q must be a QuantizedArray"):
      precision.dequantize(jnp.ones(3))


if __name__ == "__main__":
  absltest.main()
