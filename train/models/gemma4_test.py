"""Gemma 4's decoder layer: its pieces against the math, and training."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from train import presets
from train.models import attention
from train.models import gemma4
from train.models import gemma4_layout
from train.models import scan_model
from train.models import transformer as model_lib
from train.presets import sizing
from train.testing import small_runs

TINY = presets.get_preset("tiny_gemma4").model


def _numpy_attention(q, k, v, window):
  """Unscaled causal (windowed) attention, one query and head at a time."""
  b, t, h, _ = q.shape
  group = h // k.shape[2]
  out = np.zeros(q.shape[:3] + v.shape[-1:])
  for i in range(b):
    for head in range(h):
      for row in range(t):
        first = max(0, row - window + 1) if window else 0
        keys = k[i, first : row + 1, head // group]
        scores = keys @ q[i, row, head]
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        out[i, row, head] = weights @ v[i, first : row + 1, head // group]
  return out


class PiecesTest(absltest.TestCase):

  def test_windowed_attention_matches_a_numpy_loop(self):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 9, 4, 6))
    k = rng.normal(size=(2, 9, 2, 6))
    v = rng.normal(size=(2, 9, 2, 6))
    for window in (0, 1, 3):
      with self.subTest(window=window):
        got = gemma4.windowed_attention(
            *(jnp.asarray(a, jnp.float32) for a in (q, k, v)), window
        )
        np.testing.assert_allclose(
            got, _numpy_attention(q, k, v, window), rtol=1e-5, atol=1e-5
        )

  def test_query_blocks_give_the_whole_attention_and_its_gradients(self):
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, 12, 4, 8))
    k = jax.random.normal(keys[1], (2, 12, 2, 8))
    v = jax.random.normal(keys[2], (2, 12, 2, 8))

    def loss(q, k, v, window, block):
      out = gemma4.windowed_attention(q, k, v, window, query_block=block)
      return jnp.sum(out * jnp.cos(out))

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    # Windows inside a block, spanning blocks, and none.
    for window in (3, 5, 9, 0):
      with self.subTest(window=window):
        want = grad(q, k, v, window, 12)  # One block: every key.
        got = grad(q, k, v, window, 4)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
          np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

  def test_proportional_rope_turns_only_its_fraction_of_the_pairs(self):
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 16))
    positions = jnp.arange(5)
    full = gemma4.proportional_rope(x, positions, 1e4, 1.0)
    np.testing.assert_array_equal(full, attention.rope(x, positions, 1e4))
    part = gemma4.proportional_rope(x, positions, 1e6, 0.25)
    # d = 16: 8 pairs (i, i + 8), of which int(0.25 * 16 // 2) = 2 turn.
    still = np.r_[2:8, 10:16]
    np.testing.assert_array_equal(part[..., still], x[..., still])
    # Pair 1 turns at 1e6 ** (-2 / 16) radians per position.
    angle = 3 * 1e6 ** (-2 / 16)
    x1, x2 = x[0, 3, 0, 1], x[0, 3, 0, 9]
    np.testing.assert_allclose(
        part[0, 3, 0, [1, 9]],
        [
            x1 * math.cos(angle) - x2 * math.sin(angle),
            x2 * math.cos(angle) + x1 * math.sin(angle),
        ],
        rtol=1e-5,
    )

  def test_global_layers_reuse_keys_as_values(self):
    model = nnx.eval_shape(
        lambda: model_lib.Transformer(TINY, rngs=nnx.Rngs(0))
    )
    kinds = [
        (hasattr(b.attn, "wv"), b.attn.head_dim, b.attn.window)
        for b in model.blocks
    ]
    # Layers 1 and 3 are global (every second one, and the last).
    self.assertEqual(
        kinds, [(True, 32, 16), (False, 64, 0), (True, 32, 16), (False, 64, 0)]
    )

  def test_logits_are_soft_capped_and_causal(self):
    cfg = TINY.replace(
        gemma4=gemma4_layout.Gemma4Layout(
            sliding_window=4,
            global_every=2,
            global_head_dim=64,
            global_kv_heads=1,
            global_rope_fraction=0.25,
            logit_softcap=0.5,
        )
    )
    model = model_lib.Transformer(
        cfg, backend="xla", compute_dtype=jnp.float32, rngs=nnx.Rngs(1)
    )
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda t: nnx.merge(graphdef, state)(t))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
    logits, stats = forward(tokens)
    self.assertLessEqual(float(jnp.abs(logits).max()), 0.5)
    self.assertEqual(stats["tokens_per_expert"].shape, (4, 16))
    changed, _ = forward(tokens.at[:, 7].set((tokens[:, 7] + 1) % 256))
    np.testing.assert_array_equal(changed[:, :7], logits[:, :7])
    self.assertGreater(float(jnp.abs(changed[:, 7:] - logits[:, 7:]).max()), 0)


class ScannedTest(absltest.TestCase):

  def test_scanned_periods_are_the_unrolled_model(self):
    """Same initial values (same draws), same logits and statistics."""

    def build(kind):
      return kind(
          TINY,
          backend="xla",
          compute_dtype=jnp.float32,
          rngs=nnx.Rngs(params=3),
      )

    unrolled = build(model_lib.Transformer)
    scanned = build(scan_model.ScannedTransformer)
    period = TINY.gemma4.global_every
    for i, block in enumerate(unrolled.blocks):
      stacked = scanned.moe_layers.layers[i % period]
      want = jax.tree.leaves(nnx.state(block, nnx.Param))
      got = jax.tree.leaves(nnx.state(stacked, nnx.Param))
      self.assertEqual(len(got), len(want))
      for w, g in zip(want, got):
        np.testing.assert_array_equal(g[i // period], w, err_msg=f"layer {i}")
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 256)
    outputs = []
    for model in (unrolled, scanned):
      graphdef, state = nnx.split(model)
      outputs.append(jax.jit(lambda t: nnx.merge(graphdef, state)(t))(tokens))
    (want_logits, want_stats), (got_logits, got_stats) = outputs
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        got_stats["tokens_per_expert"], want_stats["tokens_per_expert"]
    )
    self.assertLen(scanned.moe_modules(), period)


class ConfigTest(absltest.TestCase):

  def test_bad_layouts_are_refused_with_the_argument_named(self):
    layout = TINY.gemma4
    for changes, message in (
        ({"sliding_window": 0}, "gemma4.sliding_window"),
        ({"global_head_dim": 63}, "gemma4.global_head_dim"),
        ({"global_rope_fraction": 0.0}, "gemma4.global_rope_fraction"),
        ({"logit_softcap": -1.0}, "gemma4.logit_softcap"),
    ):
      with self.subTest(message):
        with self.assertRaisesRegex(ValueError, message):
          dataclasses.replace(layout, **changes)
    for changes, message in (
        ({"qk_norm": "none"}, "qk_norm='head'"),
        ({"dense_ffn_size": 0}, "dense_ffn_size >= 1"),
        ({"first_dense_layers": 1}, "first_dense_layers=0"),
        (
            {"gemma4": dataclasses.replace(layout, global_kv_heads=3)},
            "global_kv_heads must divide num_heads",
        ),
    ):
      with self.subTest(message):
        with self.assertRaisesRegex(ValueError, message):
          TINY.replace(**changes)
    with self.assertRaisesRegex(TypeError, "Gemma4Layout"):
      TINY.replace(gemma4={"sliding_window": 16})

  def test_scanning_needs_whole_periods(self):
    with self.assertRaisesRegex(ValueError, "multiple of gemma4.global_every"):
      scan_model.ScannedTransformer(
          TINY.replace(num_layers=3), rngs=nnx.Rngs(0)
      )

  def test_sliding_layers_cost_fewer_attention_flops(self):
    full = sizing.flops_per_token(TINY, 64)["attention_forward"]
    wide = TINY.replace(
        gemma4=dataclasses.replace(TINY.gemma4, sliding_window=64)
    )
    self.assertLess(full, sizing.flops_per_token(wide, 64)["attention_forward"])
    # A window as long as the sequence is plain causal attention: H *
    # (T + 1) / 2 keys, 2 * 2 * d FLOPs each, summed over the layers.
    want = sum(
        2 * 4 * 32.5 * 2 * gemma4_layout.layer_shape(wide, i)[0]
        for i in range(4)
    )
    self.assertAlmostEqual(
        sizing.flops_per_token(wide, 64)["attention_forward"], want
    )


class TrainTest(absltest.TestCase):

  def test_tiny_gemma4_trains(self):
    preset = presets.get_preset("tiny_gemma4")
    run = small_runs.small_run(
        small_runs.temp_dir(self),
        model=preset.model,
        steps=12,
        batch_size=8,
        seq_len=48,
        warmup_steps=2,
        aux_loss_weight=preset.train.aux_loss_weight,
        z_loss_weight=preset.train.z_loss_weight,
    )
    losses = small_runs.step_losses(run)
    self.assertTrue(np.all(np.isfinite(losses)), losses)
    # From about log(256) = 5.5 nats (uniform) towards the byte unigram.
    self.assertGreater(losses[0], 4.5)
    self.assertLess(np.mean(losses[-3:]), losses[0] - 1.0, losses)


if __name__ == "__main__":
  absltest.main()
