"""The transformer: parameter layout and counts, causality, remat policies."""

import contextlib
import functools
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

import moe_core
from moe_core import flax as moe_flax
from moe_core import remat as moe_remat
from train import presets
from train.models import attention
from train.models import model_config
from train.models import transformer as model_lib
from train.presets import sizing
from train.testing import small_runs

# A small MLA model with a low-rank query, to check MLA's layout and count.
SMALL_MLA = small_runs.SMALL_DSV3.replace(
    name="test_mla",
    attention="mla",
    num_kv_heads=0,
    head_dim=0,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
)


def _jitted(model):
  """model(tokens) as one jitted function (eager dispatch is slow)."""
  graphdef, state = nnx.split(model)
  return jax.jit(lambda tokens: nnx.merge(graphdef, state)(tokens))


def _abstract_param_count(cfg: model_config.ModelConfig) -> int:
  """Parameters of the model as built, from shapes only (no allocation)."""
  abstract = nnx.eval_shape(
      lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  )
  state = nnx.state(abstract, nnx.Param, moe_flax.CorrectionBias)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


class ParamCountTest(parameterized.TestCase):

  @parameterized.parameters(*presets.PRESETS)
  def test_formula_equals_built_model(self, name):
    cfg = presets.get_preset(name).model
    self.assertEqual(sizing.param_counts(cfg).total, _abstract_param_count(cfg))

  def test_formula_equals_built_model_for_mla_variants(self):
    for cfg in (
        SMALL_MLA,
        SMALL_MLA.replace(q_lora_rank=0),
        small_runs.SMALL_DSV3.replace(qk_norm="full"),
        small_runs.SMALL_DSV3.replace(tie_embeddings=True),
    ):
      with self.subTest(
          f"{cfg.attention} q_lora={cfg.q_lora_rank} "
          f"qk_norm={cfg.qk_norm} tied={cfg.tie_embeddings}"
      ):
        self.assertEqual(
            sizing.param_counts(cfg).total, _abstract_param_count(cfg)
        )

  def test_active_counts_top_k_of_the_routed_experts(self):
    cfg = small_runs.SMALL_DSV3
    counts = sizing.param_counts(cfg)
    moe = cfg.moe
    one_expert = 3 * moe.hidden_size * moe.expert_ffn_size
    unused = cfg.num_moe_layers * (moe.num_experts - moe.top_k) * one_expert
    self.assertEqual(counts.total - counts.active, unused)


class ForwardTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("mha", small_runs.SMALL_DSV3),
      (
          "gqa_head_norm",
          small_runs.SMALL_DSV3.replace(
              num_heads=4, num_kv_heads=2, head_dim=8, qk_norm="head"
          ),
      ),
      ("mla", SMALL_MLA),
  )
  def test_is_causal(self, cfg):
    """Changing token t changes no logit before t.

    Dropless routing decides per token, so the MoE layers keep causality; a
    capacity limit would not (a later token could take an earlier one's slot).
    """
    model = model_lib.Transformer(
        cfg, backend="xla", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 256)
    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % 256)
    forward = _jitted(model)
    a, _ = forward(tokens)
    b, _ = forward(changed)
    np.testing.assert_array_equal(a[:, :7], b[:, :7])
    self.assertGreater(float(jnp.abs(a[:, 7:] - b[:, 7:]).max()), 0.0)

  def test_grouped_attention_matches_a_numpy_loop(self):
    b, t, h, hkv, d, dv = 2, 5, 6, 2, 4, 3
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (b, t, h, d))
    k = jax.random.normal(keys[1], (b, t, hkv, d))
    v = jax.random.normal(keys[2], (b, t, hkv, dv))
    got = attention.causal_attention(q, k, v)
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    want = np.zeros((b, t, h, dv))
    for bi in range(b):
      for hi in range(h):
        kv = hi // (h // hkv)  # Query heads share kv heads in blocks.
        for ti in range(t):
          scores = k[bi, : ti + 1, kv] @ q[bi, ti, hi] / np.sqrt(d)
          weights = np.exp(scores - scores.max())
          weights /= weights.sum()
          want[bi, ti, hi] = weights @ v[bi, : ti + 1, kv]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # In query blocks (as long sequences run), the same rows.
    blocked = attention.causal_attention(*map(jnp.asarray, (q, k, v)), 1)
    np.testing.assert_allclose(blocked, want, rtol=1e-5, atol=1e-5)

  def test_query_blocks_give_the_whole_attention_and_its_gradients(self):
    b, t, h, hkv, d = 2, 64, 4, 2, 8
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (b, t, h, d))
    k = jax.random.normal(keys[1], (b, t, hkv, d))
    v = jax.random.normal(keys[2], (b, t, hkv, d))

    def loss(block):
      return lambda *qkv: jnp.sum(attention.causal_attention(*qkv, block) ** 2)

    whole = jax.value_and_grad(loss(t), (0, 1, 2))(q, k, v)
    blocks = jax.jit(jax.value_and_grad(loss(16), (0, 1, 2)))(q, k, v)
    for a, c in zip(jax.tree.leaves(whole), jax.tree.leaves(blocks)):
      np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5)

  def test_returns_stats_for_moe_layers_only(self):
    cfg = small_runs.SMALL_DSV3
    model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    logits, stats = _jitted(model)(tokens)
    self.assertEqual(logits.shape, (2, 8, 256))
    self.assertEqual(logits.dtype, jnp.float32)
    # One MoE layer (layer 1): its stats stacked [1, ...].
    self.assertEqual(stats["tokens_per_expert"].shape, (1, cfg.moe.num_experts))
    self.assertEqual(
        int(stats["tokens_per_expert"].sum()), 2 * 8 * cfg.moe.top_k
    )
    self.assertEqual(stats["dropped_tokens"].tolist(), [0])

  def test_backends_agree_on_the_forward(self):
    cfg = small_runs.SMALL_DSV3
    model = model_lib.Transformer(
        cfg, backend="xla", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    fast, _ = _jitted(model)(tokens)
    model_lib.set_backend(model, "reference")
    ref, _ = _jitted(model)(tokens)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-4)


def _loss_fn(cfg, remat, backend="xla"):
  model = model_lib.Transformer(
      cfg,
      backend=backend,
      compute_dtype=jnp.float32,
      remat=remat,
      rngs=nnx.Rngs(0),
  )
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)

  def loss(params):
    logits, _ = nnx.merge(graphdef, params, rest)(tokens)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])

  return loss, params


@functools.lru_cache(maxsize=None)
def _gradients(policy):
  loss, params = _loss_fn(small_runs.SMALL_DSV3, policy)
  return jax.jit(jax.grad(loss))(params)


class RematTest(parameterized.TestCase):

  @parameterized.parameters("full", "save_moe", "recompute_moe", "offload_moe")
  def test_gradients_equal_no_remat(self, policy):
    want = _gradients("none")
    got = _gradients(policy)
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)
    ):
      np.testing.assert_allclose(
          g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
      )

  def _saved_names(self, policy):
    if not hasattr(jax.ad_checkpoint, "print_saved_residuals"):
      self.skipTest(
          "jax.ad_checkpoint.print_saved_residuals is missing in "
          f"jax {jax.__version__}."
      )
    loss, params = _loss_fn(small_runs.SMALL_DSV3, policy)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
      jax.ad_checkpoint.print_saved_residuals(loss, params)
    return buffer.getvalue()

  def test_save_moe_keeps_the_named_gemm_outputs(self):
    saved = self._saved_names("save_moe")
    for name in moe_core.backend.CHECKPOINT_NAMES:
      self.assertIn(f"named '{name}'", saved)

  def test_recompute_moe_and_full_drop_them(self):
    for policy in ("recompute_moe", "full"):
      saved = self._saved_names(policy)
      for name in moe_core.backend.CHECKPOINT_NAMES:
        with self.subTest(policy=policy, name=name):
          self.assertNotIn(f"named '{name}'", saved)

  def test_offload_moe_moves_them_to_host(self):
    saved = self._saved_names("offload_moe")
    self.assertIn("<host>", saved)

  def test_unknown_policy_is_refused(self):
    with self.assertRaisesRegex(ValueError, "remat must be one of"):
      moe_remat.policy("sometimes")


if __name__ == "__main__":
  absltest.main()
