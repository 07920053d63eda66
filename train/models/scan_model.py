"""The transformer with its layers under a scan: compile time flat in depth.

The same model as `transformer.Transformer` (same blocks, same initial values
from the same seed), but each run of identical layers is one `Block` whose
variables carry a leading layer axis, [L, ...], and the forward runs it
under `jax.lax.scan`, so XLA compiles one layer per stack, whatever the
depth: tokens [B, T] -> embed -> scan over the dense layers (DeepSeek-V3's
dense first layers, a stack of their own) -> scan over the MoE layers ->
norm -> head -> logits [B, T, V] (float32). Each layer runs under the
run's remat policy (`moe_core.remat`), so the backward pass keeps per layer
what the policy says, stacked over the layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import moe_core
from moe_core import flax as moe_flax
from moe_core import remat as moe_remat
from train.models import families
from train.models import layers
from train.models import model_config
from train.models import transformer


class _KeySource:
  """Stands in for `nnx.Rngs` in a layer's constructor.

  Draw n returns fold_in(root, start + n): the key `nnx.Rngs(params=seed)`
  returns for its (start + n)-th draw, so a stacked layer gets the keys its
  unrolled twin gets. `start` may be traced (one value per layer, vmapped).
  """

  def __init__(self, root: jax.Array, start):
    self._root, self._start, self.count = root, start, 0

  def params(self) -> jax.Array:
    key = jax.random.fold_in(self._root, self._start + self.count)
    self.count += 1
    return key


def stacked_block(
    cfg: model_config.ModelConfig,
    layer: int,
    num_layers: int,
    rngs: nnx.Rngs,
    block_class=layers.Block,
    **block_kwargs,
) -> layers.Block:
  """`num_layers` Blocks like layer `layer`, as one with stacked variables.

  Their values are those of `num_layers` Blocks built one after the other
  from `rngs` (which advances past them), computed under `jax.vmap`.

  Args:
    cfg: the model config.
    layer: the index of the first layer (a dense or an MoE one).
    num_layers: L, the stack's depth.
    rngs: the model's `nnx.Rngs`, with a "params" stream.
    block_class: what to stack (Gemma 4: its family's `ScanPeriod`).
    **block_kwargs: `backend`, `moe_mesh` for `layers.Block`.

  Returns:
    A `layers.Block` whose every variable is [L, ...].
  """

  def make(keys):
    return block_class(cfg, layer, rngs=keys, **block_kwargs)

  stream = rngs.params
  root, start = stream.key[...], stream.count[...]
  probe = _KeySource(root, 0)  # Counts one layer's draws.
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(probe)))
  per_layer = probe.count
  offsets = jnp.arange(num_layers, dtype=jnp.uint32) * per_layer
  state = jax.vmap(
      lambda offset: nnx.state(make(_KeySource(root, start + offset)))
  )(offsets)
  stream.count[...] = start + num_layers * per_layer
  return nnx.merge(graphdef, state)


def run_stack(
    stack: layers.Block,
    x: jax.Array,
    positions: jax.Array,
    remat: str,
    first_layer: int = 0,
):
  """x through every layer of `stack` in turn, under `jax.lax.scan`.

  Each layer gets its index (first_layer, first_layer + 1, ...) as a traced
  int, for the layers that differ by index only (GPT-OSS's sliding windows).

  Returns:
    (x, stats): stats are the layers' `moe_stats` stacked [L, ...], or
    None for dense layers.
  """
  graphdef, state = nnx.split(stack)

  def layer(layer_state, x, index):
    return nnx.merge(graphdef, layer_state)(x, positions, index)

  if remat != "none":
    # Inside a scan CSE cannot merge the recomputation with the forward
    # (the scan keeps them apart), so jax need not guard against it.
    layer = jax.checkpoint(
        layer, policy=moe_remat.policy(remat), prevent_cse=False
    )

  def body(x, layer_input):
    layer_state, index = layer_input
    return layer(layer_state, x, index)

  depth = jax.tree.leaves(state)[0].shape[0]
  indices = first_layer + jnp.arange(depth, dtype=jnp.int32)
  return jax.lax.scan(body, x, (state, indices))


def check_scannable(cfg: model_config.ModelConfig) -> None:
  """Raises ValueError if cfg's layers are not a dense run then an MoE run
  of identical layers, the two stacks this model scans.

  Llama 4's interleaved MoE layers (moe_layer_interval > 1) and NoPE layers
  (nope_layer_interval > 0) break the runs: train them unrolled
  (`transformer.Transformer`, --noscan_layers); so does Qwen3-Next's hybrid
  stack, which alternates Gated DeltaNet and softmax-attention layers
  (different variables).
  """
  if cfg.linear_attention is not None:
    raise ValueError(
        f"model {cfg.name!r} mixes Gated DeltaNet and softmax-attention "
        f"layers (full_attention_interval={cfg.full_attention_interval}); "
        "scanned layers need identical layers: train it with "
        "--noscan_layers (transformer.Transformer)."
    )
  if cfg.deepseek_v4 is not None:  # DeepSeek-V4 (issue 33)
    # Its layers differ in kind (attention map, hash or scored routing),
    # so they do not stack into one scanned layer.
    raise ValueError(
        f"scan_layers takes stacks of identical layers; model "
        f"{cfg.name!r} (deepseek_v4: layer types "
        f"{sorted(set(cfg.deepseek_v4.layer_types))}, "
        f"{cfg.deepseek_v4.num_hash_layers} hash layers) is not one: "
        "train it unrolled (--noscan_layers)."
    )
  if cfg.moe is not None and cfg.moe_layer_interval > 1:
    raise ValueError(
        "scanned layers need the MoE layers to be one run after the dense "
        f"ones, got moe_layer_interval={cfg.moe_layer_interval} "
        f"(model {cfg.name!r}); unroll them with --noscan_layers."
    )
  if cfg.nope_layer_interval:
    raise ValueError(
        "scanned layers need every layer of a stack to be alike, got "
        f"nope_layer_interval={cfg.nope_layer_interval} (NoPE layers "
        f"among RoPE ones, model {cfg.name!r}); unroll them with "
        "--noscan_layers."
    )


def _period_family(cfg: model_config.ModelConfig):
  """The family module of `cfg` if its scan stacks periods of layers, not
  layers (`families.py`'s `ScanPeriod`: Gemma 4, whose sliding and global
  layers differ in shape, but each period of them is alike); else None."""
  family = families.of(cfg)
  return family if hasattr(family, "ScanPeriod") else None


class ScannedTransformer(transformer.LanguageModel):
  """The language model with scanned layers: tokens [B, T] -> (logits, stats).

  Attributes: `embed`, `dense_layers` (a stacked `layers.Block` of the
  first dense layers, or None), `moe_layers` (a stacked Block of the MoE
  layers, or None for an all-dense model; Gemma 4: a stacked
  `gemma4.Gemma4Period`, its family's `ScanPeriod`, whose layers differ in
  shape within a period and run under the remat policy together),
  `final_norm`, `head`.

  Args: as `transformer.LanguageModel`'s. `stats` is the MoE layers'
  `moe_stats` stacked [L_moe, ...], or None for an all-dense model, as
  there.
  """

  def add_layers(self, cfg, *, backend, rngs, moe_mesh) -> None:
    """The dense layers' stack, then the MoE layers' (or the periods')."""
    check_scannable(cfg)
    kwargs = {"backend": backend, "moe_mesh": moe_mesh}
    dense, moe = cfg.num_dense_layers, cfg.num_moe_layers
    self.dense_layers = (
        stacked_block(cfg, 0, dense, rngs, **kwargs) if dense else None
    )
    family = _period_family(cfg)
    if family is not None:
      self.moe_layers = stacked_block(
          cfg,
          0,
          family.num_periods(cfg),
          rngs,
          block_class=family.ScanPeriod,
          **kwargs,
      )
    else:
      self.moe_layers = (
          stacked_block(cfg, dense, moe, rngs, **kwargs) if moe else None
      )

  def __call__(self, tokens: jax.Array):
    x = layers.embed_tokens(self, tokens)
    positions = jnp.arange(tokens.shape[1])
    stats = None
    if self.dense_layers is not None:
      x, _ = run_stack(self.dense_layers, x, positions, self.remat)
    if self.moe_layers is not None:
      x, stats = run_stack(
          self.moe_layers,
          x,
          positions,
          self.remat,
          first_layer=self.cfg.num_dense_layers,
      )
      family = _period_family(self.cfg)
      if family is not None:  # [periods, N, ...] -> [layers, ...]
        stats = family.layer_stats(stats)
    return layers.output_logits(self, x), stats

  def moe_modules(self) -> list[moe_flax.MoE]:
    """The MoE blocks: one, whose variables are stacked over the layers
    (Gemma 4: one per layer of a period, stacked over the periods)."""
    if self.moe_layers is None:
      return []
    if _period_family(self.cfg) is not None:
      return [layer.mlp for layer in self.moe_layers.layers]
    return [self.moe_layers.mlp]

  def update_correction_biases(
      self, tokens_per_expert: jax.Array, rate: float
  ) -> None:
    """The aux-loss-free rule on each MoE layer's bias, row by row.

    Args:
      tokens_per_expert: [L_moe, E]: layer j's counts in row j.
      rate: the rule's step size.
    """
    if self.moe_layers is None or not self.cfg.moe.correction_bias:
      return
    modules = self.moe_modules()
    for j, module in enumerate(modules):
      # Module j holds layers j, j + n, ... (n = len(modules); 1 but for
      # Gemma 4's periods).
      bias = getattr(module, moe_flax.BIAS_NAME)
      new = jax.vmap(
          lambda b, counts: moe_core.update_correction_bias(b, counts, rate)
      )(bias[...], tokens_per_expert[j :: len(modules)])
      moe_flax.set_value(bias, new.astype(jnp.float32))
