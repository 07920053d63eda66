"""MoEConfig: each validation error, and the capacity arithmetic."""

import math

from absl.testing import absltest
from absl.testing import parameterized

from moe_core import config as config_lib

_BASE = dict(num_experts=8, top_k=2, hidden_size=16, expert_ffn_size=32)


def _cfg(**changes):
  fields = dict(_BASE)
  fields.update(changes)
  return config_lib.MoEConfig(**fields)


class ValidationTest(parameterized.TestCase):

  @parameterized.product(
      name=(
          "num_experts",
          "top_k",
          "hidden_size",
          "expert_ffn_size",
          "n_group",
          "topk_group",
      ),
      value=(0, -3, 2.0, True, "4"),
  )
  def test_positive_ints(self, name, value):
    with self.assertRaisesRegex(
        ValueError, rf"^{name} must be a positive int, got {value!r}\.$"
    ):
      _cfg(**{name: value})

  @parameterized.parameters(-1, 1.5, False)
  def test_shared_ffn_size_non_negative_int(self, value):
    with self.assertRaisesRegex(
        ValueError, rf"^shared_ffn_size must be an int >= 0, got {value!r}"
    ):
      _cfg(shared_ffn_size=value)

  def test_top_k_at_most_num_experts(self):
    with self.assertRaisesRegex(
        ValueError,
        r"^top_k must be <= num_experts, got top_k=9, " r"num_experts=8\.$",
    ):
      _cfg(top_k=9)

  @parameterized.parameters(
      (
          "score_func",
          "softplus",
          r"\('softmax', 'sigmoid', 'sqrtsoftplus', 'sparsemixer'\)",
      ),
      ("group_score", "mean", r"\('max', 'sum_top2'\)"),
      (
          "activation",
          "swish",
          r"\('silu', 'gelu', 'gelu_tanh', 'gpt_oss_glu', 'softcapped_silu', "
          r"'relu', 'relu2'\)",
      ),
  )
  def test_choices(self, name, value, choices):
    with self.assertRaisesRegex(
        ValueError, rf"^{name} must be one of {choices}, got '{value}'\.$"
    ):
      _cfg(**{name: value})

  @parameterized.product(
      name=("swiglu_limit", "swiglu_alpha", "gate_softcap", "up_softcap"),
      value=(0.0, -1.0, math.nan, math.inf, True, "7"),
  )
  def test_activation_options_positive_finite(self, name, value):
    with self.assertRaisesRegex(
        ValueError,
        rf"^{name} must be None or a finite number > 0, got {value!r}\.$",
    ):
      _cfg(**{name: value})

  @parameterized.parameters(
      (dict(activation="gpt_oss_glu"), r"needs swiglu_alpha"),
      (
          dict(activation="softcapped_silu", gate_softcap=1.0),
          r"needs up_softcap",
      ),
      (dict(swiglu_alpha=1.702), r"swiglu_alpha is read only by.*gpt_oss"),
      (
          dict(activation="gpt_oss_glu", swiglu_alpha=1.0, up_softcap=2.0),
          r"up_softcap is read only by.*softcapped_silu.*'gpt_oss_glu'",
      ),
      (dict(activation="relu2", swiglu_limit=7.0), r"non-gated"),
  )
  def test_activation_options_match_the_activation(self, changes, message):
    with self.assertRaisesRegex(ValueError, message):
      _cfg(**changes)

  @parameterized.parameters("routing_weights_on_input", "expert_bias")
  def test_ffn_switches_are_bools(self, name):
    with self.assertRaisesRegex(TypeError, rf"^{name} must be a bool, got 1"):
      _cfg(**{name: 1})

  def test_ffn_switches_accept_the_models_settings(self):
    # GPT-OSS, DeepSeek-V4, Inkling 2, Nemotron-H, Llama 4.
    for changes in (
        dict(
            activation="gpt_oss_glu",
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
            expert_bias=True,
        ),
        dict(swiglu_limit=10.0),
        dict(activation="softcapped_silu", gate_softcap=30.0, up_softcap=30.0),
        dict(activation="relu2", shared_ffn_size=8),
        dict(top_k=1, score_func="sigmoid", routing_weights_on_input=True),
    ):
      with self.subTest(**{k: str(v) for k, v in changes.items()}):
        self.assertEqual(_cfg(**changes).replace(), _cfg(**changes))

  def test_n_group_divides_num_experts(self):
    with self.assertRaisesRegex(
        ValueError,
        r"^n_group must divide num_experts, got n_group=3, "
        r"num_experts=8\.$",
    ):
      _cfg(n_group=3)

  def test_topk_group_at_most_n_group(self):
    with self.assertRaisesRegex(
        ValueError,
        r"^topk_group must be <= n_group, got topk_group=3, " r"n_group=2\.$",
    ):
      _cfg(n_group=2, topk_group=3)

  def test_sum_top2_needs_two_experts_per_group(self):
    with self.assertRaisesRegex(
        ValueError,
        r"^group_score='sum_top2' needs at least 2 experts per "
        r"group, got num_experts=8 / n_group=8 = 1\.$",
    ):
      _cfg(n_group=8, topk_group=2, group_score="sum_top2")

  def test_top_k_fits_in_chosen_groups(self):
    with self.assertRaisesRegex(
        ValueError,
        r"^top_k must be <= topk_group \* experts per group .*"
        r"got top_k=3, topk_group=1, experts per group=2\.$",
    ):
      _cfg(top_k=3, n_group=4, topk_group=1)

  def test_shared_gate_needs_shared_expert(self):
    with self.assertRaisesRegex(
        ValueError,
        r"^shared_expert_gate=True needs shared_ffn_size > 0, "
        r"got shared_ffn_size=0\.$",
    ):
      _cfg(shared_expert_gate=True)

  @parameterized.parameters(-1e-6, "0", None, float("inf"), float("nan"))
  def test_norm_epsilon(self, value):
    with self.assertRaisesRegex(
        ValueError,
        rf"^norm_epsilon must be a finite float >= 0, got {value!r}",
    ):
      _cfg(norm_epsilon=value)

  @parameterized.parameters(math.inf, math.nan, "2.5", None)
  def test_routed_scaling_factor(self, value):
    with self.assertRaisesRegex(
        ValueError,
        r"^routed_scaling_factor must be a finite number, got " + repr(value),
    ):
      _cfg(routed_scaling_factor=value)

  @parameterized.product(
      name=("norm_topk_prob", "correction_bias", "shared_expert_gate"),
      value=(1, "yes", None),
  )
  def test_flags_must_be_bools(self, name, value):
    # A truthy non-bool would silently pick a routing variant.
    with self.assertRaisesRegex(
        TypeError, rf"^{name} must be a bool, got {value!r}"
    ):
      _cfg(**{name: value})

  @parameterized.parameters(0, -1.0, "1.25", float("inf"), float("nan"))
  def test_capacity_factor(self, value):
    with self.assertRaisesRegex(
        ValueError,
        r"^capacity_factor must be None \(dropless\) or a finite number "
        rf"> 0, got {value!r}",
    ):
      _cfg(capacity_factor=value)

  def test_valid_configs_construct(self):
    # The routers of the six supported families, at their real sizes.
    _cfg(num_experts=8, top_k=2, norm_topk_prob=True)  # Mixtral
    _cfg(
        num_experts=60, top_k=4, shared_ffn_size=5632, shared_expert_gate=True
    )  # Qwen1.5-MoE
    _cfg(
        num_experts=160,
        top_k=6,
        n_group=8,
        topk_group=3,
        routed_scaling_factor=16.0,
        shared_ffn_size=2 * 1536,
    )  # DS-V2
    _cfg(
        num_experts=256,
        top_k=8,
        score_func="sigmoid",
        correction_bias=True,
        n_group=8,
        topk_group=4,
        group_score="sum_top2",
        norm_topk_prob=True,
        norm_epsilon=1e-20,
        routed_scaling_factor=2.5,
        shared_ffn_size=2048,
    )  # DeepSeek-V3

  def test_frozen_and_replace_revalidates(self):
    cfg = _cfg()
    with self.assertRaises(AttributeError):
      cfg.top_k = 3  # pytype: disable=not-writable
    self.assertEqual(cfg.replace(top_k=3).top_k, 3)
    with self.assertRaisesRegex(ValueError, r"top_k must be <= num_experts"):
      cfg.replace(top_k=9)


class CapacityTest(parameterized.TestCase):

  def test_dropless_has_no_capacity(self):
    cfg = _cfg()
    self.assertTrue(cfg.dropless)
    self.assertIsNone(cfg.expert_capacity(1000))

  @parameterized.parameters(
      # (capacity_factor, tokens, top_k, experts, ceil(cf * T * K / E))
      (1.0, 64, 2, 8, 16),
      (1.25, 64, 2, 8, 20),
      (1.25, 10, 2, 8, 4),  # 3.125 rounds up
      (2.0, 7, 1, 8, 2),  # 1.75 rounds up
      (0.01, 3, 1, 8, 1),  # never below one slot
      # Never above the T * K copies: a huge factor is no int32 overflow.
      (1e38, 10, 2, 8, 20),
      (1.7e308, 10, 2, 8, 20),
  )
  def test_expert_capacity(self, factor, tokens, top_k, experts, want):
    cfg = _cfg(num_experts=experts, top_k=top_k, capacity_factor=factor)
    self.assertFalse(cfg.dropless)
    self.assertEqual(cfg.expert_capacity(tokens), want)

  def test_experts_per_group(self):
    self.assertEqual(_cfg(num_experts=16, n_group=4).experts_per_group, 4)


if __name__ == "__main__":
  absltest.main()
