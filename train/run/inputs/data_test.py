"""Byte data: the split, the resumable sampler, the unigram baselines."""

import math
import os
from pydoc_data import topics

from absl.testing import absltest
import numpy as np

from train.run.inputs import data
from train.testing import small_runs


class CorpusTest(absltest.TestCase):

  def test_embedded_corpus_is_real_text_and_split_one_in_ten(self):
    corpus = small_runs.corpus()
    text_bytes = len(
        "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode(
            "utf-8"
        )
    )
    self.assertEqual(len(corpus.train) + len(corpus.held_out), text_bytes)
    self.assertGreater(text_bytes, 400_000)
    self.assertAlmostEqual(len(corpus.held_out) / text_bytes, 0.1, delta=0.01)
    # Mostly printable ASCII: it is English prose and code.
    ascii_share = np.mean((corpus.train >= 32) & (corpus.train < 127))
    self.assertGreater(ascii_share, 0.9)

  def test_splits_are_the_interleaved_chunks_of_the_text(self):
    path = os.path.join(small_runs.temp_dir(self), "t.txt")
    raw = bytes(
        np.random.default_rng(0).integers(
            0, 256, 10 * 4096 + 100, dtype=np.uint8
        )
    )
    with open(path, "wb") as f:
      f.write(raw)
    corpus = data.load(path)
    chunk = data.CHUNK_BYTES
    held = b"".join(
        raw[i : i + chunk] for i in range(9 * chunk, len(raw), 10 * chunk)
    )
    self.assertEqual(corpus.held_out.tobytes(), held)
    self.assertEqual(len(corpus.train) + len(corpus.held_out), len(raw))

  def test_bad_data_paths_are_refused(self):
    with self.assertRaisesRegex(FileNotFoundError, "--data must name"):
      data.load("/nonexistent/file.txt")
    path = os.path.join(small_runs.temp_dir(self), "small.txt")
    with open(path, "w") as f:
      f.write("too short")
    with self.assertRaisesRegex(ValueError, "a held-out split needs"):
      data.load(path)


class UnigramTest(absltest.TestCase):

  def test_entropy_of_known_distributions(self):
    uniform = np.arange(256 * 4, dtype=np.uint8)
    self.assertAlmostEqual(data.unigram_entropy(uniform), math.log(256))
    self.assertEqual(data.unigram_entropy(np.full(10, 65, np.uint8)), 0.0)
    two = np.array([1, 2] * 50, np.uint8)
    self.assertAlmostEqual(data.unigram_entropy(two), math.log(2))

  def test_held_out_cross_entropy_is_at_least_its_entropy(self):
    corpus = small_runs.corpus()
    # Gibbs' inequality: no model beats the held-out text's own frequencies.
    self.assertGreaterEqual(
        data.unigram_cross_entropy(corpus.train, corpus.held_out),
        data.unigram_entropy(corpus.held_out),
    )


class SamplerTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.tokens = np.arange(2000, dtype=np.int64) % 256

  def _draw(self, sampler, n):
    return [sampler.next() for _ in range(n)]

  def test_windows_are_contiguous_text(self):
    sampler = data.BatchSampler(self.tokens.astype(np.uint8), 4, 15, seed=0)
    batch = sampler.next()
    self.assertEqual(batch.shape, (4, 16))
    self.assertEqual(batch.dtype, np.int32)
    np.testing.assert_array_equal(np.diff(batch, axis=1) % 256, 1)

  def test_same_seed_same_batches_other_seed_other_batches(self):
    a = self._draw(data.BatchSampler(self.tokens, 4, 15, seed=1), 30)
    b = self._draw(data.BatchSampler(self.tokens, 4, 15, seed=1), 30)
    c = self._draw(data.BatchSampler(self.tokens, 4, 15, seed=2), 30)
    np.testing.assert_array_equal(np.stack(a), np.stack(b))
    self.assertFalse(np.array_equal(np.stack(a), np.stack(c)))

  def test_restore_continues_exactly_across_epochs(self):
    straight = data.BatchSampler(self.tokens, 4, 15, seed=3)
    self.assertLess(straight.batches_per_epoch, 40)  # Crosses epochs.
    want = self._draw(straight, 70)
    first = data.BatchSampler(self.tokens, 4, 15, seed=3)
    got = self._draw(first, 37)
    state = first.state()
    second = data.BatchSampler(self.tokens, 4, 15, seed=3)
    second.restore(state)
    got += self._draw(second, 33)
    np.testing.assert_array_equal(np.stack(got), np.stack(want))

  def test_an_epoch_visits_each_window_once(self):
    positions = np.arange(2000)  # Each token is its own position.
    sampler = data.BatchSampler(positions, 4, 15, seed=4)
    starts = sorted(
        int(row[0])
        for _ in range(sampler.batches_per_epoch)
        for row in sampler.next()
    )
    # Non-overlapping windows: distinct starts, 16 (= seq_len + 1) apart.
    self.assertLen(set(starts), len(starts))
    self.assertEqual(set(np.diff(starts)), {16})

  def test_too_little_text_is_refused(self):
    with self.assertRaisesRegex(ValueError, "batch_size=4 x"):
      data.BatchSampler(np.zeros(50, np.uint8), 4, 15, seed=0)

  def test_eval_batches_cover_the_held_out_text(self):
    held = np.arange(1000) % 256
    batches = data.eval_batches(held, batch_size=4, seq_len=31, max_batches=3)
    self.assertLen(batches, 3)
    first_starts = [b[:, 0] for b in batches]
    self.assertEqual(int(first_starts[0][0]), 0)
    self.assertEqual(int(batches[-1][-1][-1]), int(held[-1]))


if __name__ == "__main__":
  absltest.main()
