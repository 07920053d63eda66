"""The decoder-only transformer language model whose MLPs are dropless MoE
blocks.

`Transformer` stacks one block per layer: `layers.Block` (pre-norm
attention and MLP), or the block of a family that brings its own, looked up
in `families.py` by the config (Gemma 4's, DeepSeek-V4's). This module names
no family: a family plugs in through that registry alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_core import flax as moe_flax
from moe_core import remat as moe_remat
from train.models import families
from train.models import layers
from train.models import model_config


class LanguageModel(nnx.Module):
  """What `Transformer` and `scan_model.ScannedTransformer` share: the
  constructor, which draws the embedding, then the layers (`add_layers`,
  each form's own), then the head, so that both forms get the same values
  from the same seed; the final norm and the head.

  Args:
    cfg: the model config.
    backend: the MoE backend name for every MoE block.
    compute_dtype: activation dtype (bfloat16 for mixed precision).
    remat: a `moe_core.remat` policy name applied to every block.
    rngs: `nnx.Rngs` with a "params" stream.
    moe_mesh: None for one device, or the keyword arguments that put every
      MoE block on a mesh: {"mesh": Mesh, "expert_axis": ..., "data_axes":
      ...} (see `moe_core.flax.MoE`). The parameters are the same either
      way; only the computation is distributed.
  """

  def __init__(
      self,
      cfg: model_config.ModelConfig,
      *,
      backend: str = "auto",
      compute_dtype=jnp.bfloat16,
      remat: str = "none",
      rngs: nnx.Rngs,
      moe_mesh: dict | None = None,
  ):
    moe_remat.check_policy_name(remat)
    self.cfg = cfg
    self.compute_dtype = compute_dtype
    self.remat = remat
    self.embed = layers.embedding(cfg, rngs)
    self.add_layers(cfg, backend=backend, rngs=rngs, moe_mesh=moe_mesh)
    self.final_norm = layers.RMSNorm(cfg.hidden_size, cfg.norm_eps)
    if not cfg.tie_embeddings:
      self.head = layers.weight(
          rngs.params(), (cfg.hidden_size, cfg.vocab_size)
      )

  def add_layers(self, cfg, *, backend, rngs, moe_mesh) -> None:
    """Builds the layers between the embedding and the final norm, from
    the constructor's arguments."""
    raise NotImplementedError


class Transformer(LanguageModel):
  """The language model: tokens [B, T] int32 -> (logits [B, T, V], stats).

      tokens [B, T]
        -> embed -> blocks: x += attn(norm(x)); x += mlp(norm(x))
        -> norm -> head -> logits [B, T, V] (float32)

  Every layer is its own module, called in a Python loop (unrolled: compile
  time grows with depth; `scan_model.py` scans them instead). `stats` is
  the MoE layers' `layers.moe_stats` stacked in layer order, [L_moe, ...]
  (`layers.stack_stats`), or None for an all-dense model.

  Args: as `LanguageModel`'s.
  """

  def add_layers(self, cfg, *, backend, rngs, moe_mesh) -> None:
    """One block per layer (`blocks`), the family's own where it has one;
    then whatever else the family adds."""
    # nnx.List (flax >= 0.12) marks a list of sub-modules as graph nodes;
    # older flax takes a plain list.
    module_list = getattr(nnx, "List", list)
    family = families.of(cfg)
    block_class = layers.Block if family is None else family.Block
    self.blocks = module_list(
        [
            block_class(cfg, i, backend=backend, rngs=rngs, moe_mesh=moe_mesh)
            for i in range(cfg.num_layers)
        ]
    )
    if family is not None and hasattr(family, "add_modules"):
      family.add_modules(self, cfg, rngs)  # DeepSeek-V4: its hyper-head.

  def __call__(self, tokens: jax.Array):
    family = families.of(self.cfg)
    if family is not None and hasattr(family, "forward"):
      return family.forward(self, tokens)  # DeepSeek-V4: its streams.
    x = layers.embed_tokens(self, tokens)
    positions = jnp.arange(tokens.shape[1])
    stats = []
    for block in self.blocks:
      x, block_stats = moe_flax.call_block(block, x, positions, self.remat)
      if block_stats is not None:
        stats.append(block_stats)
    return layers.output_logits(self, x), layers.stack_stats(stats)

  def moe_blocks(self) -> dict[int, moe_flax.MoE]:
    return {i: b.mlp for i, b in enumerate(self.blocks) if b.is_moe}

  def moe_modules(self) -> list[moe_flax.MoE]:
    """The MoE blocks, in layer order."""
    return list(self.moe_blocks().values())

  def update_correction_biases(
      self, tokens_per_expert: jax.Array, rate: float
  ) -> None:
    """The aux-loss-free rule on every MoE layer's correction bias.

    Args:
      tokens_per_expert: [L_moe, E], layer j's counts in row j (the
        `tokens_per_expert` of the stats `__call__` returns).
      rate: the rule's step size.
    """
    for j, block in enumerate(self.moe_modules()):
      block.update_correction_bias(tokens_per_expert[j], rate)


def set_backend(model: nnx.Module, backend: str) -> None:
  """Points every MoE block of `model` (a Transformer or a
  `scan_model.ScannedTransformer`) at `backend` (parameters unchanged)."""
  for block in model.moe_modules():
    block.backend = backend
