"""Hugging Face MoE blocks -> dropless: `MoEConfig` and parameters.

Converts the sparse MoE block (router, routed experts, shared expert) of
every transformers family in `families.SUPPORTED`, so that
`moe_core.moe_layer` computes what the transformers 5.x block computes for
the same weights (`reference/hf_families_parity_test.py` checks each family;
`reference/hf_parity_test.py`'s docstring details the six first ones):
`moe_config_from_hf` gives the config, `params_from_hf` the block's tensors.
Attention, norms and the choice of which layers are sparse
(`decoder_sparse_step`, `mlp_only_layers`, `first_k_dense_replace`) are out
of scope. Nothing here imports torch: tensors are read through their own
methods, and numpy arrays are accepted as well. Over 400 lines because it
holds one reader per router kind and weight layout of 66 families; each is
short, and splitting them would scatter the shared key handling.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moe_core import activations as activations_lib
from moe_core import config as config_lib
from moe_core import params as params_lib

from reference.hf_convert import families as families_lib

# transformers `hidden_act` -> dropless activation.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}

# transformers activation -> dropless non-gated activation (Nemotron-H's
# mlp_hidden_act: act(x W_up) W_down, no gate).
_NON_GATED_ACTIVATIONS = {"relu": "relu", "relu2": "relu2"}

# DeepSeek-V3 and its descendants add this to the top-k sum before dividing.
_DEEPSEEK_V3_NORM_EPSILON = 1e-20


def _number(c, name: str) -> float:
  """The config field `name` as a float; a ValueError naming it where it
  is absent or not a number (None, a string, a bool)."""
  value = getattr(c, name, None)
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)
  ):
    family = getattr(c, "model_type", None)
    raise ValueError(
        f"hf_config.{name} must be a number ({family}'s converter reads "
        f"it), got {value!r}."
    )
  return float(value)


def _get(c, *names, default=None):
  """The first of `names` that `c` has and is not None."""
  for name in names:
    value = getattr(c, name, None)
    if value is not None:
      return value
  return default


def _activation(act: str | None, name: str = "hidden_act") -> str:
  """The dropless activation of a transformers activation name."""
  act = act or "silu"
  if act not in _ACTIVATIONS:
    raise NotImplementedError(
        f"{name} must be one of {sorted(_ACTIVATIONS)}, got {act!r}."
    )
  return _ACTIVATIONS[act]


def _needs_switch(model_type: str, switch: str, setting: str):
  """The NotImplementedError for a setting that needs a missing switch."""
  return NotImplementedError(
      f"{model_type} with {setting} needs a switch dropless lacks: {switch}."
  )


def _deepseek_v3(c, *, shared_width=None, **extra) -> dict:
  """The DeepSeek-V3 router (sigmoid, bias, groups, norm, scale)."""
  ffn = c.moe_intermediate_size
  if shared_width is None:
    shared_width = ffn * _get(
        c, "n_shared_experts", "num_shared_experts", default=0
    )
  fields = dict(
      num_experts=_get(
          c, "n_routed_experts", "num_local_experts", "num_experts"
      ),
      expert_ffn_size=ffn,
      score_func="sigmoid",
      correction_bias=True,
      norm_topk_prob=bool(c.norm_topk_prob),
      norm_epsilon=_DEEPSEEK_V3_NORM_EPSILON,
      routed_scaling_factor=_number(c, "routed_scaling_factor"),
      n_group=_get(c, "n_group", default=1),
      topk_group=_get(c, "topk_group", default=1),
      group_score="sum_top2",
      shared_ffn_size=shared_width,
  )
  fields.update(extra)
  return fields


def _deepseek_v2(c) -> dict:
  """transformers' DeepSeek-V2 router: never normalises, always scales."""
  if getattr(c, "mlp_bias", False):
    raise NotImplementedError(
        "mlp_bias must be False (dropless experts have no biases), got "
        "mlp_bias=True."
    )
  fields = dict(
      num_experts=_get(c, "n_routed_experts", "num_experts"),
      expert_ffn_size=c.moe_intermediate_size,
      routed_scaling_factor=_number(c, "routed_scaling_factor"),
      shared_ffn_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
  )
  if c.topk_method == "group_limited_greedy":
    # Softmax scores are > 0, so the 0.0 fill of excluded groups acts as
    # dropless' -inf.
    fields.update(n_group=c.n_group, topk_group=c.topk_group, group_score="max")
  elif c.topk_method != "greedy":
    raise NotImplementedError(
        "topk_method must be 'greedy' or 'group_limited_greedy' (what "
        f"transformers' DeepSeek-V2 router runs), got {c.topk_method!r}."
    )
  return fields


def _softmax(experts, ffn, norm, **extra) -> dict:
  """softmax -> top-k, renormalised iff `norm`."""
  fields = dict(
      num_experts=experts, expert_ffn_size=ffn, norm_topk_prob=bool(norm)
  )
  fields.update(extra)
  return fields


def _mistral4(c, norm) -> dict:
  # Softmax scores, groups scored by their two best, excluded groups filled
  # with 0.0 (as good as -inf: softmax scores are > 0).
  return dict(
      num_experts=_get(c, "n_routed_experts", "num_local_experts"),
      expert_ffn_size=c.moe_intermediate_size,
      norm_topk_prob=bool(norm),
      norm_epsilon=_DEEPSEEK_V3_NORM_EPSILON,
      routed_scaling_factor=_number(c, "routed_scaling_factor"),
      n_group=_get(c, "n_group", default=1),
      topk_group=_get(c, "topk_group", default=1),
      group_score="sum_top2",
      shared_ffn_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
  )


# Cohere 2 MoE's shared_expert_combination_strategy -> shared_combine.
_COHERE_COMBINES = {"sum": "sum", "average": "mean"}


def _cohere2_moe(c) -> dict:
  shared = c.intermediate_size * (c.num_shared_experts or 0)
  combine = c.shared_expert_combination_strategy
  if combine not in _COHERE_COMBINES:
    raise ValueError(
        "shared_expert_combination_strategy must be one of "
        f"{tuple(_COHERE_COMBINES)}, got {combine!r}."
    )
  # Without a shared expert the block adds nothing, so there is no mean.
  extra = dict(shared_combine=_COHERE_COMBINES[combine]) if shared else {}
  if c.expert_selection_fn == "softmax":
    # A softmax over the K best logits is the renormalised top-k softmax.
    routing = dict(norm_topk_prob=True)
  elif c.expert_selection_fn == "sigmoid":
    routing = dict(score_func="sigmoid", norm_topk_prob=bool(c.norm_topk_prob))
  else:
    raise NotImplementedError(
        "expert_selection_fn must be 'softmax' or 'sigmoid', got "
        f"{c.expert_selection_fn!r}."
    )
  return dict(
      num_experts=c.num_experts,
      expert_ffn_size=c.intermediate_size,
      shared_ffn_size=shared,
      **routing,
      **extra,
  )


def _dbrx(c) -> dict:
  ffn = c.ffn_config
  # moe_normalize_expert_weights: None (no normalisation) or the p of the
  # p-norm the top-k softmax weights are divided by.
  p = getattr(ffn, "moe_normalize_expert_weights", None)
  act = (getattr(ffn, "ffn_act_fn", None) or {}).get("name")
  return dict(
      num_experts=ffn.moe_num_experts,
      top_k=ffn.moe_top_k,
      expert_ffn_size=ffn.ffn_hidden_size,
      norm_topk_prob=p is not None,
      norm_topk_p=1.0 if p is None else float(p),
      activation=_activation(act, "ffn_config.ffn_act_fn['name']"),
  )


def _laguna(c) -> dict:
  # The soft-cap (0: none) bends the logits before the sigmoid.
  cap = getattr(c, "moe_router_logit_softcapping", 0.0) or 0.0
  if getattr(c, "moe_apply_router_weight_on_input", False):
    raise _needs_switch(
        "laguna",
        families_lib.INPUT_SIDE_WEIGHTS,
        "moe_apply_router_weight_on_input=True",
    )
  return dict(
      num_experts=c.num_experts,
      expert_ffn_size=c.moe_intermediate_size,
      score_func="sigmoid",
      correction_bias=True,
      norm_topk_prob=True,
      routed_scaling_factor=_number(c, "moe_routed_scaling_factor"),
      shared_ffn_size=c.shared_expert_intermediate_size or 0,
      router_logit_softcap=float(cap),
  )


def _of_layer(values, name: str, layer_idx: int):
  """values[layer_idx] of the per-layer list `name`; a ValueError naming
  both where the list has no such layer."""
  if layer_idx >= len(values):
    raise ValueError(
        f"layer_idx must be < {len(values)}, the layers hf_config.{name} "
        f"lists, got layer_idx={layer_idx}."
    )
  return values[layer_idx]


def _hunyuan(c, layer_idx) -> dict:
  counts = {}
  for name in ("num_experts", "moe_topk"):
    value = getattr(c, name)
    if not isinstance(value, int):
      if layer_idx is None:
        raise ValueError(
            f"layer_idx must be given: hunyuan_v1_moe's {name} is per layer "
            f"({value}); got layer_idx=None."
        )
      value = _of_layer(value, name, layer_idx)
    counts[name] = value
  return dict(
      num_experts=counts["num_experts"],
      top_k=counts["moe_topk"],
      expert_ffn_size=c.intermediate_size,
      norm_topk_prob=True,
      shared_ffn_size=c.intermediate_size,
  )


def _axk2(c) -> dict:
  if (c.n_group or 1) > 1:
    raise _needs_switch(
        "axk2", families_lib.ZERO_FILLED_GROUPS, f"n_group={c.n_group}"
    )
  return _deepseek_v3(c, n_group=1, topk_group=1)


def _longcat_flash(c) -> dict:
  # Zero experts return their (weighted) input. With router_bias=True the
  # classifier has a bias, but the router's forward never adds it (it
  # multiplies by classifier.weight alone), so there is none to convert.
  return dict(
      num_experts=c.n_routed_experts,
      top_k=c.moe_topk,
      expert_ffn_size=c.expert_ffn_hidden_size,
      correction_bias=True,
      routed_scaling_factor=_number(c, "routed_scaling_factor"),
      num_zero_experts=c.zero_expert_num or 0,
      zero_expert_output="identity",
  )


def _layer_value(c, name, layer_idx):
  """`c.name[layer_idx]` for a per-layer list (None: no list)."""
  values = getattr(c, name, None)
  if not values:
    return None
  if layer_idx is None:
    if any(values):
      raise ValueError(
          f"layer_idx must be given: {name} differs across layers "
          f"({values}); got layer_idx=None."
      )
    return None
  return _of_layer(values, name, layer_idx)


def _step3p7(c, layer_idx) -> dict:
  for name in ("swiglu_limits", "swiglu_limits_shared"):
    limit = _layer_value(c, name, layer_idx)
    if limit:
      raise _needs_switch(
          "step3p7",
          families_lib.CLAMP_AFTER_ACTIVATION,
          f"{name}[{layer_idx}]={limit}",
      )
  return dict(
      num_experts=c.num_local_experts,
      expert_ffn_size=c.moe_intermediate_size,
      score_func="sigmoid",
      correction_bias=True,
      norm_topk_prob=True,
      routed_scaling_factor=_number(c, "moe_router_scaling_factor"),
      shared_ffn_size=c.share_expert_dim,
  )


def _silu_only(model_type, c) -> None:
  """Families whose routed experts always run silu, whatever hidden_act."""
  act = _activation(getattr(c, "hidden_act", None))
  if act != "silu":
    raise NotImplementedError(
        f"{model_type}'s routed experts always use silu and its shared "
        "expert hidden_act; dropless gives both one activation, so "
        f"hidden_act must be 'silu', got {c.hidden_act!r}."
    )


def _glm5_next(c) -> dict:
  # The routed and the shared experts both clamp gate and up.
  _silu_only("glm5_next", c)
  return _deepseek_v3(
      c, activation="silu", swiglu_limit=_number(c, "swiglu_limit")
  )


def _hy_v4(c) -> dict:
  # The routed experts clamp; the shared expert (if any) does not.
  clamp = {}
  if c.swiglu_limit is not None:
    clamp = dict(swiglu_limit=_number(c, "swiglu_limit"))
    if c.n_shared_experts:
      clamp["shared_swiglu_clamp"] = False
  return _deepseek_v3(c, activation="silu", **clamp)


def _inkling2(model_type):
  def convert(c) -> dict:
    if c.scoring_func != "sigmoid":
      raise NotImplementedError(
          f"{model_type}'s scoring_func must be 'sigmoid' (the one dropless "
          f"has among its ACT2FN choices), got {c.scoring_func!r}."
      )
    # Scores + bias for the choice, always normalised (+1e-20), scaled.
    return dict(
        num_experts=c.n_routed_experts,
        expert_ffn_size=c.moe_intermediate_size,
        score_func="sigmoid",
        correction_bias=True,
        norm_topk_prob=True,
        norm_epsilon=_DEEPSEEK_V3_NORM_EPSILON,
        routed_scaling_factor=_number(c, "routed_scaling_factor"),
        activation="softcapped_silu",
        gate_softcap=_number(c, "mlp_gate_softcap"),
        up_softcap=_number(c, "mlp_up_softcap"),
    )

  return convert


def _nemotron_h(c) -> dict:
  act = c.mlp_hidden_act
  if act not in _NON_GATED_ACTIVATIONS:
    raise NotImplementedError(
        f"mlp_hidden_act must be one of {sorted(_NON_GATED_ACTIVATIONS)}, "
        f"got {act!r}."
    )
  # NemotronHMLP falls back to intermediate_size for a width of 0.
  shared = c.moe_shared_expert_intermediate_size or c.intermediate_size
  # moe_latent_size: fc1_latent_proj before the experts, fc2_latent_proj
  # after them; the shared expert sees the block's input. mlp_bias gives
  # the shared expert's and the latent projections' linears biases.
  latent = c.moe_latent_size or 0
  return _deepseek_v3(
      c,
      shared_width=shared,
      activation=_NON_GATED_ACTIVATIONS[act],
      expert_latent_size=latent,
      latent_bias=bool(c.mlp_bias) and bool(latent),
      shared_expert_bias=bool(c.mlp_bias) and bool(shared),
  )


def _muse_spark(c) -> dict:
  # DeepSeek-V3's choice (sigmoid + bias, no groups) on logits scaled by
  # output_multiplier (a scale of the router's input, as the logits are
  # linear in it), normalised with 1e-15; the experts at moe_hidden_size
  # between pre_expert_proj (+ its centred RMS norm) and post_expert_proj,
  # each expert's output scaled then RMS-normed before its weight.
  return dict(
      num_experts=c.num_local_experts,
      expert_ffn_size=c.moe_intermediate_size,
      score_func="sigmoid",
      correction_bias=True,
      norm_topk_prob=True,
      norm_epsilon=_MUSE_SPARK_NORM_EPSILON,
      routed_scaling_factor=_number(c, "routed_scaling_factor"),
      router_input_scale=_number(c, "output_multiplier"),
      expert_latent_size=c.moe_hidden_size,
      latent_norm=True,
      latent_norm_epsilon=_number(c, "rms_norm_eps"),
      post_expert_norm=True,
      post_expert_norm_epsilon=_number(c, "post_norm_eps"),
  )


# MuseSparkTopkRouter's norm_topk_prob_eps.
_MUSE_SPARK_NORM_EPSILON = 1e-15


def _minimax_m3_vl(c) -> dict:
  # MiniMax-M2's router; GPT-OSS's clamped GLU in the routed and the shared
  # experts; the scale multiplies the routed sum only.
  return dict(
      num_experts=c.num_local_experts,
      expert_ffn_size=c.intermediate_size,
      score_func="sigmoid",
      correction_bias=True,
      norm_topk_prob=True,
      routed_scaling_factor=_number(c, "routed_scaling_factor"),
      shared_ffn_size=c.shared_intermediate_size or 0,
      activation="gpt_oss_glu",
      swiglu_alpha=_number(c, "swiglu_alpha"),
      swiglu_limit=_number(c, "swiglu_limit"),
  )


def _llama4(c) -> dict:
  # Top-k of the logits, then the sigmoid of each chosen logit (the same
  # choice as top-k of sigmoid scores), never renormalised; the weight
  # scales the expert's input.
  return dict(
      num_experts=c.num_local_experts,
      expert_ffn_size=c.intermediate_size,
      score_func="sigmoid",
      routing_weights_on_input=True,
      shared_ffn_size=c.intermediate_size,
  )


def _gpt_oss(c) -> dict:
  # Biased logits -> top-k -> softmax over the K (the renormalised softmax);
  # the clamped GLU with biases. The privacy filter divides the weights by K
  # and multiplies the output by K: the same block.
  return dict(
      num_experts=c.num_local_experts,
      expert_ffn_size=c.intermediate_size,
      norm_topk_prob=True,
      router_bias=True,
      activation="gpt_oss_glu",
      swiglu_alpha=_number(c, "swiglu_alpha"),
      swiglu_limit=_number(c, "swiglu_limit"),
      expert_bias=True,
  )


def _phimoe(c) -> dict:
  # Phi's sparsemixer always takes two experts (its top_k argument is
  # unused); inference routing (eval mode), whose jitter threshold is
  # router_jitter_noise.
  return dict(
      num_experts=c.num_local_experts,
      top_k=2,
      expert_ffn_size=c.intermediate_size,
      score_func="sparsemixer",
      sparsemixer_epsilon=_number(c, "router_jitter_noise"),
  )


def _kolibri1(c) -> dict:
  # The bias moves the logits for the choice; the weights are the sigmoid
  # of the unbiased chosen logits, normalised with no epsilon.
  return dict(
      num_experts=c.num_experts,
      expert_ffn_size=c.moe_intermediate_size,
      score_func="sigmoid",
      correction_bias=True,
      correction_bias_on="logits",
      norm_topk_prob=bool(c.norm_topk_prob),
      shared_ffn_size=c.shared_expert_intermediate_size or 0,
  )


def _gemma4(c) -> dict:
  # The decoder layer's MoE half: the router sees the layer's residual
  # through its own RMS norm, scale [D] and D**-0.5; the experts see it
  # through pre_feedforward_layernorm_2; per_expert_scale multiplies the
  # normalised weights. Both norms use rms_norm_eps.
  return dict(
      num_experts=c.num_experts,
      top_k=c.top_k_experts,
      expert_ffn_size=c.moe_intermediate_size,
      norm_topk_prob=True,
      router_input_norm=True,
      router_input_scale=float(c.hidden_size**-0.5),
      expert_input_norm=True,
      input_norm_epsilon=_number(c, "rms_norm_eps"),
      expert_output_scale=True,
      activation=_activation(c.hidden_activation, "hidden_activation"),
  )


# DeepSeek-V4's scoring_func (an ACT2FN name) -> dropless score function.
_DEEPSEEK_V4_SCORES = {"sqrtsoftplus": "sqrtsoftplus", "sigmoid": "sigmoid"}
# Its mlp_layer_types: hash-routed and scored MoE layers (transformers'
# DEEPSEEK_V4_MLP_LAYER_TYPES).
_DEEPSEEK_V4_LAYER_TYPES = ("hash_moe", "moe")


def _deepseek_v4(c, layer_idx) -> dict:
  if c.scoring_func not in _DEEPSEEK_V4_SCORES:
    raise NotImplementedError(
        "deepseek_v4's scoring_func must be one of "
        f"{sorted(_DEEPSEEK_V4_SCORES)}, got {c.scoring_func!r}."
    )
  types = c.mlp_layer_types
  if layer_idx is None and len(set(types)) > 1:
    raise ValueError(
        "layer_idx must be given: deepseek_v4's mlp_layer_types differ "
        f"across layers ({types}); got layer_idx=None."
    )
  index = 0 if layer_idx is None else layer_idx
  kind = _of_layer(types, "mlp_layer_types", index)
  if kind not in _DEEPSEEK_V4_LAYER_TYPES:
    # Not guessed: any other kind would have been read as a scored layer.
    raise ValueError(
        f"hf_config.mlp_layer_types[{index}] must be one of "
        f"{_DEEPSEEK_V4_LAYER_TYPES} (deepseek_v4's MoE layers), got "
        f"{kind!r}."
    )
  hashed = kind == "hash_moe"
  # Hash layers take their experts from tid2eid [vocab_size, K] and have no
  # correction bias; both kinds normalise (+1e-20) and scale. The routed
  # and the shared experts (one, of intermediate_size) clamp alike;
  # mlp_bias gives the shared expert's linears biases (not the routed ones).
  return dict(
      num_experts=c.num_local_experts,
      expert_ffn_size=c.intermediate_size,
      score_func=_DEEPSEEK_V4_SCORES[c.scoring_func],
      correction_bias=not hashed,
      hash_vocab_size=c.vocab_size if hashed else 0,
      norm_topk_prob=True,
      norm_epsilon=_DEEPSEEK_V3_NORM_EPSILON,
      routed_scaling_factor=_number(c, "routed_scaling_factor"),
      shared_ffn_size=c.intermediate_size,
      shared_expert_bias=bool(c.mlp_bias),
      swiglu_limit=_number(c, "swiglu_limit"),
  )


def _inkling(c) -> dict:
  # Its S shared experts are scored by the router beside the E routed ones
  # (router [E + S, D]) and weighted with the K chosen: sigmoid weights
  # normalised over all K + S, x route_scale, x the router's learned
  # global_scale (expert_output_scale, the same for every expert).
  shared = c.n_shared_experts or 0
  if not shared:
    raise NotImplementedError(
        "inkling with n_shared_experts=0: its router slices off the last "
        "n_shared_experts logits as the shared ones, and needs >= 1."
    )
  return dict(
      num_experts=c.n_routed_experts + shared,
      top_k=c.num_experts_per_tok + shared,
      num_always_on_experts=shared,
      expert_ffn_size=c.moe_intermediate_size,
      score_func="sigmoid",
      correction_bias=True,
      norm_topk_prob=True,
      routed_scaling_factor=_number(c, "route_scale"),
      expert_output_scale=True,
  )


def _qwen_shared(c) -> dict:
  shared = c.shared_expert_intermediate_size or 0
  return dict(shared_ffn_size=shared, shared_expert_gate=bool(shared))


# model_type -> hf_config -> MoEConfig fields (top_k, hidden_size and
# activation are filled in after, unless set here).
_CONVERTERS = {
    "afmoe": lambda c: dict(
        num_experts=c.num_experts,
        expert_ffn_size=c.moe_intermediate_size,
        score_func="sigmoid",
        correction_bias=True,
        norm_topk_prob=True,
        norm_epsilon=_DEEPSEEK_V3_NORM_EPSILON,
        routed_scaling_factor=_number(c, "route_scale"),
        shared_ffn_size=c.moe_intermediate_size * (c.num_shared_experts or 0),
    ),
    "aria": lambda c: dict(
        num_experts=c.moe_num_experts,
        top_k=c.moe_topk,
        expert_ffn_size=c.intermediate_size,
        norm_topk_prob=True,
        activation="silu",
        shared_ffn_size=c.intermediate_size * c.moe_num_shared_experts,
    ),
    # A.X-K1: DeepSeek-V3's block, then an RMS norm of its output.
    "axk1": lambda c: _deepseek_v3(
        c, output_norm=True, output_norm_epsilon=_number(c, "rms_norm_eps")
    ),
    "axk2": _axk2,
    "bailing_hybrid": _deepseek_v3,
    "beam": lambda c: _deepseek_v3(c, shared_width=0),
    "cohere2_moe": _cohere2_moe,
    "dbrx": _dbrx,
    "deepseek_ocr2": _deepseek_v2,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v32": _deepseek_v3,
    "dots1": _deepseek_v3,
    "dots3_note": lambda c: _deepseek_v3(
        c,
        shared_width=c.shared_experts_intermediate_size
        * (c.n_shared_experts or 0),
    ),
    "ernie4_5_moe": lambda c: dict(
        num_experts=c.moe_num_experts,
        top_k=c.moe_k,
        expert_ffn_size=c.moe_intermediate_size,
        correction_bias=True,
        norm_topk_prob=True,
        shared_ffn_size=c.moe_intermediate_size
        * (c.moe_num_shared_experts or 0),
    ),
    "exaone_moe": _deepseek_v3,
    "diffusion_gemma": _gemma4,
    "flex_olmo": lambda c: _softmax(
        c.num_experts, c.intermediate_size, c.norm_topk_prob
    ),
    "flint": lambda c: dict(
        num_experts=c.num_experts,
        expert_ffn_size=c.moe_intermediate_size,
        score_func="sigmoid",
        norm_topk_prob=bool(c.norm_topk_prob),
        shared_ffn_size=c.shared_expert_intermediate_size or 0,
    ),
    "gemma4": _gemma4,
    "glm4_moe": _deepseek_v3,
    "glm4_moe_lite": _deepseek_v3,
    "glm4v_moe": _deepseek_v3,
    "glm5_next": _glm5_next,
    "glm_moe_dsa": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "granitemoe": lambda c: _softmax(
        c.num_local_experts, c.intermediate_size, True
    ),
    "granitemoe_swa": lambda c: _softmax(
        c.num_local_experts,
        c.intermediate_size,
        True,
        shared_ffn_size=c.shared_intermediate_size or 0,
    ),
    "granitemoehybrid": lambda c: _softmax(
        c.num_local_experts,
        c.intermediate_size,
        True,
        shared_ffn_size=c.shared_intermediate_size or 0,
    ),
    "granitemoeshared": lambda c: _softmax(
        c.num_local_experts,
        c.intermediate_size,
        True,
        shared_ffn_size=c.shared_intermediate_size or 0,
    ),
    "hy_v3": lambda c: dict(
        num_experts=c.num_experts,
        expert_ffn_size=c.moe_intermediate_size,
        score_func="sigmoid",
        correction_bias=True,
        norm_topk_prob=True,
        norm_epsilon=_DEEPSEEK_V3_NORM_EPSILON,
        routed_scaling_factor=_number(c, "router_scaling_factor"),
        shared_ffn_size=c.moe_intermediate_size * (c.num_shared_experts or 0),
    ),
    "hy_v4": _hy_v4,
    "hy_v4_vl": _hy_v4,
    "inkling": _inkling,
    "inkling2": _inkling2("inkling2"),
    "inkling2_loop": _inkling2("inkling2_loop"),
    "jamba": lambda c: _softmax(c.num_experts, c.intermediate_size, False),
    # JetMoE: top-k logits -> softmax, a bias [D] after the combine.
    "jetmoe": lambda c: _softmax(
        c.num_local_experts,
        c.intermediate_size,
        True,
        output_bias=True,
        activation=_activation(c.activation_function, "activation_function"),
    ),
    "kimi_linear": _deepseek_v3,
    "kolibri1": _kolibri1,
    "laguna": _laguna,
    "lara_mini": lambda c: _softmax(
        c.num_experts,
        c.moe_intermediate_size,
        c.norm_topk_prob,
        shared_ffn_size=c.shared_expert_intermediate_size or 0,
    ),
    "lfm2_moe": lambda c: dict(
        num_experts=c.num_experts,
        expert_ffn_size=c.moe_intermediate_size,
        score_func="sigmoid",
        correction_bias=bool(c.use_expert_bias),
        norm_topk_prob=bool(c.norm_topk_prob),
        norm_epsilon=1e-6 if c.norm_topk_prob else 0.0,
        routed_scaling_factor=_number(c, "routed_scaling_factor"),
        activation="silu",
    ),
    "llama4": _llama4,
    "longcat_flash": _longcat_flash,
    "mellum": lambda c: _softmax(
        c.num_experts, c.moe_intermediate_size, c.norm_topk_prob
    ),
    "mimo_v2_flash": lambda c: _deepseek_v3(c, shared_width=0),
    "minimax": lambda c: _softmax(
        c.num_local_experts, c.intermediate_size, True
    ),
    "minimax_m2": lambda c: dict(
        num_experts=c.num_local_experts,
        expert_ffn_size=c.intermediate_size,
        score_func="sigmoid",
        correction_bias=True,
        norm_topk_prob=True,
    ),
    "minimax_m3_vl": _minimax_m3_vl,
    "mistral4": lambda c: _mistral4(c, c.norm_topk_prob),
    "mistral_large4": lambda c: _mistral4(c, True),
    "mixtral": lambda c: _softmax(
        c.num_local_experts, c.intermediate_size, True
    ),
    "muse_spark": _muse_spark,
    "nemotron_h": _nemotron_h,
    "olmoe": lambda c: _softmax(
        c.num_experts, c.intermediate_size, c.norm_topk_prob
    ),
    "openai_privacy_filter": _gpt_oss,
    "phimoe": _phimoe,
    "qwen2_moe": lambda c: _softmax(
        c.num_experts,
        c.moe_intermediate_size,
        c.norm_topk_prob,
        **_qwen_shared(c),
    ),
    "qwen3_5_moe": lambda c: _softmax(
        c.num_experts, c.moe_intermediate_size, True, **_qwen_shared(c)
    ),
    "qwen3_moe": lambda c: _softmax(
        c.num_experts, c.moe_intermediate_size, c.norm_topk_prob
    ),
    "qwen3_next": lambda c: _softmax(
        c.num_experts,
        c.moe_intermediate_size,
        c.norm_topk_prob,
        **_qwen_shared(c),
    ),
    "qwen3_omni_moe": lambda c: _softmax(
        c.num_experts, c.moe_intermediate_size, c.norm_topk_prob
    ),
    "qwen3_vl_moe": lambda c: _softmax(
        c.num_experts, c.moe_intermediate_size, True
    ),
    "qwen4_exp": lambda c: _softmax(
        c.num_experts,
        c.moe_intermediate_size,
        c.norm_topk_prob,
        **_qwen_shared(c),
    ),
    "solar_open": _deepseek_v3,
    "unlimited_ocr": _deepseek_v2,
}


# Converters that read per-layer settings take the layer index as well.
_PER_LAYER = {
    "deepseek_v4": _deepseek_v4,
    "hunyuan_v1_moe": _hunyuan,
    "step3p7": _step3p7,
}


# Every model_type with a converter; the tests check that these are the
# families whose `lacks` is empty.
SUPPORTED_MODEL_TYPES = tuple(sorted({*_CONVERTERS, *_PER_LAYER}))


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
    if model_type in _PER_LAYER:
      fields = _PER_LAYER[model_type](c, layer_idx)
    else:
      fields = _CONVERTERS[model_type](c)
  except AttributeError as e:  # A field the family's converter reads.
    raise ValueError(
        f"hf_config.{e.name} must be set ({model_type}'s converter reads "
        f"it), got a {type(c).__name__} without it."
    ) from e
  fields.setdefault("top_k", _get(c, "num_experts_per_tok"))
  fields.setdefault("hidden_size", c.hidden_size)
  fields.setdefault("activation", _activation(getattr(c, "hidden_act", None)))
  fields.update(overrides)
  return config_lib.MoEConfig(**fields)


def _to_numpy(tensor, key: str) -> np.ndarray:
  """state_dict[key], a torch tensor (any dtype, any device) or an array
  of numbers -> float32 numpy; a ValueError naming the key otherwise (a
  string, an object)."""
  if hasattr(tensor, "detach"):  # torch.Tensor; bfloat16 has no numpy twin.
    return tensor.detach().cpu().float().numpy()
  array = np.asarray(tensor)
  if array.dtype.kind not in "biuf":
    got = (
        repr(tensor)[:40]
        if isinstance(tensor, str)
        else (f"a {type(tensor).__name__} of dtype {array.dtype}")
    )
    raise ValueError(
        f"state_dict[{key!r}] must be a tensor or array of numbers, got "
        f"{got}."
    )
  return array.astype(np.float32)


def _first_key(state_dict, prefix, candidates):
  for name in candidates:
    if prefix + name in state_dict:
      return prefix + name
  return None


# Routing state, kept float32 whatever `dtype` says.
_FLOAT32_PARAMS = (
    "router",
    "correction_bias",
    "router_bias",
    "router_norm_scale",
    "expert_output_scale",
)

# Where each family keeps its router matrix [E, D] and its choice bias [E].
ROUTER_KEYS = (
    "gate.weight",  # Mixtral, Qwen, DeepSeek, GLM, ...
    "router.weight",  # Jamba, Granite, Aria
    "gate.wg.weight",  # HunYuan
    "router.gate.weight",  # AFMoE
    "router.layer.weight",  # DBRX
    "router.classifier.weight",  # LongCat-Flash
    "router.proj.weight",  # Gemma 4 (its decoder layer's router)
)
BIAS_KEYS = (
    "gate.e_score_correction_bias",  # DeepSeek-V3 and descendants, Laguna
    "e_score_correction_bias",  # MiniMax-M2, HY-V3 (a block buffer)
    "expert_bias",  # AFMoE, LFM2-MoE
    "gate.moe_statics.e_score_correction_bias",  # ERNIE 4.5 [1, E]
    "router.e_score_correction_bias",  # LongCat-Flash
)


def _expert_stack(state_dict, prefix, cfg, interleaved=False):
  """[E, D, F] gate, [E, D, F] up, [E, F, D] down from any family's layout.

  The gate is None for a non-gated activation. `interleaved`: GPT-OSS's
  [E, D, 2F] gate_up_proj holds gate and up in alternate columns.
  """
  # d: the experts' width (the latent one, where the block projects).
  e, d, f = cfg.num_experts, cfg.expert_width, cfg.expert_ffn_size
  fused = prefix + "experts.gate_up_proj"
  if not activations_lib.get(cfg.activation).gated:
    # Nemotron-H: up_proj [E, F, D], down_proj [E, D, F], no gate.
    up_key = prefix + "experts.up_proj"
    if up_key not in state_dict:
      raise ValueError(
          f"the non-gated activation={cfg.activation!r} needs '{up_key}' "
          f"in state_dict; got keys {sorted(state_dict)[:8]}..."
      )
    up = _to_numpy(state_dict[up_key], up_key)
    down = _required(state_dict, prefix + "experts.down_proj", f"'{up_key}'")
    return None, np.swapaxes(up, 1, 2), np.swapaxes(down, 1, 2)
  if fused in state_dict:
    gate_up = _to_numpy(state_dict[fused], fused)
    down = _required(state_dict, prefix + "experts.down_proj", f"'{fused}'")
    if cfg.num_zero_experts and gate_up.shape[0] > e:
      # LongCat-Flash gives its zero experts gate_up rows they never use.
      gate_up = gate_up[:e]
    if gate_up.shape == (e, d, 2 * f) and down.shape == (e, f, d):
      # Aria, Llama 4, GPT-OSS: [E, D, 2F] and [E, F, D], already x @ W.
      if interleaved:
        return gate_up[:, :, ::2], gate_up[:, :, 1::2], down
      return gate_up[:, :, :f], gate_up[:, :, f:], down
    if gate_up.ndim != 3 or gate_up.shape[1] % 2:
      raise ValueError(f"{fused} must be [E, 2F, D], got {gate_up.shape}.")
    half = gate_up.shape[1] // 2
    return (
        np.swapaxes(gate_up[:, :half], 1, 2),
        np.swapaxes(gate_up[:, half:], 1, 2),
        np.swapaxes(down, 1, 2),
    )
  jetmoe = prefix + "input_linear.weight"
  if jetmoe in state_dict:
    # JetMoE: input_linear [E, 2F, D] (gate rows, then up), output_linear
    # [E, D, F], each used as x @ W[e].T.
    gate_up = _to_numpy(state_dict[jetmoe], jetmoe)
    down = _required(state_dict, prefix + "output_linear.weight", f"'{jetmoe}'")
    gate, up = np.split(np.swapaxes(gate_up, 1, 2), 2, axis=-1)
    return gate, up, np.swapaxes(down, 1, 2)
  dbrx = prefix + "experts.mlp.w1"
  if dbrx in state_dict:
    # DBRX: w1 (gate), v1 (up), w2 (down) stacked as [E * F, D]; the block
    # computes x @ w1[e].T, x @ v1[e].T and h @ w2[e].
    w1, v1, w2 = (
        _required(state_dict, prefix + f"experts.mlp.{n}", f"'{dbrx}'").reshape(
            e, -1, d
        )
        for n in ("w1", "v1", "w2")
    )
    return np.swapaxes(w1, 1, 2), np.swapaxes(v1, 1, 2), w2
  names = None
  for candidate in (
      ("gate_proj", "up_proj", "down_proj"),
      ("w1", "w3", "w2"),
  ):  # Mixtral: w1 gate, w3 up, w2 down.
    if f"{prefix}experts.0.{candidate[0]}.weight" in state_dict:
      names = candidate
  if names is None:
    raise ValueError(
        f"state_dict has no expert weights under prefix {prefix!r}: expected "
        f"'{fused}', '{dbrx}', '{prefix}experts.0.gate_proj.weight' or "
        f"'{prefix}experts.0.w1.weight'; got keys {sorted(state_dict)[:8]}"
        "..."
    )
  stacks = []
  for name in names:
    per_expert = [
        _required(
            state_dict,
            f"{prefix}experts.{i}.{name}.weight",
            f"cfg.num_experts={e} (experts 0 to {e - 1})",
        )
        for i in range(e)
    ]
    stacks.append(np.swapaxes(np.stack(per_expert), 1, 2))
  return tuple(stacks)


def _required(state_dict, key, setting):
  """state_dict[key] as float32 numpy; a ValueError naming the key and the
  `setting` that needs it if absent (and `_to_numpy`'s if not numbers)."""
  if key not in state_dict:
    raise ValueError(
        f"{setting} needs '{key}' in state_dict; found none (keys: "
        f"{sorted(state_dict)[:8]}...)."
    )
  return _to_numpy(state_dict[key], key)


def _hash_table(table, key: str, cfg) -> np.ndarray:
  """DeepSeek-V4's gate.tid2eid [V, K] as int32: integers (a float table
  is refused, not rounded), each in [0, E + Z), checked before the cast
  (which would wrap 2**32 + 3 to expert 3)."""
  if hasattr(table, "detach"):
    table = table.detach().cpu().numpy()
  table = np.asarray(table)
  if table.dtype.kind not in "iu":
    raise ValueError(
        f"state_dict[{key!r}] must hold integer expert ids (hash routing's "
        f"token id -> experts table), got dtype {table.dtype}."
    )
  e = cfg.num_router_experts
  if table.size and (table.min() < 0 or table.max() >= e):
    raise ValueError(
        f"state_dict[{key!r}] must hold expert ids in [0, {e}), got values "
        f"in [{table.min()}, {table.max()}]."
    )
  return table.astype(np.int32)


def _expert_biases(state_dict, prefix, cfg, interleaved):
  """b_gate, b_up [E, F] and b_down [E, D] (GPT-OSS's layout)."""
  fused = _required(
      state_dict, prefix + "experts.gate_up_proj_bias", "cfg.expert_bias=True"
  )
  if interleaved:
    b_gate, b_up = fused[:, ::2], fused[:, 1::2]
  else:
    b_gate, b_up = np.split(fused, 2, axis=-1)
  b_down = _required(
      state_dict, prefix + "experts.down_proj_bias", "cfg.expert_bias=True"
  )
  return b_gate, b_up, b_down


# The router-side parameters: param name -> (the config switch that needs
# it, its key relative to the block). Gemma 4's are its decoder layer's
# (router.*, pre_feedforward_layernorm_2).
_ROUTER_EXTRAS = {
    "router_bias": ("router_bias", "router.bias"),  # GPT-OSS
    "router_norm_scale": ("router_input_norm", "router.scale"),
    "expert_norm_scale": (
        "expert_input_norm",
        "pre_feedforward_layernorm_2.weight",
    ),
    "expert_output_scale": ("expert_output_scale", "router.per_expert_scale"),
    "output_bias": ("output_bias", "bias"),  # JetMoE, after the combine
    # A.X-K1's norm of the block's output.
    "output_norm_scale": ("output_norm", "post_mlp_layernorm.weight"),
}

# The latent projections [out, in] -> latent_in [D, L], latent_out [L, D]:
# Nemotron-H's fc1/fc2, Muse Spark's pre/post_expert_proj.
_LATENT_KEYS = {
    "latent_in": ("fc1_latent_proj.weight", "pre_expert_proj.weight"),
    "latent_out": ("fc2_latent_proj.weight", "post_expert_proj.weight"),
}
# Muse Spark's norms keep w for a scale of (1 + w): param -> (switch, key).
_CENTRED_SCALES = {
    "latent_norm_scale": ("latent_norm", "pre_expert_norm.weight"),
    "post_expert_norm_scale": (
        "post_expert_norm",
        "experts.post_expert_norm.weight",
    ),
}


def _latent_params(state_dict, prefix, cfg, params) -> None:
  """The latent projections and Muse Spark's norms around the experts, in
  place, where cfg has them."""
  if cfg.expert_latent_size:
    for name, candidates in _LATENT_KEYS.items():
      key = _first_key(state_dict, prefix, candidates)
      if key is None:
        raise ValueError(
            f"cfg.expert_latent_size={cfg.expert_latent_size} needs one of "
            f"{[prefix + k for k in candidates]} in state_dict; found none."
        )
      params[name] = _to_numpy(state_dict[key], key).T
      if cfg.latent_bias:  # Nemotron-H's mlp_bias: the Linear's bias.
        bias_key = key[: -len("weight")] + "bias"
        params[name + "_bias"] = _required(
            state_dict, bias_key, "cfg.latent_bias=True"
        )
  for name, (switch, key) in _CENTRED_SCALES.items():
    if getattr(cfg, switch):
      params[name] = 1.0 + _required(
          state_dict, prefix + key, f"cfg.{switch}=True"
      )


# Families whose [E, D, 2F] gate_up_proj interleaves gate and up columns;
# the privacy filter stores the same shape with gate and up in halves.
_INTERLEAVED_GATE_UP = ("gpt_oss",)
# The families that store experts.gate_up_proj_bias, whose layout the keys
# alone do not say.
_FUSED_BIAS_FAMILIES = ("gpt_oss", "openai_privacy_filter")


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
  if fused_bias in state_dict and model_type not in _FUSED_BIAS_FAMILIES:
    raise ValueError(
        f"model_type must be one of {_FUSED_BIAS_FAMILIES} for a state dict "
        f"with '{fused_bias}' (gpt_oss interleaves gate and up, "
        f"openai_privacy_filter keeps them in halves), got "
        f"model_type={model_type!r}."
    )
  return model_type


def _shared_expert(state_dict, prefix, cfg):
  """shared_w_gate/up [D, Fs], shared_w_down [Fs, D] from any layout."""
  for name in ("shared_expert.", "shared_experts.", "shared_mlp."):
    base = prefix + name

    def part(n, found, base=base):
      """The shared expert's tensor `n`, needed by the one `found`."""
      return _required(state_dict, base + n, f"'{base}{found}'")

    if (
        base + "up_proj.weight" in state_dict
        and not activations_lib.get(cfg.activation).gated
    ):
      # Nemotron-H: up_proj / down_proj, no gate.
      up = part("up_proj.weight", "up_proj.weight")
      return None, up.T, part("down_proj.weight", "up_proj.weight").T
    if base + "gate_up_proj.weight" in state_dict:
      # MiniMax-M3: gate_up_proj [2Fs, D], gate rows then up rows.
      fused = part("gate_up_proj.weight", "gate_up_proj.weight")
      half = fused.shape[0] // 2
      down = part("down_proj.weight", "gate_up_proj.weight")
      return fused[:half].T, fused[half:].T, down.T
    if base + "gate_proj.weight" in state_dict:
      return tuple(
          part(f"{n}.weight", "gate_proj.weight").T
          for n in ("gate_proj", "up_proj", "down_proj")
      )
    if base + "input_linear.weight" in state_dict:
      # Granite: input_linear [2Fs, D], gate rows then up rows.
      fused = part("input_linear.weight", "input_linear.weight")
      half = fused.shape[0] // 2
      down = part("output_linear.weight", "input_linear.weight")
      return fused[:half].T, fused[half:].T, down.T
  raise ValueError(
      f"cfg.shared_ffn_size={cfg.shared_ffn_size} needs a shared expert in "
      f"state_dict: '{prefix}shared_expert.gate_proj.weight', "
      f"'{prefix}shared_experts.gate_proj.weight', "
      f"'{prefix}shared_mlp.gate_proj.weight' or "
      f"'{prefix}shared_mlp.input_linear.weight'; found none."
  )


def _shared_biases(state_dict, prefix, cfg, params) -> None:
  """shared_b_gate, shared_b_up [Fs], shared_b_down [D] in place: the
  biases of the shared expert's nn.Linear layers (DeepSeek-V4's and
  Nemotron-H's shared_experts with mlp_bias)."""
  gated = activations_lib.get(cfg.activation).gated
  for name in ("gate", "up", "down") if gated else ("up", "down"):
    params[f"shared_b_{name}"] = _required(
        state_dict,
        f"{prefix}shared_experts.{name}_proj.bias",
        "cfg.shared_expert_bias=True",
    )


def _always_on_experts(state_dict, prefix, cfg, params) -> None:
  """Inkling's router-weighted shared experts, in place: their stacked
  shared_experts.{gate,up}_proj [S, F, D] and down_proj [S, D, F] become
  experts E - S .. E - 1 after the routed ones; the correction bias [E - S]
  gets 0 for them (they are always chosen); the router's global_scale [1]
  becomes expert_output_scale [E]."""
  s, e = cfg.num_always_on_experts, cfg.num_experts
  shared = [
      np.swapaxes(
          _required(
              state_dict,
              f"{prefix}shared_experts.{name}",
              f"cfg.num_always_on_experts={s}",
          ),
          1,
          2,
      )
      for name in ("gate_proj", "up_proj", "down_proj")
  ]
  for name, stack in zip(("w_gate", "w_up", "w_down"), shared):
    params[name] = np.concatenate([params[name], stack], axis=0)
  if cfg.correction_bias and params["correction_bias"].shape == (e - s,):
    params["correction_bias"] = np.concatenate(
        [params["correction_bias"], np.zeros(s, np.float32)]
    )
  if cfg.expert_output_scale:
    scale = _required(
        state_dict, prefix + "gate.global_scale", "cfg.expert_output_scale"
    )
    params["expert_output_scale"] = np.full(e, scale.reshape(-1)[0])


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
  router_key = _first_key(state_dict, prefix, ROUTER_KEYS)
  if router_key is None:
    raise ValueError(
        f"state_dict has no router matrix under prefix {prefix!r}: expected "
        f"one of {[prefix + k for k in ROUTER_KEYS]}."
    )
  params = {"router": _to_numpy(state_dict[router_key], router_key).T}
  if cfg.correction_bias:
    bias_key = _first_key(state_dict, prefix, BIAS_KEYS)
    if bias_key is None:
      raise ValueError(
          "cfg.correction_bias=True needs one of "
          f"{[prefix + k for k in BIAS_KEYS]} in state_dict; found none."
      )
    params["correction_bias"] = _to_numpy(
        state_dict[bias_key], bias_key
    ).reshape(-1)
  for name, (switch, key) in _ROUTER_EXTRAS.items():
    if name == "expert_output_scale" and cfg.num_always_on_experts:
      continue  # Inkling's one global scale: `_always_on_experts`.
    if getattr(cfg, switch):
      params[name] = _required(state_dict, prefix + key, f"cfg.{switch}=True")
  if cfg.hash_vocab_size:
    # DeepSeek-V4's hash layers: token id -> its K experts.
    key = prefix + "gate.tid2eid"
    if key not in state_dict:
      raise ValueError(
          f"cfg.hash_vocab_size={cfg.hash_vocab_size} needs '{key}' in "
          "state_dict; found none."
      )
    params["hash_table"] = _hash_table(state_dict[key], key, cfg)
  model_type = _layout_model_type(state_dict, prefix, model_type, hf_config)
  _latent_params(state_dict, prefix, cfg, params)
  interleaved = model_type in _INTERLEAVED_GATE_UP
  params["w_gate"], params["w_up"], params["w_down"] = _expert_stack(
      state_dict, prefix, cfg, interleaved
  )
  if cfg.expert_bias:
    params["b_gate"], params["b_up"], params["b_down"] = _expert_biases(
        state_dict, prefix, cfg, interleaved
    )
  if cfg.shared_ffn_size:
    (
        params["shared_w_gate"],
        params["shared_w_up"],
        params["shared_w_down"],
    ) = _shared_expert(
        state_dict, prefix if shared_prefix is None else shared_prefix, cfg
    )
    if cfg.shared_expert_gate:
      params["shared_gate"] = _required(
          state_dict,
          prefix + "shared_expert_gate.weight",
          "cfg.shared_expert_gate=True",
      ).T
    if cfg.shared_expert_bias:
      base = prefix if shared_prefix is None else shared_prefix
      _shared_biases(state_dict, base, cfg, params)
  if cfg.num_always_on_experts:
    _always_on_experts(state_dict, prefix, cfg, params)
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
    keep_f32 = name in _FLOAT32_PARAMS
    out[name] = jnp.asarray(value, jnp.float32 if keep_f32 else dtype)
  return out
