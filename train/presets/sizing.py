"""Parameter, FLOP and memory counts of a model, from its config alone.

The counts follow the layout `train/models/` builds, module by module (a
test checks they equal the sizes of the model's abstract parameters), so
nothing is allocated: they size the full-size presets for `--dry_run`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import moe_core
from moe_core import remat as moe_remat
from train.models import deepseek_v4_config
from train.models import gated_deltanet
from train.models import gemma4_layout
from train.models import llama4
from train.models import model_config

# --- Counting ----------------------------------------------------------------


def attention_param_count(cfg: model_config.ModelConfig) -> int:
  """Parameters of one attention sub-layer (projections and QK-norms)."""
  d, h = cfg.hidden_size, cfg.num_heads
  if cfg.attention == "mla":
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
      q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    else:
      q = d * h * qk
    kv = (
        d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        + cfg.kv_lora_rank
        + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    )
    return q + kv + h * cfg.v_head_dim * d
  q_width = h * cfg.head_dim
  kv_width = cfg.num_kv_heads * cfg.head_dim
  count = d * q_width + 2 * d * kv_width + q_width * d
  if cfg.attention_output_gate:  # The gate half of the query projection.
    count += d * q_width
  if cfg.qk_norm == "head":
    count += 2 * cfg.head_dim
  elif cfg.qk_norm == "full":
    count += q_width + kv_width
  if cfg.attention_bias:  # GPT-OSS: q, k, v and o biases.
    count += q_width + 2 * kv_width + d
  if cfg.attention_sinks:  # GPT-OSS: one sink logit per query head.
    count += h
  return count


def attended_positions(seq_len: int, window: int) -> float:
  """Keys a query attends to, on average over a causal sequence (window W:
  at most W, itself included; 0: no window)."""
  if not window or window >= seq_len:
    return (seq_len + 1) / 2
  return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def routed_expert_param_count(moe: moe_core.MoEConfig) -> int:
  """Parameters of one MoE block's routed experts: w_gate (if gated), w_up,
  w_down and their biases (if any)."""
  shapes = moe_core.param_shapes(moe)
  per_expert = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
  return sum(math.prod(shapes[n]) for n in per_expert if n in shapes)


def moe_param_counts(moe: moe_core.MoEConfig) -> tuple[int, int]:
  """(total, active per token) parameters of one MoE block."""
  shapes = moe_core.param_shapes(moe)
  total = sum(math.prod(s) for s in shapes.values())
  routed = routed_expert_param_count(moe)
  active = total - routed + routed * moe.top_k // moe.num_experts
  return total, active


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  """Parameter counts of a model.

  Attributes:
    total: every parameter.
    active: parameters used per token: all but the unchosen routed experts
      (the input embedding included, as most model cards count it).
    embedding: the input embedding table.
    head: the output head (0 when tied).
    attention: all attention sub-layers.
    dense_mlp: all dense MLPs.
    moe: all MoE blocks (router, routed and shared experts, biases).
    moe_active: the part of `moe` used per token.
    norms: RMSNorm scales outside attention.
    hyper_connections: DeepSeek-V4's hyper-connections and hyper-head (0
      for other models).
  """

  total: int
  active: int
  embedding: int
  head: int
  attention: int
  dense_mlp: int
  moe: int
  moe_active: int
  norms: int
  hyper_connections: int = 0

  @property
  def active_without_embedding(self) -> int:
    return self.active - self.embedding


def _totalled(
    moe: tuple[int, int],
    embedding: int,
    head: int,
    attention: int,
    dense_mlp: int,
    norms: int,
    hyper_connections: int = 0,
) -> ParamCounts:
  """`ParamCounts` from its parts: `moe` (all experts, the chosen ones) and
  the parts every token uses, which total and active both add."""
  moe_total, moe_active = moe
  shared = embedding + head + attention + dense_mlp + norms + hyper_connections
  return ParamCounts(
      total=shared + moe_total,
      active=shared + moe_active,
      embedding=embedding,
      head=head,
      attention=attention,
      dense_mlp=dense_mlp,
      moe=moe_total,
      moe_active=moe_active,
      norms=norms,
      hyper_connections=hyper_connections,
  )


def param_counts(cfg: model_config.ModelConfig) -> ParamCounts:
  """Counts parameters from the config, in `train/models/`'s layout."""
  if cfg.deepseek_v4 is not None:  # DeepSeek-V4 (issue 33)
    return _deepseek_v4_param_counts(cfg)
  d = cfg.hidden_size
  embedding = cfg.vocab_size * d
  head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
  if cfg.gemma4 is not None:  # Gemma 4 (issue 33): per-layer shapes.
    attention, dense_mlp, norms = gemma4_layout.shared_param_counts(cfg)
  else:
    attention = cfg.num_full_attention_layers * attention_param_count(cfg)
    if cfg.linear_attention is not None:  # Qwen3-Next's Gated DeltaNet.
      attention += cfg.num_linear_attention_layers * (
          gated_deltanet.param_count(cfg.linear_attention, d)
      )
    dense_mlp = cfg.num_dense_layers * 3 * d * cfg.dense_ffn_size
    norms = 2 * d * cfg.num_layers + d
  moe_total, moe_active = moe_param_counts(cfg.moe) if cfg.moe else (0, 0)
  moe_total *= cfg.num_moe_layers
  moe_active *= cfg.num_moe_layers
  return _totalled(
      (moe_total, moe_active), embedding, head, attention, dense_mlp, norms
  )


def _deepseek_v4_param_counts(cfg: model_config.ModelConfig) -> ParamCounts:
  """`param_counts` of a DeepSeek-V4 model (`train/models/deepseek_v4.py`'s
  layout): per-layer attention kinds, hash and scored MoE layers, two
  hyper-connections per layer and the hyper-head."""
  d, layers = cfg.hidden_size, range(cfg.num_layers)
  embedding = cfg.vocab_size * d
  head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
  attention = sum(
      deepseek_v4_config.attention_param_count(cfg, i) for i in layers
  )
  moe = [moe_param_counts(deepseek_v4_config.layer_moe(cfg, i)) for i in layers]
  moe_total, moe_active = sum(t for t, _ in moe), sum(a for _, a in moe)
  norms = 2 * d * cfg.num_layers + d
  hyper = 2 * cfg.num_layers * deepseek_v4_config.hyper_connection_param_count(
      cfg
  ) + deepseek_v4_config.hyper_head_param_count(cfg)
  return _totalled(
      (moe_total, moe_active), embedding, head, attention, 0, norms, hyper
  )


def _attention_flops(cfg: model_config.ModelConfig, seq_len: int) -> float:
  """Forward FLOPs per token of every layer's token mixing (scores and
  weighted values, or a linear-attention recurrence), beyond its weights."""
  if cfg.gemma4 is not None:  # Gemma 4 (issue 33): sliding windows.
    return gemma4_layout.attention_flops(cfg, seq_len)
  if cfg.deepseek_v4 is not None:  # DeepSeek-V4 (issue 33)
    return _deepseek_v4_attend_flops(cfg, seq_len)

  # Sliding-window layers (GPT-OSS) attend to at most their window, Llama
  # 4's RoPE layers within chunks; Gated DeltaNet layers (Qwen3-Next) run
  # their recurrence instead.
  def keys_per_query(layer):
    window = cfg.attention_window(layer)
    if window:
      return attended_positions(seq_len, window)
    chunk = cfg.attention_chunk_size if cfg.uses_rope(layer) else 0
    return llama4.mean_attended_keys(seq_len, chunk)

  context = sum(
      keys_per_query(layer)
      for layer in range(cfg.num_layers)
      if not cfg.is_linear_attention_layer(layer)
  )
  attend = 2 * cfg.num_heads * context * (cfg.qk_head_dim + cfg.value_head_dim)
  if cfg.linear_attention is not None:
    attend += cfg.num_linear_attention_layers * (
        gated_deltanet.recurrence_flops_per_token(cfg.linear_attention)
    )
  return attend


def flops_per_token(
    cfg: model_config.ModelConfig, seq_len: int
) -> dict[str, float]:
  """Matmul FLOPs per token, forward and training (forward + backward).

  2 FLOPs per multiply-add of every weight a token uses (the embedding
  lookup is free, the output head is not), plus causal attention's scores
  and weighted values: on average a token attends to (seq_len + 1) / 2
  positions (fewer on sliding-window layers, `attended_positions`, and on
  chunked layers, `llama4.mean_attended_keys`).
  Training costs 3x the forward (the backward computes two products per
  forward product); recomputation under remat is extra.
  """
  counts = param_counts(cfg)
  matmul = counts.active - counts.embedding - counts.norms
  if cfg.tie_embeddings:
    matmul += cfg.vocab_size * cfg.hidden_size

  attend = _attention_flops(cfg, seq_len)
  forward = 2.0 * matmul + attend
  return {
      "forward": forward,
      "train": 3.0 * forward,
      "attention_forward": attend,
  }


def _deepseek_v4_attend_flops(
    cfg: model_config.ModelConfig, seq_len: int
) -> float:
  """Attention's score and value FLOPs per token of a DeepSeek-V4 model,
  averaged over the positions of a sequence: each query reads the keys of
  its window and the compressed entries it sees (complete windows; at most
  index_topk in compressed-sparse layers, whose indexer also scores every
  complete entry)."""
  s = cfg.deepseek_v4
  t = np.arange(1, seq_len + 1)  # keys up to and including each query
  per_key = 2 * cfg.num_heads * (cfg.head_dim + cfg.head_dim)
  window = np.minimum(t, s.sliding_window).mean()
  total = 0.0
  for kind in s.layer_types:
    total += per_key * window
    if kind == "hca":
      total += per_key * (t // s.hca_rate).mean()
    elif kind == "csa":
      entries = t // s.csa_rate
      total += per_key * np.minimum(entries, s.index_topk).mean()
      total += 2 * s.index_n_heads * s.index_head_dim * entries.mean()
  return float(total)


# --- Memory for a mesh --------------------------------------------------------

MESH_AXES = ("data", "fsdp", "expert", "tensor")
REMAT_CHOICES = moe_remat.POLICIES


def parse_mesh(spec: str) -> dict[str, int]:
  """'data=8,expert=8' -> {'data': 8, 'fsdp': 1, 'expert': 8, 'tensor': 1}."""
  mesh = dict.fromkeys(MESH_AXES, 1)
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, size = item.partition("=")
    if not sep or name.strip() not in MESH_AXES:
      raise ValueError(
          f"--mesh entries must be AXIS=SIZE with AXIS in "
          f"{MESH_AXES}, got {item!r} in {spec!r}."
      )
    try:
      value = int(size)
    except ValueError:
      value = 0
    if value < 1:
      raise ValueError(
          f"mesh axis {name!r} needs a positive int size, got " f"{size!r}."
      )
    mesh[name.strip()] = value
  return mesh


def _activation_bytes_per_token_layer(
    cfg: model_config.ModelConfig,
    moe_layer: bool,
    remat: str,
    seq_len: int,
    tensor: int,
    linear_attention: gated_deltanet.DeltaNetConfig | None = None,
) -> tuple[float, float]:
  """(device, host) bytes one token leaves saved for the backward, one layer.

  An estimate in bf16 (2 bytes) with float32 softmax statistics; tensor
  parallelism splits the head and hidden widths. `linear_attention`: the
  layer is Gated DeltaNet of these widths, not softmax attention.
  """
  d, h = cfg.hidden_size, cfg.num_heads
  block_input = 2.0 * d
  if remat == "full":
    return block_input, 0.0
  q_width = h * cfg.qk_head_dim
  kv_width = (
      h * (cfg.qk_head_dim + cfg.value_head_dim)
      if cfg.attention == "mla"
      else 2 * cfg.num_kv_heads * cfg.head_dim
  )
  attn = (
      2.0 * (2 * d + q_width + kv_width + h * cfg.value_head_dim) / tensor
      # Causal scores and probabilities, f32, (seq_len + 1) / 2 each.
      + 2 * 4.0 * h * (seq_len + 1) / 2 / tensor
  )
  if linear_attention is not None:
    dn = linear_attention
    attn = (
        2.0 * (2 * d + 3 * dn.conv_width + 2 * dn.value_width) / tensor
        # `gated_deltanet`'s scan keeps each step's f32 state for the backward.
        + 4.0
        * dn.num_value_heads
        * dn.key_head_dim
        * dn.value_head_dim
        / tensor
    )
  if moe_layer:
    moe = cfg.moe
    k, f = moe.top_k, moe.expert_ffn_size
    # Router logits/probs (f32), dispatched rows, gate, up, act, down.
    gemm_outputs = 2.0 * k * (2 * f + d) / tensor
    mlp = (
        2 * 4.0 * moe.num_experts
        + 2.0 * k * d
        + gemm_outputs
        + 2.0 * k * f / tensor
        + 2.0 * d
        + 2.0 * 4 * moe.shared_ffn_size / tensor
    )
    if cfg.gemma4 is not None:  # Gemma 4: a dense MLP beside the MoE.
      mlp += 2.0 * (4 * cfg.dense_ffn_size / tensor + 2 * d)
  else:
    gemm_outputs = 0.0
    mlp = 2.0 * (4 * cfg.dense_ffn_size / tensor + 2 * d)
  everything = block_input + attn + mlp
  if remat == "none":
    return everything, 0.0
  if remat == "recompute_moe":
    return everything - gemm_outputs, 0.0
  if remat == "save_moe":
    return block_input + gemm_outputs, 0.0
  if remat == "offload_moe":
    return block_input, gemm_outputs
  raise ValueError(f"remat must be one of {REMAT_CHOICES}, got {remat!r}.")


def memory_per_device(
    cfg: model_config.ModelConfig,
    mesh: dict[str, int],
    batch_size: int,
    seq_len: int,
    remat: str = "full",
    moment_bytes: int = 4,
) -> dict[str, float]:
  """Bytes per device for weights, gradients, optimiser state, activations.

  Layout assumed: float32 master weights and gradients, AdamW's two
  moments of `moment_bytes` each (4: float32; 2: --opt_state_dtype=
  bfloat16); routed-expert weights sharded over expert x fsdp x tensor,
  the rest over fsdp x expert x tensor (`train.parallel.sharding`: where they
  divide); the batch split over data x fsdp x expert (the
  expert axis is a data axis outside the MoE blocks); activations as in
  `_activation_bytes_per_token_layer`, plus the float32 logits of the
  output head.
  """
  counts = param_counts(cfg)
  routed = 0
  if cfg.moe:
    routed = cfg.num_moe_layers * routed_expert_param_count(cfg.moe)
  other = counts.total - routed
  per_device = routed / (
      mesh["expert"] * mesh["fsdp"] * mesh["tensor"]
  ) + other / (mesh["fsdp"] * mesh["expert"] * mesh["tensor"])
  batch_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
  tokens = batch_size * seq_len / batch_shards
  device_act = host_act = 0.0
  for layer in range(cfg.num_layers):
    dev, host = _activation_bytes_per_token_layer(
        cfg,
        cfg.is_moe_layer(layer),
        remat,
        seq_len,
        mesh["tensor"],
        cfg.linear_attention if cfg.is_linear_attention_layer(layer) else None,
    )
    device_act += dev
    host_act += host
  logits = 4.0 * cfg.vocab_size / mesh["tensor"]
  return {
      "params_per_device": per_device,
      "weights": 4.0 * per_device,
      "gradients": 4.0 * per_device,
      "optimizer": 2.0 * moment_bytes * per_device,
      "activations": tokens * (device_act + logits),
      "activations_offloaded_to_host": tokens * host_act,
      "tokens_per_device": tokens,
  }
