"""The converter's bad inputs: each a ValueError naming what was wrong.

No torch: the configs are plain objects with a transformers config's
attributes, the state dicts numpy arrays (which `params_from_hf` takes as
it takes tensors), so this runs on every leg. One test per bad input of
the table: a model type that would read a state dict in another layout,
hash tables that the int32 cast would wrap or round, layer indices out of
range, missing keys, a cyclic text_config, wrong-typed fields and tensors,
and layer types the converter does not know. Each was found by a hostile
pass that got a silent misread or a bare KeyError / IndexError /
TypeError / RecursionError before.
"""

import dataclasses
import types

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import hf_convert

E, K, D, F, V = 4, 2, 8, 6, 10


def _gpt_oss_config(**changes):
  fields = dict(
      model_type="gpt_oss",
      num_local_experts=E,
      num_experts_per_tok=K,
      hidden_size=D,
      intermediate_size=F,
      swiglu_alpha=1.702,
      swiglu_limit=7.0,
      num_hidden_layers=2,
  )
  fields.update(changes)
  return types.SimpleNamespace(**fields)


def _gpt_oss_state():
  rng = np.random.default_rng(0)
  return {
      "router.weight": rng.standard_normal((E, D)),
      "router.bias": rng.standard_normal(E),
      "experts.gate_up_proj": rng.standard_normal((E, D, 2 * F)),
      "experts.gate_up_proj_bias": rng.standard_normal((E, 2 * F)),
      "experts.down_proj": rng.standard_normal((E, F, D)),
      "experts.down_proj_bias": rng.standard_normal((E, D)),
  }


def _deepseek_v4_config(**changes):
  fields = dict(
      model_type="deepseek_v4",
      scoring_func="sqrtsoftplus",
      mlp_layer_types=["hash_moe", "moe"],
      num_local_experts=E,
      num_experts_per_tok=K,
      hidden_size=D,
      intermediate_size=F,
      hidden_act="silu",
      vocab_size=V,
      routed_scaling_factor=1.5,
      mlp_bias=False,
      swiglu_limit=10.0,
      num_hidden_layers=2,
  )
  fields.update(changes)
  return types.SimpleNamespace(**fields)


def _hash_state(table):
  rng = np.random.default_rng(1)
  state = {
      "gate.weight": rng.standard_normal((E, D)),
      "gate.tid2eid": table,
      "experts.gate_up_proj": rng.standard_normal((E, 2 * F, D)),
      "experts.down_proj": rng.standard_normal((E, D, F)),
  }
  for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
    state[f"shared_experts.{name}_proj.weight"] = rng.standard_normal(shape)
  return state


def _table(**at) -> np.ndarray:
  """A valid [V, K] int64 table (rows v, v + 1 mod E) with entries set."""
  table = (np.arange(V)[:, None] + np.arange(K)) % E
  for index, value in at.items():
    table[tuple(map(int, index.split("_")))] = value
  return table


def _qwen_config(model_type="qwen2_moe", **changes):
  fields = dict(
      model_type=model_type,
      num_experts=E,
      num_experts_per_tok=K,
      hidden_size=D,
      moe_intermediate_size=F,
      norm_topk_prob=False,
      shared_expert_intermediate_size=F,
      hidden_act="silu",
  )
  fields.update(changes)
  return types.SimpleNamespace(**fields)


def _fused_state(shared_gate=True):
  rng = np.random.default_rng(2)
  state = {
      "gate.weight": rng.standard_normal((E, D)),
      "experts.gate_up_proj": rng.standard_normal((E, 2 * F, D)),
      "experts.down_proj": rng.standard_normal((E, D, F)),
      "shared_expert.gate_proj.weight": rng.standard_normal((F, D)),
      "shared_expert.up_proj.weight": rng.standard_normal((F, D)),
      "shared_expert.down_proj.weight": rng.standard_normal((D, F)),
  }
  if shared_gate:
    state["shared_expert_gate.weight"] = rng.standard_normal((1, D))
  return state


def _mixtral():
  hf_cfg = types.SimpleNamespace(
      model_type="mixtral",
      num_local_experts=E,
      num_experts_per_tok=K,
      hidden_size=D,
      intermediate_size=F,
      hidden_act="silu",
  )
  rng = np.random.default_rng(3)
  state = {"gate.weight": rng.standard_normal((E, D))}
  for e in range(E):
    for name, shape in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
      state[f"experts.{e}.{name}.weight"] = rng.standard_normal(shape)
  return hf_cfg, state


@dataclasses.dataclass(frozen=True)
class _Bad:
  """A bad params_from_hf call: the state dict, the config and keywords."""

  state: dict
  hf_cfg: object
  kwargs: dict


def _without(state, key):
  return {k: v for k, v in state.items() if k != key}


# params_from_hf: (name, bad call, the message's pattern).
_BAD_PARAMS = (
    # A GPT-OSS state dict read under another family's name: before, each
    # was silently read in the privacy filter's layout (off by up to 1.55).
    *(
        (
            f"gpt_oss_as_{label}",
            _Bad(_gpt_oss_state(), _gpt_oss_config(), dict(model_type=name)),
            rf"model_type must be None or one of .*got {name!r}\.",
        )
        for label, name in (
            ("hyphen", "gpt-oss"),
            ("upper", "GPT_OSS"),
            ("empty", ""),
        )
    ),
    (
        "gpt_oss_as_mixtral",
        _Bad(_gpt_oss_state(), _gpt_oss_config(), dict(model_type="mixtral")),
        r"model_type must be one of \('gpt_oss', 'openai_privacy_filter'\) "
        r"for a state dict with 'experts.gate_up_proj_bias'.*got "
        r"model_type='mixtral'\.",
    ),
    (
        "gpt_oss_without_model_type",
        _Bad(_gpt_oss_state(), _gpt_oss_config(), {}),
        r"model_type must be one of .*got model_type=None\.",
    ),
    (
        "model_type_against_hf_config",
        _Bad(
            _gpt_oss_state(),
            _gpt_oss_config(),
            dict(
                model_type="openai_privacy_filter",
                hf_config=_gpt_oss_config(),
            ),
        ),
        r"model_type='openai_privacy_filter' must be hf_config's model type, "
        r"got hf_config of 'gpt_oss'",
    ),
    # gate.tid2eid: before, cast to int32 unchecked (2**32 + 3 -> 3, 2.7
    # -> 2).
    (
        "tid2eid_past_int32",
        _Bad(
            _hash_state(_table(**{"3_1": 2**32 + 3})), _deepseek_v4_config(), {}
        ),
        r"state_dict\['gate.tid2eid'\] must hold expert ids in \[0, 4\), got "
        r"values in \[0, 4294967299\]\.",
    ),
    (
        "tid2eid_negative",
        _Bad(_hash_state(_table(**{"0_0": -1})), _deepseek_v4_config(), {}),
        r"tid2eid'\] must hold expert ids in \[0, 4\), got values in \[-1, 3\]",
    ),
    (
        "tid2eid_float",
        _Bad(
            _hash_state(_table().astype(np.float64) + 0.7),
            _deepseek_v4_config(),
            {},
        ),
        r"state_dict\['gate.tid2eid'\] must hold integer expert ids .*got "
        r"dtype float64\.",
    ),
    # Missing keys: before, a bare KeyError.
    (
        "missing_down_proj",
        _Bad(
            _without(_fused_state(), "experts.down_proj"),
            _qwen_config(),
            {},
        ),
        r"'experts.gate_up_proj' needs 'experts.down_proj' in state_dict",
    ),
    (
        "missing_one_experts_w1",
        _Bad(
            _without(_mixtral()[1], "experts.2.w1.weight"),
            _mixtral()[0],
            {},
        ),
        r"cfg.num_experts=4 \(experts 0 to 3\) needs 'experts.2.w1.weight'",
    ),
    (
        "missing_shared_expert_gate",
        _Bad(_fused_state(shared_gate=False), _qwen_config(), {}),
        r"cfg.shared_expert_gate=True needs 'shared_expert_gate.weight'",
    ),
    (
        "missing_shared_down_proj",
        _Bad(
            _without(_fused_state(), "shared_expert.down_proj.weight"),
            _qwen_config(),
            {},
        ),
        r"'shared_expert.gate_proj.weight' needs "
        r"'shared_expert.down_proj.weight'",
    ),
    # A string where a tensor goes: before, numpy's words naming nothing.
    (
        "string_tensor",
        _Bad(
            dict(_fused_state(), **{"gate.weight": "not a tensor"}),
            _qwen_config(),
            {},
        ),
        r"state_dict\['gate.weight'\] must be a tensor or array of numbers, "
        r"got 'not a tensor'\.",
    ),
)


def _cyclic_config():
  top = types.SimpleNamespace(model_type="qwen3_vl_moe")
  middle = types.SimpleNamespace(model_type="qwen3_vl_moe_text")
  top.text_config, middle.text_config = middle, top
  return top


def _self_referring_config():
  config = types.SimpleNamespace(model_type="qwen3_vl_moe")
  config.text_config = config
  return config


# moe_config_from_hf: (name, hf_config, layer_idx, the message's pattern).
_BAD_CONFIGS = (
    # layer_idx: before, a bare IndexError past the end, and -1 silently
    # the last layer.
    (
        "layer_idx_past_the_last_layer",
        _deepseek_v4_config(),
        2,
        r"layer_idx must be < hf_config.num_hidden_layers=2, got "
        r"layer_idx=2\.",
    ),
    (
        "layer_idx_past_the_per_layer_list",
        _deepseek_v4_config(num_hidden_layers=None),
        5,
        r"layer_idx must be < 2, the layers hf_config.mlp_layer_types "
        r"lists, got layer_idx=5\.",
    ),
    (
        "layer_idx_negative",
        _deepseek_v4_config(),
        -1,
        r"layer_idx must be None or a decoder layer's index, an int >= 0, "
        r"got -1\.",
    ),
    (
        "layer_idx_bool",
        _deepseek_v4_config(),
        True,
        r"layer_idx must be None or .*got True\.",
    ),
    (
        "hunyuan_layer_idx_past_its_list",
        types.SimpleNamespace(
            model_type="hunyuan_v1_moe",
            hidden_size=D,
            intermediate_size=F,
            hidden_act="silu",
            num_experts=[E, E],
            moe_topk=[K, K],
        ),
        3,
        r"layer_idx must be < 2, the layers hf_config.num_experts lists",
    ),
    # A layer type the converter does not know: before, read as scored.
    (
        "deepseek_v4_dense_layer",
        _deepseek_v4_config(mlp_layer_types=["dense", "moe"]),
        0,
        r"hf_config.mlp_layer_types\[0\] must be one of \('hash_moe', "
        r"'moe'\) \(deepseek_v4's MoE layers\), got 'dense'\.",
    ),
    # A text_config that refers back: before, RecursionError.
    (
        "text_config_refers_to_itself",
        _self_referring_config(),
        None,
        r"hf_config.text_config must be a config of its own .*cycle",
    ),
    (
        "text_config_cycle",
        _cyclic_config(),
        None,
        r"hf_config.text_config.text_config must be a config of its own",
    ),
    # Wrong-typed or absent fields: before, float()'s or getattr's words.
    (
        "gpt_oss_without_swiglu_limit",
        _gpt_oss_config(swiglu_limit=None),
        None,
        r"hf_config.swiglu_limit must be a number \(gpt_oss's converter "
        r"reads it\), got None\.",
    ),
    (
        "gpt_oss_swiglu_alpha_none",
        _gpt_oss_config(swiglu_alpha=None),
        None,
        r"hf_config.swiglu_alpha must be a number .*got None\.",
    ),
    (
        "gpt_oss_swiglu_alpha_string",
        _gpt_oss_config(swiglu_alpha="1.702"),
        None,
        r"hf_config.swiglu_alpha must be a number .*got '1.702'\.",
    ),
    (
        "qwen_without_num_experts",
        types.SimpleNamespace(
            **{
                k: v
                for k, v in vars(_qwen_config()).items()
                if k != "num_experts"
            }
        ),
        None,
        r"hf_config.num_experts must be set \(qwen2_moe's converter reads "
        r"it\), got a SimpleNamespace without it\.",
    ),
)


class ConverterErrorsTest(parameterized.TestCase):

  @parameterized.named_parameters(*_BAD_PARAMS)
  def test_params_from_hf_refuses(self, bad, pattern):
    cfg = hf_convert.moe_config_from_hf(bad.hf_cfg, layer_idx=0)
    with self.assertRaisesRegex(ValueError, pattern):
      hf_convert.params_from_hf(bad.state, cfg, **bad.kwargs)

  @parameterized.named_parameters(*_BAD_CONFIGS)
  def test_moe_config_from_hf_refuses(self, hf_cfg, layer_idx, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      hf_convert.moe_config_from_hf(hf_cfg, layer_idx=layer_idx)

  def test_gpt_oss_model_type_from_hf_config(self):
    hf_cfg = _gpt_oss_config()
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    state = _gpt_oss_state()
    want = hf_convert.params_from_hf(state, cfg, model_type="gpt_oss")
    for kwargs in (
        dict(hf_config=hf_cfg),
        dict(hf_config=hf_cfg, model_type="gpt_oss"),
    ):
      got = hf_convert.params_from_hf(state, cfg, **kwargs)
      for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # Interleaved: gate and up in alternate columns.
    np.testing.assert_array_equal(
        want["w_gate"],
        state["experts.gate_up_proj"][:, :, ::2].astype(np.float32),
    )

  def test_valid_hash_table_converts_to_int32(self):
    hf_cfg = _deepseek_v4_config()
    cfg = hf_convert.moe_config_from_hf(hf_cfg, layer_idx=0)
    self.assertEqual(cfg.hash_vocab_size, V)
    table = _table()
    for dtype in (np.int64, np.uint8):
      got = hf_convert.params_from_hf(_hash_state(table.astype(dtype)), cfg)
      self.assertEqual(got["hash_table"].dtype, np.int32)
      np.testing.assert_array_equal(got["hash_table"], table)

  def test_last_layer_and_scored_layer_convert(self):
    hf_cfg = _deepseek_v4_config()
    self.assertEqual(
        hf_convert.moe_config_from_hf(hf_cfg, layer_idx=1).hash_vocab_size, 0
    )
    self.assertEqual(
        hf_convert.moe_config_from_hf(
            hf_cfg, layer_idx=np.int64(0)
        ).hash_vocab_size,
        V,
    )


if __name__ == "__main__":
  absltest.main()
