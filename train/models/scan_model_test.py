"""The scanned transformer is the unrolled one, and traces once per stack."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from moe_core import flax as moe_flax
from train import presets
from train.models import scan_model
from train.models import transformer as model_lib
from train.presets import sizing
from train.testing import small_runs

# Three MoE layers after the dense one: per-layer statistics and biases
# that differ from layer to layer.
DEEPER = small_runs.SMALL_DSV3.replace(name="test_deeper", num_layers=4)
MLA = small_runs.SMALL_DSV3.replace(
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
DENSE = small_runs.SMALL_DSV3.replace(name="test_dense", moe=None)
TIED = small_runs.SMALL_DSV3.replace(
    name="test_tied", tie_embeddings=True, qk_norm="head"
)
CONFIGS = (
    ("dsv3", DEEPER),
    ("mla", MLA),
    ("all_dense", DENSE),
    ("tied_qk_norm", TIED),
)


def _models(cfg, seed=3, remat="none"):
  """(unrolled, scanned) from the same seed, float32 compute."""

  def build(kind):
    return kind(
        cfg,
        backend="xla",
        compute_dtype=jnp.float32,
        remat=remat,
        rngs=nnx.Rngs(params=seed),
    )

  return build(model_lib.Transformer), build(scan_model.ScannedTransformer)


def _variables(module) -> list:
  return jax.tree.leaves(nnx.state(module, nnx.Param, moe_flax.CorrectionBias))


def _forward(model):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda tokens: nnx.merge(graphdef, state)(tokens))


def _tokens():
  return jax.random.randint(jax.random.key(1), (2, 16), 0, 256)


class SameModelTest(parameterized.TestCase):

  @parameterized.named_parameters(*CONFIGS)
  def test_same_initial_values_as_the_unrolled_model(self, cfg):
    unrolled, scanned = _models(cfg)
    dense = cfg.num_dense_layers
    for i, block in enumerate(unrolled.blocks):
      stack, row = (
          (scanned.dense_layers, i)
          if i < dense
          else (scanned.moe_layers, i - dense)
      )
      for want, got in zip(_variables(block), _variables(stack)):
        np.testing.assert_array_equal(got[row], want, err_msg=f"layer {i}")
    for name in ("embed", "head"):
      if hasattr(unrolled, name):
        np.testing.assert_array_equal(
            getattr(scanned, name)[...], getattr(unrolled, name)[...]
        )
    self.assertEqual(
        sum(x.size for x in _variables(scanned)),
        sizing.param_counts(cfg).total,
    )

  @parameterized.named_parameters(*CONFIGS)
  def test_same_logits_and_stats_in_float32(self, cfg):
    unrolled, scanned = _models(cfg)
    want_logits, want_stats = _forward(unrolled)(_tokens())
    got_logits, got_stats = _forward(scanned)(_tokens())
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    if cfg.moe is None:
      self.assertIsNone(got_stats)
      return
    self.assertEqual(
        got_stats["tokens_per_expert"].shape,
        (cfg.num_moe_layers, cfg.moe.num_experts),
    )
    np.testing.assert_array_equal(
        got_stats["tokens_per_expert"], want_stats["tokens_per_expert"]
    )

  @parameterized.parameters(*presets.PRESETS)
  def test_every_preset_builds_stacked(self, name):
    cfg = presets.get_preset(name).model
    build = lambda: scan_model.ScannedTransformer(cfg, rngs=nnx.Rngs(0))
    if (
        cfg.linear_attention is not None  # Qwen3-Next's hybrid stack.
        or cfg.moe_layer_interval > 1  # Llama 4's interleaved layers.
        or cfg.nope_layer_interval
        or cfg.deepseek_v4 is not None  # Its layers differ in kind.
    ):
      with self.assertRaisesRegex(ValueError, "--noscan_layers"):
        nnx.eval_shape(build)
      return
    abstract = nnx.eval_shape(build)
    variables = _variables(abstract)
    self.assertEqual(
        sum(math.prod(x.shape) for x in variables),
        sizing.param_counts(cfg).total,
    )
    if cfg.moe is not None:
      # One MoE module per layer of a stacked unit (Gemma 4: of a period).
      modules = abstract.moe_modules()
      self.assertEqual(
          modules[0].w_up.shape[:2],
          (cfg.num_moe_layers // len(modules), cfg.moe.num_experts),
      )


class PerLayerStateTest(absltest.TestCase):

  def test_bias_rule_applies_to_each_layer_with_its_own_loads(self):
    unrolled, scanned = _models(DEEPER)
    _, stats = _forward(scanned)(_tokens())
    counts = stats["tokens_per_expert"]
    self.assertEqual(counts.shape, (3, DEEPER.moe.num_experts))
    self.assertTrue(np.any(np.asarray(counts[0]) != np.asarray(counts[1])))
    for model in (unrolled, scanned):
      model.update_correction_biases(counts, 0.25)
    got = scanned.moe_layers.mlp.correction_bias[...]
    for j, block in enumerate(unrolled.moe_modules()):
      np.testing.assert_array_equal(got[j], block.correction_bias[...])
      load = np.asarray(counts[j], np.float32)
      np.testing.assert_allclose(
          got[j], 0.25 * np.sign(load.mean() - load), atol=1e-7
      )


@functools.lru_cache(maxsize=None)
def _gradients(remat):
  _, scanned = _models(DEEPER, remat=remat)
  graphdef, params, rest = nnx.split(scanned, nnx.Param, ...)
  tokens = _tokens()

  def loss(params):
    logits, _ = nnx.merge(graphdef, params, rest)(tokens)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])

  return jax.jit(jax.grad(loss))(params)


class RematPerLayerTest(parameterized.TestCase):

  @parameterized.parameters("full", "save_moe", "recompute_moe", "offload_moe")
  def test_gradients_equal_no_remat(self, policy):
    want, got = _gradients("none"), _gradients(policy)
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)
    ):
      np.testing.assert_allclose(
          g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
      )


def _traced_equations(cfg, scan_layers: bool) -> int:
  """Top-level equations of the jaxpr of the loss's gradient."""
  kind = scan_model.ScannedTransformer if scan_layers else model_lib.Transformer
  model = nnx.eval_shape(
      lambda: kind(cfg, backend="xla", remat="full", rngs=nnx.Rngs(0))
  )
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jnp.zeros((2, 8), jnp.int32)

  def loss(params):
    return jnp.mean(nnx.merge(graphdef, params, rest)(tokens)[0])

  return len(jax.make_jaxpr(jax.grad(loss))(params).eqns)


class DepthTest(absltest.TestCase):

  def test_program_does_not_grow_with_depth(self):
    # What XLA compiles is what is traced: with the layers scanned, 3 and
    # 12 layers trace to the same program but for the stacks' length.
    shallow = small_runs.SMALL_DSV3.replace(num_layers=3)
    deep = small_runs.SMALL_DSV3.replace(num_layers=12)
    self.assertEqual(
        _traced_equations(deep, scan_layers=True),
        _traced_equations(shallow, scan_layers=True),
    )
    self.assertGreater(
        _traced_equations(deep, scan_layers=False),
        2 * _traced_equations(shallow, scan_layers=False),
    )


if __name__ == "__main__":
  absltest.main()
