"""The tile list against a row-by-row numpy account of who owns each row."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from backends.pallas import metadata
from backends.pallas import tiling


def _owner_of_each_row(group_sizes, num_rows):
  """[num_rows] group of each row; len(group_sizes) for rows past the sum."""
  owner = np.full(num_rows, len(group_sizes))
  start = 0
  for g, size in enumerate(group_sizes):
    end = min(start + size, num_rows)
    owner[start:end] = g
    start = end
  return owner


class BuildTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("aligned", (16, 32, 16), 64, 16),
      ("shared_tiles", (10, 0, 23, 31), 64, 16),
      ("padding_rows", (5, 17, 0, 20), 64, 16),
      ("all_empty", (0, 0, 0), 32, 16),
      ("one_row_groups", (1, 1, 1, 1, 1), 32, 16),
      ("large_tile", (3, 40, 2), 128, 128),
      ("sum_past_rows_is_cut", (30, 30), 48, 16),
  )
  def test_every_row_owned_by_exactly_one_visit_of_its_group(
      self, group_sizes, num_rows, bm
  ):
    meta = jax.tree.map(
        np.asarray,
        metadata.build(np.array(group_sizes, np.int32), num_rows, bm),
    )
    num_groups = len(group_sizes)
    self.assertEqual(
        meta.group_ids.shape, (tiling.num_visits(num_rows, bm, num_groups),)
    )
    owner = _owner_of_each_row(group_sizes, num_rows)
    times_owned = np.zeros(num_rows, int)
    for g, t, lo, hi in zip(
        meta.group_ids, meta.tile_ids, meta.row_starts, meta.row_ends
    ):
      if hi <= lo:
        continue  # An unused visit.
      self.assertGreaterEqual(lo, t * bm, "a visit's rows lie in its tile")
      self.assertLessEqual(hi, t * bm + bm, "a visit's rows lie in its tile")
      np.testing.assert_array_equal(
          owner[lo:hi], g, err_msg=f"rows {lo}:{hi} of visit g={g}"
      )
      times_owned[lo:hi] += 1
    np.testing.assert_array_equal(times_owned, 1)

  @parameterized.named_parameters(
      ("shared_tiles", (10, 0, 23, 31), 64, 16),
      ("padding_rows", (5, 17, 0, 20), 64, 16),
      ("all_empty", (0, 0, 0), 32, 16),
  )
  def test_group_visits_are_csr_offsets_of_the_visits(
      self, group_sizes, num_rows, bm
  ):
    meta = jax.tree.map(
        np.asarray,
        metadata.build(np.array(group_sizes, np.int32), num_rows, bm),
    )
    offsets = meta.group_visits
    self.assertEqual(offsets.shape, (len(group_sizes) + 2,))
    for g, size in enumerate(group_sizes):
      visits = slice(offsets[g], offsets[g + 1])
      np.testing.assert_array_equal(meta.group_ids[visits], g)
      rows = np.sum(meta.row_ends[visits] - meta.row_starts[visits])
      self.assertEqual(rows, size, f"rows owned by group {g}")

  def test_random_group_sizes(self):
    rng = np.random.default_rng(0)
    for _ in range(10):
      num_groups = int(rng.integers(1, 12))
      num_rows = 16 * int(rng.integers(1, 12))
      sizes = rng.multinomial(
          int(rng.integers(0, num_rows + 1)), np.ones(num_groups) / num_groups
      )
      meta = jax.tree.map(
          np.asarray, metadata.build(sizes.astype(np.int32), num_rows, 16)
      )
      owner = _owner_of_each_row(sizes, num_rows)
      covered = np.zeros(num_rows, int)
      for g, lo, hi in zip(meta.group_ids, meta.row_starts, meta.row_ends):
        np.testing.assert_array_equal(owner[lo:hi], g)
        covered[lo:hi] += 1
      np.testing.assert_array_equal(covered, 1, err_msg=f"sizes={sizes}")

  def test_rows_not_a_multiple_of_bm_is_an_error(self):
    with self.assertRaisesRegex(
        ValueError,
        r"num_rows must be a multiple of " r"bm, got num_rows=40, bm=16",
    ):
      metadata.build(np.array([3, 4], np.int32), 40, 16)


if __name__ == "__main__":
  absltest.main()
