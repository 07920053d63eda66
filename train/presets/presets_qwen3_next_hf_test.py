"""Qwen3-Next against transformers: the 80B's counts, and the new layers.

On the leg with torch and transformers (py311-jax0.10): the transformers
model built from the released config on the `meta` device (nothing is
allocated) has exactly the parameters `sizing.py` counts, part by
part; and the training model's Gated DeltaNet and gated attention layers
compute what transformers' `Qwen3NextGatedDeltaNet` and `Qwen3NextAttention`
compute, from the same weights.
"""

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from train import presets
from train.models import gated_deltanet
from train.models import layers
from train.presets import sizing

try:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers.models.qwen3_next import (  # pylint: disable=g-import-not-at-top
      modeling_qwen3_next as hf_qwen3_next,
  )

  _IMPORT_ERROR = None
except ImportError as e:  # Skipped in setUp, with this reason.
  torch = transformers = hf_qwen3_next = None
  _IMPORT_ERROR = e

_SKIP_REASON = (
    "needs torch and transformers, which only the py311-jax0.10 leg "
    f"installs (tools/test.sh --leg=py311-jax0.10): {_IMPORT_ERROR}"
)

_PRESET = "qwen3_next_80b_a3b"


def _hf_config(cfg, **overrides):
  """transformers' Qwen3NextConfig with the values of ModelConfig `cfg`."""
  dn, moe = cfg.linear_attention, cfg.moe
  fields = dict(
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.hidden_size,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=cfg.tie_embeddings,
      rope_parameters={
          "rope_type": "default",
          "rope_theta": cfg.rope_theta,
          "partial_rotary_factor": cfg.partial_rotary_factor,
      },
      full_attention_interval=cfg.full_attention_interval,
      linear_num_key_heads=dn.num_key_heads,
      linear_num_value_heads=dn.num_value_heads,
      linear_key_head_dim=dn.key_head_dim,
      linear_value_head_dim=dn.value_head_dim,
      linear_conv_kernel_dim=dn.conv_kernel,
      num_experts=moe.num_experts,
      num_experts_per_tok=moe.top_k,
      moe_intermediate_size=moe.expert_ffn_size,
      shared_expert_intermediate_size=moe.shared_ffn_size,
      norm_topk_prob=moe.norm_topk_prob,
  )
  fields.update(overrides)
  return transformers.Qwen3NextConfig(**fields)


class _TorchTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if _IMPORT_ERROR is not None:
      self.skipTest(_SKIP_REASON)


class ReleasedConfigCountTest(_TorchTest):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    if _IMPORT_ERROR is not None:
      return
    cls.cfg = presets.get_preset(_PRESET).model
    # On the meta device: shapes only, nothing allocated.
    with torch.device("meta"):
      cls.hf = hf_qwen3_next.Qwen3NextForCausalLM(_hf_config(cls.cfg))
    cls.params = dict(cls.hf.named_parameters())

  def _sum(self, keep) -> int:
    return sum(p.numel() for n, p in self.params.items() if keep(n))

  def test_layer_layout_is_the_released_one(self):
    # 12 x (3 Gated DeltaNet + 1 gated attention), MoE everywhere.
    hf_linear = [t == "linear_attention" for t in self.hf.config.layer_types]
    ours = [
        self.cfg.is_linear_attention_layer(i)
        for i in range(self.cfg.num_layers)
    ]
    self.assertEqual(ours, hf_linear)
    self.assertEqual(sum(ours), 36)
    self.assertEqual(self.cfg.num_moe_layers, 48)

  def test_total_equals_the_transformers_model(self):
    self.assertEqual(
        sizing.param_counts(self.cfg).total, self._sum(lambda n: True)
    )

  def test_each_part_equals_the_transformers_model(self):
    counts = sizing.param_counts(self.cfg)
    parts = {
        "embedding": (counts.embedding, lambda n: "embed_tokens" in n),
        "head": (counts.head, lambda n: n.startswith("lm_head")),
        "attention": (
            counts.attention,
            lambda n: ".self_attn." in n or ".linear_attn." in n,
        ),
        "moe": (counts.moe, lambda n: ".mlp." in n),
        "norms": (
            counts.norms,
            lambda n: "layernorm" in n or n == "model.norm.weight",
        ),
    }
    for part, (ours, keep) in parts.items():
      with self.subTest(part):
        self.assertEqual(ours, self._sum(keep))

  def test_active_equals_the_transformers_model_with_top_k_experts(self):
    routed = self._sum(lambda n: ".mlp.experts." in n)
    moe = self.cfg.moe
    active = self._sum(lambda n: True) - routed
    active += routed * moe.top_k // moe.num_experts
    self.assertEqual(sizing.param_counts(self.cfg).active, active)

  def test_non_embedding_total_is_the_model_cards_79b(self):
    # The card's "Number of Paramaters (Non-Embedding): 79B" leaves out
    # the embedding and the output head.
    non_embedding = self._sum(
        lambda n: "embed_tokens" not in n and not n.startswith("lm_head")
    )
    self.assertLess(abs(non_embedding - 79e9), 0.5e9)


def _t(x) -> "torch.Tensor":
  return torch.from_numpy(np.asarray(x, np.float32))


def _randomise(module, seed):
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


class LayerParityTest(_TorchTest):
  """The training model's layers against transformers', same weights."""

  def setUp(self):
    super().setUp()
    self.cfg = presets.get_preset("tiny_qwen3_next").model
    self.hf_config = _hf_config(self.cfg, attn_implementation="sdpa")
    rng = np.random.default_rng(0)
    self.x = rng.standard_normal((2, 9, self.cfg.hidden_size)).astype(
        np.float32
    )

  def test_gated_delta_rule_matches_the_recurrent_torch_function(self):
    rng = np.random.default_rng(1)
    b, t, hk, hv, dk, dv = 2, 7, 2, 4, 8, 6
    q, k = (rng.standard_normal((b, t, hk, dk)) for _ in range(2))
    v = rng.standard_normal((b, t, hv, dv))
    g = -rng.uniform(0.0, 2.0, (b, t, hv))
    beta = rng.uniform(0.0, 1.0, (b, t, hv))
    want, _ = hf_qwen3_next.torch_recurrent_gated_delta_rule(
        *map(_t, (q, k, v)),
        g=_t(g),
        beta=_t(beta),
        use_qk_l2norm_in_kernel=True,
    )
    r = hv // hk
    q, k = (
        jnp.repeat(
            gated_deltanet.l2_normalize(jnp.asarray(a, jnp.float32)), r, 2
        )
        for a in (q, k)
    )
    got = gated_deltanet.gated_delta_rule(
        q, k, jnp.asarray(v, jnp.float32), jnp.asarray(g), jnp.asarray(beta)
    )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)

  def test_gated_deltanet_layer_matches_transformers(self):
    hf = hf_qwen3_next.Qwen3NextGatedDeltaNet(self.hf_config, layer_idx=0)
    _randomise(hf, seed=2)
    ours = gated_deltanet.GatedDeltaNet(
        self.cfg.linear_attention,
        self.cfg.hidden_size,
        self.cfg.norm_eps,
        rngs=nnx.Rngs(0),
    )
    weights = {
        "w_qkvz": hf.in_proj_qkvz.weight.T,
        "w_ba": hf.in_proj_ba.weight.T,
        "conv": hf.conv1d.weight[:, 0, :].T,
        "dt_bias": hf.dt_bias,
        "a_log": hf.A_log,
        "norm_scale": hf.norm.weight,
        "w_out": hf.out_proj.weight.T,
    }
    for name, value in weights.items():
      getattr(ours, name)[...] = jnp.asarray(value.detach().numpy())
    with torch.no_grad():
      want = hf(_t(self.x)).numpy()
    got = ours(jnp.asarray(self.x), jnp.arange(self.x.shape[1]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

  def test_gated_attention_with_partial_rope_matches_transformers(self):
    hf = hf_qwen3_next.Qwen3NextAttention(self.hf_config, layer_idx=1)
    _randomise(hf, seed=3)
    rotary = hf_qwen3_next.Qwen3NextRotaryEmbedding(self.hf_config)
    ours = layers.Attention(self.cfg, rngs=nnx.Rngs(0))
    ours.wq[...] = jnp.asarray(hf.q_proj.weight.detach().numpy().T)
    ours.wk[...] = jnp.asarray(hf.k_proj.weight.detach().numpy().T)
    ours.wv[...] = jnp.asarray(hf.v_proj.weight.detach().numpy().T)
    ours.wo[...] = jnp.asarray(hf.o_proj.weight.detach().numpy().T)
    # transformers' norms scale by (1 + w): the same function, shifted.
    ours.q_norm.scale[...] = 1.0 + jnp.asarray(
        hf.q_norm.weight.detach().numpy()
    )
    ours.k_norm.scale[...] = 1.0 + jnp.asarray(
        hf.k_norm.weight.detach().numpy()
    )
    t = self.x.shape[1]
    with torch.no_grad():
      x = _t(self.x)
      position_embeddings = rotary(x, torch.arange(t)[None])
      want, _ = hf(x, position_embeddings, attention_mask=None)
    got = ours(jnp.asarray(self.x), jnp.arange(t))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
  absltest.main()
