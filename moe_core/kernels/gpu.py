"""The GPU a kernel is built for: one probe of its kind, capability and SMs.

The kernel backends build for the GPU the program is lowered for, which is
not always the one here: `moe_core.aot.compile` lowers inside its target
topology's abstract mesh, whose abstract device names a GPU by its kind and
SM count only. `probe` describes that GPU the same way for every backend, as
a `Gpu` (kind, compute capability as 90/100, SM count): a device given, else
the abstract GPU being lowered for (`target_device`), else the first local
device if it is a GPU. A device that reports a `compute_capability` ("9.0")
is read by it; an abstract one by its kind (`capability_of_kind`). What each
capability means (which kernels, which are supported, what to say when not)
stays with each backend.
"""

from __future__ import annotations

import dataclasses

import jax

# Compute capability by GPU model, for a GPU known by its kind alone (an
# abstract device). Matched as fragments of the kind, longer names first
# ("GB200" before "B200").
_KIND_CAPABILITIES = (
    ("GB200", 100),
    ("GB300", 103),
    ("GH200", 90),
    ("B100", 100),
    ("B200", 100),
    ("B300", 103),
    ("H100", 90),
    ("H200", 90),
    ("H800", 90),
)
# Platforms of a device that is an NVIDIA or AMD GPU: a real device says
# "gpu", an abstract one may say "cuda".
_GPU_PLATFORMS = ("gpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU as the kernels see it.

  Attributes:
    kind: its model, as `jax.Device.device_kind` spells it ("NVIDIA H200").
    capability: its CUDA compute capability as major * 10 + minor (90 for
      sm_90), or None when unknown (not CUDA, or a kind not in the table).
    sm_count: its streaming multiprocessors, or None when not reported.
  """

  kind: str
  capability: int | None
  sm_count: int | None


def lowering_platform() -> str:
  """The platform the program being traced is lowered for.

  The abstract mesh's device where one is set: `moe_core.aot.compile`
  lowers inside its target topology's, whose abstract GPU need not be
  here (a mesh in use also sets one, that of its devices); else JAX's
  default backend. "gpu" for any GPU ("cuda", "rocm").
  """
  platform = getattr(_abstract_device(), "platform", None)
  platform = platform or jax.default_backend()
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def lowering_device():
  """The abstract device of the program being lowered (a GPU or a TPU: the
  abstract mesh's, as `lowering_platform` reads it), or None."""
  return _abstract_device()


def _abstract_device():
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  return getattr(get_mesh(), "abstract_device", None) if get_mesh else None


def target_device():
  """The abstract GPU the program is being lowered for, or None.

  `moe_core.aot.compile` lowers inside the target topology's abstract mesh,
  whose abstract device names the GPU; a kernel built for the local device
  instead (none here, or another model) would not run on it.
  """
  device = _abstract_device()
  if getattr(device, "platform", None) not in _GPU_PLATFORMS:
    return None
  return device


def parse_capability(text) -> int | None:
  """JAX's `compute_capability` string as an int: "9.0" -> 90, "10.3" ->
  103; None for anything else (None, "", "gfx942")."""
  major, dot, minor = str(text or "").partition(".")
  if not (dot and major.isdigit() and minor.isdigit() and len(minor) == 1):
    return None
  return int(major) * 10 + int(minor)


def capability_of_kind(kind: str) -> int | None:
  """The compute capability of a GPU model by name (90 for "NVIDIA H100
  80GB HBM3"), or None for a model not in the table."""
  for fragment, capability in _KIND_CAPABILITIES:
    if fragment in kind:
      return capability
  return None


def capability_text(capability: int | None) -> str:
  """90 -> "9.0", as JAX and NVIDIA write it; None -> "none"."""
  if capability is None:
    return "none"
  return f"{capability // 10}.{capability % 10}"


def _describe(device) -> Gpu | None:
  if getattr(device, "platform", None) not in _GPU_PLATFORMS:
    return None
  kind = str(getattr(device, "device_kind", "") or "")
  if hasattr(device, "compute_capability"):
    capability = parse_capability(device.compute_capability)
  else:
    capability = capability_of_kind(kind)
  # A real device reports `core_count`, an abstract one `num_cores`.
  sm_count = getattr(device, "core_count", None)
  if sm_count is None:
    sm_count = getattr(device, "num_cores", None)
  if not isinstance(sm_count, int) or sm_count <= 0:
    sm_count = None
  return Gpu(kind=kind, capability=capability, sm_count=sm_count)


def probe(device=None) -> Gpu | None:
  """The GPU the kernels are built for, or None when that is not a GPU.

  Args:
    device: a jax device (real or abstract) to describe; None: the abstract
      GPU being lowered for (`target_device`), else the first local device.

  Returns:
    Its `Gpu`; None when the device described is not a GPU (a CPU, or no
    target and no local GPU).
  """
  if device is None:
    device = target_device()
  if device is None:
    device = jax.devices()[0]
  return _describe(device)
