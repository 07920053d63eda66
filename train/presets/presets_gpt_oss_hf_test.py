"""The GPT-OSS presets against transformers' own GPT-OSS model.

transformers builds `GptOssForCausalLM` from the released configuration
on the meta device (shapes only, nothing allocated); its parameter count,
component by component, must equal `sizing.py`'s count of our
preset. Also checks our YaRN frequencies against transformers'.

Needs torch and transformers (the py311-jax0.10 leg); skips elsewhere.
"""

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from train import presets
from train.models import layers
from train.models import model_config
from train.models import sink_attention
from train.presets import sizing

try:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers import modeling_rope_utils  # pylint: disable=g-import-not-at-top
except ImportError as error:  # The other legs have no torch.
  torch = transformers = modeling_rope_utils = None
  _IMPORT_ERROR = str(error)

# The released config.json of each model, as far as it differs from
# GptOssConfig's defaults (which are gpt-oss-120b's): the layer and expert
# counts of gpt-oss-20b. Everything else (width 2880, 64 heads of 64, 8 KV
# heads, vocab 201088, top-4, sliding window 128 on alternate layers, YaRN
# factor 32 over 4096, rope_theta 150000) is the same in both.
RELEASED = {
    "gpt_oss_20b": dict(num_hidden_layers=24, num_local_experts=32),
    "gpt_oss_120b": dict(num_hidden_layers=36, num_local_experts=128),
}


def _hf_config(name):
  return transformers.GptOssConfig(**RELEASED[name])


def _hf_counts(name) -> dict[str, int]:
  """transformers' parameter counts of the model, by component."""
  with torch.device("meta"):
    model = transformers.GptOssForCausalLM(_hf_config(name))
  counts = dict.fromkeys(("embedding", "head", "attention", "moe", "norms"), 0)
  for path, param in model.named_parameters():
    if path.startswith("model.embed_tokens."):
      part = "embedding"
    elif path.startswith("lm_head."):
      part = "head"
    elif ".self_attn." in path:
      part = "attention"
    elif ".mlp." in path:
      part = "moe"
    else:
      part = "norms"  # input/post-attention layernorms and the final norm.
    counts[part] += param.numel()
  return counts


class CountsTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if torch is None:
      self.skipTest(f"needs torch and transformers: {_IMPORT_ERROR}")

  @parameterized.parameters(*RELEASED)
  def test_released_config_matches_the_preset(self, name):
    hf = _hf_config(name)
    cfg = presets.get_preset(name).model
    self.assertEqual(cfg.num_layers, hf.num_hidden_layers)
    self.assertEqual(cfg.moe.num_experts, hf.num_local_experts)
    self.assertEqual(cfg.moe.top_k, hf.num_experts_per_tok)
    self.assertEqual(cfg.moe.expert_ffn_size, hf.intermediate_size)
    self.assertEqual(cfg.moe.swiglu_alpha, hf.swiglu_alpha)
    self.assertEqual(cfg.moe.swiglu_limit, hf.swiglu_limit)
    self.assertEqual(
        (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads),
        (
            hf.vocab_size,
            hf.hidden_size,
            hf.num_attention_heads,
            hf.num_key_value_heads,
        ),
    )
    self.assertEqual(cfg.head_dim, hf.head_dim)
    self.assertEqual(cfg.tie_embeddings, hf.tie_word_embeddings)
    self.assertEqual(cfg.attention_bias, hf.attention_bias)
    self.assertEqual(cfg.norm_eps, hf.rms_norm_eps)
    windows = [
        hf.sliding_window if kind == "sliding_attention" else 0
        for kind in hf.layer_types
    ]
    self.assertEqual(
        [cfg.attention_window(i) for i in range(cfg.num_layers)], windows
    )
    rope = hf.rope_parameters
    self.assertEqual(rope["rope_type"], "yarn")
    self.assertEqual(cfg.rope_theta, rope["rope_theta"])
    self.assertEqual(cfg.yarn.factor, rope["factor"])
    self.assertEqual(
        cfg.yarn.original_max_positions,
        rope["original_max_position_embeddings"],
    )
    self.assertEqual(
        (cfg.yarn.beta_fast, cfg.yarn.beta_slow, cfg.yarn.truncate),
        (rope["beta_fast"], rope["beta_slow"], rope["truncate"]),
    )

  @parameterized.parameters(*RELEASED)
  def test_parameter_counts_equal_transformers(self, name):
    ours = sizing.param_counts(presets.get_preset(name).model)
    hf = _hf_counts(name)
    self.assertEqual(ours.embedding, hf["embedding"])
    self.assertEqual(ours.head, hf["head"])
    self.assertEqual(ours.attention, hf["attention"])
    self.assertEqual(ours.moe, hf["moe"])
    self.assertEqual(ours.norms, hf["norms"])
    self.assertEqual(ours.total, sum(hf.values()))

  def test_yarn_frequencies_equal_transformers(self):
    name = "gpt_oss_120b"
    cfg = presets.get_preset(name).model
    want, want_scale = modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](
        _hf_config(name), "cpu"
    )
    got, scale = sink_attention.yarn_frequencies(
        cfg.head_dim, cfg.rope_theta, cfg.yarn
    )
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)
    self.assertAlmostEqual(scale, want_scale, places=6)


class AttentionParityTest(absltest.TestCase):
  """Our attention layer against transformers' GptOssAttention (eager)."""

  def setUp(self):
    super().setUp()
    if torch is None:
      self.skipTest(f"needs torch and transformers: {_IMPORT_ERROR}")

  def test_sliding_and_full_layers_equal_transformers(self):
    t, window = 10, 4
    hf_cfg = transformers.GptOssConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        num_local_experts=4,
        intermediate_size=16,
        vocab_size=64,
        max_position_embeddings=32,
        sliding_window=window,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,
        },
    )
    hf_cfg._attn_implementation = "eager"  # pylint: disable=protected-access
    ours_cfg = model_config.ModelConfig(
        name="parity",
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dense_ffn_size=16,
        rope_theta=150000.0,
        attention_bias=True,
        attention_sinks=True,
        sliding_window=window,
        full_attention_every=2,
        yarn=model_config.YarnRope(
            factor=4.0, original_max_positions=8, truncate=False
        ),
    )
    torch.manual_seed(0)
    x = torch.randn(1, t, 32)
    positions = torch.arange(t)[None]
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(
        hf_cfg
    )
    cos_sin = rotary(x, positions)
    for layer in (0, 1):  # Layer 0 slides, layer 1 attends fully.
      with self.subTest(layer=layer):
        hf = transformers.models.gpt_oss.modeling_gpt_oss.GptOssAttention(
            hf_cfg, layer
        )
        with torch.no_grad():
          for param in hf.parameters():
            param.copy_(0.5 * torch.randn_like(param))
        distance = positions[0][:, None] - positions[0][None, :]
        visible = distance >= 0
        if hf.sliding_window:
          visible &= distance < hf.sliding_window
        mask = torch.where(visible, 0.0, float("-inf"))[None, None]
        with torch.no_grad():
          want, _ = hf(x, cos_sin, mask)
        ours = sink_attention.SinkAttention(
            ours_cfg, rngs=nnx.Rngs(0), weight=layers.weight
        )
        np_of = lambda tensor: jnp.asarray(tensor.detach().numpy())
        for name, proj in (
            ("q", hf.q_proj),
            ("k", hf.k_proj),
            ("v", hf.v_proj),
            ("o", hf.o_proj),
        ):
          getattr(ours, "w" + name)[...] = np_of(proj.weight.T)
          getattr(ours, "b" + name)[...] = np_of(proj.bias)
        ours.sinks[...] = np_of(hf.sinks)
        got = ours(np_of(x), jnp.arange(t), layer)
        np.testing.assert_allclose(got, want.numpy(), rtol=2e-4, atol=2e-4)


if __name__ == "__main__":
  absltest.main()
