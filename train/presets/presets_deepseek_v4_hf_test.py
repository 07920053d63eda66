"""DeepSeek-V4's counts against transformers' own model, built on `meta`.

transformers 5.24.0's DeepseekV4ForCausalLM is built from each released
config (the values of its config.json, written out below, independent of
`train/presets/`) on the meta device, which allocates nothing; its
parameters are counted by part and compared with `sizing.py`'s count
of our preset. The one convention apart: transformers keeps the correction
bias and the hash table (tid2eid) as buffers, our model as routing state
that `sizing` counts (as it does DeepSeek-V3's bias), so the buffers are
added to the MoE part. Runs on the leg with torch (py311-jax0.10); skips
elsewhere.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized

from train import presets
from train.presets import sizing
from train.testing import small_runs

try:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  _IMPORT_ERROR = None
except ImportError as e:  # Skipped in setUp, with this reason.
  torch = transformers = None
  _IMPORT_ERROR = e

_SKIP_REASON = (
    "needs torch and transformers, which only the py311-jax0.10 leg "
    f"installs (tools/test.sh --leg=py311-jax0.10): {_IMPORT_ERROR}"
)


def _alternating(first: list[int], num_layers: int) -> list[int]:
  """compress_ratios: `first`, then 4 on even and 128 on odd layers, then
  the MTP layer's 0 (as both released config.json files have them)."""
  rest = [4 if i % 2 == 0 else 128 for i in range(len(first), num_layers)]
  return first + rest + [0]


# The released config.json values that shape the parameters (the rest are
# DeepseekV4Config's defaults, equal to them).
_RELEASED = {
    "deepseek_v4_flash": dict(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        num_key_value_heads=1,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=6,
        moe_intermediate_size=2048,
        num_hash_layers=3,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        hc_mult=4,
        compress_ratios=_alternating([0, 0], 43),
    ),
    "deepseek_v4_pro": dict(
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=1,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=6,
        moe_intermediate_size=3072,
        num_hash_layers=3,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=1024,
        hc_mult=4,
        compress_ratios=_alternating([128, 128], 61),
    ),
}


# transformers' names -> the part of `sizing.ParamCounts` that counts them.
def _part(name: str) -> str:
  if name.startswith("lm_head"):
    return "head"
  if "embed_tokens" in name:
    return "embedding"
  if ".self_attn." in name:
    return "attention"
  if ".mlp." in name:
    return "moe"
  if "_hc." in name or "hc_head" in name:
    return "hyper_connections"
  return "norms"  # input_layernorm, post_attention_layernorm, model.norm


def _hf_counts(fields: dict) -> dict[str, int]:
  """Parameters (and the two routing buffers) of transformers' model."""
  config = transformers.DeepseekV4Config(**fields)
  with torch.device("meta"):
    model = transformers.DeepseekV4ForCausalLM(config)
  counts = dict.fromkeys(
      ("embedding", "head", "attention", "moe", "hyper_connections", "norms"),
      0,
  )
  for name, param in model.named_parameters():
    counts[_part(name)] += param.numel()
  for name, buffer in model.named_buffers():
    if name.endswith(("e_score_correction_bias", "tid2eid")):
      counts["moe"] += buffer.numel()
  return counts


class DeepseekV4CountsTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if _IMPORT_ERROR is not None:
      self.skipTest(_SKIP_REASON)

  def _assert_counts_equal(self, name, fields):
    ours = sizing.param_counts(presets.get_preset(name).model)
    theirs = _hf_counts(fields)
    for part, count in theirs.items():
      self.assertEqual(getattr(ours, part), count, f"{name}: {part}")
    self.assertEqual(ours.dense_mlp, 0)
    self.assertEqual(ours.total, sum(theirs.values()))

  @parameterized.parameters("deepseek_v4_flash", "deepseek_v4_pro")
  def test_released_config_counts_as_transformers_does(self, name):
    self._assert_counts_equal(name, _RELEASED[name])

  def test_flash_is_transformers_default_config_but_for_its_layer_map(self):
    # DeepseekV4Config() is Flash but for the attention map (its default is
    # Pro's: two HCA layers first); with Flash's map it is the release.
    default = transformers.DeepseekV4Config()
    released = transformers.DeepseekV4Config(**_RELEASED["deepseek_v4_flash"])
    # The legacy fields are folded into others: compared there.
    legacy = ("compress_ratios", "qk_rope_head_dim", "num_hash_layers")
    for field in _RELEASED["deepseek_v4_flash"]:
      if field not in legacy:
        self.assertEqual(getattr(default, field), getattr(released, field))
    self.assertEqual(default.qk_rope_head_dim, released.qk_rope_head_dim)
    self.assertEqual(default.mlp_layer_types, released.mlp_layer_types)
    self.assertNotEqual(default.layer_types, released.layer_types)

  def test_tiny_preset_counts_as_transformers_does(self):
    cfg = presets.get_preset("tiny_deepseek_v4").model
    self._assert_counts_equal(
        "tiny_deepseek_v4", small_runs.deepseek_v4_hf_fields(cfg)
    )

  def test_preset_layer_maps_are_the_released_ones(self):
    for name, fields in _RELEASED.items():
      with self.subTest(name):
        config = transformers.DeepseekV4Config(**fields)
        ours = presets.get_preset(name).model.deepseek_v4.layer_types
        self.assertEqual(
            [small_runs.DEEPSEEK_V4_HF_LAYER_TYPES[t] for t in ours],
            config.layer_types,
        )


if __name__ == "__main__":
  absltest.main()
