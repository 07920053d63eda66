"""Tiles validation, the dict form, block fitting and the shape heuristic."""

import itertools

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp

from backends.pallas import tiling


def _is_pow2(x):
  return x > 0 and x & (x - 1) == 0


# A Hopper thread has 255 registers; the accumulators may take half of them
# (the rest hold operands, addresses and loop state), or ptxas spills.
_ACC_REG_BUDGET = 128
# DeepSeek-V3 expert shapes as timed by bench/gpu_check (T=4096, top-8, a
# 32-expert slice): (kind, m, k, n, E, products per step) of every kernel of
# the expert FFN's forward and backward: gate+up fused, then down.
_DEEPSEEK_KERNELS = [
    ("fwd", 32768, 7168, 2048, 32, 2),  # gate and up: two accumulators.
    ("dgrad", 32768, 2048, 7168, 32, 2),  # dX = dgate wg^T + dup wu^T.
    ("wgrad", 32768, 7168, 2048, 32, 2),  # dW_gate and dW_up.
    ("fwd", 32768, 2048, 7168, 32, 1),  # down.
    ("dgrad", 32768, 7168, 2048, 32, 1),
    ("wgrad", 32768, 2048, 7168, 32, 1),
]


def _acc_regs_per_thread(tiles, kind, num_operands):
  """float32 accumulator registers per thread, from the kernels' shapes.

  gmm carries one [bm, bn] accumulator per output (the fused forward has
  two, its dX sums both products into one); tgmm one [bk, bn] per rhs.
  """
  accs = 1 if kind == "dgrad" else num_operands
  rows = tiles.bk if kind == "wgrad" else tiles.bm
  return accs * rows * tiles.bn / (32 * tiles.num_warps)


class TilesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (
          "not_pow2",
          {"bm": 48},
          r"Tiles.bm must be a power of two >= 16 "
          r"\(a Triton block\), got bm=48",
      ),
      (
          "too_small",
          {"bk": 8},
          r"Tiles.bk must be a power of two >= 16 "
          r"\(a Triton block\), got bk=8",
      ),
      ("bool", {"bn": True}, r"Tiles.bn must be .*, got bn=True"),
      (
          "warps",
          {"num_warps": 3},
          r"num_warps must be a power of two <= 32, " r"got num_warps=3",
      ),
      (
          "stages",
          {"num_stages": 0},
          r"num_stages must be an int >= 1, got " r"num_stages=0",
      ),
  )
  def test_invalid_tiles_raise(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      tiling.Tiles(**kwargs)

  def test_parse_forms(self):
    small = tiling.Tiles(bm=16, bk=16, bn=32)
    self.assertEqual(tiling.TileConfig.parse(None), tiling.TileConfig())
    self.assertEqual(
        tiling.TileConfig.parse(small), tiling.TileConfig(small, small, small)
    )
    self.assertEqual(
        tiling.TileConfig.parse({"bm": 16, "bk": 16, "bn": 32}),
        tiling.TileConfig(small, small, small),
    )
    self.assertEqual(
        tiling.TileConfig.parse({"wgrad": {"bm": 16, "bk": 16, "bn": 32}}),
        tiling.TileConfig(wgrad=small),
    )

  def test_parse_rejects_unknown_keys_and_types(self):
    with self.assertRaisesRegex(
        ValueError,
        r"tiles as a dict must map each of the kinds \['fwd', 'dgrad', "
        r"'wgrad'\] to a Tiles, or hold the fields of one Tiles .*; got keys "
        r"\['block_m'\]\.",
    ):
      tiling.TileConfig.parse({"block_m": 16})
    # Empty, it could be either form: refused rather than guessed.
    with self.assertRaisesRegex(ValueError, r"got keys \[\]\."):
      tiling.TileConfig.parse({})
    with self.assertRaisesRegex(
        ValueError,
        r"tiles\['fwd'\] must have only the keys \['bm', 'bk', 'bn', "
        r"'num_warps', 'num_stages'\]; got \['bm', 'warps'\] "
        r"\(unknown: \['warps'\]\)\.",
    ):
      tiling.TileConfig.parse({"fwd": {"bm": 16, "warps": 4}})
    with self.assertRaisesRegex(
        TypeError,
        r"tiles\['wgrad'\] must be a Tiles or a dict of its fields, got int\.",
    ):
      tiling.TileConfig.parse({"wgrad": 16})
    with self.assertRaisesRegex(
        TypeError,
        r"tiles must be None, a dict, Tiles or TileConfig, got int\.",
    ):
      tiling.TileConfig.parse(16)
    with self.assertRaisesRegex(
        TypeError, r"TileConfig.fwd must be a Tiles " r"or None, got dict"
    ):
      tiling.TileConfig(fwd={"bm": 16})


class FitBlockTest(parameterized.TestCase):

  def test_divides_when_a_power_of_two_divides(self):
    for dim, target in itertools.product(range(1, 300), (16, 64, 512)):
      block = tiling.fit_block(dim, target)
      self.assertTrue(_is_pow2(block) and block >= tiling.MIN_BLOCK)
      self.assertLessEqual(block, max(target, tiling.MIN_BLOCK))
      if dim % tiling.MIN_BLOCK == 0:
        self.assertEqual(dim % block, 0, f"{dim=}, {target=}, {block=}")
      self.assertGreaterEqual(tiling.padded(dim, block), dim)
      self.assertEqual(tiling.padded(dim, block) % block, 0)

  def test_deepseek_dims_need_no_padding(self):
    for dim in (7168, 2048, 1536):
      self.assertEqual(dim % tiling.fit_block(dim, 256), 0)


class HeuristicTest(parameterized.TestCase):

  @parameterized.product(
      kind=tiling.KINDS, interpret=[False, True], dtype=["float32", "bfloat16"]
  )
  def test_heuristic_gives_valid_tiles_that_fit_hopper(
      self, kind, interpret, dtype
  ):
    shapes = [
        (1, 16, 24, 3),
        (37, 48, 80, 3),
        (4096, 512, 1024, 64),
        (65536, 7168, 2048, 32),
        (65536, 2048, 7168, 32),
    ]
    for (m, k, n, e), operands in itertools.product(shapes, (1, 2)):
      tiles = tiling.heuristic(
          kind, m, k, n, e, dtype, interpret=interpret, num_operands=operands
      )
      self.assertIsInstance(tiles, tiling.Tiles)  # Validated on creation.
      if not interpret:
        self.assertLessEqual(
            tiles.smem_bytes(kind, dtype, operands),
            tiling.HOPPER_SMEM_BYTES,
            f"{kind} {(m, k, n, e)} x{operands}: {tiles}",
        )
        self.assertLessEqual(
            _acc_regs_per_thread(tiles, kind, operands),
            _ACC_REG_BUDGET,
            f"{kind} {(m, k, n, e)} x{operands}: {tiles}",
        )

  def test_shipped_gpu_tiles_fit_hopper_shared_memory(self):
    for name, tiles in tiling.GPU_TILES.items():
      kind = "wgrad" if name.startswith("tgmm") else "fwd"
      dtype = jnp.float32 if "f32" in name else jnp.bfloat16
      self.assertLessEqual(
          tiles.smem_bytes(kind, dtype), tiling.HOPPER_SMEM_BYTES, name
      )

  def test_shipped_gpu_tiles_fit_the_register_budget(self):
    self.assertLessEqual(tiling.ACC_REGS_PER_THREAD, _ACC_REG_BUDGET)
    for name, tiles in tiling.GPU_TILES.items():
      # A gmm config serves the unfused kernels as shipped (the fused ones
      # go through fit_gpu); a tgmm config serves the fused dW as shipped.
      kind, operands = ("wgrad", 2) if name.startswith("tgmm") else ("fwd", 1)
      dtype = jnp.float32 if "f32" in name else jnp.bfloat16
      self.assertLessEqual(
          _acc_regs_per_thread(tiles, kind, operands), _ACC_REG_BUDGET, name
      )
      self.assertEqual(
          tiling.fit_gpu(tiles, kind, dtype, operands),
          tiles,
          f"{name} is not final as shipped",
      )

  def test_deepseek_kernels_fit_registers_and_shared_memory(self):
    for kind, m, k, n, e, operands in _DEEPSEEK_KERNELS:
      tiles = tiling.heuristic(
          kind, m, k, n, e, jnp.bfloat16, interpret=False, num_operands=operands
      )
      label = f"{kind} {(m, k, n, e)} x{operands}: {tiles}"
      self.assertLessEqual(
          _acc_regs_per_thread(tiles, kind, operands), _ACC_REG_BUDGET, label
      )
      self.assertLessEqual(
          tiles.smem_bytes(kind, jnp.bfloat16, operands),
          tiling.HOPPER_SMEM_BYTES,
          label,
      )
    # The fused gate+up forward starts from the large config and keeps its
    # rows and warps, narrowing only bn (two 128x256 accumulators would be
    # 256 registers per thread).
    fused = tiling.heuristic(
        "fwd",
        32768,
        7168,
        2048,
        32,
        jnp.bfloat16,
        interpret=False,
        num_operands=2,
    )
    large = tiling.GPU_TILES["gmm_bf16_large"]
    self.assertEqual(
        (fused.bm, fused.bn, fused.num_warps),
        (large.bm, large.bn // 2, large.num_warps),
    )

  def test_fit_registers_adds_warps_then_narrows(self):
    tiles = tiling.Tiles(bm=128, bk=64, bn=256, num_warps=4)
    fitted = tiling.fit_registers(tiles, "fwd", num_accumulators=2)
    self.assertEqual((fitted.num_warps, fitted.bn, fitted.bm), (8, 128, 128))
    # Already within budget: unchanged.
    self.assertEqual(tiling.fit_registers(fitted, "fwd", 2), fitted)

  def test_caller_tiles_override_the_heuristic(self):
    mine = tiling.Tiles(bm=16, bk=32, bn=64)
    config = tiling.TileConfig(dgrad=mine)
    self.assertEqual(
        tiling.choose(
            config, "dgrad", 4096, 512, 1024, 8, "float32", interpret=True
        ),
        mine,
    )
    self.assertNotEqual(
        tiling.choose(
            config, "fwd", 4096, 512, 1024, 8, "float32", interpret=True
        ),
        mine,
    )

  def test_row_tile_shrinks_with_the_average_group(self):
    few = tiling.heuristic("fwd", 4096, 512, 1024, 8, "float32", interpret=True)
    many = tiling.heuristic(
        "fwd", 4096, 512, 1024, 256, "float32", interpret=True
    )
    self.assertLess(many.bm, few.bm)
    self.assertLessEqual(many.bm, 4096 // 256)


if __name__ == "__main__":
  absltest.main()
