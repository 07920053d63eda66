"""Runs the conformance suite for one backend: the main of Bazel's targets."""

# By hand:
#   python -m conformance.conformance_main --backend=xla \
#       --backend_options='{"levels": [64, 8]}'
# `moe_conformance_test(backend = ...)` (bazel/moe.bzl) generates a main that
# calls `main()`. absltest honours Bazel's sharding (TEST_TOTAL_SHARDS,
# TEST_SHARD_INDEX): each shard runs its share of the test methods.

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags
from absl.testing import absltest

from conformance import suite

_BACKEND = flags.DEFINE_string(
    "backend", None, "The registered backend to test, e.g. 'xla'."
)
_BACKEND_OPTIONS = flags.DEFINE_string(
    "backend_options",
    "{}",
    "JSON dict of keyword options for moe_core.get_backend(backend, ...).",
)
_TOLERANCE_OVERRIDES = flags.DEFINE_string(
    "tolerance_overrides",
    "{}",
    "JSON dict loosening conformance/tolerances.py for this backend, e.g. "
    "'{\"bfloat16\": [0.04, 0.02]}'; give the reason where it is set.",
)
_EP = flags.DEFINE_bool(
    "ep",
    False,
    "Run the expert-parallel suites (suite.EP_SUITES, which need "
    "8 devices) instead of the single-device ones.",
)
flags.mark_flag_as_required("backend")


def _json_dict(flag) -> dict:
  try:
    value = json.loads(flag.value)
  except json.JSONDecodeError as e:
    raise app.UsageError(
        f"--{flag.name} must be a JSON dict, got " f"{flag.value!r}: {e}"
    ) from e
  if not isinstance(value, dict):
    raise app.UsageError(
        f"--{flag.name} must be a JSON dict, got " f"{flag.value!r}."
    )
  return value


def install_test_classes(module) -> dict[str, type]:
  """Puts the suite's classes for --backend into `module`'s namespace."""
  options = _json_dict(_BACKEND_OPTIONS)
  # JSON has no tuples; backend options such as tile sizes want them.
  options = {
      k: tuple(v) if isinstance(v, list) else v for k, v in options.items()
  }
  overrides = _json_dict(_TOLERANCE_OVERRIDES)
  suites = suite.EP_SUITES if _EP.value else suite.SUITES
  classes = suite.make_test_classes(
      _BACKEND.value, options, overrides, suites=suites
  )
  for name, cls in classes.items():
    cls.__module__ = module.__name__
    setattr(module, name, cls)
  return classes


def _run(argv):
  del argv  # absltest re-reads sys.argv.
  install_test_classes(sys.modules["__main__"])
  absltest.main()


def main():
  app.run(_run)


if __name__ == "__main__":
  main()
