"""The --moe_backend absl flag; import this module to define it."""

from __future__ import annotations

from absl import flags

from moe_core import registry

MOE_BACKEND = flags.DEFINE_string(
    "moe_backend", "auto",
    "MoE expert backend: 'auto' or a registered name (see "
    "moe_core.registered_backends(): reference, xla, pallas, ...).")


def _is_registered(name: str) -> bool:
  return name == "auto" or name in registry.registered_backends()


flags.register_validator(
    "moe_backend", _is_registered,
    message="--moe_backend must be 'auto' or a registered backend name "
    "(moe_core.registered_backends()).")
