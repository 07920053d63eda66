"""Reading a transformers config's fields, with errors that name them."""

from __future__ import annotations

import numpy as np

# transformers `hidden_act` -> dropless activation.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}

# transformers activation -> dropless non-gated activation (Nemotron-H's
# mlp_hidden_act: act(x W_up) W_down, no gate).
NON_GATED_ACTIVATIONS = {"relu": "relu", "relu2": "relu2"}


def number(c, name: str) -> float:
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


def get(c, *names, default=None):
  """The first of `names` that `c` has and is not None."""
  for name in names:
    value = getattr(c, name, None)
    if value is not None:
      return value
  return default


def activation(act: str | None, name: str = "hidden_act") -> str:
  """The dropless activation of a transformers activation name."""
  act = act or "silu"
  if act not in ACTIVATIONS:
    raise NotImplementedError(
        f"{name} must be one of {sorted(ACTIVATIONS)}, got {act!r}."
    )
  return ACTIVATIONS[act]


def needs_switch(model_type: str, switch: str, setting: str):
  """The NotImplementedError for a setting that needs a missing switch."""
  return NotImplementedError(
      f"{model_type} with {setting} needs a switch dropless lacks: {switch}."
  )


def of_layer(values, name: str, layer_idx: int):
  """values[layer_idx] of the per-layer list `name`; a ValueError naming
  both where the list has no such layer."""
  if layer_idx >= len(values):
    raise ValueError(
        f"layer_idx must be < {len(values)}, the layers hf_config.{name} "
        f"lists, got layer_idx={layer_idx}."
    )
  return values[layer_idx]


def layer_value(c, name, layer_idx):
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
  return of_layer(values, name, layer_idx)
