"""Reading a state dict's tensors as float32 numpy, with errors naming keys.

Nothing here imports torch: a tensor is read through its own methods.
"""

from __future__ import annotations

import numpy as np


def to_numpy(tensor, key: str) -> np.ndarray:
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


def required(state_dict, key, setting):
  """state_dict[key] as float32 numpy; a ValueError naming the key and the
  `setting` that needs it if absent (and `to_numpy`'s if not numbers)."""
  if key not in state_dict:
    raise ValueError(
        f"{setting} needs '{key}' in state_dict; found none (keys: "
        f"{sorted(state_dict)[:8]}...)."
    )
  return to_numpy(state_dict[key], key)


def first_key(state_dict, prefix, candidates):
  """prefix + the first of `candidates` that state_dict holds, or None."""
  for name in candidates:
    if prefix + name in state_dict:
      return prefix + name
  return None
