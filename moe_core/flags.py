"""The --moe_backend absl flag; import this module to define it."""

from __future__ import annotations

from absl import flags

from moe_core import registry

MOE_BACKEND = flags.DEFINE_string(
    "moe_backend",
    "auto",
    "MoE expert backend: 'auto' or a registered name (see "
    "moe_core.registered_backends(): reference, xla, pallas, ...).",
)


def _check_registered(name: str) -> bool:
  # Read at parse time, so backends registered by the program count too.
  valid = ["auto"] + registry.registered_backends()
  if name not in valid:
    raise flags.ValidationError(
        f"--moe_backend must be 'auto' or a registered backend name, one of "
        f"{valid}; got {name!r}."
    )
  return True


flags.register_validator("moe_backend", _check_registered)
