"""DeepSeek-V4's decoder: its pieces against their math, causality, training."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from train import presets
from train.models import deepseek_v4
from train.models import deepseek_v4_config
from train.models import transformer as model_lib
from train.presets import sizing
from train.run.training import trainer
from train.testing import small_runs

TINY = presets.get_preset("tiny_deepseek_v4").model

# Smaller still, for the forward tests.
SMALL = small_runs.SMALL_DEEPSEEK_V4


def _forward(cfg, tokens):
  model = model_lib.Transformer(
      cfg, backend="xla", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
  )
  graphdef, state = nnx.split(model)
  return jax.jit(lambda t: nnx.merge(graphdef, state)(t))(tokens)


class PiecesTest(absltest.TestCase):

  def test_sinkhorn_makes_rows_and_columns_sum_to_one(self):
    positive = jnp.exp(jax.random.normal(jax.random.key(0), (5, 4, 4)))
    mixed = deepseek_v4.sinkhorn(positive, iterations=20, eps=1e-6)
    np.testing.assert_allclose(mixed.sum(-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(mixed.sum(-2), 1.0, atol=1e-4)

  def test_hyper_connection_weights_are_in_range(self):
    hc = deepseek_v4.HyperConnection(SMALL, rngs=nnx.Rngs(1))
    streams = jax.random.normal(jax.random.key(2), (2, 3, 4, 32))
    post, comb, x = hc(streams)
    self.assertEqual(x.shape, (2, 3, 32))
    self.assertTrue(bool(jnp.all((post > 0) & (post < 2))))
    # comb is (nearly) doubly stochastic: mixing keeps the streams' mean.
    np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-4)

  def test_rope_rotates_only_the_trailing_pairs_and_inverts(self):
    x = jax.random.normal(jax.random.key(3), (1, 5, 2, 16))
    positions = jnp.arange(5)
    turned = deepseek_v4.rope_trailing(x, positions, 100.0, 8)
    np.testing.assert_array_equal(turned[..., :8], x[..., :8])
    # A rotation of each pair: norms kept, the position-0 token unmoved.
    pairs = lambda a: jnp.linalg.norm(
        a[..., 8:].reshape(1, 5, 2, 4, 2), axis=-1
    )
    np.testing.assert_allclose(pairs(turned), pairs(x), rtol=1e-5)
    np.testing.assert_allclose(turned[:, 0], x[:, 0], rtol=1e-6)
    back = deepseek_v4.rope_trailing(turned, positions, 100.0, 8, inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-5)

  def test_sliding_window_attention_sees_window_keys_only(self):
    attn = deepseek_v4.Attention(SMALL, 0, rngs=nnx.Rngs(4))  # "sliding"
    x = jax.random.normal(jax.random.key(5), (1, 12, 32))
    moved = x.at[:, 2].add(1.0)
    a, b = attn(x, jnp.arange(12)), attn(moved, jnp.arange(12))
    window = SMALL.deepseek_v4.sliding_window
    changed = np.abs(np.asarray(a - b)).max(-1)[0] > 1e-6
    # Token 2 is seen by queries 2 .. 2 + window - 1, and by no other.
    np.testing.assert_array_equal(
        changed, [2 <= t < 2 + window for t in range(12)]
    )

  def test_compressed_entry_appears_once_its_window_is_complete(self):
    visible = deepseek_v4.visible_entries(3, 12, 4)
    want = [[t + 1 >= 4 * (w + 1) for w in range(3)] for t in range(12)]
    np.testing.assert_array_equal(visible, want)


class ModelTest(absltest.TestCase):

  def test_is_causal(self):
    """Changing token t changes no logit before t (compressors, indexer and
    hash routing included)."""
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
    changed = tokens.at[:, 13].set((tokens[:, 13] + 1) % 256)
    a, _ = _forward(SMALL, tokens)
    b, _ = _forward(SMALL, changed)
    np.testing.assert_array_equal(a[:, :13], b[:, :13])
    self.assertGreater(float(jnp.abs(a[:, 13:] - b[:, 13:]).max()), 0.0)

  def test_hash_layers_route_by_the_table(self):
    model = model_lib.Transformer(SMALL, backend="xla", rngs=nnx.Rngs(0))
    hashed = [b.mlp for b in model.blocks if b.hashed]
    self.assertLen(hashed, SMALL.deepseek_v4.num_hash_layers)
    for block in hashed:
      self.assertFalse(block.cfg.correction_bias)
      self.assertEqual(block.hash_table[...].shape, (256, 2))
    self.assertTrue(model.blocks[-1].mlp.cfg.correction_bias)

  def test_attention_flops_count_the_window_and_the_entries_seen(self):
    s = SMALL.deepseek_v4
    per_key = 2 * SMALL.num_heads * 2 * SMALL.head_dim  # scores + values
    covering = SMALL.replace(
        deepseek_v4=s.replace(layer_types=("sliding",) * 3, sliding_window=64)
    )
    # A window as long as the sequence: plain causal attention.
    self.assertAlmostEqual(
        sizing.flops_per_token(covering, 64)["attention_forward"],
        3 * per_key * (64 + 1) / 2,
    )
    # SMALL: a 6-token window (keys 1..6, then 6) in each layer, plus the
    # CSA layer's entries (<= index_topk = 2 of t // 4) and its indexer's
    # scores, plus the HCA layer's t // 8 entries.
    t = np.arange(1, 65)
    want = 3 * per_key * np.minimum(t, 6).mean()
    want += per_key * np.minimum(t // 4, 2).mean()
    want += 2 * s.index_n_heads * s.index_head_dim * (t // 4).mean()
    want += per_key * (t // 8).mean()
    self.assertAlmostEqual(
        sizing.flops_per_token(SMALL, 64)["attention_forward"], want
    )

  def test_bad_settings_are_refused_with_the_field(self):
    with self.assertRaisesRegex(ValueError, "layer_types entries"):
      deepseek_v4_config.DeepseekV4Settings(layer_types=("window",))
    with self.assertRaisesRegex(TypeError, "layer_types must be a tuple"):
      deepseek_v4_config.DeepseekV4Settings(layer_types=["csa"])
    with self.assertRaisesRegex(ValueError, "one layer type per layer"):
      SMALL.replace(num_layers=4)
    with self.assertRaisesRegex(ValueError, "num_kv_heads=1"):
      SMALL.replace(num_kv_heads=2)
    with self.assertRaisesRegex(ValueError, "o_groups to divide"):
      SMALL.replace(
          deepseek_v4=SMALL.deepseek_v4.replace(o_groups=3),
      )


class TrainingTest(absltest.TestCase):

  def test_tiny_preset_trains_with_finite_falling_loss(self):
    run = small_runs.small_run(
        small_runs.temp_dir(self),
        model=TINY,
        steps=8,
        batch_size=4,
        seq_len=64,
        scan_layers=False,
    )
    tr = trainer.Trainer(run, small_runs.corpus(), out=None)
    losses = [
        float(tr.train_step(tr.sampler.next())["loss"])
        for _ in range(run.steps)
    ]
    self.assertTrue(np.all(np.isfinite(losses)), losses)
    # Uniform over bytes at first (log 256 = 5.5 nats), then learning.
    self.assertGreater(losses[0], 5.0)
    self.assertLess(np.mean(losses[-3:]), losses[0] - 1.0)
    # The hash layers' tables are routing state the step leaves alone.
    tables = [
        x
        for path, x in jax.tree_util.tree_leaves_with_path(tr.state["bias"])
        if "hash_table" in jax.tree_util.keystr(path)
    ]
    self.assertLen(tables, TINY.deepseek_v4.num_hash_layers)
    self.assertEqual(tables[0].dtype, jnp.int32)


if __name__ == "__main__":
  absltest.main()
