"""Hugging Face MoE blocks -> dropless: `MoEConfig` and parameters.

Converts the sparse MoE block (router, routed experts, shared expert) of
every transformers family in `families.SUPPORTED`, so that
`moe_core.moe_layer` computes what the transformers 5.x block computes for
the same weights (`hf_convert/hf_families_parity_test.py` checks each family;
`hf_convert/hf_parity_test.py`'s docstring details the six first ones):
`moe_config_from_hf` gives the config, `params_from_hf` the block's tensors.
Attention, norms and the choice of which layers are sparse
(`decoder_sparse_step`, `mlp_only_layers`, `first_k_dense_replace`) are out
of scope. Nothing here imports torch: tensors are read through their own
methods, and numpy arrays are accepted as well.

This module holds the two entry points; the readers live by concern:
`converters.py` maps each family to its config reader (`router_fields.py`,
`expert_fields.py`, `shared_fields.py`, `layer_fields.py`), and
`router_params.py`, `expert_params.py` and `shared_params.py` read the
state dict's tensors.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moe_core import config as config_lib
from moe_core import params as params_lib

from hf_convert import converters
from hf_convert import expert_params
from hf_convert import families as families_lib
from hf_convert import fields
from hf_convert import router_params
from hf_convert import shared_params

# Where each family keeps its router matrix and its choice bias (parity.py
# reads ROUTER_KEYS from here).
ROUTER_KEYS = router_params.ROUTER_KEYS
BIAS_KEYS = router_params.BIAS_KEYS

# Every model_type with a converter; the tests check that these are the
# families whose `lacks` is empty.
SUPPORTED_MODEL_TYPES = tuple(
    sorted({*converters.CONVERTERS, *converters.PER_LAYER})
)


def _text_config(hf_config):
  """A multimodal config's text part (what holds the MoE fields): its
  text_config (or thinker_config), followed while the config at hand has
  no MoE fields; a ValueError where that path comes back to a config it
  passed."""
  path, config, seen = "hf_config", hf_config, []
  while getattr(config, "num_experts_per_tok", None) is None:
    name = next(
        (
            n
            for n in ("text_config", "thinker_config")
            if getattr(config, n, None) is not None
        ),
        None,
    )
    if name is None:
      break
    seen.append(config)
    config, path = getattr(config, name), f"{path}.{name}"
    if any(config is passed for passed in seen):
      raise ValueError(
          f"{path} must be a config of its own (the text part), got a "
          "config that holds it: the text_config path is a cycle."
      )
  return config


def _model_type(c) -> str:
  """The family: a text config's `model_type` names its parent's family."""
  model_type = getattr(c, "model_type", None)
  for candidate in (
      model_type,
      str(model_type).replace("-", "_"),
      str(model_type).removesuffix("_text"),
  ):
    if candidate in families_lib.BY_MODEL_TYPE:
      return candidate
  for family in families_lib.FAMILIES:
    if type(c).__name__ == family.config:
      return family.model_type
  return model_type


def _check_layer_idx(c, layer_idx) -> None:
  """layer_idx: None, or a decoder layer in [0, num_hidden_layers) (where
  the config says how many); a negative index is refused, not counted
  from the end."""
  if layer_idx is None:
    return
  if (
      isinstance(layer_idx, bool)
      or not isinstance(layer_idx, (int, np.integer))
      or layer_idx < 0
  ):
    raise ValueError(
        "layer_idx must be None or a decoder layer's index, an int >= 0, "
        f"got {layer_idx!r}."
    )
  layers = getattr(c, "num_hidden_layers", None)
  if isinstance(layers, int) and layer_idx >= layers:
    raise ValueError(
        f"layer_idx must be < hf_config.num_hidden_layers={layers}, got "
        f"layer_idx={layer_idx}."
    )


def moe_config_from_hf(
    hf_config, *, layer_idx: int | None = None, **overrides
) -> config_lib.MoEConfig:
  """The `MoEConfig` of one sparse block of a transformers model config.

  Converted: expert count, top-k, widths, score function, top-k
  normalisation (and its epsilon), routed scaling, correction bias,
  group-limited selection, shared expert and its gate, activation (with
  its clamp, soft caps or GPT-OSS alpha), routing weights on the input,
  the router switches (router bias, logit soft-cap, correction bias on the
  logits, router and expert input norms, per-expert output scale, zero
  experts, hash routing, sqrtsoftplus and sparsemixer scores), the output
  bias after the combine and the output norm, for
  every family in `SUPPORTED_MODEL_TYPES` (docs/hf_families.md says how
  each maps).

  Args:
    hf_config: a transformers config (or any object with its attributes)
      whose `model_type` is one of `families.FAMILIES`; a multimodal
      config's `text_config` is used when the top level has no MoE fields.
    layer_idx: the decoder layer, an int in [0, num_hidden_layers) (a
      negative one is refused, not counted from the end), for the
      families whose MoE settings vary by layer (HunYuan's per-layer
      expert counts, Step-3.7's per-layer clamps, DeepSeek-V4's hash and
      scored layers); other families check its range and ignore it.
    **overrides: `MoEConfig` fields to set on top, e.g. `capacity_factor`.

  Returns:
    A `MoEConfig` that reproduces the Hugging Face block.

  Raises:
    ValueError: `model_type` is not a transformers MoE family; a field the
      family's converter reads is absent or of the wrong type; layer_idx
      is out of range; a layer type the converter does not know; a
      text_config that refers back to its parent. Each names the field or
      argument, what was expected and what was given.
    NotImplementedError: the family (or this setting of it) needs a switch
      dropless lacks; the message names the switches.

  DeepSeek-V2 note: transformers' DeepSeek-V2 router never normalises the
  top-k weights (it ignores `norm_topk_prob`) and always multiplies by
  `routed_scaling_factor`, so the converted config has norm_topk_prob=False
  whatever the Hugging Face config says.
  """
  c = _text_config(hf_config)
  model_type = _model_type(c)
  family = families_lib.BY_MODEL_TYPE.get(model_type)
  if family is None:
    raise ValueError(
        "hf_config.model_type must be one of the transformers MoE families "
        f"{tuple(families_lib.BY_MODEL_TYPE)}, got {model_type!r}."
    )
  if not family.supported:
    raise NotImplementedError(
        f"model_type {model_type!r} ({family.block}) needs switches "
        f"dropless lacks: {', '.join(family.lacks)}."
    )
  _check_layer_idx(c, layer_idx)
  try:
    if model_type in converters.PER_LAYER:
      out = converters.PER_LAYER[model_type](c, layer_idx)
    else:
      out = converters.CONVERTERS[model_type](c)
  except AttributeError as e:  # A field the family's converter reads.
    raise ValueError(
        f"hf_config.{e.name} must be set ({model_type}'s converter reads "
        f"it), got a {type(c).__name__} without it."
    ) from e
  out.setdefault("top_k", fields.get(c, "num_experts_per_tok"))
  out.setdefault("hidden_size", c.hidden_size)
  out.setdefault(
      "activation", fields.activation(getattr(c, "hidden_act", None))
  )
  out.update(overrides)
  return config_lib.MoEConfig(**out)


def _layout_model_type(state_dict, prefix, model_type, hf_config):
  """The family params_from_hf reads the state dict as: model_type, or
  hf_config's (the two must agree); a known family's name exactly, and one
  that stores experts.gate_up_proj_bias where the state dict has it."""
  if hf_config is not None:
    from_config = _model_type(_text_config(hf_config))
    if model_type is not None and model_type != from_config:
      raise ValueError(
          f"model_type={model_type!r} must be hf_config's model type, got "
          f"hf_config of {from_config!r}: give one, or the two alike."
      )
    model_type = from_config
  if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
        f"model_type must be None or one of {SUPPORTED_MODEL_TYPES}, got "
        f"{model_type!r}."
    )
  fused_bias = prefix + "experts.gate_up_proj_bias"
  storing = expert_params.FUSED_BIAS_FAMILIES
  if fused_bias in state_dict and model_type not in storing:
    raise ValueError(
        f"model_type must be one of {storing} for a state dict "
        f"with '{fused_bias}' (gpt_oss interleaves gate and up, "
        f"openai_privacy_filter keeps them in halves), got "
        f"model_type={model_type!r}."
    )
  return model_type


def params_from_hf(
    state_dict,
    cfg: config_lib.MoEConfig,
    *,
    prefix: str = "",
    shared_prefix: str | None = None,
    model_type: str | None = None,
    hf_config=None,
    dtype=jnp.float32,
) -> dict:
  """dropless parameters from a Hugging Face MoE block's state dict.

  Args:
    state_dict: name -> tensor, e.g. `block.state_dict()` (torch tensors or
      numpy arrays), keyed as listed below. Granite's shared MLP lives in
      the decoder layer: add its tensors as `shared_mlp.*` (the decoder
      layer's own names) beside the block's, or see `shared_prefix`.
    cfg: the block's config (from `moe_config_from_hf`).
    prefix: prepended to every key, e.g. "model.layers.3.mlp.".
    shared_prefix: prepended to the shared expert's keys instead of
      `prefix` (default: `prefix`). Granite's shared MLP is the decoder
      layer's `shared_mlp`, beside its `block_sparse_moe`: for layer 3 of a
      whole model, prefix="model.layers.3.block_sparse_moe." and
      shared_prefix="model.layers.3.".
    model_type: the family, one of `SUPPORTED_MODEL_TYPES` exactly (any
      other name is a ValueError), needed where the keys alone do not say
      the layout: GPT-OSS interleaves the gate and up columns of its
      `experts.gate_up_proj` [E, D, 2F] (and of its bias), the privacy
      filter stores the same shapes in halves; a state dict with
      `experts.gate_up_proj_bias` and no model_type, or the model_type of
      a family that stores no such key, is a ValueError naming both.
    hf_config: the transformers config `cfg` came from, instead of (or
      besides) model_type: the family is read from it as
      `moe_config_from_hf` reads it, and a model_type given too must be
      that one (a ValueError naming both otherwise).
    dtype: dtype of the expert and shared weights. The router and its
      other parameters (correction and router biases, scales, hash table)
      stay float32 (int32): routing runs in float32, and rounding the
      router would change which experts are chosen.

  Returns:
    A dict in the layout of `moe_core.param_shapes(cfg)`.

  Keys, relative to the block (`prefix` for a whole model):

    router [E, D] -> router [D, E], one of
      gate.weight, router.weight, gate.wg.weight (HunYuan),
      router.gate.weight (AFMoE), router.layer.weight (DBRX)
    correction bias [E] -> correction_bias [E], one of
      gate.e_score_correction_bias, e_score_correction_bias (a block
      buffer: MiniMax-M2, HY-V3), expert_bias (AFMoE, LFM2-MoE),
      gate.moe_statics.e_score_correction_bias [1, E] (ERNIE 4.5)
    experts.gate_up_proj [E, 2F, D]         -> w_gate, w_up [E, D, F]
      (transformers 5.x: gate rows first, then up rows; Aria stores
      [E, D, 2F] and down_proj [E, F, D], already x @ W)
    experts.down_proj [E, D, F]             -> w_down [E, F, D]
    experts.mlp.{w1,v1,w2} [E * F, D]       -> gate, up, down (DBRX)
    experts.{e}.{gate,up,down}_proj.weight  -> the same, per expert
    experts.{e}.{w1,w3,w2}.weight           -> the same (Mixtral checkpoints)
    input_linear.weight [E, 2F, D] (gate rows first),
    output_linear.weight [E, D, F]          -> the same (JetMoE)
    {shared_expert,shared_experts,shared_mlp}.{gate,up,down}_proj.weight
                                            -> shared_w_* [in, out]
    experts.up_proj [E, F, D], experts.down_proj [E, D, F]
                                            -> w_up, w_down (non-gated
      activation, Nemotron-H: no w_gate)
    shared_experts.gate_up_proj.weight [2Fs, D]
                                            -> shared_w_gate, shared_w_up
      (MiniMax-M3: gate rows first); non-gated: shared_experts.{up,down}_proj
    shared_mlp.input_linear.weight [2Fs, D] -> shared_w_gate, shared_w_up
      (Granite: gate rows first), shared_mlp.output_linear.weight
      [D, Fs] -> shared_w_down
    shared_expert_gate.weight [1, D]        -> shared_gate [D, 1]
    experts.gate_up_proj_bias [E, 2F], experts.down_proj_bias [E, D]
                                            -> b_gate, b_up, b_down (GPT-OSS:
      interleaved like its weights; the privacy filter: in halves)
    router.bias [E]                         -> router_bias (GPT-OSS)
    router.scale [D], router.per_expert_scale [E],
    pre_feedforward_layernorm_2.weight [D]  -> router_norm_scale,
      expert_output_scale, expert_norm_scale (Gemma 4's decoder layer)
    bias [D]                                -> output_bias (JetMoE)
    post_mlp_layernorm.weight [D]           -> output_norm_scale (A.X-K1)
    fc1_latent_proj.weight [L, D], fc2_latent_proj.weight [D, L]
                                            -> latent_in [D, L], latent_out
      [L, D] (Nemotron-H with moe_latent_size; the experts are then [E, L,
      F] and [E, F, L]); Muse Spark's pre_expert_proj, post_expert_proj
    fc1_latent_proj.bias [L], fc2_latent_proj.bias [D]
                                            -> latent_in_bias, latent_out_bias
      (Nemotron-H's mlp_bias)
    shared_experts.{gate,up,down}_proj.bias -> shared_b_gate, shared_b_up
      [Fs], shared_b_down [D] (DeepSeek-V4's, Nemotron-H's mlp_bias)
    pre_expert_norm.weight [L], experts.post_expert_norm.weight [L]
                                            -> latent_norm_scale,
      post_expert_norm_scale, each 1 + w (Muse Spark's norms scale by 1 + w)
    shared_experts.{gate,up,down}_proj [S, ...] -> experts E - S .. E - 1,
      gate.global_scale [1] -> expert_output_scale [E] (Inkling, whose
      router weighs its S shared experts: num_always_on_experts = S)
    gate.tid2eid [V, K]                     -> hash_table, int32
      (DeepSeek-V4's hash layers)

  Hugging Face stores nn.Linear weights as [out, in]; dropless multiplies
  x @ W, so every matrix is transposed.
  """
  want = params_lib.param_shapes(cfg)
  params = router_params.router_params(state_dict, prefix, cfg)
  model_type = _layout_model_type(state_dict, prefix, model_type, hf_config)
  expert_params.latent_params(state_dict, prefix, cfg, params)
  interleaved = model_type in expert_params.INTERLEAVED_GATE_UP
  params["w_gate"], params["w_up"], params["w_down"] = (
      expert_params.expert_stack(state_dict, prefix, cfg, interleaved)
  )
  if cfg.expert_bias:
    params["b_gate"], params["b_up"], params["b_down"] = (
        expert_params.expert_biases(state_dict, prefix, interleaved)
    )
  if cfg.shared_ffn_size:
    params.update(
        shared_params.shared_params(
            state_dict,
            prefix,
            prefix if shared_prefix is None else shared_prefix,
            cfg,
        )
    )
  if cfg.num_always_on_experts:
    shared_params.always_on(state_dict, prefix, cfg, params)
  # A non-gated activation has no gate matrices.
  params = {k: v for k, v in params.items() if v is not None}
  out = {}
  for name, value in params.items():
    if value.shape != want[name]:
      raise ValueError(
          f"converted {name} must have shape {want[name]} for this cfg, got "
          f"{value.shape}; does cfg match the checkpoint?"
      )
    if name == "hash_table":
      out[name] = jnp.asarray(value, jnp.int32)
      continue
    keep_f32 = name in router_params.FLOAT32_PARAMS
    out[name] = jnp.asarray(value, jnp.float32 if keep_f32 else dtype)
  return out
