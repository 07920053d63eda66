"""The triton config table, the override forms and their validation."""

import types

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp

from backends.triton import configs

_KIND_BUCKETS = {
    "fwd": ("few_rows", "default", "many_rows"),
    "dgrad": ("few_rows", "default", "many_rows"),
    "gated": ("few_rows", "default", "many_rows"),
    "wgrad": ("few_rows", "default", "many_rows"),
    "permute": ("default", "wide"),
}
# (m, k, n, E) landing in each bucket, large enough that nothing is clamped:
# 64, 256 and 4096 rows per group with DeepSeek-V3's widths.
_SHAPES = {
    "few_rows": (2048, 7168, 2048, 32),
    "default": (8192, 7168, 2048, 32),
    "many_rows": (32768, 7168, 2048, 8),
    "wide": (32768, 1, 7168, 1),
}
_SMALL = configs.Config(16, 32, 16, num_warps=2, num_stages=2)


def _is_pow2(x):
  return x > 0 and x & (x - 1) == 0


def _shape(kind, bucket):
  if kind == "permute" and bucket == "default":
    return (32768, 1, 1024, 1)
  return _SHAPES[bucket]


class TableTest(parameterized.TestCase):

  def test_every_generation_kind_and_bucket_has_an_entry(self):
    want = {
        (gen, kind, bucket)
        for gen in configs.GENERATIONS.values()
        for kind, buckets in _KIND_BUCKETS.items()
        for bucket in buckets
    }
    self.assertEqual(set(configs.TABLE), want)

  @parameterized.named_parameters(
      ("_".join(key), key, config) for key, config in configs.TABLE.items()
  )
  def test_shipped_entry_fits_bf16_unchanged(self, key, config):
    _, kind, _ = key
    self.assertEqual(configs.fit(config, kind, jnp.bfloat16), config)
    self.assertLessEqual(config.smem_bytes(kind, 2), configs.SMEM_FIT_BYTES)
    self.assertLessEqual(
        config.acc_regs_per_thread(kind), configs.ACC_REGS_PER_THREAD
    )

  @parameterized.named_parameters(
      ("_".join(key), key, config)
      for key, config in configs.TABLE.items()
      if key[1] != "permute"
  )
  def test_float32_fit_keeps_the_smaller_budget(self, key, config):
    _, kind, _ = key
    fitted = configs.fit(config, kind, jnp.float32)
    step = fitted.block_m if kind == "wgrad" else fitted.block_k
    self.assertLessEqual(step, configs.MAX_BLOCK_K_F32)
    self.assertLessEqual(fitted.num_warps, configs.MAX_WARPS_F32)
    self.assertLessEqual(
        fitted.acc_regs_per_thread(kind), configs.ACC_REGS_PER_THREAD_F32
    )
    self.assertLessEqual(fitted.smem_bytes(kind, 4), configs.SMEM_FIT_BYTES)
    self.assertGreaterEqual(fitted.num_stages, 2)

  @parameterized.product(
      generation=("sm90", "sm100"),
      kind_bucket=[(k, b) for k, bs in _KIND_BUCKETS.items() for b in bs],
  )
  def test_choose_reads_the_table(self, generation, kind_bucket):
    kind, bucket = kind_bucket
    m, k, n, e = _shape(kind, bucket)
    self.assertEqual(configs.bucket(kind, m, k, n, e), bucket)
    got = configs.choose(None, generation, kind, m, k, n, e, jnp.bfloat16)
    self.assertEqual(got, configs.TABLE[(generation, kind, bucket)])

  def test_bucket_boundaries(self):
    # 127 and 128 rows per group; 1024 rows per group with a narrow output.
    self.assertEqual(configs.bucket("fwd", 127 * 4, 64, 512, 4), "few_rows")
    self.assertEqual(configs.bucket("fwd", 128 * 4, 64, 512, 4), "default")
    self.assertEqual(configs.bucket("fwd", 1024 * 4, 64, 512, 4), "many_rows")
    self.assertEqual(configs.bucket("fwd", 1024 * 4, 64, 128, 4), "default")
    self.assertEqual(configs.bucket("permute", 10, 0, 2047, 1), "default")
    self.assertEqual(configs.bucket("permute", 10, 0, 2048, 1), "wide")

  @parameterized.parameters("fwd", "dgrad", "wgrad", "gated", "permute")
  def test_unknown_generation_uses_the_fitted_heuristic(self, kind):
    m, k, n, e = 8192, 4096, 4096, 16
    for dtype in (jnp.bfloat16, jnp.float32):
      got = configs.choose(None, None, kind, m, k, n, e, dtype)
      want = configs.fit(
          configs.clamp(
              configs.heuristic(kind, m, k, n, e, dtype), kind, m, k, n
          ),
          kind,
          dtype,
      )
      self.assertEqual(got, want)
      self.assertLessEqual(
          got.smem_bytes(kind, jnp.dtype(dtype).itemsize),
          configs.SMEM_FIT_BYTES,
      )

  @parameterized.parameters("fwd", "dgrad", "wgrad", "gated", "permute")
  def test_small_problems_get_small_blocks(self, kind):
    # 20 rows, 24 wide, contracting 40: blocks cover each axis once at most.
    got = configs.choose(None, "sm90", kind, 20, 40, 24, 2, jnp.bfloat16)
    self.assertLessEqual(got.block_m, 32)
    self.assertLessEqual(got.block_n, 32)
    if kind != "permute":
      self.assertLessEqual(got.block_k, 64)
    for value in (got.block_m, got.block_n, got.block_k):
      self.assertTrue(_is_pow2(value) and value >= configs.MIN_BLOCK)
    # No more warps than keep 32 tile elements per thread (the tile is
    # [block_k, block_n] for wgrad: 64 x 32 here, two warps).
    rows = got.block_k if kind == "wgrad" else got.block_m
    self.assertEqual(got.num_warps, max(1, rows * got.block_n // (32 * 32)))

  def test_fit_grows_warps_then_narrows(self):
    big = configs.Config(256, 256, 64, num_warps=4, num_stages=6)
    got = configs.fit(big, "fwd", jnp.bfloat16)
    self.assertEqual(got.num_warps, configs.MAX_FIT_WARPS)
    self.assertLessEqual(
        got.acc_regs_per_thread("fwd"), configs.ACC_REGS_PER_THREAD
    )
    self.assertLessEqual(got.smem_bytes("fwd", 2), configs.SMEM_FIT_BYTES)
    self.assertGreaterEqual(got.num_stages, 2)

  def test_smem_estimate_per_kind(self):
    c = configs.Config(128, 64, 32, num_warps=4, num_stages=3)
    self.assertEqual(c.smem_bytes("fwd", 2), 3 * 2 * (128 * 32 + 32 * 64))
    self.assertEqual(c.smem_bytes("gated", 2), 3 * 2 * (128 * 32 + 2 * 32 * 64))
    self.assertEqual(c.smem_bytes("wgrad", 4), 3 * 4 * 128 * (32 + 64))
    self.assertEqual(c.smem_bytes("permute", 2), 0)
    self.assertEqual(c.acc_regs_per_thread("fwd"), 128 * 64 // 128)
    self.assertEqual(c.acc_regs_per_thread("gated"), 2 * 128 * 64 // 128)
    self.assertEqual(c.acc_regs_per_thread("wgrad"), 32 * 64 // 128)

  def test_interpret_uses_tiny_tiles(self):
    got = configs.choose(
        None, "sm90", "fwd", 8192, 4096, 4096, 8, jnp.bfloat16, interpret=True
    )
    self.assertIs(got, configs.INTERPRET)
    self.assertEqual(
        (got.block_m, got.block_n, got.block_k, got.num_warps, got.num_stages),
        (16, 32, 32, 1, 1),
    )


class BlockConstexprsTest(absltest.TestCase):

  def test_names_per_kind(self):
    c = configs.Config(16, 64, 32)
    self.assertEqual(
        configs.block_constexprs("fwd", c),
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32},
    )
    self.assertEqual(
        configs.block_constexprs("wgrad", c),
        {"BLOCK_M": 16, "BLOCK_P": 32, "BLOCK_Q": 64},
    )
    self.assertEqual(
        configs.block_constexprs("permute", c),
        {"BLOCK_R": 16, "BLOCK_T": 16, "BLOCK_D": 64},
    )

  def test_filtered_by_the_kernel_parameters(self):
    # A stand-in with the parameters of a permute kernel; `fn` as on a
    # @triton.jit kernel.
    def kernel(x_ptr, out_ptr, T, BLOCK_T, BLOCK_D):
      del x_ptr, out_ptr, T, BLOCK_T, BLOCK_D

    jitted = types.SimpleNamespace(fn=kernel)
    got = configs.block_constexprs(
        "permute", configs.Config(16, 64, 16), jitted
    )
    self.assertEqual(got, {"BLOCK_T": 16, "BLOCK_D": 64})


class OverrideTest(parameterized.TestCase):

  def test_a_config_overrides_every_kind_as_given(self):
    for kind in configs.KINDS:
      got = configs.choose(
          _SMALL, "sm90", kind, 8192, 4096, 4096, 8, jnp.float32
      )
      self.assertIs(got, _SMALL)  # Not clamped or fitted.

  def test_override_wins_over_interpret(self):
    got = configs.choose(
        {"fwd": _SMALL},
        None,
        "fwd",
        64,
        64,
        64,
        2,
        jnp.bfloat16,
        interpret=True,
    )
    self.assertIs(got, _SMALL)

  def test_a_partial_dict_leaves_other_kinds_to_the_table(self):
    override = {"wgrad": {"block_m": 16, "block_n": 32, "block_k": 16}}
    m, k, n, e = _SHAPES["default"]
    self.assertEqual(
        configs.choose(override, "sm90", "wgrad", m, k, n, e, jnp.bfloat16),
        configs.Config(16, 32, 16),
    )
    self.assertEqual(
        configs.choose(override, "sm90", "fwd", m, k, n, e, jnp.bfloat16),
        configs.TABLE[("sm90", "fwd", "default")],
    )

  def test_parse_forms(self):
    everywhere = configs.Overrides(*([_SMALL] * len(configs.KINDS)))
    self.assertIsNone(configs.parse(None))
    self.assertEqual(configs.parse(_SMALL), everywhere)
    self.assertEqual(
        configs.parse(
            {
                "block_m": 16,
                "block_n": 32,
                "block_k": 16,
                "num_warps": 2,
                "num_stages": 2,
            }
        ),
        everywhere,
    )
    self.assertEqual(
        configs.parse({"fwd": _SMALL, "permute": None}),
        configs.Overrides(fwd=_SMALL),
    )
    self.assertIs(configs.parse(everywhere), everywhere)
    # Hashable, so that a Runner holding it can be a static argument.
    self.assertEqual(
        hash(configs.parse({"gated": _SMALL})),
        hash(configs.Overrides(gated=_SMALL)),
    )

  @parameterized.named_parameters(
      (
          "not_pow2",
          {"block_m": 48},
          r"Config.block_m must be a power of two in \[16, 4096\] \(a Triton "
          r"block\), got block_m=48\.",
      ),
      ("too_small", {"block_k": 8}, r"Config.block_k .* got block_k=8\."),
      ("bool", {"block_n": True}, r"Config.block_n .* got block_n=True\."),
      (
          "warps",
          {"num_warps": 3},
          r"Config.num_warps must be a power of two <= 32, got num_warps=3\.",
      ),
      (
          "stages",
          {"num_stages": 0},
          r"Config.num_stages must be an int in \[1, 8\], got num_stages=0\.",
      ),
  )
  def test_invalid_config_raises(self, change, message):
    fields = {"block_m": 16, "block_n": 16, "block_k": 16}
    with self.assertRaisesRegex(ValueError, message):
      configs.Config(**{**fields, **change})

  @parameterized.named_parameters(
      (
          "unknown_kind",
          {"fwdd": _SMALL},
          ValueError,
          r"configs as a dict must map each of the kinds \['fwd', 'dgrad', "
          r"'wgrad', 'gated', 'permute'\] to a configs.Config, or hold the "
          r"fields of one configs.Config .*; got keys \['fwdd'\]\.",
      ),
      (
          "mixed_keys",
          {"fwd": _SMALL, "block_m": 16},
          ValueError,
          r"got keys \['block_m', 'fwd'\]",
      ),
      ("empty", {}, ValueError, r"got keys \[\]\."),
      (
          "missing_field",
          {"fwd": {"block_m": 16}},
          ValueError,
          r"configs\['fwd'\] must have the keys \['block_m', 'block_n', "
          r"'block_k'\] and optionally num_warps, num_stages; got "
          r"\['block_m'\] "
          r"\(missing: \['block_n', 'block_k'\]\)\.",
      ),
      (
          "unknown_field",
          {"gated": {"block_m": 16, "block_n": 16, "block_k": 16, "warps": 4}},
          ValueError,
          r"configs\['gated'\] .* \(unknown: \['warps'\]\)\.",
      ),
      (
          "wrong_value_type",
          {"fwd": (16, 16, 16)},
          TypeError,
          r"configs\['fwd'\] must be a configs.Config or a dict of its fields, "
          r"got tuple\.",
      ),
      (
          "wrong_type",
          [16, 16, 16],
          TypeError,
          r"configs must be None, a dict, configs.Config or Overrides, got "
          r"list\.",
      ),
  )
  def test_invalid_override_raises(self, override, error, message):
    with self.assertRaisesRegex(error, message):
      configs.parse(override)

  def test_invalid_kind_and_generation_raise(self):
    with self.assertRaisesRegex(
        ValueError,
        r"kind must be one of \['fwd', 'dgrad', 'wgrad', 'gated', "
        r"'permute'\], got 'bwd'\.",
    ):
      configs.choose(None, "sm90", "bwd", 64, 64, 64, 1, jnp.bfloat16)
    with self.assertRaisesRegex(
        ValueError,
        r"generation must be None or one of \['sm100', 'sm90'\], got "
        r"'sm80'\.",
    ):
      configs.choose(None, "sm80", "fwd", 64, 64, 64, 1, jnp.bfloat16)


class GenerationTest(parameterized.TestCase):

  @parameterized.parameters(
      ("gpu", "9.0", "sm90"),
      ("gpu", "10.0", "sm100"),
      ("gpu", "10.3", "sm100"),
      ("gpu", "8.0", None),
      ("gpu", "12.0", None),
      ("gpu", None, None),
      ("cpu", None, None),
  )
  def test_from_compute_capability(self, platform, capability, want):
    device = types.SimpleNamespace(
        platform=platform, compute_capability=capability
    )
    self.assertEqual(configs.generation(device), want)

  def test_default_device(self):
    # This machine's first device: a GPU of another generation gives None.
    self.assertIn(configs.generation(), (None, "sm90", "sm100"))


if __name__ == "__main__":
  absltest.main()
