"""Llama 4 presets against transformers' own model.

Independent of `sizing.py`: transformers (5.24) builds Llama 4 from
its released config on torch's meta device (shapes only, nothing
allocated), and its parameters are counted module by module. The presets'
counts must equal them exactly; the published figures count the
multimodal model, whose vision encoder and projector
(`published.LLAMA4_VISION_PARAMS`) are counted here too. And a small
Llama 4 with every piece (interleaved MoE, NoPE layers, L2 QK-norm, chunked
attention, temperature tuning) computes transformers' logits from the same
weights.
"""

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from moe_core import flax as moe_flax
from train import presets
from train.models import transformer as model_lib
from train.presets import published
from train.presets import sizing

try:
  import torch  # pylint: disable=g-import-not-at-top
  from transformers.models.llama4 import configuration_llama4  # pylint: disable=g-import-not-at-top
  from transformers.models.llama4 import modeling_llama4  # pylint: disable=g-import-not-at-top

  _IMPORT_ERROR = None
except ImportError as e:  # Skipped in setUp, with this reason.
  torch = configuration_llama4 = modeling_llama4 = None
  _IMPORT_ERROR = e

_SKIP_REASON = (
    "needs torch and transformers, which only the py311-jax0.10 leg "
    f"installs (tools/test.sh --leg=py311-jax0.10): {_IMPORT_ERROR}"
)

# text_config of the released config.json files, where it differs from
# Llama4TextConfig's defaults (which are Scout's: 5120 wide, 48 layers, 40
# query and 8 KV heads of 128, vocab 202048, expert width 8192, dense width
# 16384, top-1, NoPE every 4th layer, chunks of 8192, temperature tuning with
# floor 8192 and scale 0.1, rms_norm_eps 1e-5, rope_theta 500000).
_TEXT_CONFIGS = {
    "llama4_scout": dict(
        num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True
    ),
    "llama4_maverick": dict(
        num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False
    ),
}
# vision_config of both released config.json files.
_VISION_CONFIG = dict(
    hidden_size=1408,
    intermediate_size=5632,
    num_attention_heads=16,
    num_hidden_layers=34,
    image_size=336,
    patch_size=14,
    pixel_shuffle_ratio=0.5,
    projector_input_dim=4096,
    projector_output_dim=4096,
    vision_output_dim=4096,
    multi_modal_projector_bias=False,
)


def _count(module) -> int:
  return sum(p.numel() for p in module.parameters())


class Llama4AgainstTransformersTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if torch is None:
      self.skipTest(_SKIP_REASON)

  def _text_config(self, name):
    return configuration_llama4.Llama4TextConfig(**_TEXT_CONFIGS[name])

  @parameterized.parameters(*_TEXT_CONFIGS)
  def test_preset_has_the_released_config(self, name):
    hf = self._text_config(name)
    cfg = presets.get_preset(name).model
    self.assertEqual(
        (
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.dense_ffn_size,
            cfg.moe.expert_ffn_size,
            cfg.moe.shared_ffn_size,
            cfg.moe.num_experts,
            cfg.moe.top_k,
            cfg.qk_norm == "l2",
            cfg.attention_chunk_size,
            cfg.attn_temperature_floor,
            cfg.attn_temperature_scale,
            cfg.norm_eps,
            cfg.rope_theta,
            cfg.tie_embeddings,
        ),
        (
            hf.vocab_size,
            hf.hidden_size,
            hf.num_hidden_layers,
            hf.num_attention_heads,
            hf.num_key_value_heads,
            hf.head_dim,
            hf.intermediate_size_mlp,
            hf.intermediate_size,
            hf.intermediate_size,
            hf.num_local_experts,
            hf.num_experts_per_tok,
            hf.use_qk_norm,
            hf.attention_chunk_size,
            hf.floor_scale if hf.attn_temperature_tuning else 0,
            hf.attn_scale,
            hf.rms_norm_eps,
            hf.rope_parameters["rope_theta"],
            hf.tie_word_embeddings,
        ),
    )
    layers = range(cfg.num_layers)
    self.assertEqual(
        [i for i in layers if cfg.is_moe_layer(i)], list(hf.moe_layers)
    )
    self.assertEqual(
        [int(cfg.uses_rope(i)) for i in layers], list(hf.no_rope_layers)
    )
    # transformers chunks the RoPE layers' attention, not the NoPE ones'.
    self.assertEqual(
        [
            "chunked_attention" if cfg.uses_rope(i) else "full_attention"
            for i in layers
        ],
        list(hf.layer_types),
    )

  @parameterized.parameters(*_TEXT_CONFIGS)
  def test_counts_equal_the_transformers_text_model(self, name):
    with torch.device("meta"):
      model = modeling_llama4.Llama4ForCausalLM(self._text_config(name))
    total = _count(model)
    # Active per token: all but the routed experts a top-k choice skips.
    experts = [
        layer.feed_forward.experts
        for layer in model.model.layers
        if layer.is_moe_layer
    ]
    routed = sum(_count(e) for e in experts)
    e, k = model.config.num_local_experts, model.config.num_experts_per_tok
    active = total - routed + routed * k // e
    counts = sizing.param_counts(presets.get_preset(name).model)
    self.assertEqual(counts.total, total)
    self.assertEqual(counts.active, active)

  @parameterized.parameters(*_TEXT_CONFIGS)
  def test_published_total_is_the_multimodal_model(self, name):
    config = configuration_llama4.Llama4Config(
        text_config=_TEXT_CONFIGS[name], vision_config=_VISION_CONFIG
    )
    with torch.device("meta"):
      model = modeling_llama4.Llama4ForConditionalGeneration(config)
    vision = _count(model.vision_model) + _count(model.multi_modal_projector)
    self.assertEqual(vision, published.LLAMA4_VISION_PARAMS)
    self.assertEqual(published.PUBLISHED[name].total_beyond_preset, vision)
    total, _ = published.counts_as_published(name)
    self.assertEqual(total, _count(model))


# A small Llama 4 with every piece: MoE every other layer, NoPE every 4th,
# L2 QK-norm, chunks of 8 and a temperature floor of 4 (a 20-token sequence
# crosses both).
_SMALL_TEXT_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    intermediate_size_mlp=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    use_qk_norm=True,
    no_rope_layer_interval=4,
    attention_chunk_size=8,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_scale=0.1,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _small_model_config(hf):
  return presets.ModelConfig(
      name="small_llama4",
      vocab_size=hf.vocab_size,
      hidden_size=hf.hidden_size,
      num_layers=hf.num_hidden_layers,
      num_heads=hf.num_attention_heads,
      num_kv_heads=hf.num_key_value_heads,
      head_dim=hf.head_dim,
      qk_norm="l2",
      dense_ffn_size=hf.intermediate_size_mlp,
      moe=presets.llama4_moe(
          hf.hidden_size,
          num_experts=hf.num_local_experts,
          expert_ffn_size=hf.intermediate_size,
      ),
      moe_layer_interval=hf.interleave_moe_layer_step,
      nope_layer_interval=hf.no_rope_layer_interval,
      attention_chunk_size=hf.attention_chunk_size,
      attn_temperature_floor=hf.floor_scale,
      attn_temperature_scale=hf.attn_scale,
      rope_theta=hf.rope_parameters["rope_theta"],
      norm_eps=hf.rms_norm_eps,
  )


def _rope_halves(w, head_dim):
  """HF's [out, in] q/k projection -> ours [in, out], RoPE pairs moved.

  transformers rotates the pairs (2i, 2i + 1) of each head, we rotate
  (i, i + d/2) at the same frequency: column 2i goes to i, 2i + 1 to
  i + d/2 (a permutation of both queries and keys, so q.k is unchanged).
  """
  w = w.T.reshape(w.shape[1], -1, head_dim // 2, 2)
  return np.concatenate([w[..., 0], w[..., 1]], axis=-1).reshape(w.shape[0], -1)


def _copy_weights(hf_model, model, head_dim):
  """Sets `model`'s (our Transformer's) parameters to hf_model's."""

  def put(variable, value):
    moe_flax.set_value(variable, jnp.asarray(value, jnp.float32))

  def get(tensor):
    return tensor.detach().numpy()

  put(model.embed, get(hf_model.model.embed_tokens.weight))
  put(model.head, get(hf_model.lm_head.weight).T)
  put(model.final_norm.scale, get(hf_model.model.norm.weight))
  for block, layer in zip(model.blocks, hf_model.model.layers):
    attn = layer.self_attn
    put(block.attn_norm.scale, get(layer.input_layernorm.weight))
    put(block.mlp_norm.scale, get(layer.post_attention_layernorm.weight))
    put(block.attn.wq, _rope_halves(get(attn.q_proj.weight), head_dim))
    put(block.attn.wk, _rope_halves(get(attn.k_proj.weight), head_dim))
    put(block.attn.wv, get(attn.v_proj.weight).T)
    put(block.attn.wo, get(attn.o_proj.weight).T)
    ff = layer.feed_forward
    if not block.is_moe:
      put(block.mlp.w_gate, get(ff.gate_proj.weight).T)
      put(block.mlp.w_up, get(ff.up_proj.weight).T)
      put(block.mlp.w_down, get(ff.down_proj.weight).T)
      continue
    gate, up = np.split(get(ff.experts.gate_up_proj), 2, axis=-1)
    put(block.mlp.router, get(ff.router.weight).T)
    put(block.mlp.w_gate, gate)
    put(block.mlp.w_up, up)
    put(block.mlp.w_down, get(ff.experts.down_proj))
    put(block.mlp.shared_w_gate, get(ff.shared_expert.gate_proj.weight).T)
    put(block.mlp.shared_w_up, get(ff.shared_expert.up_proj.weight).T)
    put(block.mlp.shared_w_down, get(ff.shared_expert.down_proj.weight).T)


class Llama4ForwardParityTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if torch is None:
      self.skipTest(_SKIP_REASON)

  def test_small_model_computes_transformers_logits(self):
    hf_config = configuration_llama4.Llama4TextConfig(**_SMALL_TEXT_CONFIG)
    hf_config._attn_implementation = "eager"  # pylint: disable=protected-access
    torch.manual_seed(0)
    hf_model = modeling_llama4.Llama4ForCausalLM(hf_config).eval()
    with torch.no_grad():
      # Weights of unit-scale activations (the default init's 0.02 would
      # leave every piece's effect below the tolerance); norms near 1.
      for name, p in hf_model.named_parameters():
        if p.ndim == 1:
          p.copy_(1.0 + 0.1 * torch.randn(p.shape))
        else:
          fan_in = p.shape[-2] if "experts" in name else p.shape[-1]
          p.copy_(torch.randn(p.shape) / fan_in**0.5)
    cfg = _small_model_config(hf_config)
    model = model_lib.Transformer(
        cfg, backend="reference", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    _copy_weights(hf_model, model, cfg.head_dim)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
      want = hf_model(torch.as_tensor(tokens)).logits.numpy()
    got, stats = model(jnp.asarray(tokens, jnp.int32))
    self.assertEqual(stats["tokens_per_expert"].shape, (2, 4))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
  absltest.main()
