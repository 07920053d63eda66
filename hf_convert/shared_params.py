"""Shared expert weights: every family's layout -> shared_w_* [in, out].

Also the shared expert's gate and biases, and Inkling's router-weighted
shared experts, which become routed experts that are always chosen.
"""

from __future__ import annotations

import numpy as np

from moe_core import activations as activations_lib

from hf_convert import tensors

# Where the shared expert lives, relative to the block (Granite's: the
# decoder layer, see params_from_hf's shared_prefix).
_BASES = ("shared_expert.", "shared_experts.", "shared_mlp.")


def _fused_rows(down):
  """A fused [2Fs, D] of gate rows, then up rows, and its `down` [D, Fs]:
  MiniMax-M3's gate_up_proj, Granite's input_linear."""

  def read(part, marker):
    fused = part(marker)
    half = fused.shape[0] // 2
    return fused[:half].T, fused[half:].T, part(down).T

  return read


def _separate(part, marker):
  """gate_proj, up_proj, down_proj: one nn.Linear each."""
  del marker  # gate_proj.weight, the first of the three.
  return tuple(
      part(f"{n}.weight").T for n in ("gate_proj", "up_proj", "down_proj")
  )


def _non_gated(part, marker):
  """Nemotron-H: up_proj / down_proj, no gate."""
  return None, part(marker).T, part("down_proj.weight").T


# The gated layouts under each base, tried in order: the key that marks
# each and its reader.
_GATED_LAYOUTS = (
    ("gate_up_proj.weight", _fused_rows("down_proj.weight")),
    ("gate_proj.weight", _separate),
    ("input_linear.weight", _fused_rows("output_linear.weight")),
)


def _weights(state_dict, prefix, cfg):
  """shared_w_gate/up [D, Fs], shared_w_down [Fs, D] from any layout."""
  layouts = _GATED_LAYOUTS
  if not activations_lib.get(cfg.activation).gated:
    layouts = (("up_proj.weight", _non_gated),) + layouts
  for name in _BASES:
    base = prefix + name
    for marker, read in layouts:
      if base + marker in state_dict:
        # Each tensor of the layout, needed by the `marker` found.
        part = lambda n, base=base, marker=marker: tensors.required(
            state_dict, base + n, f"'{base}{marker}'"
        )
        return read(part, marker)
  raise ValueError(
      f"cfg.shared_ffn_size={cfg.shared_ffn_size} needs a shared expert in "
      f"state_dict: '{prefix}shared_expert.gate_proj.weight', "
      f"'{prefix}shared_experts.gate_proj.weight', "
      f"'{prefix}shared_mlp.gate_proj.weight' or "
      f"'{prefix}shared_mlp.input_linear.weight'; found none."
  )


def shared_params(state_dict, prefix, shared_prefix, cfg) -> dict:
  """shared_w_* under `shared_prefix`; shared_gate [D, 1] (under `prefix`)
  and the biases of the shared expert's nn.Linear layers (DeepSeek-V4's
  and Nemotron-H's mlp_bias) shared_b_gate, shared_b_up [Fs], shared_b_down
  [D], where cfg has them."""
  params = dict(
      zip(
          ("shared_w_gate", "shared_w_up", "shared_w_down"),
          _weights(state_dict, shared_prefix, cfg),
      )
  )
  if cfg.shared_expert_gate:
    params["shared_gate"] = tensors.required(
        state_dict,
        prefix + "shared_expert_gate.weight",
        "cfg.shared_expert_gate=True",
    ).T
  if cfg.shared_expert_bias:
    gated = activations_lib.get(cfg.activation).gated
    for name in ("gate", "up", "down") if gated else ("up", "down"):
      params[f"shared_b_{name}"] = tensors.required(
          state_dict,
          f"{shared_prefix}shared_experts.{name}_proj.bias",
          "cfg.shared_expert_bias=True",
      )
  return params


def always_on(state_dict, prefix, cfg, params) -> None:
  """Inkling's router-weighted shared experts, in place: their stacked
  shared_experts.{gate,up}_proj [S, F, D] and down_proj [S, D, F] become
  experts E - S .. E - 1 after the routed ones; the correction bias [E - S]
  gets 0 for them (they are always chosen); the router's global_scale [1]
  becomes expert_output_scale [E]."""
  s, e = cfg.num_always_on_experts, cfg.num_experts
  shared = [
      np.swapaxes(
          tensors.required(
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
    scale = tensors.required(
        state_dict, prefix + "gate.global_scale", "cfg.expert_output_scale"
    )
    params["expert_output_scale"] = np.full(e, scale.reshape(-1)[0])
