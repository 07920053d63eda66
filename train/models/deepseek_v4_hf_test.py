"""DeepSeek-V4's decoder against transformers' with the same weights.

The whole small model (`small_runs.SMALL_DEEPSEEK_V4`: a layer of each
attention kind, hash then scored MoE layers), and alone each attention kind
(sliding window; compressed-sparse with its indexer; heavily-compressed),
the hyper-connections and the hyper-head of `deepseek_v4.py`, are
given the weights of transformers 5.24.0's (built from the same small
DeepseekV4Config) and the same input, in float32; the logits and outputs
must agree.
Runs on the leg with torch (py311-jax0.10); skips elsewhere.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from moe_core import flax as moe_flax
from train.models import deepseek_v4
from train.models import transformer as model_lib
from train.testing import small_runs

try:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers.models.deepseek_v4 import (  # pylint: disable=g-import-not-at-top
      modeling_deepseek_v4 as hf_v4,
  )

  _IMPORT_ERROR = None
except ImportError as e:  # Skipped in setUp, with this reason.
  torch = transformers = hf_v4 = None
  _IMPORT_ERROR = e

_SKIP_REASON = (
    "needs torch and transformers, which only the py311-jax0.10 leg "
    f"installs (tools/test.sh --leg=py311-jax0.10): {_IMPORT_ERROR}"
)

CFG = small_runs.SMALL_DEEPSEEK_V4
_T = 24


def _hf_config():
  config = transformers.DeepseekV4Config(
      **small_runs.deepseek_v4_hf_fields(CFG)
  )
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  return config


def _t(x) -> "torch.Tensor":
  return torch.tensor(np.asarray(x, np.float32))


def _randomise(module, seed: int) -> None:
  """Every float parameter of a transformers module drawn N(0, 0.3^2)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _set(variable, tensor) -> None:
  moe_flax.set_value(variable, jnp.asarray(tensor.detach().numpy()))


def _load_pooler(ours, theirs) -> None:
  _set(ours.wkv, theirs.kv_proj.weight.T)
  _set(ours.wgate, theirs.gate_proj.weight.T)
  _set(ours.position_bias, theirs.position_bias)
  _set(ours.norm.scale, theirs.kv_norm.weight)


def _load_attention(ours, theirs, config) -> None:
  _set(ours.wq_a, theirs.q_a_proj.weight.T)
  _set(ours.q_a_norm.scale, theirs.q_a_norm.weight)
  _set(ours.wq_b, theirs.q_b_proj.weight.T)
  _set(ours.wkv, theirs.kv_proj.weight.T)
  _set(ours.kv_norm.scale, theirs.kv_norm.weight)
  g, rank = config.o_groups, config.o_lora_rank
  # transformers' grouped weight is [g * rank, width]: group i's rows.
  _set(
      ours.wo_a,
      theirs.o_a_proj.weight.reshape(g, rank, -1).transpose(1, 2),
  )
  _set(ours.wo_b, theirs.o_b_proj.weight.T)
  _set(ours.sinks, theirs.sinks)
  if theirs.compressor is not None:
    _load_pooler(ours.compressor, theirs.compressor)
  if ours.kind == "csa":
    indexer = theirs.compressor.indexer
    _load_pooler(ours.indexer.keys, indexer)
    _set(ours.indexer.wq_b, indexer.q_b_proj.weight.T)
    _set(ours.indexer.w_heads, indexer.scorer.weights_proj.weight.T)


def _load_moe(ours, theirs) -> None:
  """transformers' DeepseekV4SparseMoeBlock -> our `moe_core.flax.MoE`."""
  f = ours.cfg.expert_ffn_size
  gate_up = theirs.experts.gate_up_proj  # [E, 2F, D]: gate rows, then up.
  _set(ours.router, theirs.gate.weight.T)
  _set(ours.w_gate, gate_up[:, :f].transpose(1, 2))
  _set(ours.w_up, gate_up[:, f:].transpose(1, 2))
  _set(ours.w_down, theirs.experts.down_proj.transpose(1, 2))
  _set(ours.shared_w_gate, theirs.shared_experts.gate_proj.weight.T)
  _set(ours.shared_w_up, theirs.shared_experts.up_proj.weight.T)
  _set(ours.shared_w_down, theirs.shared_experts.down_proj.weight.T)
  if ours.cfg.hash_vocab_size:
    _set(ours.hash_table, theirs.gate.tid2eid.int())
  else:
    _set(ours.correction_bias, theirs.gate.e_score_correction_bias)


def _load_hyper_connection(ours, theirs) -> None:
  _set(ours.fn, theirs.fn.T)
  _set(ours.base, theirs.base)
  _set(ours.scale, theirs.scale)


def _load_model(ours, theirs, config) -> None:
  """transformers' DeepseekV4ForCausalLM -> our Transformer."""
  inner = theirs.model
  _set(ours.embed, inner.embed_tokens.weight)
  for block, layer in zip(ours.blocks, inner.layers):
    _load_attention(block.attn, layer.self_attn, config)
    _load_hyper_connection(block.attn_hc, layer.attn_hc)
    _load_hyper_connection(block.mlp_hc, layer.ffn_hc)
    _set(block.attn_norm.scale, layer.input_layernorm.weight)
    _set(block.mlp_norm.scale, layer.post_attention_layernorm.weight)
    _load_moe(block.mlp, layer.mlp)
  _set(ours.hc_head.fn, inner.hc_head.hc_fn.T)
  _set(ours.hc_head.base, inner.hc_head.hc_base)
  _set(ours.hc_head.scale, inner.hc_head.hc_scale)
  _set(ours.final_norm.scale, inner.norm.weight)
  _set(ours.head, theirs.lm_head.weight.T)


class DeepseekV4ParityTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if _IMPORT_ERROR is not None:
      self.skipTest(_SKIP_REASON)

  @parameterized.parameters(0, 1, 2)  # sliding, csa, hca
  def test_attention_equals_transformers(self, layer):
    config = _hf_config()
    theirs = hf_v4.DeepseekV4Attention(config, layer).float().eval()
    _randomise(theirs, layer)
    ours = deepseek_v4.Attention(CFG, layer, rngs=nnx.Rngs(0))
    _load_attention(ours, theirs, config)

    x = np.random.default_rng(layer).normal(size=(2, _T, CFG.hidden_size))
    positions = torch.arange(_T)[None].expand(2, -1)
    rotary = hf_v4.DeepseekV4RotaryEmbedding(config)
    embeddings = {
        kind: rotary(_t(x), positions, layer_type=kind)
        for kind in ("main", "compress")
    }
    rows, cols = torch.arange(_T)[:, None], torch.arange(_T)[None, :]
    visible = (cols <= rows) & (rows - cols < config.sliding_window)
    mask = torch.zeros(2, 1, _T, _T).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
      want, _ = theirs(_t(x), embeddings, positions, mask)
    got = ours(jnp.asarray(x, jnp.float32), jnp.arange(_T))
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-4, atol=2e-5)

  def test_whole_model_equals_transformers(self):
    """Logits of the small model (a layer of each attention kind, hash then
    scored MoE layers) with transformers' weights, float32."""
    config = _hf_config()
    theirs = transformers.DeepseekV4ForCausalLM(config).float().eval()
    _randomise(theirs, 11)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
      for layer in theirs.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):  # K distinct experts per token id.
          table = torch.rand(gate.tid2eid.shape[0], 8, generator=gen)
          gate.tid2eid.copy_(table.argsort(-1)[:, : gate.tid2eid.shape[1]])
        else:
          gate.e_score_correction_bias.normal_(0.0, 0.1, generator=gen)
    ours = model_lib.Transformer(
        CFG, backend="reference", compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    _load_model(ours, theirs, config)
    tokens = np.random.default_rng(13).integers(0, CFG.vocab_size, (2, _T))
    with torch.no_grad():
      want = theirs(torch.tensor(tokens)).logits
    got, _ = ours(jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-3, atol=1e-4)

  def test_hyper_connection_equals_transformers(self):
    config = _hf_config()
    theirs = hf_v4.DeepseekV4HyperConnection(config).float()
    _randomise(theirs, 7)
    ours = deepseek_v4.HyperConnection(CFG, rngs=nnx.Rngs(0))
    _set(ours.fn, theirs.fn.T)
    _set(ours.base, theirs.base)
    _set(ours.scale, theirs.scale)
    streams = np.random.default_rng(7).normal(
        size=(2, 5, CFG.deepseek_v4.hc_mult, CFG.hidden_size)
    )
    with torch.no_grad():
      want = theirs(_t(streams))
    got = ours(jnp.asarray(streams, jnp.float32))
    for name, g, w in zip(("post", "comb", "collapsed"), got, want):
      np.testing.assert_allclose(
          g, w.numpy(), rtol=1e-4, atol=1e-5, err_msg=name
      )
    # One layer's residual update, as transformers' decoder layer does it.
    post, comb, _ = want
    output = np.random.default_rng(8).normal(size=(2, 5, CFG.hidden_size))
    want_merged = post.unsqueeze(-1) * _t(output).unsqueeze(-2) + torch.matmul(
        comb.transpose(-1, -2), _t(streams)
    )
    got_merged = deepseek_v4.merge_streams(
        got[0],
        got[1],
        jnp.asarray(output, jnp.float32),
        jnp.asarray(streams, jnp.float32),
    )
    np.testing.assert_allclose(
        got_merged, want_merged.numpy(), rtol=1e-4, atol=1e-5
    )

  def test_hyper_head_equals_transformers(self):
    config = _hf_config()
    theirs = hf_v4.DeepseekV4HyperHead(config).float()
    _randomise(theirs, 9)
    ours = deepseek_v4.HyperHead(CFG, rngs=nnx.Rngs(0))
    _set(ours.fn, theirs.hc_fn.T)
    _set(ours.base, theirs.hc_base)
    _set(ours.scale, theirs.hc_scale)
    streams = np.random.default_rng(9).normal(
        size=(2, 5, CFG.deepseek_v4.hc_mult, CFG.hidden_size)
    )
    with torch.no_grad():
      want = theirs(_t(streams))
    got = ours(jnp.asarray(streams, jnp.float32))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
