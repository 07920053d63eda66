"""The JAX platform the programs start on when the user names none.

The legs carry JAX's CUDA plugin (to compile for GPUs from any host,
`moe_core.aot`). On a host without an accelerator, JAX is pinned to the CPU
so that it starts without the plugin's failing check; on a TPU host to the
TPU (then the CPU), so that a user who sets nothing trains on the chip; on
a GPU host JAX chooses. No jax import here: this runs before jax starts.
"""

from __future__ import annotations

import glob
import importlib.util
import os


def accelerator() -> str | None:
  """ "gpu" or "tpu" if this host has one attached (by its device files),
  else None."""
  if os.path.exists("/dev/nvidiactl"):
    return "gpu"
  # TPU VMs expose /dev/accel<N> (v4) or VFIO groups (v5e and later); a
  # VFIO group alone is any passed-through device, so libtpu must be
  # installed too (found, not imported).
  devices = glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
  if devices and importlib.util.find_spec("libtpu") is not None:
    return "tpu"
  return None


def set_default_platforms() -> None:
  """Sets JAX_PLATFORMS for this host unless the user has set it."""
  found = accelerator()
  if found is None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  elif found == "tpu":
    os.environ.setdefault("JAX_PLATFORMS", "tpu,cpu")
