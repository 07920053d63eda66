"""Router weights: the router matrix, its biases, scales and hash table."""

from __future__ import annotations

import numpy as np

from hf_convert import tensors

# Routing state, kept float32 whatever `dtype` says.
FLOAT32_PARAMS = (
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


def router_params(state_dict, prefix, cfg) -> dict:
  """router [D, E], and where cfg has them correction_bias [E] (any
  stored shape), the `_ROUTER_EXTRAS` and hash_table [V, K] int32."""
  router_key = tensors.first_key(state_dict, prefix, ROUTER_KEYS)
  if router_key is None:
    raise ValueError(
        f"state_dict has no router matrix under prefix {prefix!r}: expected "
        f"one of {[prefix + k for k in ROUTER_KEYS]}."
    )
  params = {"router": tensors.to_numpy(state_dict[router_key], router_key).T}
  if cfg.correction_bias:
    bias_key = tensors.first_key(state_dict, prefix, BIAS_KEYS)
    if bias_key is None:
      raise ValueError(
          "cfg.correction_bias=True needs one of "
          f"{[prefix + k for k in BIAS_KEYS]} in state_dict; found none."
      )
    params["correction_bias"] = tensors.to_numpy(
        state_dict[bias_key], bias_key
    ).reshape(-1)
  for name, (switch, key) in _ROUTER_EXTRAS.items():
    if name == "expert_output_scale" and cfg.num_always_on_experts:
      continue  # Inkling's one global scale: `shared_params.always_on`.
    if getattr(cfg, switch):
      params[name] = tensors.required(
          state_dict, prefix + key, f"cfg.{switch}=True"
      )
  if cfg.hash_vocab_size:
    # DeepSeek-V4's hash layers: token id -> its K experts.
    key = prefix + "gate.tid2eid"
    if key not in state_dict:
      raise ValueError(
          f"cfg.hash_vocab_size={cfg.hash_vocab_size} needs '{key}' in "
          "state_dict; found none."
      )
    params["hash_table"] = _hash_table(state_dict[key], key, cfg)
  return params
