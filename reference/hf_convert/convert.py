"""Hugging Face MoE blocks -> dropless: `MoEConfig` and parameters.

Converts the sparse MoE block (router, routed experts, shared expert) of the
transformers families Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2 and
DeepSeek-V3, so that `moe_core.moe_layer` computes what the transformers 5.x
block computes for the same weights (see `reference/hf_parity_test.py`, whose
docstring lists how the families differ): `moe_config_from_hf` gives the
config, `params_from_hf` the block's tensors. Attention, norms and the
choice of which layers are sparse (`decoder_sparse_step`, `mlp_only_layers`,
`first_k_dense_replace`) are out of scope. Nothing here imports torch:
tensors are read through their own methods, and numpy arrays are accepted
as well.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moe_core import config as config_lib
from moe_core import params as params_lib

SUPPORTED_MODEL_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
)

# transformers `hidden_act` -> dropless activation.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}

# DeepSeek-V3 adds this to the top-k sum before dividing.
_DEEPSEEK_V3_NORM_EPSILON = 1e-20


def _activation(hf_config) -> str:
  act = getattr(hf_config, "hidden_act", "silu")
  if act not in _ACTIVATIONS:
    raise NotImplementedError(
        f"hidden_act must be one of {sorted(_ACTIVATIONS)}, got {act!r}."
    )
  return _ACTIVATIONS[act]


def moe_config_from_hf(hf_config, **overrides) -> config_lib.MoEConfig:
  """The `MoEConfig` of one sparse block of a transformers model config.

  Converted: expert count, top-k, widths, score function, top-k
  normalisation (and its epsilon), routed scaling, correction bias,
  group-limited selection, shared expert and its gate, activation.

  Args:
    hf_config: a transformers config whose `model_type` is one of
      `SUPPORTED_MODEL_TYPES` (the config object, not a dict).
    **overrides: `MoEConfig` fields to set on top, e.g. `capacity_factor`.

  Returns:
    A `MoEConfig` that reproduces the Hugging Face block's routing.

  DeepSeek-V2 note: transformers' DeepSeek-V2 router never normalises the
  top-k weights (it ignores `norm_topk_prob`) and always multiplies by
  `routed_scaling_factor`, so the converted config has norm_topk_prob=False
  whatever the Hugging Face config says.
  """
  model_type = getattr(hf_config, "model_type", None)
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
        f"hf_config.model_type must be one of "
        f"{SUPPORTED_MODEL_TYPES}, got {model_type!r}."
    )
  c = hf_config
  if model_type == "mixtral":
    fields = dict(
        num_experts=c.num_local_experts,
        expert_ffn_size=c.intermediate_size,
        norm_topk_prob=True,
    )
  elif model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
    ffn = (
        c.intermediate_size
        if model_type == "olmoe"
        else (c.moe_intermediate_size)
    )
    fields = dict(
        num_experts=c.num_experts,
        expert_ffn_size=ffn,
        norm_topk_prob=bool(c.norm_topk_prob),
    )
    if model_type == "qwen2_moe":
      shared = c.shared_expert_intermediate_size or 0
      fields.update(shared_ffn_size=shared, shared_expert_gate=bool(shared))
  elif model_type == "deepseek_v2":
    if getattr(c, "mlp_bias", False):
      raise NotImplementedError(
          "mlp_bias must be False (dropless experts have no biases), got "
          "mlp_bias=True."
      )
    fields = dict(
        num_experts=c.n_routed_experts,
        expert_ffn_size=c.moe_intermediate_size,
        routed_scaling_factor=float(c.routed_scaling_factor),
        shared_ffn_size=(c.moe_intermediate_size * (c.n_shared_experts or 0)),
    )
    if c.topk_method == "group_limited_greedy":
      fields.update(
          n_group=c.n_group, topk_group=c.topk_group, group_score="max"
      )
    elif c.topk_method != "greedy":
      raise NotImplementedError(
          "topk_method must be 'greedy' or 'group_limited_greedy' (what "
          f"transformers' DeepSeek-V2 router runs), got {c.topk_method!r}."
      )
  else:  # "deepseek_v3".
    fields = dict(
        num_experts=c.n_routed_experts,
        expert_ffn_size=c.moe_intermediate_size,
        score_func="sigmoid",
        correction_bias=True,
        norm_topk_prob=bool(c.norm_topk_prob),
        norm_epsilon=_DEEPSEEK_V3_NORM_EPSILON,
        routed_scaling_factor=float(c.routed_scaling_factor),
        n_group=c.n_group or 1,
        topk_group=c.topk_group or 1,
        group_score="sum_top2",
        shared_ffn_size=(c.moe_intermediate_size * (c.n_shared_experts or 0)),
    )
  fields.update(
      top_k=c.num_experts_per_tok,
      hidden_size=c.hidden_size,
      activation=_activation(c),
  )
  fields.update(overrides)
  return config_lib.MoEConfig(**fields)


def _to_numpy(tensor) -> np.ndarray:
  """A torch tensor (any dtype, any device) or array -> float32 numpy."""
  if hasattr(tensor, "detach"):  # torch.Tensor; bfloat16 has no numpy twin.
    tensor = tensor.detach().cpu().float().numpy()
  return np.asarray(tensor, np.float32)


def _expert_stack(state_dict, prefix, num_experts):
  """[E, D, F] gate, [E, D, F] up, [E, F, D] down from either layout."""
  fused = prefix + "experts.gate_up_proj"
  if fused in state_dict:
    gate_up = _to_numpy(state_dict[fused])  # [E, 2F, D]
    down = _to_numpy(state_dict[prefix + "experts.down_proj"])  # [E, D, F]
    if gate_up.ndim != 3 or gate_up.shape[1] % 2:
      raise ValueError(f"{fused} must be [E, 2F, D], got {gate_up.shape}.")
    f = gate_up.shape[1] // 2
    gate, up = gate_up[:, :f], gate_up[:, f:]
    return (
        np.swapaxes(gate, 1, 2),
        np.swapaxes(up, 1, 2),
        np.swapaxes(down, 1, 2),
    )
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
        f"'{fused}' or '{prefix}experts.0.gate_proj.weight' or "
        f"'{prefix}experts.0.w1.weight'; got keys {sorted(state_dict)[:8]}"
        "..."
    )
  stacks = []
  for name in names:
    per_expert = [
        _to_numpy(state_dict[f"{prefix}experts.{e}.{name}.weight"])
        for e in range(num_experts)
    ]
    stacks.append(np.swapaxes(np.stack(per_expert), 1, 2))
  return tuple(stacks)


def params_from_hf(
    state_dict,
    cfg: config_lib.MoEConfig,
    *,
    prefix: str = "",
    dtype=jnp.float32,
) -> dict:
  """dropless parameters from a Hugging Face MoE block's state dict.

  Args:
    state_dict: name -> tensor, e.g. `block.state_dict()` (torch tensors or
      numpy arrays), keyed as listed below.
    cfg: the block's config (from `moe_config_from_hf`).
    prefix: prepended to every key, e.g. "model.layers.3.mlp.".
    dtype: dtype of the expert and shared weights. The router and the
      correction bias stay float32: routing runs in float32, and rounding
      the router would change which experts are chosen.

  Returns:
    A dict in the layout of `moe_core.param_shapes(cfg)`.

  Keys, relative to the block (`prefix` for a whole model):

    gate.weight [E, D]                      -> router [D, E]
    gate.e_score_correction_bias [E]        -> correction_bias [E]
    experts.gate_up_proj [E, 2F, D]         -> w_gate, w_up [E, D, F]
      (transformers 5.x: gate rows first, then up rows)
    experts.down_proj [E, D, F]             -> w_down [E, F, D]
    experts.{e}.{gate,up,down}_proj.weight  -> the same, per expert
    experts.{e}.{w1,w3,w2}.weight           -> the same (Mixtral checkpoints)
    shared_expert(s).{gate,up,down}_proj.weight [out, in]
                                            -> shared_w_* [in, out]
    shared_expert_gate.weight [1, D]        -> shared_gate [D, 1]

  Hugging Face stores nn.Linear weights as [out, in]; dropless multiplies
  x @ W, so every matrix is transposed.
  """
  want = params_lib.param_shapes(cfg)
  params = {"router": _to_numpy(state_dict[prefix + "gate.weight"]).T}
  if cfg.correction_bias:
    params["correction_bias"] = _to_numpy(
        state_dict[prefix + "gate.e_score_correction_bias"]
    )
  params["w_gate"], params["w_up"], params["w_down"] = _expert_stack(
      state_dict, prefix, cfg.num_experts
  )
  if cfg.shared_ffn_size:
    shared = None
    for name in ("shared_expert.", "shared_experts."):
      if prefix + name + "gate_proj.weight" in state_dict:
        shared = prefix + name
    if shared is None:
      raise ValueError(
          f"cfg.shared_ffn_size={cfg.shared_ffn_size} needs "
          f"'{prefix}shared_expert.gate_proj.weight' or "
          f"'{prefix}shared_experts.gate_proj.weight' in state_dict; found "
          "neither."
      )
    for ours, theirs in (
        ("shared_w_gate", "gate_proj"),
        ("shared_w_up", "up_proj"),
        ("shared_w_down", "down_proj"),
    ):
      params[ours] = _to_numpy(state_dict[f"{shared}{theirs}.weight"]).T
    if cfg.shared_expert_gate:
      params["shared_gate"] = _to_numpy(
          state_dict[prefix + "shared_expert_gate.weight"]
      ).T
  out = {}
  for name, value in params.items():
    if value.shape != want[name]:
      raise ValueError(
          f"converted {name} must have shape {want[name]} for this cfg, got "
          f"{value.shape}; does cfg match the checkpoint?"
      )
    keep_f32 = name in ("router", "correction_bias")
    out[name] = jnp.asarray(value, jnp.float32 if keep_f32 else dtype)
  return out
