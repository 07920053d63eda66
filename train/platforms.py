"""The JAX platform the programs start on when the user names none.

The legs carry JAX's CUDA plugin (to compile for GPUs from any host,
`moe_core.aot`). On a host without an accelerator, JAX is pinned to the CPU
so that it starts without the plugin's failing check; on a TPU host to the
TPU (then the CPU), so that a user who sets nothing trains on the chip; on
a GPU host JAX chooses.

On the CPU the programs also keep freed memory for the next step's
buffers (`backends.cpu.allocator`: glibc otherwise hands each step's large
buffers out as fresh pages, faulted in and zeroed by the kernel that
writes them first).

Importing the library sets nothing: each program (`python -m train.main`,
`python -m bench.<name>`) calls `set_default_platforms` first thing in its
`__main__` block, and the repository's conftest before any test. No jax
import here: a program may call it before jax starts.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from backends.cpu import allocator


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


def default_platforms() -> str | None:
  """The JAX_PLATFORMS value for this host: "cpu" without an accelerator,
  "tpu,cpu" on a TPU host, None on a GPU host (JAX chooses)."""
  return {None: "cpu", "tpu": "tpu,cpu", "gpu": None}[accelerator()]


def set_default_platforms() -> None:
  """Sets JAX's platforms for this host (`default_platforms`) unless the
  user has set JAX_PLATFORMS.

  In the environment (the value jax reads when it is imported, and what
  the program's child processes inherit), and, when jax is imported
  already, in `jax.config` too, which takes effect if no device has been
  used yet (JAX starts its backends at the first device use). A value the
  program set in `jax.config` itself stands.

  Where the first platform is the CPU, also keeps freed memory in the
  process (`allocator.keep_freed_memory`), which counts only before JAX
  starts its CPU client.
  """
  value = os.environ.get("JAX_PLATFORMS")
  if value is None:
    value = default_platforms()
    if value is not None:
      os.environ["JAX_PLATFORMS"] = value
      jax = sys.modules.get("jax")
      if jax is not None and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", value)
  if value is not None and value.split(",")[0].strip() == "cpu":
    allocator.keep_freed_memory()
