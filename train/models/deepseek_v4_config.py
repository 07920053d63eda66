"""`DeepseekV4Settings`: what DeepSeek-V4's decoder adds to a `ModelConfig`.

The value of `ModelConfig.deepseek_v4` (None for every other family), its
validation against the rest of the config, and the parameter counts of the
layers it describes (`train/presets/sizing.py` adds them up; `deepseek_v4.py`
builds the layers). No model code here, so the config and the counts import
nothing heavy.

The model's own fields keep their meaning: `num_heads` query heads of
`head_dim` (512) over one shared key/value head (`num_kv_heads` = 1),
`q_lora_rank` the query's low-rank bottleneck, `rope_theta` the RoPE base
of the sliding-window-only layers, `moe` the MoE block of the scored
layers (its hash layers use `hash_moe(cfg)`).
"""

from __future__ import annotations

import dataclasses

import moe_core
from train.models import field_checks

# Per-layer attention: a 128-token sliding window only ("sliding"), plus
# compressed-sparse entries (one per `csa_rate` tokens, chosen by an indexer:
# "csa"), or plus heavily-compressed entries (one per `hca_rate` tokens:
# "hca").
LAYER_TYPES = ("sliding", "csa", "hca")


@dataclasses.dataclass(frozen=True)
class DeepseekV4Settings:
  """DeepSeek-V4's decoder switches (transformers' DeepseekV4Config names).

  Attributes:
    layer_types: one of `LAYER_TYPES` per layer (the released config's
      `compress_ratios` 0 / 4 / 128 without its last entry, the MTP
      layer's).
    num_hash_layers: the first MoE layers route by a token-id table.
    hc_mult: residual streams n of the hyper-connections (mHC).
    hc_sinkhorn_iters: Sinkhorn-Knopp iterations of the stream-mixing matrix.
    hc_eps: floor added in the hyper-connections' weights and Sinkhorn.
    rope_head_dim: the trailing channels of each head that RoPE rotates.
    o_groups: groups g of the grouped low-rank output projection.
    o_lora_rank: each group's output width in that projection.
    sliding_window: keys a query sees uncompressed (itself included).
    csa_rate: tokens per compressed-sparse entry.
    hca_rate: tokens per heavily-compressed entry.
    index_n_heads: the indexer's query heads.
    index_head_dim: the indexer's head width.
    index_topk: compressed-sparse entries a query attends to (at most).
    compress_rope_theta: RoPE base of the compressed layers (and their
      compressors and indexer).
  """

  layer_types: tuple[str, ...]
  num_hash_layers: int = 3
  hc_mult: int = 4
  hc_sinkhorn_iters: int = 20
  hc_eps: float = 1e-6
  rope_head_dim: int = 64
  o_groups: int = 8
  o_lora_rank: int = 1024
  sliding_window: int = 128
  csa_rate: int = 4
  hca_rate: int = 128
  index_n_heads: int = 64
  index_head_dim: int = 128
  index_topk: int = 512
  compress_rope_theta: float = 160000.0

  def __post_init__(self):
    if not isinstance(self.layer_types, tuple):
      raise TypeError(
          "deepseek_v4.layer_types must be a tuple of "
          f"{LAYER_TYPES}, got {type(self.layer_types).__name__}."
      )
    bad = [t for t in self.layer_types if t not in LAYER_TYPES]
    if bad:
      raise ValueError(
          f"deepseek_v4.layer_types entries must be one of {LAYER_TYPES}, "
          f"got {bad}."
      )
    field_checks.check_positive_ints(
        self,
        "deepseek_v4",
        (
            "hc_mult",
            "hc_sinkhorn_iters",
            "rope_head_dim",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "csa_rate",
            "hca_rate",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        ),
    )
    if self.num_hash_layers < 0:
      raise ValueError(
          "deepseek_v4.num_hash_layers must be >= 0, got "
          f"{self.num_hash_layers}."
      )
    for name in ("rope_head_dim", "index_head_dim"):
      if getattr(self, name) % 2:
        raise ValueError(
            f"deepseek_v4.{name} must be even (RoPE rotates pairs), got "
            f"{getattr(self, name)}."
        )
    if not self.hc_eps >= 0 or not self.compress_rope_theta > 0:
      raise ValueError(
          "deepseek_v4 needs hc_eps >= 0 and compress_rope_theta > 0, got "
          f"hc_eps={self.hc_eps}, "
          f"compress_rope_theta={self.compress_rope_theta}."
      )

  def replace(self, **changes) -> DeepseekV4Settings:
    return dataclasses.replace(self, **changes)


def check_model(cfg) -> None:
  """Raises ValueError where `cfg` (a ModelConfig) does not fit its
  `deepseek_v4` settings: the fields the decoder reads from the model."""
  s = cfg.deepseek_v4
  wrong = []
  if cfg.attention != "gqa" or cfg.num_kv_heads != 1:
    wrong.append(
        "attention='gqa' with num_kv_heads=1 (one shared key/value head), "
        f"got attention={cfg.attention!r}, num_kv_heads={cfg.num_kv_heads}"
    )
  if cfg.qk_norm != "none":
    wrong.append(f"qk_norm='none', got {cfg.qk_norm!r}")
  if cfg.q_lora_rank < 1:
    wrong.append(f"q_lora_rank >= 1, got {cfg.q_lora_rank}")
  if cfg.moe is None or cfg.first_dense_layers:
    wrong.append(
        "an MoE block in every layer (moe set, first_dense_layers=0), got "
        f"moe={'set' if cfg.moe else None}, "
        f"first_dense_layers={cfg.first_dense_layers}"
    )
  elif cfg.moe.hash_vocab_size:
    wrong.append(
        "moe to be the scored layers' block (hash_vocab_size=0; the hash "
        f"layers' block is derived), got {cfg.moe.hash_vocab_size}"
    )
  if len(s.layer_types) != cfg.num_layers:
    wrong.append(
        f"one layer type per layer ({cfg.num_layers}), got "
        f"{len(s.layer_types)}"
    )
  if s.num_hash_layers > cfg.num_layers:
    wrong.append(
        f"num_hash_layers <= num_layers ({cfg.num_layers}), got "
        f"{s.num_hash_layers}"
    )
  if s.rope_head_dim > cfg.head_dim:
    wrong.append(
        f"rope_head_dim <= head_dim ({cfg.head_dim}), got " f"{s.rope_head_dim}"
    )
  if (cfg.num_heads * cfg.head_dim) % s.o_groups:
    wrong.append(
        f"o_groups to divide num_heads * head_dim "
        f"({cfg.num_heads * cfg.head_dim}), got {s.o_groups}"
    )
  if wrong:
    raise ValueError(
        "deepseek_v4 needs " + "; ".join(wrong) + f" (model {cfg.name!r})."
    )


def hash_moe(cfg) -> moe_core.MoEConfig:
  """The MoE block of the hash layers: the scored block's experts, chosen by
  a [vocab_size, top_k] token-id table, without a correction bias."""
  return cfg.moe.replace(correction_bias=False, hash_vocab_size=cfg.vocab_size)


def layer_moe(cfg, layer: int) -> moe_core.MoEConfig:
  """The MoE block of layer `layer`."""
  if layer < cfg.deepseek_v4.num_hash_layers:
    return hash_moe(cfg)
  return cfg.moe


# --- Parameter counts, in `deepseek_v4.py`'s layout --------------------


def _compressor_param_count(d: int, width: int, rate: int, overlap: bool):
  """A compressor's key/value and gate projections, position bias, norm."""
  series = 2 if overlap else 1
  return 2 * d * series * width + rate * series * width + width


def attention_param_count(cfg, layer: int) -> int:
  """Layer `layer`'s attention: projections, norms, sinks, compressor."""
  s, d, h, hd = cfg.deepseek_v4, cfg.hidden_size, cfg.num_heads, cfg.head_dim
  q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * hd
  kv = d * hd + hd
  out = h * hd * s.o_lora_rank + s.o_groups * s.o_lora_rank * d
  count = q + kv + out + h  # + the per-head sinks
  kind = s.layer_types[layer]
  if kind == "hca":
    count += _compressor_param_count(d, hd, s.hca_rate, overlap=False)
  elif kind == "csa":
    count += _compressor_param_count(d, hd, s.csa_rate, overlap=True)
    ihd, ih = s.index_head_dim, s.index_n_heads
    count += _compressor_param_count(d, ihd, s.csa_rate, overlap=True)
    count += cfg.q_lora_rank * ih * ihd + d * ih
  return count


def hyper_connection_param_count(cfg) -> int:
  """One hyper-connection: its [n*D, (2+n)*n] projection, bias, 3 scales."""
  n = cfg.deepseek_v4.hc_mult
  mixes = (2 + n) * n
  return n * cfg.hidden_size * mixes + mixes + 3


def hyper_head_param_count(cfg) -> int:
  """The final stream collapse: [n*D, n] projection, n biases, one scale."""
  n = cfg.deepseek_v4.hc_mult
  return n * cfg.hidden_size * n + n + 1
