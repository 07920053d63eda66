"""Published parameter counts of the full-size presets, and how to compare.

Each full-size preset's row holds its config (from the model's Hugging
Face config.json) and what its model card says (`rows.Published`); here
they are gathered and compared, so a test can check that `sizing.py`
counts the configs as their authors do.
"""

from __future__ import annotations

from train.presets import catalog
from train.presets import llama4
from train.presets import rows
from train.presets import sizing

# The row field's type (`rows.Published`), named here for this module's users.
Published = rows.Published


# Llama 4's vision encoder and projector, which its published total counts.
LLAMA4_VISION_PARAMS = llama4.LLAMA4_VISION_PARAMS

# Published counts by preset name: the `published` of every full-size row.
PUBLISHED: dict[str, Published] = {
    name: catalog.get_preset(name).published for name in catalog.FULL_SIZE
}

# The published figures are rounded to 2-3 significant digits: a count
# matches when it is within half a unit of the last published digit, plus 1%
# for the conventions that differ between cards (what counts as "active").
PUBLISHED_RELATIVE_TOLERANCE = 0.01


def published_tolerance(value: float) -> float:
  """Absolute tolerance for a published figure like 46.7e9, 37e9 or 1.6e12
  (cards quote billions, or trillions from 1e12 on)."""
  unit = 1e12 if value >= 1e12 else 1e9
  digits = f"{value / unit:g}"
  decimals = len(digits.partition(".")[2])
  return 0.5 * 10.0 ** (-decimals) * unit + PUBLISHED_RELATIVE_TOLERANCE * value


def counts_as_published(name: str) -> tuple[int, int]:
  """(total, active) of preset `name`, active counted as its card counts it."""
  counts = sizing.param_counts(catalog.get_preset(name).model)
  total = counts.total + PUBLISHED[name].total_beyond_preset
  active = (
      counts.active
      if PUBLISHED[name].active_counts_embedding
      else counts.active_without_embedding
  )
  if not PUBLISHED[name].active_counts_head:
    active -= counts.head
  return total, active
