"""The GPU a Triton kernel is compiled for: the target topology's abstract
device when `moe_core.aot` compiles for GPUs that are not here, and the PTX
ISA that both Triton and XLA's CUDA plugin accept."""

from __future__ import annotations

import functools
import inspect

from moe_core.kernels import gpu


def target_capability() -> int | None:
  """The compute capability of the target GPU (90 for an H100), or None.

  The abstract GPU that `moe_core.aot.compile` lowers for
  (`gpu.target_device`), which jax-triton would otherwise not see: it
  compiles each kernel for the local GPU (none on a CPU host, or another
  model). None when no target is set or its kind has no known capability
  (`gpu.capability_of_kind`): jax-triton then asks the local GPU.
  """
  device = gpu.target_device()
  return None if device is None else gpu.probe(device).capability


@functools.lru_cache(maxsize=None)
def _plugin_ptx_version() -> int | None:
  """The newest PTX ISA that XLA's CUDA plugin compiles, e.g. 90.

  jax-triton hands XLA the kernels' PTX, which XLA assembles with the PTX
  compiler of the CUDA its plugin was built with (or a newer ptxas): PTX
  ISA 9.0 for CUDA 13.0, by Triton's own CUDA -> PTX mapping. None when
  that is unknown (no CUDA plugin).
  """
  try:
    # pylint: disable=g-import-not-at-top
    from jax._src.lib import cuda_versions
    from triton.backends.nvidia import compiler as nvidia
    # pylint: enable=g-import-not-at-top

    build = int(cuda_versions.cuda_runtime_build_version())
  except Exception:  # pylint: disable=broad-except
    return None
  if build <= 0:
    return None
  return nvidia.ptx_get_version(f"{build // 1000}.{build % 1000 // 10}")


@functools.lru_cache(maxsize=None)
def _triton_ptx_version(capability: int) -> int | None:
  """The PTX ISA Triton emits for sm_<capability> by default (its ptxas')."""
  try:
    # pylint: disable-next=g-import-not-at-top
    from triton.backends.nvidia import compiler as nvidia

    return nvidia.ptx_get_version(nvidia.get_ptxas(capability).version)
  except Exception:  # pylint: disable=broad-except
    return None


def ptx_version(capability: int | None) -> int | None:
  """The PTX ISA to ask Triton for, or None to leave Triton's default.

  Triton labels its PTX with the ISA of the ptxas it ships (9.4 from
  Triton 3.9's CUDA 13.4 ptxas), but XLA assembles it with the CUDA
  plugin's (9.0 for CUDA 13.0), which refuses a newer ISA ("Unsupported
  .version 9.4; current version is '9.0'"). Asking Triton for the
  plugin's ISA keeps it within what both accept.
  """
  plugin = _plugin_ptx_version()
  triton_default = _triton_ptx_version(capability or 90)
  if plugin is None or triton_default is None or triton_default <= plugin:
    return None
  return plugin


def options(jax_triton) -> dict:
  """triton_call's compute_capability and PTX ISA for the target GPU."""
  parameters = inspect.signature(jax_triton.triton_call).parameters
  capability = target_capability()
  options = {}
  if capability is not None and "compute_capability" in parameters:
    options["compute_capability"] = capability
  ptx = ptx_version(capability)
  if ptx is not None and "backend_options" in parameters:
    options["backend_options"] = {"ptx_version": ptx}
  return options
