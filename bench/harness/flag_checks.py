"""Checks shared by the benchmarks' absl flags."""

from __future__ import annotations

from typing import Sequence

from absl import flags


def check_distinct_names(
    flag: str, names: Sequence[str], valid: Sequence[str]
) -> bool:
  """True if `names` is one or more distinct entries of `valid`.

  Raises flags.ValidationError naming --`flag`, the choices and what was
  given, for use inside an absl flag validator.
  """
  valid = list(valid)
  if not names or len(set(names)) < len(names) or set(names) - set(valid):
    raise flags.ValidationError(
        f"--{flag} must list one or more distinct names from {valid}, got "
        f"{names!r}."
    )
  return True
