"""A check that several of the model's config dataclasses make of their
fields (`gemma4_layout.Gemma4Layout`, `gated_deltanet.DeltaNetConfig`,
`deepseek_v4_config.DeepseekV4Settings`): no flax, no jax."""

from __future__ import annotations

from collections.abc import Iterable


def check_positive_ints(config, owner: str, names: Iterable[str]) -> None:
  """ValueError for the first of `config`'s fields `names` that is not an
  int >= 1 (a bool is not one), naming it `owner.name`: the config as its
  user spells it ("gemma4", "deepseek_v4", "DeltaNetConfig")."""
  for name in names:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}.")
