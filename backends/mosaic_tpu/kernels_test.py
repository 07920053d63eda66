"""The mosaic_tpu kernels in Pallas' interpreters, against float64 numpy.

Tiles are the smallest a TPU block takes (128 rows and columns) and the
group sizes are chosen so that tiles shared by several groups, chunks a
visit skips, empty groups (first, middle, last), rows past sum(group_sizes)
holding NaN, padded K and N, several K steps and a group offset all occur.
The TPU interpreter (`pltpu.InterpretParams`) also raises on out-of-bounds
accesses and races; it runs a few cases, the HLO interpreter the rest.
"""

from absl.testing import absltest
from absl.testing import parameterized
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from backends.mosaic_tpu import kernels
from backends.mosaic_tpu import metadata
from backends.mosaic_tpu import tiling

_HLO = kernels.KernelLaunch(interpret=True)
_STATIC = kernels.KernelLaunch(interpret=True, dynamic_grid=False)
_DEBUG = kernels.KernelLaunch(
    interpret=pltpu.InterpretParams(detect_races=True)
)

# (rows, group sizes): group boundaries inside tiles and chunks, empty
# groups at the start, middle and end, unused rows at the end.
_GROUPS = {
    "shared_tiles": (384, [0, 100, 37, 0, 120, 3, 0]),
    "one_group": (256, [256]),
    "all_in_last": (300, [0, 0, 290]),
    "aligned": (512, [128, 256, 128]),
    "none_used": (128, [0, 0]),
}
_TILES = {
    "whole_k": tiling.Tiles(bm=128, bk=None, bn=128),
    "k_steps": tiling.Tiles(bm=256, bk=128, bn=128, chunk=128),
    "chunks": tiling.Tiles(bm=256, bk=None, bn=256, chunk=128),
}


def _operands(m, k, n, group_sizes, *, transpose_rhs=False, seed=0):
  """rows [m, k] and dy [m, n] with NaN past the groups; weights."""
  rng = np.random.default_rng(seed)
  used = sum(group_sizes)
  rows = rng.standard_normal((m, k)).astype(np.float32)
  rows[used:] = np.nan
  dy = rng.standard_normal((m, n)).astype(np.float32)
  dy[used:] = np.nan
  e = len(group_sizes)
  weights = rng.standard_normal((e, n, k) if transpose_rhs else (e, k, n))
  return rows, weights.astype(np.float32), dy


def _gmm64(rows, weights, group_sizes, transpose_rhs=False, first=0):
  """float64 rows @ weights[g] for groups [first, first + E); zeros else."""
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  out = np.zeros((rows.shape[0], n))
  ends = np.cumsum(group_sizes)
  for e in range(weights.shape[0]):
    g = first + e
    w = weights[e].T if transpose_rhs else weights[e]
    lo, hi = ends[g] - group_sizes[g], ends[g]
    out[lo:hi] = rows[lo:hi].astype(np.float64) @ w.astype(np.float64)
  return out


def _tgmm64(lhs, rhs, group_sizes, first=0, num_groups=None):
  num_groups = len(group_sizes) if num_groups is None else num_groups
  out = np.zeros((num_groups, lhs.shape[1], rhs.shape[1]))
  ends = np.cumsum(group_sizes)
  for e in range(num_groups):
    g = first + e
    lo, hi = ends[g] - group_sizes[g], ends[g]
    out[e] = lhs[lo:hi].T.astype(np.float64) @ rhs[lo:hi].astype(np.float64)
  return out


def _close(test, got, want, rtol=2e-5):
  got = np.asarray(got, np.float64)
  test.assertTrue(np.all(np.isfinite(got)), "non-finite values")
  scale = max(float(np.abs(want).max()), 1.0)
  np.testing.assert_allclose(got, want, atol=rtol * scale, rtol=rtol)


class VisitsTest(parameterized.TestCase):
  """The visit lists: every row owned once, in row order."""

  @parameterized.named_parameters(*[(k, *v) for k, v in _GROUPS.items()])
  def test_gmm_visits_own_every_row_once_in_order(self, m, sizes):
    bm = 128
    mp = -(-m // bm) * bm
    v = metadata.visit_list(
        jnp.asarray(sizes, jnp.int32), mp, bm, weight_gradient=False
    )
    count = int(v.count[0])
    owner = np.full(mp, -1)
    ends = np.cumsum(sizes)
    for i in range(count):
      tile, lo, hi = int(v.tile[i]), int(v.row_start[i]), int(v.row_end[i])
      self.assertTrue(tile * bm <= lo <= hi <= tile * bm + bm)
      self.assertTrue(np.all(owner[lo:hi] == -1), f"visit {i} rewrites rows")
      owner[lo:hi] = int(v.segment[i])
      if i:
        self.assertGreaterEqual(tile, int(v.tile[i - 1]))
    self.assertTrue(np.all(owner >= 0), "a row no visit writes")
    # Each row's segment is its group + 1, or past the groups E + 1.
    want = np.searchsorted(ends, np.arange(mp), side="right") + 1
    np.testing.assert_array_equal(owner, np.minimum(want, len(sizes) + 1))
    self.assertLessEqual(count, v.segment.shape[0])
    # Unused visits own nothing and repeat the last used tile.
    for i in range(count, v.segment.shape[0]):
      self.assertEqual(int(v.row_start[i]), int(v.row_end[i]))
      self.assertEqual(int(v.tile[i]), int(v.tile[count - 1]))

  @parameterized.named_parameters(*[(k, *v) for k, v in _GROUPS.items()])
  def test_tgmm_visits_every_group_consecutively(self, m, sizes):
    bm = 128
    mp = -(-m // bm) * bm
    v = metadata.visit_list(
        jnp.asarray(sizes, jnp.int32), mp, bm, weight_gradient=True
    )
    segments = [int(s) for s in v.segment[: int(v.count[0])]]
    # Every group visited, each in one run, in order.
    runs = [s for i, s in enumerate(segments) if i == 0 or segments[i - 1] != s]
    self.assertEqual(runs, list(range(len(sizes))))
    owned = np.zeros(len(sizes), int)
    for i in range(int(v.count[0])):
      owned[int(v.segment[i])] += int(v.row_end[i]) - int(v.row_start[i])
    np.testing.assert_array_equal(owned, sizes)


class GmmTest(parameterized.TestCase):

  @parameterized.product(
      groups=list(_GROUPS), tiles=list(_TILES), transpose_rhs=[False, True]
  )
  def test_matches_float64(self, groups, tiles, transpose_rhs):
    m, sizes = _GROUPS[groups]
    rows, weights, _ = _operands(
        m, 200, 260, sizes, transpose_rhs=transpose_rhs
    )
    (out,) = kernels.gmm(
        [jnp.asarray(rows)],
        [jnp.asarray(weights)],
        jnp.asarray(sizes, jnp.int32),
        tiles=_TILES[tiles],
        launch=_HLO,
        transpose_rhs=transpose_rhs,
    )
    _close(self, out, _gmm64(rows, weights, sizes, transpose_rhs))

  def test_static_grid_matches_dynamic(self):
    m, sizes = _GROUPS["shared_tiles"]
    rows, weights, _ = _operands(m, 128, 128, sizes)
    args = ([jnp.asarray(rows)], [jnp.asarray(weights)], jnp.asarray(sizes))
    tiles = _TILES["chunks"]
    (dynamic,) = kernels.gmm(*args, tiles=tiles, launch=_HLO)
    (static,) = kernels.gmm(*args, tiles=tiles, launch=_STATIC)
    np.testing.assert_array_equal(np.asarray(dynamic), np.asarray(static))

  def test_bfloat16_accumulates_in_float32(self):
    m, sizes = _GROUPS["shared_tiles"]
    rows, weights, _ = _operands(m, 512, 128, sizes)
    rows16, weights16 = (jnp.asarray(a, jnp.bfloat16) for a in (rows, weights))
    (out,) = kernels.gmm(
        [rows16],
        [weights16],
        jnp.asarray(sizes),
        tiles=_TILES["k_steps"],
        launch=_HLO,
        out_dtype=jnp.float32,
    )
    want = _gmm64(
        np.asarray(rows16, np.float32), np.asarray(weights16, np.float32), sizes
    )
    # Products of bf16 values are exact in float32: only the sum rounds.
    _close(self, out, want, rtol=1e-5)

  def test_products_epilogue_and_row_scale(self):
    """Two weights into two accumulators, an epilogue of both, a row scale."""
    m, sizes = _GROUPS["shared_tiles"]
    rows, w_a, _ = _operands(m, 128, 256, sizes, seed=1)
    _, w_b, _ = _operands(m, 128, 256, sizes, seed=2)
    scale = np.random.default_rng(3).standard_normal(m).astype(np.float32)
    outs = kernels.gmm(
        [jnp.asarray(rows)],
        [jnp.asarray(w_a), jnp.asarray(w_b)],
        jnp.asarray(sizes),
        tiles=_TILES["chunks"],
        launch=_HLO,
        products=((0, 0, 0), (0, 1, 1)),
        epilogue=lambda accs: (accs[0] * accs[1], accs[0]),
        num_outputs=2,
        row_scale=jnp.asarray(scale),
    )
    a = _gmm64(rows, w_a, sizes) * scale[:, None]
    b = _gmm64(rows, w_b, sizes) * scale[:, None]
    _close(self, outs[0], a * b, rtol=1e-4)
    _close(self, outs[1], a)

  @parameterized.parameters(0, 2, 4)
  def test_group_offset_computes_only_local_groups(self, first):
    m, sizes = _GROUPS["shared_tiles"]
    rows, weights, _ = _operands(m, 128, 128, sizes)
    local = weights[first : first + 3]
    (out,) = kernels.gmm(
        [jnp.asarray(rows)],
        [jnp.asarray(local)],
        jnp.asarray(sizes),
        tiles=_TILES["chunks"],
        launch=_HLO,
        group_offset=jnp.int32(first),
    )
    _close(self, out, _gmm64(rows, local, sizes, first=first))

  def test_debug_interpreter_finds_no_out_of_bounds_access_or_race(self):
    m, sizes = _GROUPS["shared_tiles"]
    for name in ("k_steps", "chunks"):
      rows, weights, _ = _operands(m, 200, 260, sizes, transpose_rhs=True)
      (out,) = kernels.gmm(
          [jnp.asarray(rows)],
          [jnp.asarray(weights)],
          jnp.asarray(sizes),
          tiles=_TILES[name],
          launch=_DEBUG,
          transpose_rhs=True,
      )
      _close(self, out, _gmm64(rows, weights, sizes, True))


class TgmmTest(parameterized.TestCase):

  @parameterized.product(groups=list(_GROUPS), chunk=[None, 128])
  def test_matches_float64(self, groups, chunk):
    m, sizes = _GROUPS[groups]
    rows, _, dy = _operands(m, 200, 260, sizes)
    tiles = tiling.Tiles(bm=256, bk=128, bn=128, chunk=chunk)
    outs = kernels.tgmm(
        jnp.asarray(rows),
        [jnp.asarray(dy), jnp.asarray(2 * dy)],
        jnp.asarray(sizes),
        tiles=tiles,
        launch=_HLO,
        num_groups=len(sizes),
    )
    want = _tgmm64(np.nan_to_num(rows), np.nan_to_num(dy), sizes)
    _close(self, outs[0], want)
    _close(self, outs[1], 2 * want)

  def test_group_offset_and_debug_interpreter(self):
    m, sizes = _GROUPS["shared_tiles"]
    rows, _, dy = _operands(m, 128, 128, sizes)
    (out,) = kernels.tgmm(
        jnp.asarray(rows),
        [jnp.asarray(dy)],
        jnp.asarray(sizes),
        tiles=tiling.Tiles(bm=128, bk=128, bn=128),
        launch=_DEBUG,
        num_groups=3,
        group_offset=jnp.int32(2),
    )
    want = _tgmm64(np.nan_to_num(rows), np.nan_to_num(dy), sizes, 2, 3)
    _close(self, out, want)


class TilingTest(parameterized.TestCase):

  @parameterized.product(
      generation=list(tiling.GENERATIONS), kind=list(tiling.KINDS)
  )
  def test_table_fits_vmem_at_the_workloads(self, generation, kind):
    gen = tiling.GENERATIONS[generation]
    for m, k, n, e in (
        (8192, 4096, 14336, 8),
        (8192, 14336, 4096, 8),
        (16384, 7168, 2048, 32),
        (32768, 2048, 768, 128),
    ):
      call = tiling.Call(kind, m, k, n, e, 2, 2, num_rhs=2, num_accs=2)
      tiles = tiling.choose(tiling.TileConfig(), call, generation)
      self.assertLessEqual(
          tiling.vmem_bytes(tiles, call), gen.tile_budget_bytes
      )
      self.assertEqual(tiles.bm % tiles.rows_per_pass, 0)

  @parameterized.parameters("fwd", "dgrad", "wgrad")
  def test_sweep_candidates_start_at_the_table_and_fit(self, kind):
    call = tiling.Call(kind, 32768, 2048, 768, 128, 2, 2)
    cands = tiling.candidates(kind, 32768, 2048, 768, 128)
    self.assertEqual(cands[0], tiling.choose(tiling.TileConfig(), call, "v5e"))
    self.assertLen(set(cands), len(cands))
    budget = tiling.GENERATIONS["v5e"].tile_budget_bytes
    for tiles in cands:
      self.assertLessEqual(tiling.vmem_bytes(tiles, call), budget)

  def test_thin_k_widens_the_tables_columns_in_finer_chunks(self):
    gen = tiling.GENERATIONS["v5e"]
    table = tiling.TABLE["v5e"]
    # tokamax's v5e entry [262144, 256] x [256, 256, 7168]: the step's
    # multiply-adds at 1024 columns are an eighth of STEP_MACS; the whole N
    # (7168) is fewer columns than reach it, and fits the VMEM.
    thin = tiling.Call("fwd", 262144, 256, 7168, 256, 2, 2)
    tiles = tiling.choose(tiling.TileConfig(), thin, "v5e")
    self.assertEqual((tiles.bm, tiles.bk, tiles.bn), (512, None, 7168))
    # Its chunk is finer than the table's: a widened pass is long, and a
    # visit computes up to a chunk past its group's rows.
    self.assertEqual(tiles.chunk, tiling.WIDENED_CHUNK)
    self.assertLess(tiling.WIDENED_CHUNK, table["fwd"].chunk)
    self.assertLessEqual(tiling.vmem_bytes(tiles, thin), gen.tile_budget_bytes)
    # Part of the way: K = 768 needs 2048 columns, and N = 4096 has them.
    part = tiling.Call("dgrad", 32768, 768, 4096, 128, 2, 2, num_lhs=2)
    part_tiles = tiling.choose(tiling.TileConfig(), part, "v5e")
    self.assertEqual(
        (part_tiles.bn, part_tiles.chunk), (2048, tiling.WIDENED_CHUNK)
    )
    # A K the table's row already fills, wgrad, and tiles the caller gave
    # stay as they were.
    for call in (
        tiling.Call("fwd", 16384, 7168, 2048, 32, 2, 2),
        tiling.Call("wgrad", 262144, 256, 7168, 256, 2, 2),
    ):
      self.assertEqual(
          tiling.choose(tiling.TileConfig(), call, "v5e"),
          tiling.fit(table[call.kind], call, gen),
      )
    given = tiling.TileConfig(fwd=tiling.Tiles(bm=512, bn=1024, chunk=256))
    self.assertEqual(tiling.choose(given, thin, "v5e").bn, 1024)

  def test_bad_tiles_name_the_field(self):
    with self.assertRaisesRegex(ValueError, r"Tiles.bm must be .*got bm=100"):
      tiling.Tiles(bm=100)
    with self.assertRaisesRegex(ValueError, r"Tiles.chunk .*dividing bm=512"):
      tiling.Tiles(bm=512, chunk=384)

  def test_generation_of_device_kinds(self):
    for kind, want in (
        ("TPU v5 lite", "v5e"),
        ("TPU v5", "v5p"),
        ("TPU v5p", "v5p"),
        ("TPU v6 lite", "v6e"),
        ("TPU7x", "tpu7x"),
        ("NVIDIA H100 80GB HBM3", None),
        ("cpu", None),
    ):
      self.assertEqual(tiling.generation_of_kind(kind), want, kind)


if __name__ == "__main__":
  absltest.main()
