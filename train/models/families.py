"""The decoder families that bring blocks of their own, by config field.

Most families are rows of settings on `layers.Block` (its attention kinds and
MLPs). A family whose layer differs in shape (Gemma 4's sandwich of a dense
MLP and an MoE block, DeepSeek-V4's hyper-connection streams) is a module
that `transformer.Transformer` asks for by the `ModelConfig` field that turns
it on; it is imported on first use, so the transformer names no family and
the family's module imports the transformer's pieces (`layers.py`) freely.

A family module provides:
  Block(cfg, layer, *, backend, rngs, moe_mesh): its layer (a
    `layers.LayerBlock`, which gives that constructor), called as
    `block(x, positions) -> (x, moe stats or None)` (the stats of
    `layers.moe_stats`).
  add_modules(model, cfg, rngs) (optional): sets the modules the family
    keeps beside its blocks on `model` (DeepSeek-V4: `hc_head`).
  forward(model, tokens) (optional): the model's whole forward pass, for a
    family whose blocks pass other than [B, T, D] between them.
  ScanPeriod, num_periods(cfg), layer_stats(stats) (optional, together):
    for a family whose layers differ within a repeating period, what
    `scan_model.py` stacks (a module of one period's layers, called as a
    Block is), how many periods, and the stats [periods, N, ...] as
    [layers, ...] (Gemma 4).

To add one: write the module, add its settings to `ModelConfig` (a field
that is None unless the family is on) and a line to `_FAMILIES`.
"""

from __future__ import annotations

import importlib
import types

from train.models import model_config

# The `ModelConfig` field that turns a family on -> its module.
_FAMILIES = {
    "gemma4": "train.models.gemma4",
    "deepseek_v4": "train.models.deepseek_v4",
}


def of(cfg: model_config.ModelConfig) -> types.ModuleType | None:
  """The module of the family `cfg` turns on; None for `layers.Block`."""
  for field, module in _FAMILIES.items():
    if getattr(cfg, field) is not None:
      return importlib.import_module(module)
  return None
