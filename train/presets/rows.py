"""What a preset is: the row type every family's table fills.

A `Preset` is a named model (`model_config.ModelConfig`), the training run
it suggests (`TrainDefaults`: flags override each) and, for a published
model, the counts its authors give (`Published`). The helpers spell the
shared parts once: `tiny_model` (the CPU-sized models), `dims` (the six
figures every config.json starts with), `moe_block` (an MoE block's four
sizes), `full_size_training`; and for the families' tables, `row_model`
(a row's name, dims and MoE sizes made a model) and `preset_row` (the run,
description and published counts every row ends with made a preset).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses

import moe_core
from train.models import model_config


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
class Published:
  """A published parameter count, with where it was read.

  Attributes:
    total: total parameters.
    active: parameters used per token.
    active_counts_embedding: whether `active` includes the input embedding
      table (model cards differ; the output head is always included).
    source: where the figures were read.
    active_counts_head: whether `active` includes the output head (Qwen's
      "non-embedding" figures leave out both tables).
    total_beyond_preset: parameters the card's total counts that the preset
      does not build (Llama 4: the vision encoder and its projector), added
      to the preset's total before comparing; none of them is active per
      text token.
  """

  total: float
  active: float
  active_counts_embedding: bool
  source: str
  active_counts_head: bool = True
  total_beyond_preset: int = 0


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named model with the training run it suggests (`--model=NAME`)."""

  model: model_config.ModelConfig
  train: TrainDefaults = TrainDefaults()
  description: str = ""
  # A published model's counts, as its authors give them (None: not
  # published, or not counted).
  published: Published | None = None


def preset_row(
    model: model_config.ModelConfig, rest: tuple, **conventions
) -> Preset:
  """A preset from a family table's row: `model`, built from the row's own
  columns, then the `rest` every family's rows end with: the suggested run
  (`TrainDefaults`), the description and, for a published model, its
  counts (total, active) and where they were read. `conventions` are the
  family's other `Published` fields (which tables the counts include)."""
  train, description, *counts_source = rest
  published = None
  if counts_source:
    (total, active), source = counts_source
    published = Published(total, active, source=source, **conventions)
  return Preset(
      model=model, train=train, description=description, published=published
  )


# The width of the tiny presets.
TINY_D = 128


def tiny_model(name: str, **fields) -> model_config.ModelConfig:
  """A CPU-sized model: byte tokens, width 128, 4 layers of 4 heads of 32."""
  return model_config.ModelConfig(
      name=name,
      vocab_size=256,
      hidden_size=TINY_D,
      num_layers=4,
      num_heads=4,
      head_dim=32,
      **fields,
  )


def dims(
    *,
    vocab: int,
    d: int,
    layers: int,
    heads: int,
    kv: int | None = None,
    hd: int | None = None,
) -> dict[str, int]:
  """The `ModelConfig` fields of a config.json's first figures: vocab_size,
  hidden_size D, num_layers, num_heads, and where given num_kv_heads and
  head_dim (left out: the config's defaults)."""
  fields = dict(
      vocab_size=vocab, hidden_size=d, num_layers=layers, num_heads=heads
  )
  if kv is not None:
    fields["num_kv_heads"] = kv
  if hd is not None:
    fields["head_dim"] = hd
  return fields


def row_model(
    name_dims: tuple[str, tuple[int, ...]],
    moe: tuple[Callable[..., moe_core.MoEConfig], tuple],
    **fields,
) -> model_config.ModelConfig:
  """A family table row's model: its name and dims (vocabulary, D, layers,
  heads, and where given KV heads and head dim), its MoE block (the
  family's builder, called with D and the row's sizes) and its other
  `fields`."""
  name, (vocab, d, layers, heads, *kv_hd) = name_dims
  kv, hd = (*kv_hd, None, None)[:2]
  moe_builder, moe_sizes = moe
  return model_config.ModelConfig(
      name=name,
      **dims(vocab=vocab, d=d, layers=layers, heads=heads, kv=kv, hd=hd),
      moe=moe_builder(d, *moe_sizes),
      **fields,
  )


def moe_block(
    sizes: tuple[int, int, int, int], **routing
) -> moe_core.MoEConfig:
  """An MoE block of `sizes` (width D, E experts, K chosen a token, expert
  width F) with a family's routing and expert fields (`routing`)."""
  hidden_size, num_experts, top_k, expert_ffn_size = sizes
  return moe_core.MoEConfig(
      hidden_size=hidden_size,
      num_experts=num_experts,
      top_k=top_k,
      expert_ffn_size=expert_ffn_size,
      **routing,
  )


def full_size_training(**changes) -> TrainDefaults:
  """The suggested run of a full-size model: 4096-token sequences."""
  return TrainDefaults(seq_len=4096, **changes)


# The run suggested for a full-size model whose authors publish none
# (Qwen3-30B-A3B's: batch 1024 x 4096 tokens, 3e-4, aux loss 1e-3).
SUGGESTED_FULL_SIZE_RUN = full_size_training(
    batch_size=1024, learning_rate=3e-4, aux_loss_weight=1e-3
)
