"""Llama 4's pieces: config checks, the attention math, tiny_llama4 trains."""

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from train import presets
from train import train_flags
from train.models import attention
from train.models import llama4
from train.models import scan_model
from train.models import transformer as model_lib
from train.presets import sizing
from train.testing import small_runs

TINY = presets.get_preset("tiny_llama4").model


def _numpy_attention(q, k, v, allowed):
  """Softmax attention with an explicit [T, T] mask, one head at a time."""
  t, h, d = q.shape
  group = h // k.shape[1]
  out = np.zeros((t, h, v.shape[-1]))
  for head in range(h):
    logits = q[:, head] @ k[:, head // group].T / np.sqrt(d)
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out[:, head] = probs @ v[:, head // group]
  return out


class ConfigTest(parameterized.TestCase):

  def test_layer_pattern_follows_the_intervals(self):
    cfg = TINY.replace(num_layers=8)
    self.assertEqual([cfg.is_moe_layer(i) for i in range(8)], [False, True] * 4)
    self.assertEqual(
        [cfg.uses_rope(i) for i in range(8)], [True, True, True, False] * 2
    )
    self.assertEqual((cfg.num_dense_layers, cfg.num_moe_layers), (4, 4))

  def test_interval_counts_after_the_first_dense_layers(self):
    cfg = TINY.replace(num_layers=7, first_dense_layers=2)
    self.assertEqual([i for i in range(7) if cfg.is_moe_layer(i)], [3, 5])

  @parameterized.parameters(
      ("moe_layer_interval", 0, ValueError),
      ("nope_layer_interval", -1, ValueError),
      ("attention_chunk_size", -8, ValueError),
      ("attn_temperature_floor", -1, ValueError),
      ("moe_layer_interval", 2.0, TypeError),
      ("attention_chunk_size", True, TypeError),
  )
  def test_bad_values_are_refused_by_name(self, field, value, error):
    with self.assertRaisesRegex(error, field):
      TINY.replace(**{field: value})

  def test_temperature_without_nope_layers_is_refused(self):
    with self.assertRaisesRegex(ValueError, "nope_layer_interval"):
      TINY.replace(nope_layer_interval=0)

  def test_mla_refuses_nope_layers(self):
    with self.assertRaisesRegex(ValueError, "'gqa' attention only"):
      small_runs.SMALL_DSV3.replace(
          attention="mla",
          num_kv_heads=0,
          head_dim=0,
          kv_lora_rank=16,
          qk_nope_head_dim=8,
          qk_rope_head_dim=4,
          v_head_dim=8,
          nope_layer_interval=2,
      )

  def test_scan_layers_flag_is_refused_at_parse_time(self):
    values = {"model": "tiny_llama4", "scan_layers": True}
    with self.assertRaisesRegex(flags.ValidationError, "--noscan_layers"):
      train_flags._check_layers_scan(values)  # pylint: disable=protected-access
    values["scan_layers"] = False
    self.assertTrue(train_flags._check_layers_scan(values))  # pylint: disable=protected-access

  def test_scanned_model_refuses_interleaved_layers(self):
    with self.assertRaisesRegex(ValueError, "moe_layer_interval=2"):
      scan_model.check_scannable(TINY)
    with self.assertRaisesRegex(ValueError, "nope_layer_interval=4"):
      scan_model.check_scannable(TINY.replace(moe_layer_interval=1))


class AttentionMathTest(absltest.TestCase):

  def test_chunked_attention_sees_only_its_own_chunk(self):
    t, h, hkv, d, chunk = 12, 4, 2, 8, 5
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, t, h, d))
    k = jax.random.normal(keys[1], (1, t, hkv, d))
    v = jax.random.normal(keys[2], (1, t, hkv, d))
    rows, cols = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = (rows >= cols) & (rows // chunk == cols // chunk)
    want = _numpy_attention(
        np.asarray(q[0]), np.asarray(k[0]), np.asarray(v[0]), allowed
    )
    got = attention.causal_attention(q, k, v, chunk_size=chunk)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    # Query blocks (rows in several passes) give the same rows.
    blocked = attention.causal_attention(
        q, k, v, query_block=4, chunk_size=chunk
    )
    np.testing.assert_allclose(blocked, got, rtol=1e-6, atol=1e-6)

  def test_temperature_is_one_below_the_floor_then_logarithmic(self):
    floor, strength = 8, 0.1
    p = np.arange(40)
    want = 1.0 + strength * np.log(1.0 + np.floor((p + 1) / floor))
    got = llama4.temperature_scale(jnp.asarray(p), floor, strength)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(got[: floor - 1], 1.0)

  def test_l2_norm_gives_unit_rms(self):
    x = jax.random.normal(jax.random.key(1), (3, 5, 16)) * 7.0
    y = llama4.l2_norm(x, 1e-6)
    np.testing.assert_allclose(
        jnp.sqrt(jnp.mean(y * y, axis=-1)), 1.0, rtol=1e-5
    )

  def test_mean_attended_keys_counts_every_query(self):
    for seq_len, chunk in ((10, 0), (10, 4), (12, 4), (7, 16), (1, 3)):
      brute = np.mean([(p % chunk if chunk else p) + 1 for p in range(seq_len)])
      self.assertAlmostEqual(
          llama4.mean_attended_keys(seq_len, chunk), brute, msg=(seq_len, chunk)
      )

  def test_attention_flops_count_the_chunked_layers_keys(self):
    seq_len = 64
    unchunked = TINY.replace(attention_chunk_size=0)
    got = sizing.flops_per_token(TINY, seq_len)["attention_forward"]
    full = sizing.flops_per_token(unchunked, seq_len)["attention_forward"]
    per_layer_key = 2 * TINY.num_heads * 2 * TINY.head_dim
    rope_layers = sum(map(TINY.uses_rope, range(TINY.num_layers)))
    saved = (
        rope_layers
        * per_layer_key
        * ((seq_len + 1) / 2 - llama4.mean_attended_keys(seq_len, 16))
    )
    self.assertAlmostEqual(got, full - saved, delta=1e-6 * full)


class ModelTest(absltest.TestCase):

  def _model(self, cfg):
    return model_lib.Transformer(
        cfg, backend="xla", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )

  def _logits(self, cfg, tokens):
    """The model's logits for tokens [B, T], traced and run once (jitted:
    eager dispatch is slower than a compile here)."""
    graphdef, state = nnx.split(self._model(cfg))
    return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])(state, tokens)

  def test_layers_get_the_pieces_their_index_asks_for(self):
    model = self._model(TINY)
    kinds = [
        (b.is_moe, b.attn.use_rope, b.attn.chunk_size, b.attn.temperature)
        for b in model.blocks
    ]
    self.assertEqual(
        kinds,
        [
            (False, True, 16, None),
            (True, True, 16, None),
            (False, True, 16, None),
            (True, False, 0, (8, 0.1)),
        ],
    )

  def test_every_piece_changes_the_output(self):
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, 256)
    logits = self._logits(TINY, tokens)
    for change in (
        dict(qk_norm="none"),
        dict(attention_chunk_size=0),
        dict(attn_temperature_scale=0.0),
        dict(attn_temperature_floor=0, nope_layer_interval=0),
    ):
      other = self._logits(TINY.replace(**change), tokens)
      with self.subTest(**change):
        self.assertGreater(float(jnp.max(jnp.abs(other - logits))), 1e-4)
    self.assertTrue(bool(jnp.all(jnp.isfinite(logits))))

  def test_is_causal(self):
    tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, 256)
    # Row 1 differs from row 0 from position 30 on.
    tokens = tokens.at[1].set(tokens[0]).at[1, 30].add(1) % 256
    logits = self._logits(TINY, tokens)
    np.testing.assert_allclose(
        logits[0, :30], logits[1, :30], rtol=1e-5, atol=1e-5
    )
    self.assertGreater(float(jnp.max(jnp.abs(logits[0] - logits[1]))), 1e-4)


class TrainTest(absltest.TestCase):

  def test_tiny_llama4_trains_with_finite_falling_loss(self):
    preset = presets.get_preset("tiny_llama4")
    run = small_runs.small_run(
        small_runs.temp_dir(self),
        model=preset.model,
        scan_layers=False,
        steps=8,
        batch_size=4,
        seq_len=48,
        warmup_steps=2,
        aux_loss_weight=preset.train.aux_loss_weight,
    )
    losses = small_runs.step_losses(run)
    self.assertTrue(np.all(np.isfinite(losses)), losses)
    # At initialisation the loss is near log(256) = 5.5 nats (uniform).
    self.assertLess(np.mean(losses[-3:]), losses[0] - 0.5, losses)


if __name__ == "__main__":
  absltest.main()
