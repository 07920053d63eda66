"""Routed expert weights: every family's layout -> [E, D, F] / [E, F, D].

Hugging Face stores nn.Linear weights as [out, in]; dropless multiplies
x @ W, so most layouts are transposed. Also the experts' biases (GPT-OSS)
and the latent projections and norms around them (Nemotron-H, Muse Spark).
"""

from __future__ import annotations

import numpy as np

from moe_core import activations as activations_lib

from hf_convert import tensors

# Families whose [E, D, 2F] gate_up_proj interleaves gate and up columns;
# the privacy filter stores the same shape with gate and up in halves.
INTERLEAVED_GATE_UP = ("gpt_oss",)
# The families that store experts.gate_up_proj_bias, whose layout the keys
# alone do not say.
FUSED_BIAS_FAMILIES = ("gpt_oss", "openai_privacy_filter")

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


def _non_gated(state_dict, prefix, cfg):
  """Nemotron-H: up_proj [E, F, D], down_proj [E, D, F], no gate."""
  up_key = prefix + "experts.up_proj"
  if up_key not in state_dict:
    raise ValueError(
        f"the non-gated activation={cfg.activation!r} needs '{up_key}' "
        f"in state_dict; got keys {sorted(state_dict)[:8]}..."
    )
  up = tensors.to_numpy(state_dict[up_key], up_key)
  down = tensors.required(
      state_dict, prefix + "experts.down_proj", f"'{up_key}'"
  )
  return None, np.swapaxes(up, 1, 2), np.swapaxes(down, 1, 2)


def _fused(state_dict, prefix, cfg, interleaved):
  """transformers 5.x: gate_up_proj [E, 2F, D] (gate rows, then up) and
  down_proj [E, D, F]; or [E, D, 2F] and [E, F, D], already x @ W (Aria,
  Llama 4, GPT-OSS, whose columns alternate where `interleaved`)."""
  e, d, f = cfg.num_experts, cfg.expert_width, cfg.expert_ffn_size
  fused = prefix + "experts.gate_up_proj"
  gate_up = tensors.to_numpy(state_dict[fused], fused)
  down = tensors.required(
      state_dict, prefix + "experts.down_proj", f"'{fused}'"
  )
  if cfg.num_zero_experts and gate_up.shape[0] > e:
    # LongCat-Flash gives its zero experts gate_up rows they never use.
    gate_up = gate_up[:e]
  if gate_up.shape == (e, d, 2 * f) and down.shape == (e, f, d):
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


def _jetmoe(state_dict, prefix, cfg, interleaved):
  """JetMoE: input_linear [E, 2F, D] (gate rows, then up), output_linear
  [E, D, F], each used as x @ W[e].T."""
  del cfg, interleaved  # The keys say it all.
  key = prefix + "input_linear.weight"
  gate_up = tensors.to_numpy(state_dict[key], key)
  down = tensors.required(
      state_dict, prefix + "output_linear.weight", f"'{key}'"
  )
  gate, up = np.split(np.swapaxes(gate_up, 1, 2), 2, axis=-1)
  return gate, up, np.swapaxes(down, 1, 2)


def _dbrx(state_dict, prefix, cfg, interleaved):
  """DBRX: w1 (gate), v1 (up), w2 (down) stacked as [E * F, D]; the block
  computes x @ w1[e].T, x @ v1[e].T and h @ w2[e]."""
  del interleaved
  e, d = cfg.num_experts, cfg.expert_width
  w1, v1, w2 = (
      tensors.required(
          state_dict, prefix + f"experts.mlp.{n}", f"'{prefix}experts.mlp.w1'"
      ).reshape(e, -1, d)
      for n in ("w1", "v1", "w2")
  )
  return np.swapaxes(w1, 1, 2), np.swapaxes(v1, 1, 2), w2


def _per_expert(names):
  """One nn.Linear per expert: experts.{i}.{gate,up,down}.weight."""

  def read(state_dict, prefix, cfg, interleaved):
    del interleaved
    e = cfg.num_experts
    stacks = []
    for name in names:
      per_expert = [
          tensors.required(
              state_dict,
              f"{prefix}experts.{i}.{name}.weight",
              f"cfg.num_experts={e} (experts 0 to {e - 1})",
          )
          for i in range(e)
      ]
      stacks.append(np.swapaxes(np.stack(per_expert), 1, 2))
    return tuple(stacks)

  return read


# The gated layouts, tried in order: the key (relative to the block) that
# marks each, and its reader. A Mixtral checkpoint (w1 gate, w3 up, w2
# down) wins over per-expert gate_proj keys beside it.
_LAYOUTS = (
    ("experts.gate_up_proj", _fused),
    ("input_linear.weight", _jetmoe),
    ("experts.mlp.w1", _dbrx),
    ("experts.0.w1.weight", _per_expert(("w1", "w3", "w2"))),
    (
        "experts.0.gate_proj.weight",
        _per_expert(("gate_proj", "up_proj", "down_proj")),
    ),
)


def expert_stack(state_dict, prefix, cfg, interleaved=False):
  """[E, D, F] gate, [E, D, F] up, [E, F, D] down from any family's layout.

  The gate is None for a non-gated activation. D is the experts' width
  (the latent one, where the block projects). `interleaved`: GPT-OSS's
  [E, D, 2F] gate_up_proj holds gate and up in alternate columns.
  """
  if not activations_lib.get(cfg.activation).gated:
    return _non_gated(state_dict, prefix, cfg)
  for marker, read in _LAYOUTS:
    if prefix + marker in state_dict:
      return read(state_dict, prefix, cfg, interleaved)
  raise ValueError(
      f"state_dict has no expert weights under prefix {prefix!r}: expected "
      f"'{prefix}experts.gate_up_proj', '{prefix}experts.mlp.w1', "
      f"'{prefix}experts.0.gate_proj.weight' or "
      f"'{prefix}experts.0.w1.weight'; got keys {sorted(state_dict)[:8]}..."
  )


def expert_biases(state_dict, prefix, interleaved):
  """b_gate, b_up [E, F] and b_down [E, D] (GPT-OSS's layout)."""
  fused = tensors.required(
      state_dict, prefix + "experts.gate_up_proj_bias", "cfg.expert_bias=True"
  )
  if interleaved:
    b_gate, b_up = fused[:, ::2], fused[:, 1::2]
  else:
    b_gate, b_up = np.split(fused, 2, axis=-1)
  b_down = tensors.required(
      state_dict, prefix + "experts.down_proj_bias", "cfg.expert_bias=True"
  )
  return b_gate, b_up, b_down


def latent_params(state_dict, prefix, cfg, params) -> None:
  """The latent projections and Muse Spark's norms around the experts, in
  place, where cfg has them."""
  if cfg.expert_latent_size:
    for name, candidates in _LATENT_KEYS.items():
      key = tensors.first_key(state_dict, prefix, candidates)
      if key is None:
        raise ValueError(
            f"cfg.expert_latent_size={cfg.expert_latent_size} needs one of "
            f"{[prefix + k for k in candidates]} in state_dict; found none."
        )
      params[name] = tensors.to_numpy(state_dict[key], key).T
      if cfg.latent_bias:  # Nemotron-H's mlp_bias: the Linear's bias.
        bias_key = key[: -len("weight")] + "bias"
        params[name + "_bias"] = tensors.required(
            state_dict, bias_key, "cfg.latent_bias=True"
        )
  for name, (switch, key) in _CENTRED_SCALES.items():
    if getattr(cfg, switch):
      params[name] = 1.0 + tensors.required(
          state_dict, prefix + key, f"cfg.{switch}=True"
      )
