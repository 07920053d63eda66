"""GPT-OSS in the training model: sink attention, windows, YaRN, the preset.

The counts of the full-size presets against transformers' own model are in
`presets_gpt_oss_hf_test.py` (the torch leg).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from moe_core import flax as moe_flax
from train import presets
from train.models import attention
from train.models import model_config
from train.models import scan_model
from train.models import sink_attention
from train.models import transformer as model_lib
from train.presets import sizing
from train.testing import small_runs

# SMALL_DSV3's dense first layer, then three MoE layers with GPT-OSS's
# attention: windows of 4 on layers 0 and 2, full attention on 1 and 3, so
# the scanned MoE stack must number its layers from 1.
SMALL_GPT_OSS = small_runs.SMALL_DSV3.replace(
    name="test_gpt_oss",
    num_layers=4,
    attention_bias=True,
    attention_sinks=True,
    sliding_window=4,
    full_attention_every=2,
    yarn=model_config.YarnRope(factor=4.0, original_max_positions=8),
)


def _numpy_sink_attention(q, k, v, sinks, window):
  """The definition, one query at a time, in float64."""
  q, k, v, sinks = (np.asarray(a, np.float64) for a in (q, k, v, sinks))
  b, t, h, d = q.shape
  hkv = k.shape[2]
  out = np.zeros((b, t, h, v.shape[-1]))
  for bi in range(b):
    for hi in range(h):
      kv = hi // (h // hkv)
      for ti in range(t):
        first = max(0, ti - window + 1) if window else 0
        scores = k[bi, first : ti + 1, kv] @ q[bi, ti, hi] / np.sqrt(d)
        peak = max(scores.max(), sinks[hi])
        weights = np.exp(scores - peak)
        weights /= weights.sum() + np.exp(sinks[hi] - peak)
        out[bi, ti, hi] = weights @ v[bi, first : ti + 1, kv]
  return out


def _perturbed(model, seed):
  """`model` with every parameter moved by noise, so zero-initialised
  biases and sinks take part."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [
      x + 0.3 * jax.random.normal(key, x.shape, x.dtype)
      for x, key in zip(leaves, keys)
  ]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)


class SinkAttentionTest(absltest.TestCase):

  def test_matches_the_definition_with_windows_and_sinks(self):
    b, t, h, hkv, d, dv = 2, 9, 6, 2, 4, 3
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (b, t, h, d))
    k = jax.random.normal(keys[1], (b, t, hkv, d))
    v = jax.random.normal(keys[2], (b, t, hkv, dv))
    sinks = 2.0 * jax.random.normal(keys[3], (h,))
    for window in (0, 1, 3, 20):
      with self.subTest(window=window):
        want = _numpy_sink_attention(q, k, v, sinks, window)
        got = sink_attention.sink_attention(q, k, v, sinks, window)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # A traced window (the scanned stack's) and query blocks (long
        # sequences) give the same rows.
        traced = jax.jit(
            lambda w: sink_attention.sink_attention(
                q[:, :6], k[:, :6], v[:, :6], sinks, w, 2
            )
        )(jnp.int32(window))
        np.testing.assert_allclose(traced, want[:, :6], rtol=1e-5, atol=1e-5)

  def test_without_sinks_or_window_is_plain_causal_attention(self):
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (1, 7, 4, 8))
    k = jax.random.normal(keys[1], (1, 7, 2, 8))
    v = jax.random.normal(keys[2], (1, 7, 2, 8))
    np.testing.assert_allclose(
        sink_attention.sink_attention(q, k, v, None, 0),
        attention.causal_attention(q, k, v),
        rtol=1e-5,
        atol=1e-5,
    )

  def test_a_large_sink_silences_the_head(self):
    q = jnp.ones((1, 3, 2, 4))
    k = jnp.ones((1, 3, 1, 4))
    v = jnp.ones((1, 3, 1, 4))
    out = sink_attention.sink_attention(q, k, v, jnp.array([60.0, -60.0]), 0)
    np.testing.assert_allclose(out[..., 0, :], 0.0, atol=1e-6)
    np.testing.assert_allclose(out[..., 1, :], 1.0, atol=1e-6)


class YarnTest(absltest.TestCase):

  def test_fast_pairs_kept_slow_pairs_stretched(self):
    yarn = model_config.YarnRope(
        factor=32.0, original_max_positions=4096, truncate=False
    )
    freq, scale = sink_attention.yarn_frequencies(64, 150000.0, yarn)
    base = 150000.0 ** (-np.arange(32) / 32)
    turns = 4096 * base / (2 * math.pi)  # Turns over the original context.
    fast, slow = turns > 32, turns < 1
    self.assertTrue(fast.any() and slow.any())
    np.testing.assert_allclose(freq[fast], base[fast], rtol=1e-5)
    np.testing.assert_allclose(freq[slow], base[slow] / 32, rtol=1e-5)
    between = ~fast & ~slow
    self.assertTrue(
        np.all(freq[between] <= base[between] * (1 + 1e-6))
        and np.all(freq[between] >= base[between] / 32 * (1 - 1e-6))
    )
    self.assertAlmostEqual(scale, 1 + 0.1 * math.log(32), places=6)

  def test_bad_settings_are_refused(self):
    with self.assertRaisesRegex(ValueError, "yarn.factor"):
      model_config.YarnRope(factor=1.0, original_max_positions=8)
    with self.assertRaisesRegex(ValueError, "beta_fast > beta_slow"):
      model_config.YarnRope(
          factor=2.0, original_max_positions=8, beta_fast=1, beta_slow=2
      )


class ConfigTest(absltest.TestCase):

  def test_layer_windows_alternate(self):
    cfg = presets.get_preset("gpt_oss_20b").model
    self.assertEqual(
        [cfg.attention_window(i) for i in range(4)], [128, 0, 128, 0]
    )
    every = SMALL_GPT_OSS.replace(full_attention_every=0)
    self.assertEqual({every.attention_window(i) for i in range(4)}, {4})

  def test_bad_combinations_are_refused(self):
    with self.assertRaisesRegex(ValueError, "needs sliding_window >= 1"):
      SMALL_GPT_OSS.replace(sliding_window=0)
    with self.assertRaisesRegex(ValueError, "sliding_window and full_"):
      SMALL_GPT_OSS.replace(sliding_window=-1)
    with self.assertRaisesRegex(ValueError, "without qk_norm"):
      SMALL_GPT_OSS.replace(qk_norm="head")
    with self.assertRaisesRegex(TypeError, "yarn must be a YarnRope"):
      SMALL_GPT_OSS.replace(yarn={"factor": 32})

  def test_attention_count_adds_biases_and_sinks(self):
    cfg = SMALL_GPT_OSS
    plain = cfg.replace(
        attention_bias=False,
        attention_sinks=False,
        sliding_window=0,
        full_attention_every=0,
        yarn=None,
    )
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    self.assertEqual(
        sizing.attention_param_count(cfg) - sizing.attention_param_count(plain),
        q + 2 * kv + cfg.hidden_size + cfg.num_heads,
    )

  def test_sliding_layers_attend_to_fewer_positions(self):
    self.assertEqual(sizing.attended_positions(8, 0), 4.5)
    self.assertEqual(sizing.attended_positions(8, 8), 4.5)
    # Window 2 over 8 positions: 1 + 2 * 7 keys.
    self.assertEqual(sizing.attended_positions(8, 2), 15 / 8)
    cfg = presets.get_preset("gpt_oss_20b").model
    full = cfg.replace(sliding_window=0, full_attention_every=0)
    self.assertLess(
        sizing.flops_per_token(cfg, 4096)["attention_forward"],
        sizing.flops_per_token(full, 4096)["attention_forward"],
    )


def _forward(model):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda tokens: nnx.merge(graphdef, state)(tokens))


# The model card's per-component counts (arXiv 2508.10925, its parameter
# table; train/presets/published.py names where it was read), in billions:
# (MLP, attention, embedding + unembedding).
CARD_COMPONENTS = {
    "gpt_oss_20b": (19.12, 0.64, 1.16),
    "gpt_oss_120b": (114.71, 0.96, 1.16),
}


class CardComponentsTest(absltest.TestCase):

  def test_components_round_to_the_card(self):
    for name, (mlp, attn, embed) in CARD_COMPONENTS.items():
      with self.subTest(name):
        counts = sizing.param_counts(presets.get_preset(name).model)
        # Two decimals of billions: within half a unit of the last digit.
        self.assertAlmostEqual(counts.moe / 1e9, mlp, delta=0.005)
        self.assertAlmostEqual(counts.attention / 1e9, attn, delta=0.005)
        self.assertAlmostEqual(
            (counts.embedding + counts.head) / 1e9, embed, delta=0.005
        )


class ModelTest(absltest.TestCase):

  def _build(self, kind):
    return kind(
        SMALL_GPT_OSS,
        backend="xla",
        compute_dtype=jnp.float32,
        rngs=nnx.Rngs(params=2),
    )

  def test_scanned_equals_unrolled(self):
    # The same seed gives both the same values (scan_model_test); the
    # windows differ by layer, so a stack numbered wrongly differs.
    unrolled = self._build(model_lib.Transformer)
    scanned = self._build(scan_model.ScannedTransformer)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    want, want_stats = _forward(unrolled)(tokens)
    got, got_stats = _forward(scanned)(tokens)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(
        got_stats["tokens_per_expert"], want_stats["tokens_per_expert"]
    )

  def test_sliding_layers_forget_beyond_the_window(self):
    # A one-layer model whose only layer slides over 4 positions: a token
    # 4 or more places back cannot change the output.
    cfg = SMALL_GPT_OSS.replace(
        num_layers=1, first_dense_layers=0, full_attention_every=0
    )
    model = _perturbed(
        model_lib.Transformer(
            cfg, backend="xla", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
        ),
        3,
    )
    tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, 256)
    changed = tokens.at[:, 2].set((tokens[:, 2] + 1) % 256)
    forward = _forward(model)
    a, _ = forward(tokens)
    b, _ = forward(changed)
    np.testing.assert_array_equal(a[:, 6:], b[:, 6:])
    self.assertGreater(float(jnp.abs(a[:, 2:6] - b[:, 2:6]).max()), 0.0)

  def test_parameters_have_the_counted_shapes(self):
    model = nnx.eval_shape(lambda: self._build(model_lib.Transformer))
    attn = model.blocks[1].attn
    h, hkv, d = 2, 2, 16
    self.assertEqual(attn.sinks.shape, (h,))
    self.assertEqual(attn.bq.shape, (h * d,))
    self.assertEqual(attn.bk.shape, (hkv * d,))
    self.assertEqual(attn.bo.shape, (SMALL_GPT_OSS.hidden_size,))
    mlp = model.blocks[1].mlp
    self.assertIsInstance(mlp, moe_flax.MoE)


class TinyPresetTrainsTest(absltest.TestCase):

  def test_loss_is_finite_and_falls(self):
    preset = presets.get_preset("tiny_gpt_oss")
    run = small_runs.small_run(
        small_runs.temp_dir(self),
        model=preset.model,
        steps=8,
        batch_size=4,
        seq_len=32,
        warmup_steps=2,
        aux_loss_weight=preset.train.aux_loss_weight,
    )
    self.assertTrue(run.scan_layers)  # The program's default path.
    losses = small_runs.step_losses(run)
    self.assertTrue(np.all(np.isfinite(losses)), losses)
    self.assertLess(np.mean(losses[-3:]), losses[0] - 0.5, losses)


if __name__ == "__main__":
  absltest.main()
