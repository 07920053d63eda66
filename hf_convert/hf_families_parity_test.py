"""moe_layer against every supported transformers MoE family, in float32.

One case per family of `hf_convert.families.SUPPORTED`: the
family's sparse block is built directly from its class (not a whole model)
with a small config (D=32, F=48, E=16, K=4, 4 groups of which 2 are kept,
scaling 2.5 where the family scales) and seeded random weights, run in
torch, converted with `hf_convert`, and run through `moe_core.moe_layer` on
"reference" and "xla". The experts each token is sent to (read where the
block calls its expert bank) must be the same set, and the outputs must
agree to float32 rounding. `python -m hf_convert.report` prints
the same comparison as a table. The six original families keep their
detailed cases (router logits, combine weights, DeepSeek corner cases) in
`hf_parity_test.py`.
"""

from __future__ import annotations

import types

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import hf_convert
from hf_convert import families
from hf_convert import parity

_BACKENDS = ("reference", "xla")

# Other settings of the families whose routers have switches (HF config
# fields); the defaults are covered by the per-family cases.
_VARIANTS = (
    (
        "cohere2_moe_sum",
        "cohere2_moe",
        dict(shared_expert_combination_strategy="sum"),
    ),
    (
        "cohere2_moe_sigmoid",
        "cohere2_moe",
        dict(expert_selection_fn="sigmoid", norm_topk_prob=True),
    ),
    (
        "cohere2_moe_sigmoid_no_norm",
        "cohere2_moe",
        dict(expert_selection_fn="sigmoid", norm_topk_prob=False),
    ),
    ("deepseek_v2_greedy", "deepseek_v2", dict(topk_method="greedy")),
    (
        "dbrx_no_norm",
        "dbrx",
        dict(
            ffn_config=parity.dbrx_ffn_config(moe_normalize_expert_weights=None)
        ),
    ),
    (
        "dbrx_p2",
        "dbrx",
        dict(
            ffn_config=parity.dbrx_ffn_config(moe_normalize_expert_weights=2.0)
        ),
    ),
    ("flint_no_norm", "flint", dict(norm_topk_prob=False)),
    ("hy_v4_no_shared", "hy_v4", dict(n_shared_experts=0)),
    (
        "lfm2_moe_no_bias_no_norm",
        "lfm2_moe",
        dict(use_expert_bias=False, norm_topk_prob=False),
    ),
    ("mistral4_no_norm", "mistral4", dict(norm_topk_prob=False)),
    (
        "glm4_moe_no_norm_gelu",
        "glm4_moe",
        dict(norm_topk_prob=False, hidden_act="gelu"),
    ),
    ("qwen3_next_no_norm", "qwen3_next", dict(norm_topk_prob=False)),
    ("nemotron_h_relu", "nemotron_h", dict(mlp_hidden_act="relu")),
    # fc1/fc2 latent projections around the experts, the shared expert at D.
    ("nemotron_h_latent", "nemotron_h", dict(moe_latent_size=16)),
    # mlp_bias: biased shared expert (and latent projections).
    ("nemotron_h_mlp_bias", "nemotron_h", dict(mlp_bias=True)),
    (
        "nemotron_h_latent_mlp_bias",
        "nemotron_h",
        dict(moe_latent_size=16, mlp_bias=True),
    ),
    ("deepseek_v4_mlp_bias", "deepseek_v4", dict(mlp_bias=True)),
    # A soft-cap tight enough to bend logits of std ~1.7.
    ("laguna_softcap", "laguna", dict(moe_router_logit_softcapping=1.0)),
    ("longcat_flash_no_zero_experts", "longcat_flash", dict(zero_expert_num=0)),
    ("kolibri1_no_norm", "kolibri1", dict(norm_topk_prob=False)),
    (
        "deepseek_v4_scored_layer",
        "deepseek_v4",
        dict(mlp_layer_types=["moe", "moe"]),
    ),
    (
        "granitemoe_swa_no_shared",
        "granitemoe_swa",
        dict(shared_intermediate_size=0),
    ),
)

# Settings of supported families that need a missing switch: (name,
# model_type, HF config fields, layer_idx, the switch the error must name).
_REFUSED_SETTINGS = (
    (
        "axk2_groups",
        "axk2",
        dict(n_group=4, topk_group=2),
        None,
        families.ZERO_FILLED_GROUPS,
    ),
    (
        "step3p7_clamped_layer",
        "step3p7",
        dict(
            swiglu_limits=[0.0, 7.0],
            swiglu_limits_shared=[0.0, 16.0],
            num_hidden_layers=2,
        ),
        1,
        families.CLAMP_AFTER_ACTIVATION,
    ),
)


class HfFamiliesParityTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if parity.IMPORT_ERROR is not None:
      self.skipTest(parity.SKIP_REASON)

  def _assert_parity(self, model_type, **overrides):
    result = parity.compare(model_type, backends=_BACKENDS, **overrides)
    for backend, error in result.errors.items():
      self.assertLessEqual(
          error, parity.TOLERANCE * result.scale, f"{backend}: max abs error"
      )
    self.assertIsNotNone(result.ids_hf, "the block's expert ids")
    np.testing.assert_array_equal(
        np.sort(result.ids, -1), np.sort(result.ids_hf, -1)
    )

  @parameterized.named_parameters(
      (model_type, model_type) for model_type in families.SUPPORTED
  )
  def test_matches_hf_block(self, model_type):
    self._assert_parity(model_type)

  @parameterized.named_parameters(*_VARIANTS)
  def test_matches_hf_block_variant(self, model_type, overrides):
    self._assert_parity(model_type, **overrides)

  @parameterized.named_parameters(
      (model_type, model_type) for model_type in families.UNSUPPORTED
  )
  def test_refuses_unsupported_family_naming_its_switches(self, model_type):
    family = families.BY_MODEL_TYPE[model_type]
    hf_cfg = parity.hf_config(model_type)
    with self.assertRaisesRegex(NotImplementedError, model_type) as raised:
      hf_convert.moe_config_from_hf(hf_cfg)
    for switch in family.lacks:
      self.assertIn(switch, str(raised.exception))

  @parameterized.named_parameters(*_REFUSED_SETTINGS)
  def test_refuses_setting_naming_its_switch(
      self, model_type, overrides, layer_idx, switch
  ):
    hf_cfg = parity.hf_config(model_type, **overrides)
    with self.assertRaisesRegex(NotImplementedError, model_type) as raised:
      hf_convert.moe_config_from_hf(hf_cfg, layer_idx=layer_idx)
    self.assertIn(switch, str(raised.exception))

  def test_step3p7_unclamped_layer_converts(self):
    hf_cfg = parity.hf_config(
        "step3p7",
        swiglu_limits=[0.0, 7.0],
        swiglu_limits_shared=[0.0, 16.0],
        num_hidden_layers=2,
    )
    cfg = hf_convert.moe_config_from_hf(hf_cfg, layer_idx=0)
    self.assertEqual(cfg.num_experts, parity.E)
    with self.assertRaisesRegex(ValueError, "layer_idx must be given"):
      hf_convert.moe_config_from_hf(hf_cfg)

  def test_deepseek_v4_layer_kinds(self):
    hf_cfg = parity.hf_config("deepseek_v4")  # A hash layer, then a scored.
    hashed = hf_convert.moe_config_from_hf(hf_cfg, layer_idx=0)
    scored = hf_convert.moe_config_from_hf(hf_cfg, layer_idx=1)
    self.assertEqual(hashed.hash_vocab_size, hf_cfg.vocab_size)
    self.assertFalse(hashed.correction_bias)
    self.assertEqual(scored.hash_vocab_size, 0)
    self.assertTrue(scored.correction_bias)
    with self.assertRaisesRegex(ValueError, "layer_idx must be given"):
      hf_convert.moe_config_from_hf(hf_cfg)

  def test_gpt_oss_layout_needs_the_model_type(self):
    hf_cfg, block, _ = parity.build_block("gpt_oss")
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    state = dict(block.state_dict())
    with self.assertRaisesRegex(
        ValueError, r"model_type must be one of .*got model_type=None"
    ):
      hf_convert.params_from_hf(state, cfg)
    interleaved = hf_convert.params_from_hf(state, cfg, model_type="gpt_oss")
    fused = state["experts.gate_up_proj"].numpy()
    np.testing.assert_array_equal(interleaved["w_gate"], fused[:, :, ::2])
    np.testing.assert_array_equal(interleaved["w_up"], fused[:, :, 1::2])

  def test_hunyuan_per_layer_counts(self):
    # HunYuan's modeling code reads per-layer lists; its config class
    # types them as int, so a plain object with the attributes stands in.
    hf_cfg = types.SimpleNamespace(
        model_type="hunyuan_v1_moe",
        hidden_size=parity.D,
        intermediate_size=parity.F,
        hidden_act="silu",
        num_experts=[8, 16],
        moe_topk=[2, 4],
    )
    cfg = hf_convert.moe_config_from_hf(hf_cfg, layer_idx=1)
    self.assertEqual((cfg.num_experts, cfg.top_k), (16, 4))
    with self.assertRaisesRegex(ValueError, "layer_idx must be given"):
      hf_convert.moe_config_from_hf(hf_cfg)

  def test_granite_shared_mlp_from_a_whole_model_state_dict(self):
    # The decoder layer holds block_sparse_moe and shared_mlp side by side.
    hf_cfg, block, shared = parity.build_block("granitemoeshared")
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    layer = "model.layers.3."
    state = {
        f"{layer}block_sparse_moe.{k}": v for k, v in block.state_dict().items()
    }
    state.update(
        {f"{layer}shared_mlp.{k}": v for k, v in shared.state_dict().items()}
    )
    got = hf_convert.params_from_hf(
        state, cfg, prefix=f"{layer}block_sparse_moe.", shared_prefix=layer
    )
    merged = dict(block.state_dict())
    merged.update(
        {f"shared_mlp.{k}": v for k, v in shared.state_dict().items()}
    )
    want = hf_convert.params_from_hf(merged, cfg)
    self.assertEqual(sorted(got), sorted(want))
    fused = shared.state_dict()["input_linear.weight"].numpy()
    np.testing.assert_array_equal(
        want["shared_w_up"], fused[cfg.shared_ffn_size :].T
    )
    for name in want:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)

  @parameterized.named_parameters(
      ("aria", "aria", "AriaConfig"),
      ("qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoeConfig"),
      ("glm4v_moe", "glm4v_moe", "Glm4vMoeConfig"),
  )
  def test_multimodal_config_uses_its_text_config(self, model_type, top_level):
    configuration = parity.configuration_module(model_type)
    top = getattr(configuration, top_level)()
    self.assertEqual(
        hf_convert.moe_config_from_hf(top),
        hf_convert.moe_config_from_hf(top.text_config),
    )

  @parameterized.named_parameters(
      ("hidden_act", "qwen3_moe", dict(hidden_act="relu"), "hidden_act"),
      (
          "dbrx_ffn_act_fn",
          "dbrx",
          dict(ffn_config=parity.dbrx_ffn_config(ffn_act_fn=dict(name="relu"))),
          r"ffn_config.ffn_act_fn\['name'\]",
      ),
  )
  def test_unknown_activation_names_the_field(self, model_type, fields, name):
    hf_cfg = parity.hf_config(model_type, **fields)
    with self.assertRaisesRegex(NotImplementedError, f"{name} .*'relu'"):
      hf_convert.moe_config_from_hf(hf_cfg)

  def test_missing_router_or_bias_names_the_keys(self):
    hf_cfg, block, _ = parity.build_block("deepseek_v3")
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    state = dict(block.state_dict())
    del state["gate.e_score_correction_bias"]
    with self.assertRaisesRegex(
        ValueError, r"correction_bias=True needs one of .*gate\.e_score"
    ):
      hf_convert.params_from_hf(state, cfg)
    del state["gate.weight"]
    with self.assertRaisesRegex(ValueError, r"no router matrix .*gate\.weight"):
      hf_convert.params_from_hf(state, cfg)

  def test_every_family_without_lacks_has_a_converter(self):
    self.assertEqual(
        hf_convert.SUPPORTED_MODEL_TYPES, tuple(sorted(families.SUPPORTED))
    )

  def test_every_family_names_its_block_and_config_classes(self):
    for family in families.FAMILIES:
      with self.subTest(family.model_type):
        modeling = parity.modeling_module(family.model_type)
        configuration = parity.configuration_module(family.model_type)
        self.assertTrue(hasattr(modeling, family.block), family.block)
        self.assertTrue(hasattr(configuration, family.config), family.config)

  def test_table_covers_every_transformers_moe_family(self):
    self.assertEqual(
        sorted(parity.transformers_moe_families()),
        sorted(f.model_type for f in families.FAMILIES),
    )


if __name__ == "__main__":
  absltest.main()
