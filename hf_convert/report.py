"""Prints every transformers MoE family: supported or not, parity error.

  PYTHONPATH=$PWD .venvs/py311-jax0.10/bin/python -m hf_convert.report

One row per family of `families.FAMILIES` (Markdown): for a supported family
the largest |moe_layer - transformers| over the parity tokens on each
backend, relative to the largest |output|, and whether the chosen experts
match as sets; for the others the switches they lack. Needs torch and
transformers (the py311-jax0.10 leg).
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

from hf_convert import families
from hf_convert import parity


def rows(backends=("reference", "xla")):
  """Yields one Markdown row per family."""
  for family in families.FAMILIES:
    if not family.supported:
      yield f"| {family.model_type} | no | {'; '.join(family.lacks)} |"
      continue
    result = parity.compare(family.model_type, backends=backends)
    same = result.ids_hf is not None and np.array_equal(
        np.sort(result.ids, -1), np.sort(result.ids_hf, -1)
    )
    errors = ", ".join(
        f"{b} {e:.1e} ({e / result.scale:.1e} rel)"
        for b, e in result.errors.items()
    )
    yield (
        f"| {family.model_type} | yes | max abs error {errors}; "
        f"experts {'same' if same else 'DIFFER'} |"
    )


def main() -> int:
  if parity.IMPORT_ERROR is not None:
    print(parity.SKIP_REASON, file=sys.stderr)
    return 1
  warnings.filterwarnings("ignore")
  print("| model_type | supported | parity (reference, xla) or lacks |")
  print("|---|---|---|")
  for row in rows():
    print(row, flush=True)
  print(
      f"\n{len(families.SUPPORTED)} supported, "
      f"{len(families.UNSUPPORTED)} not, {len(families.FAMILIES)} in all."
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
