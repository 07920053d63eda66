"""The Gemma 4 presets against transformers' Gemma 4 text model.

An independent check of `sizing.py` and `train/models/gemma4.py`: the full
released config of google/gemma-4-26B-A4B builds transformers'
`Gemma4ForCausalLM` on the meta device (nothing allocated), whose parameter
count must equal ours exactly, part by part; and the tiny preset, built by
both with the same seeded weights, must give the same logits.

Needs torch and transformers (the py311-jax0.10 leg); skips elsewhere.
"""

import collections
import math

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

import hf_convert
from moe_core import flax as moe_flax
from train import presets
from train.models import transformer as model_lib
from train.presets import sizing

try:
  import torch  # pylint: disable=g-import-not-at-top
  from transformers.models.gemma4 import (  # pylint: disable=g-import-not-at-top
      configuration_gemma4,
      modeling_gemma4,
  )

  _IMPORT_ERROR = None
except ImportError as e:  # Skipped in setUp, with this reason.
  torch = configuration_gemma4 = modeling_gemma4 = None
  _IMPORT_ERROR = e

# google/gemma-4-26B-A4B's config.json, text_config (the values that shape
# parameters or the computation; read with the search tool from copies of
# the released file, e.g. mlx-community/gemma-4-26b-a4b-it-4bit's).
_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
    },
}
RELEASED_26B_A4B = {
    "vocab_size": 262144,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "attention_k_eq_v": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "sliding_window": 1024,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
    "rope_parameters": _ROPE,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "enable_moe_block": True,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
}


def _hf_fields(cfg) -> dict:
  """A `ModelConfig` with a gemma4 layout, as Gemma4TextConfig fields."""
  layout = cfg.gemma4
  return {
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.dense_ffn_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "global_head_dim": layout.global_head_dim,
      "num_global_key_value_heads": layout.global_kv_heads,
      "attention_k_eq_v": layout.global_k_eq_v,
      "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": cfg.norm_eps,
      "sliding_window": layout.sliding_window,
      "layer_types": [
          "full_attention"
          if layout.is_global(i, cfg.num_layers)
          else "sliding_attention"
          for i in range(cfg.num_layers)
      ],
      "rope_parameters": {
          "sliding_attention": {
              "rope_type": "default",
              "rope_theta": cfg.rope_theta,
          },
          "full_attention": {
              "rope_type": "proportional",
              "partial_rotary_factor": layout.global_rope_fraction,
              "rope_theta": layout.global_rope_theta,
          },
      },
      "final_logit_softcapping": layout.logit_softcap or None,
      "tie_word_embeddings": cfg.tie_embeddings,
      "enable_moe_block": True,
      "num_experts": cfg.moe.num_experts,
      "top_k_experts": cfg.moe.top_k,
      "moe_intermediate_size": cfg.moe.expert_ffn_size,
      "hidden_size_per_layer_input": 0,
      "num_kv_shared_layers": 0,
      "use_double_wide_mlp": False,
  }


# Where each transformers parameter counts in `sizing.ParamCounts`.
_MOE_PARTS = ("router.", "experts.", "pre_feedforward_layernorm_2.")


def _part(name: str) -> str:
  if name == "model.embed_tokens.weight":
    return "embedding"
  if ".self_attn." in name:
    return "attention"
  if ".mlp." in name:
    return "dense_mlp"
  if any(f".{part}" in name for part in _MOE_PARTS):
    return "moe"
  if name.endswith("norm.weight") or "layernorm" in name:
    return "norms"
  raise AssertionError(f"unplaced parameter {name}")


class Gemma4HfTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if _IMPORT_ERROR is not None:
      self.skipTest(
          "needs torch and transformers (the py311-jax0.10 leg): "
          f"{_IMPORT_ERROR}"
      )

  def test_the_preset_is_the_released_config(self):
    got = _hf_fields(presets.get_preset("gemma4_26b_a4b").model)
    self.assertEqual(got, RELEASED_26B_A4B)

  def test_the_moe_block_is_the_converters(self):
    for name in ("gemma4_26b_a4b", "tiny_gemma4"):
      cfg = presets.get_preset(name).model
      hf_cfg = configuration_gemma4.Gemma4TextConfig(**_hf_fields(cfg))
      with self.subTest(name):
        self.assertEqual(hf_convert.moe_config_from_hf(hf_cfg), cfg.moe)

  def test_full_size_count_equals_transformers_part_by_part(self):
    hf_cfg = configuration_gemma4.Gemma4TextConfig(**RELEASED_26B_A4B)
    with torch.device("meta"):
      model = modeling_gemma4.Gemma4ForCausalLM(hf_cfg)
    parts = collections.Counter()
    # named_parameters lists the tied head once, as the embedding.
    for name, p in model.named_parameters():
      parts[_part(name)] += p.numel()
    counts = sizing.param_counts(presets.get_preset("gemma4_26b_a4b").model)
    self.assertEqual(counts.total, sum(parts.values()))
    for part, hf_count in parts.items():
      with self.subTest(part):
        self.assertEqual(getattr(counts, part), hf_count)
    self.assertEqual(counts.head, 0)  # Tied, as transformers ties it.

  def test_tiny_logits_equal_transformers(self):
    cfg = presets.get_preset("tiny_gemma4").model
    hf_cfg = configuration_gemma4.Gemma4TextConfig(**_hf_fields(cfg))
    hf_cfg._attn_implementation = "eager"  # pylint: disable=protected-access
    torch.manual_seed(0)
    hf_model = modeling_gemma4.Gemma4ForCausalLM(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
      for name, p in hf_model.named_parameters():
        if p.ndim == 1:  # Norm scales, router scale, per-expert scale.
          p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=gen))
        elif "router.proj" in name:  # Logits of std ~1.5: few near-ties.
          p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        elif "embed_tokens" in name:
          p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        else:
          p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)

    model = model_lib.Transformer(
        cfg, backend="reference", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    _load(model, hf_model, cfg)

    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
      want = hf_model(torch.as_tensor(tokens)).logits.numpy()
    got, _ = model(jnp.asarray(tokens, jnp.int32))
    # 40 tokens: the sliding layers' window of 16 matters.
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def _set(variable, value) -> None:
  value = jnp.asarray(np.asarray(value, np.float32))
  assert variable[...].shape == value.shape, (variable[...].shape, value.shape)
  moe_flax.set_value(variable, value)


def _load(model, hf_model, cfg) -> None:
  """transformers' weights into `model_lib.Transformer` (x @ W layout)."""
  state = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
  # The tied head is embed.T * D ** -0.5 here: the same function as
  # transformers' input scale sqrt(D) and unscaled head.
  _set(
      model.embed,
      state["model.embed_tokens.weight"] * math.sqrt(cfg.hidden_size),
  )
  _set(model.final_norm.scale, state["model.norm.weight"])
  norms = {
      "attn_norm": "input_layernorm",
      "post_attn_norm": "post_attention_layernorm",
      "mlp_norm": "pre_feedforward_layernorm",
      "post_dense_norm": "post_feedforward_layernorm_1",
      "post_moe_norm": "post_feedforward_layernorm_2",
      "post_mlp_norm": "post_feedforward_layernorm",
  }
  projections = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj"}
  projections["wo"] = "o_proj"
  for i, block in enumerate(model.blocks):
    layer = f"model.layers.{i}."
    for ours, theirs in norms.items():
      _set(getattr(block, ours).scale, state[f"{layer}{theirs}.weight"])
    for ours, theirs in projections.items():
      key = f"{layer}self_attn.{theirs}.weight"
      if key in state:
        _set(getattr(block.attn, ours), state[key].T)
      else:
        assert not hasattr(block.attn, ours), key
    _set(block.attn.q_norm.scale, state[f"{layer}self_attn.q_norm.weight"])
    _set(block.attn.k_norm.scale, state[f"{layer}self_attn.k_norm.weight"])
    for ours in ("gate", "up", "down"):
      weight = state[f"{layer}mlp.{ours}_proj.weight"]
      _set(getattr(block.dense_mlp, f"w_{ours}"), weight.T)
    layer_state = {
        k[len(layer) :]: v for k, v in state.items() if k.startswith(layer)
    }
    params = hf_convert.params_from_hf(
        layer_state, cfg.moe, model_type="gemma4"
    )
    for name, value in params.items():
      _set(getattr(block.mlp, name), value)


if __name__ == "__main__":
  absltest.main()
