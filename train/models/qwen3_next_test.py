"""Qwen3-Next's pieces in the training model: Gated DeltaNet's math against a
per-step loop, the new config fields' checks, and the tiny preset training.

(Parity with transformers' layers and the 80B's counts against the
transformers model are in presets_qwen3_next_hf_test.py, on the torch leg.)
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from train import presets
from train.models import gated_deltanet
from train.models import transformer as model_lib
from train.testing import small_runs

_TINY = presets.get_preset("tiny_qwen3_next").model


def _delta_rule_loop(q, k, v, g, beta):
  """The gated delta rule token by token, head by head, in float64 numpy."""
  b, t, h, dk = q.shape
  out = np.zeros(v.shape)
  for i in range(b):
    for j in range(h):
      state = np.zeros((dk, v.shape[-1]))
      for s in range(t):
        state *= np.exp(g[i, s, j])
        error = v[i, s, j] - state.T @ k[i, s, j]
        state += np.outer(k[i, s, j], beta[i, s, j] * error)
        out[i, s, j] = state.T @ (q[i, s, j] / np.sqrt(dk))
  return out


class GatedDeltaRuleTest(absltest.TestCase):

  def test_scan_matches_a_per_step_loop(self):
    rng = np.random.default_rng(0)
    b, t, h, dk, dv = 2, 11, 3, 5, 4
    q, k = (
        np.asarray(
            gated_deltanet.l2_normalize(rng.standard_normal((b, t, h, dk)))
        )
        for _ in range(2)
    )
    v = rng.standard_normal((b, t, h, dv))
    g = -rng.uniform(0.0, 3.0, (b, t, h))
    beta = rng.uniform(0.0, 1.0, (b, t, h))
    got = gated_deltanet.gated_delta_rule(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta))
    )
    want = _delta_rule_loop(q, k, v, g, beta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def test_full_write_stores_the_value_exactly(self):
    # beta = 1 and no decay: reading with the key just written returns its
    # value, whatever was stored before (the delta rule's correction).
    rng = np.random.default_rng(1)
    k = gated_deltanet.l2_normalize(
        jnp.asarray(rng.standard_normal((1, 4, 1, 8)), jnp.float32)
    )
    v = jnp.asarray(rng.standard_normal((1, 4, 1, 3)), jnp.float32)
    ones = jnp.ones((1, 4, 1))
    out = gated_deltanet.gated_delta_rule(k * 8**0.5, k, v, 0 * ones, ones)
    np.testing.assert_allclose(out, v, rtol=1e-5, atol=1e-5)

  def test_causal_conv_matches_numpy_convolve(self):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 9, 3))
    kernel = rng.standard_normal((4, 3))
    got = gated_deltanet.causal_depthwise_conv(
        jnp.asarray(x, jnp.float32), jnp.asarray(kernel, jnp.float32)
    )
    for i in range(2):
      for c in range(3):
        # np.convolve flips the kernel; the layer's last tap weighs x[t].
        want = np.convolve(x[i, :, c], kernel[::-1, c])[:9]
        np.testing.assert_allclose(got[i, :, c], want, rtol=1e-5, atol=1e-5)


class ConfigTest(parameterized.TestCase):

  def test_layout_alternates_as_the_interval_says(self):
    self.assertEqual(
        [_TINY.is_linear_attention_layer(i) for i in range(4)],
        [True, False, True, False],
    )
    self.assertEqual(_TINY.num_full_attention_layers, 2)
    self.assertEqual(_TINY.rotary_dim, 8)

  @parameterized.named_parameters(
      (
          "interval_without_linear",
          dict(linear_attention=None),
          "full_attention_interval",
      ),
      (
          "linear_without_interval",
          dict(full_attention_interval=0),
          "full_attention_interval >= 1",
      ),
      (
          "rotary_factor_zero",
          dict(partial_rotary_factor=0.0),
          "partial_rotary_factor",
      ),
      ("rotary_width_odd", dict(partial_rotary_factor=3 / 32), "even int"),
      (
          "gate_with_mla",
          dict(
              attention="mla",
              qk_norm="none",
              kv_lora_rank=16,
              qk_nope_head_dim=16,
              qk_rope_head_dim=8,
              v_head_dim=16,
              linear_attention=None,
              full_attention_interval=0,
              partial_rotary_factor=1.0,
          ),
          "attention_output_gate",
      ),
  )
  def test_bad_fields_are_refused_by_name(self, changes, message):
    with self.assertRaisesRegex(ValueError, message):
      _TINY.replace(**changes)

  def test_linear_attention_of_the_wrong_type_is_refused(self):
    with self.assertRaisesRegex(TypeError, "DeltaNetConfig"):
      _TINY.replace(linear_attention={"num_key_heads": 2})

  def test_bad_deltanet_widths_are_refused(self):
    with self.assertRaisesRegex(ValueError, "multiple of num_key_heads"):
      gated_deltanet.DeltaNetConfig(2, 3, 8, 8)
    with self.assertRaisesRegex(ValueError, "conv_kernel"):
      gated_deltanet.DeltaNetConfig(2, 4, 8, 8, conv_kernel=0)


class TinyModelTest(absltest.TestCase):

  def test_is_causal(self):
    model = model_lib.Transformer(
        _TINY, backend="xla", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 256)
    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % 256)
    forward = nnx.jit(lambda m, x: m(x))
    logits, stats = forward(model, tokens)
    logits_changed, _ = forward(model, changed)
    np.testing.assert_allclose(logits[:, :7], logits_changed[:, :7], atol=1e-5)
    self.assertGreater(float(jnp.abs(logits - logits_changed)[:, 7:].max()), 0)
    self.assertEqual(stats["tokens_per_expert"].shape, (4, 16))

  def test_training_program_lowers_the_loss(self):
    run = small_runs.small_run(
        small_runs.temp_dir(self),
        model=_TINY,
        scan_layers=False,
        steps=12,
        batch_size=4,
        seq_len=32,
        warmup_steps=2,
    )
    losses = small_runs.step_losses(run)
    self.assertTrue(np.all(np.isfinite(losses)), losses)
    # Near log(256) = 5.5 nats at first; a dozen steps learn the bytes'
    # frequencies.
    self.assertGreater(losses[0], 5.0)
    self.assertLess(np.mean(losses[-3:]), losses[0] - 1.0, losses)


if __name__ == "__main__":
  absltest.main()
