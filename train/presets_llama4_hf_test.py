"""Llama 4 presets against transformers' own model, built on the meta device.

Independent of `train/sizing.py`: transformers (5.24) builds Llama 4 from
its released config on torch's meta device (shapes only, nothing
allocated), and its parameters are counted module by module. The presets'
counts must equal them exactly; the published figures count the
multimodal model, whose vision encoder and projector
(`published.LLAMA4_VISION_PARAMS`) are counted here too.
"""

from absl.testing import absltest
from absl.testing import parameterized

from train import presets
from train import published
from train import sizing

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


if __name__ == "__main__":
  absltest.main()
