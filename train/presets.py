"""Model presets, and parameter, FLOP and memory counts computed from them.

Two kinds of preset live here:

* small training presets (`tiny_dsv3`, the default, `tiny_mixtral`,
  `tiny_qwen3`) that train on a laptop CPU in minutes;
* full-size configs of published MoE models (`deepseek_v3`, `mixtral_8x7b`,
  `qwen3_30b_a3b`, `olmoe_1b_7b`), used for `--dry_run` counts and checked
  against the published parameter counts (see `PUBLISHED`).

The counts are computed from the config alone, module by module, in the same
layout as `train/model.py` builds (a test checks they equal the sizes of the
model's abstract parameters), so nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import math

import moe_core

ATTENTIONS = ("gqa", "mla")
QK_NORMS = ("none", "head", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer whose MLPs are dense or MoE blocks.

  Attributes:
    name: preset name.
    vocab_size: V.
    hidden_size: D.
    num_layers: transformer blocks.
    num_heads: query heads H.
    num_kv_heads: key/value heads (GQA; equal to H for MHA). Unused by MLA.
    head_dim: per-head width for "gqa".
    attention: "gqa" (multi-/grouped-query attention with RoPE) or "mla"
      (DeepSeek's multi-head latent attention).
    q_lora_rank: MLA query down-projection rank (0: a full-rank query).
    kv_lora_rank: MLA compressed key/value width.
    qk_nope_head_dim: MLA per-head query/key width without RoPE.
    qk_rope_head_dim: MLA per-head query/key width with RoPE (the key part is
      shared by all heads).
    v_head_dim: MLA per-head value width.
    qk_norm: "none", "head" (RMSNorm over each head's query/key, Qwen3) or
      "full" (over the whole query/key projection, OLMoE).
    first_dense_layers: the first blocks use a dense MLP (DeepSeek-V3: 3).
    dense_ffn_size: hidden width of the dense MLPs.
    moe: the MoE block of every other layer (None: an all-dense model).
    tie_embeddings: the output head reuses the input embedding.
    rope_theta: RoPE base.
    norm_eps: RMSNorm epsilon.
  """

  name: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int = 0
  head_dim: int = 0
  attention: str = "gqa"
  q_lora_rank: int = 0
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  qk_norm: str = "none"
  first_dense_layers: int = 0
  dense_ffn_size: int = 0
  moe: moe_core.MoEConfig | None = None
  tie_embeddings: bool = False
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6

  def __post_init__(self):
    if self.attention not in ATTENTIONS:
      raise ValueError(
          f"attention must be one of {ATTENTIONS}, got " f"{self.attention!r}."
      )
    if self.qk_norm not in QK_NORMS:
      raise ValueError(
          f"qk_norm must be one of {QK_NORMS}, got " f"{self.qk_norm!r}."
      )
    if self.attention == "gqa":
      if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
        raise ValueError(
            "num_kv_heads must be >= 1 and divide num_heads, got "
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}."
        )
      if self.head_dim < 2 or self.head_dim % 2:
        raise ValueError(
            "head_dim must be even (RoPE rotates pairs), got "
            f"head_dim={self.head_dim}."
        )
    else:
      if self.qk_norm != "none":
        raise ValueError(
            "qk_norm applies to 'gqa' attention only, got "
            f"qk_norm={self.qk_norm!r} with attention='mla'."
        )
      for name in (
          "kv_lora_rank",
          "qk_nope_head_dim",
          "qk_rope_head_dim",
          "v_head_dim",
      ):
        if getattr(self, name) < 1:
          raise ValueError(
              f"attention='mla' needs {name} >= 1, got "
              f"{getattr(self, name)}."
          )
      if self.qk_rope_head_dim % 2:
        raise ValueError(
            "qk_rope_head_dim must be even (RoPE rotates "
            f"pairs), got {self.qk_rope_head_dim}."
        )
    if not 0 <= self.first_dense_layers <= self.num_layers:
      raise ValueError(
          "first_dense_layers must be in [0, num_layers], got "
          f"first_dense_layers={self.first_dense_layers}, "
          f"num_layers={self.num_layers}."
      )
    if self.num_dense_layers and self.dense_ffn_size < 1:
      raise ValueError(
          f"{self.num_dense_layers} dense layers need "
          f"dense_ffn_size >= 1, got {self.dense_ffn_size}."
      )
    if self.moe is not None and self.moe.hidden_size != self.hidden_size:
      raise ValueError(
          "moe.hidden_size must equal hidden_size, got "
          f"moe.hidden_size={self.moe.hidden_size}, "
          f"hidden_size={self.hidden_size}."
      )

  @property
  def num_dense_layers(self) -> int:
    return self.num_layers if self.moe is None else self.first_dense_layers

  @property
  def num_moe_layers(self) -> int:
    return self.num_layers - self.num_dense_layers

  def is_moe_layer(self, layer: int) -> bool:
    return self.moe is not None and layer >= self.first_dense_layers

  @property
  def qk_head_dim(self) -> int:
    if self.attention == "mla":
      return self.qk_nope_head_dim + self.qk_rope_head_dim
    return self.head_dim

  @property
  def value_head_dim(self) -> int:
    return self.v_head_dim if self.attention == "mla" else self.head_dim

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class TrainDefaults:
  """Training hyper-parameters a preset suggests; flags override each."""

  steps: int = 200
  batch_size: int = 16
  seq_len: int = 128
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  # DeepSeek-V3 uses 1e-3 over ~500k steps; a few hundred steps need a
  # faster rule for the bias to matter at all.
  bias_update_rate: float = 1e-2
  aux_loss_weight: float = 0.0
  z_loss_weight: float = 0.0


@dataclasses.dataclass(frozen=True)
class Preset:
  model: ModelConfig
  train: TrainDefaults = TrainDefaults()
  description: str = ""


@dataclasses.dataclass(frozen=True)
class Published:
  """A published parameter count, with where it was read.

  Attributes:
    total: total parameters.
    active: parameters used per token.
    active_counts_embedding: whether `active` includes the input embedding
      table (model cards differ; the output head is always included).
    source: where the figures were read.
  """

  total: float
  active: float
  active_counts_embedding: bool
  source: str


# --- Small presets that train on a CPU ----------------------------------------

_TINY_D = 128

TINY_DSV3 = Preset(
    description=(
        "DeepSeek-V3 family, tiny: a dense first layer, then MoE "
        "layers with one shared expert, sigmoid routing with an "
        "aux-loss-free correction bias, group-limited top-k and "
        "routed scaling; MHA with RoPE."
    ),
    model=ModelConfig(
        name="tiny_dsv3",
        vocab_size=256,
        hidden_size=_TINY_D,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        head_dim=32,
        first_dense_layers=1,
        dense_ffn_size=384,
        moe=moe_core.MoEConfig(
            num_experts=16,
            top_k=4,
            hidden_size=_TINY_D,
            expert_ffn_size=64,
            score_func="sigmoid",
            norm_topk_prob=True,
            norm_epsilon=1e-20,
            routed_scaling_factor=2.5,
            correction_bias=True,
            n_group=4,
            topk_group=2,
            group_score="sum_top2",
            shared_ffn_size=64,
        ),
    ),
    train=TrainDefaults(),
)

TINY_MIXTRAL = Preset(
    description="Mixtral style, tiny: softmax top-2 of 8 experts, GQA.",
    model=ModelConfig(
        name="tiny_mixtral",
        vocab_size=256,
        hidden_size=_TINY_D,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        moe=moe_core.MoEConfig(
            num_experts=8,
            top_k=2,
            hidden_size=_TINY_D,
            expert_ffn_size=192,
            score_func="softmax",
            norm_topk_prob=True,
        ),
    ),
    train=TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
)

TINY_QWEN3 = Preset(
    description=(
        "Qwen3-MoE / OLMoE style, tiny: fine-grained experts "
        "(32, top-8), softmax with top-k renormalisation, GQA with "
        "per-head QK-norm."
    ),
    model=ModelConfig(
        name="tiny_qwen3",
        vocab_size=256,
        hidden_size=_TINY_D,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qk_norm="head",
        moe=moe_core.MoEConfig(
            num_experts=32,
            top_k=8,
            hidden_size=_TINY_D,
            expert_ffn_size=48,
            score_func="softmax",
            norm_topk_prob=True,
        ),
    ),
    train=TrainDefaults(aux_loss_weight=1e-2, z_loss_weight=1e-3),
)


# --- Full-size published configs ----------------------------------------------

DEEPSEEK_V3 = Preset(
    description="DeepSeek-V3 (671B), main model without the MTP module.",
    model=ModelConfig(
        name="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_dense_layers=3,
        dense_ffn_size=18432,
        moe=moe_core.MoEConfig(
            num_experts=256,
            top_k=8,
            hidden_size=7168,
            expert_ffn_size=2048,
            score_func="sigmoid",
            norm_topk_prob=True,
            norm_epsilon=1e-20,
            routed_scaling_factor=2.5,
            correction_bias=True,
            n_group=8,
            topk_group=4,
            group_score="sum_top2",
            shared_ffn_size=2048,
        ),
        rope_theta=10000.0,
    ),
    train=TrainDefaults(
        seq_len=4096,
        batch_size=15360,
        learning_rate=2.2e-4,
        bias_update_rate=1e-3,
    ),
)

MIXTRAL_8X7B = Preset(
    description="Mixtral 8x7B.",
    model=ModelConfig(
        name="mixtral_8x7b",
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        moe=moe_core.MoEConfig(
            num_experts=8,
            top_k=2,
            hidden_size=4096,
            expert_ffn_size=14336,
            score_func="softmax",
            norm_topk_prob=True,
        ),
        rope_theta=1e6,
        norm_eps=1e-5,
    ),
    train=TrainDefaults(
        seq_len=4096, batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-2
    ),
)

QWEN3_30B_A3B = Preset(
    description="Qwen3-30B-A3B.",
    model=ModelConfig(
        name="qwen3_30b_a3b",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        qk_norm="head",
        moe=moe_core.MoEConfig(
            num_experts=128,
            top_k=8,
            hidden_size=2048,
            expert_ffn_size=768,
            score_func="softmax",
            norm_topk_prob=True,
        ),
        rope_theta=1e6,
    ),
    train=TrainDefaults(
        seq_len=4096, batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
    ),
)

OLMOE_1B_7B = Preset(
    description="OLMoE-1B-7B.",
    model=ModelConfig(
        name="olmoe_1b_7b",
        vocab_size=50304,
        hidden_size=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        qk_norm="full",
        moe=moe_core.MoEConfig(
            num_experts=64,
            top_k=8,
            hidden_size=2048,
            expert_ffn_size=1024,
            score_func="softmax",
            norm_topk_prob=False,
        ),
        norm_eps=1e-5,
    ),
    train=TrainDefaults(
        seq_len=4096,
        batch_size=1024,
        learning_rate=4e-4,
        aux_loss_weight=1e-2,
        z_loss_weight=1e-3,
    ),
)

PRESETS: dict[str, Preset] = {
    p.model.name: p
    for p in (
        TINY_DSV3,
        TINY_MIXTRAL,
        TINY_QWEN3,
        DEEPSEEK_V3,
        MIXTRAL_8X7B,
        QWEN3_30B_A3B,
        OLMOE_1B_7B,
    )
}
DEFAULT_PRESET = "tiny_dsv3"
FULL_SIZE = ("deepseek_v3", "mixtral_8x7b", "qwen3_30b_a3b", "olmoe_1b_7b")

# Published counts, read with the search tool from the sources named (the
# configs themselves are those of the models' Hugging Face config.json).
PUBLISHED: dict[str, Published] = {
    "deepseek_v3": Published(
        total=671e9,
        active=37e9,
        active_counts_embedding=True,
        source=(
            "huggingface.co/deepseek-ai/DeepSeek-V3, README.md ('671B "
            "total parameters with 37B activated for each token'); the "
            "MTP module is counted apart. README_WEIGHTS.md's finer "
            "'36.7B activated, including 0.9B for Embedding and 0.9B for "
            "the output Head' disagrees with the config by about 0.9B "
            "(the config gives 37.5B with both, 36.6B without the input "
            "embedding); both conventions fall within the card's 37B"
        ),
    ),
    "mixtral_8x7b": Published(
        total=46.7e9,
        active=12.9e9,
        active_counts_embedding=True,
        source=(
            "mistral.ai/news/mixtral-of-experts ('46.7B total parameters "
            "but only uses 12.9B parameters per token')"
        ),
    ),
    "qwen3_30b_a3b": Published(
        total=30.5e9,
        active=3.3e9,
        active_counts_embedding=True,
        source=(
            "the Qwen3-30B-A3B model card's '30.5B in total and 3.3B "
            "activated', as quoted by docs.vllm.ai (vLLM-Ascend "
            "tutorials/models/Qwen3-30B-A3B) and "
            "apxml.com/models/qwen3-30b-a3b"
        ),
    ),
    "olmoe_1b_7b": Published(
        total=6.9e9,
        active=1.3e9,
        active_counts_embedding=True,
        source=(
            "OLMoE (arXiv:2409.02060): 6.9B total, 1.3B active per "
            "token, as listed by labindex.ai/outputs/ai2/olmoe; the "
            "abstract rounds them to 7B and 1B"
        ),
    ),
}
# The published figures are rounded to 2-3 significant digits: a count
# matches when it is within half a unit of the last published digit, plus 1%
# for the conventions that differ between cards (what counts as "active").
PUBLISHED_RELATIVE_TOLERANCE = 0.01


def published_tolerance(value: float) -> float:
  """Absolute tolerance for a published figure like 46.7e9 or 37e9."""
  digits = f"{value / 1e9:g}"
  decimals = len(digits.partition(".")[2])
  return 0.5 * 10.0 ** (-decimals) * 1e9 + PUBLISHED_RELATIVE_TOLERANCE * value


def counts_as_published(name: str) -> tuple[int, int]:
  """(total, active) of preset `name`, active counted as its card counts it."""
  counts = param_counts(get_preset(name).model)
  active = (
      counts.active
      if PUBLISHED[name].active_counts_embedding
      else counts.active_without_embedding
  )
  return counts.total, active


def get_preset(name: str) -> Preset:
  if name not in PRESETS:
    raise ValueError(
        f"unknown model preset {name!r}; valid names: " f"{sorted(PRESETS)}."
    )
  return PRESETS[name]


# --- Counting ----------------------------------------------------------------


def attention_param_count(cfg: ModelConfig) -> int:
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
  if cfg.qk_norm == "head":
    count += 2 * cfg.head_dim
  elif cfg.qk_norm == "full":
    count += q_width + kv_width
  return count


def moe_param_counts(moe: moe_core.MoEConfig) -> tuple[int, int]:
  """(total, active per token) parameters of one MoE block."""
  shapes = moe_core.param_shapes(moe)
  total = sum(math.prod(s) for s in shapes.values())
  routed = sum(math.prod(shapes[n]) for n in ("w_gate", "w_up", "w_down"))
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

  @property
  def active_without_embedding(self) -> int:
    return self.active - self.embedding


def param_counts(cfg: ModelConfig) -> ParamCounts:
  """Counts parameters from the config, in `train/model.py`'s layout."""
  d = cfg.hidden_size
  embedding = cfg.vocab_size * d
  head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
  attention = cfg.num_layers * attention_param_count(cfg)
  dense_mlp = cfg.num_dense_layers * 3 * d * cfg.dense_ffn_size
  moe_total, moe_active = moe_param_counts(cfg.moe) if cfg.moe else (0, 0)
  moe_total *= cfg.num_moe_layers
  moe_active *= cfg.num_moe_layers
  norms = 2 * d * cfg.num_layers + d
  shared = embedding + head + attention + dense_mlp + norms
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
  )


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
  """Matmul FLOPs per token, forward and training (forward + backward).

  2 FLOPs per multiply-add of every weight a token uses (the embedding
  lookup is free, the output head is not), plus causal attention's scores
  and weighted values: on average a token attends to (seq_len + 1) / 2
  positions. Training costs 3x the forward (the backward computes two
  products per forward product); recomputation under remat is extra.
  """
  counts = param_counts(cfg)
  matmul = counts.active - counts.embedding - counts.norms
  if cfg.tie_embeddings:
    matmul += cfg.vocab_size * cfg.hidden_size
  context = (seq_len + 1) / 2
  attend = (
      2
      * cfg.num_layers
      * cfg.num_heads
      * context
      * (cfg.qk_head_dim + cfg.value_head_dim)
  )
  forward = 2.0 * matmul + attend
  return {
      "forward": forward,
      "train": 3.0 * forward,
      "attention_forward": attend,
  }


# --- Memory for a mesh --------------------------------------------------------

MESH_AXES = ("data", "fsdp", "expert", "tensor")
REMAT_CHOICES = ("none", "full", "save_moe", "recompute_moe", "offload_moe")


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
    cfg: ModelConfig, moe_layer: bool, remat: str, seq_len: int, tensor: int
) -> tuple[float, float]:
  """(device, host) bytes one token leaves saved for the backward, one layer.

  An estimate in bf16 (2 bytes) with float32 softmax statistics; tensor
  parallelism splits the head and hidden widths.
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
    cfg: ModelConfig,
    mesh: dict[str, int],
    batch_size: int,
    seq_len: int,
    remat: str = "full",
) -> dict[str, float]:
  """Bytes per device for weights, gradients, optimiser state, activations.

  Layout assumed: float32 master weights and gradients, AdamW's two float32
  moments; routed-expert weights sharded over expert x fsdp x tensor, the
  rest over fsdp x tensor; the batch split over data x fsdp x expert (the
  expert axis is a data axis outside the MoE blocks); activations as in
  `_activation_bytes_per_token_layer`, plus the float32 logits of the
  output head.
  """
  counts = param_counts(cfg)
  routed = 0
  if cfg.moe:
    shapes = moe_core.param_shapes(cfg.moe)
    routed = cfg.num_moe_layers * sum(
        math.prod(shapes[n]) for n in ("w_gate", "w_up", "w_down")
    )
  other = counts.total - routed
  per_device = routed / (
      mesh["expert"] * mesh["fsdp"] * mesh["tensor"]
  ) + other / (mesh["fsdp"] * mesh["tensor"])
  batch_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
  tokens = batch_size * seq_len / batch_shards
  device_act = host_act = 0.0
  for layer in range(cfg.num_layers):
    dev, host = _activation_bytes_per_token_layer(
        cfg, cfg.is_moe_layer(layer), remat, seq_len, mesh["tensor"]
    )
    device_act += dev
    host_act += host
  logits = 4.0 * cfg.vocab_size / mesh["tensor"]
  return {
      "params_per_device": per_device,
      "weights": 4.0 * per_device,
      "gradients": 4.0 * per_device,
      "optimizer": 8.0 * per_device,
      "activations": tokens * (device_act + logits),
      "activations_offloaded_to_host": tokens * host_act,
      "tokens_per_device": tokens,
  }


def human(n: float, unit: str = "") -> str:
  """1.234e9 -> '1.23G'."""
  for scale, suffix in (
      (1e15, "P"),
      (1e12, "T"),
      (1e9, "G"),
      (1e6, "M"),
      (1e3, "k"),
  ):
    if abs(n) >= scale:
      return f"{n / scale:.3g}{suffix}{unit}"
  return f"{n:.3g}{unit}"


def human_bytes(n: float) -> str:
  for scale, suffix in (
      (2**40, "TiB"),
      (2**30, "GiB"),
      (2**20, "MiB"),
      (2**10, "KiB"),
  ):
    if abs(n) >= scale:
      return f"{n / scale:.3g} {suffix}"
  return f"{n:.0f} B"


def describe(
    preset: Preset,
    *,
    mesh: dict[str, int],
    batch_size: int,
    seq_len: int,
    remat: str,
) -> str:
  """The `--dry_run` report: counts, FLOPs per token and memory per device."""
  cfg = preset.model
  c = param_counts(cfg)
  fl = flops_per_token(cfg, seq_len)
  mem = memory_per_device(cfg, mesh, batch_size, seq_len, remat)
  devices = math.prod(mesh.values())
  total_bytes = sum(
      mem[k] for k in ("weights", "gradients", "optimizer", "activations")
  )
  lines = [
      f"model {cfg.name}: {preset.description}",
      f"  layers {cfg.num_layers} ({cfg.num_dense_layers} dense, "
      f"{cfg.num_moe_layers} MoE), hidden {cfg.hidden_size}, "
      f"attention {cfg.attention}, vocab {cfg.vocab_size}",
  ]
  if cfg.moe:
    m = cfg.moe
    lines.append(
        f"  experts {m.num_experts} (top-{m.top_k}, ffn {m.expert_ffn_size}"
        f", shared ffn {m.shared_ffn_size}), router {m.score_func}"
    )
  lines += [
      f"  parameters: total {c.total:,} ({human(c.total)}), active per token"
      f" {c.active:,} ({human(c.active)}); without the input embedding "
      f"{human(c.active_without_embedding)}",
      f"    embedding {human(c.embedding)}, head {human(c.head)}, attention "
      f"{human(c.attention)}, dense MLP {human(c.dense_mlp)}, MoE "
      f"{human(c.moe)} (active {human(c.moe_active)})",
  ]
  if cfg.name in PUBLISHED:
    pub = PUBLISHED[cfg.name]
    lines.append(
        f"  published: {human(pub.total)} total, {human(pub.active)} active "
        f"({'with' if pub.active_counts_embedding else 'without'} the input "
        f"embedding); source: {pub.source}"
    )
  lines += [
      f"  FLOPs per token at seq_len {seq_len}: forward "
      f"{human(fl['forward'])}, training {human(fl['train'])} (6 x active "
      f"matmul params + attention; remat recompute not included)",
      f"  per device, mesh {mesh} ({devices} devices), global batch "
      f"{batch_size} x {seq_len} tokens, remat={remat}:",
      f"    weights (f32) {human_bytes(mem['weights'])}, gradients "
      f"{human_bytes(mem['gradients'])}, AdamW state "
      f"{human_bytes(mem['optimizer'])}, activations "
      f"{human_bytes(mem['activations'])}"
      + (
          f" (+{human_bytes(mem['activations_offloaded_to_host'])} on host)"
          if mem["activations_offloaded_to_host"]
          else ""
      ),
      f"    total {human_bytes(total_bytes)}",
  ]
  return "\n".join(lines)
