"""Transformer Engine, imported lazily: availability, paths and lowering aids.

Everything here is safe to import without Transformer Engine (TE): the
package is imported on the first call that needs it (`import_te`, which
raises ImportError naming what to install). The backend, the NCCL-EP
exchange and the tests share these helpers: whether TE is installed and
usable on a GPU of some capability (`installed`, `availability`), making
TE's tracing believe the GPU is sm_<cc> for `jax.export(...,
platforms=["cuda"])` on a machine without one (`compute_capability`), TE's
registered FFI targets (`custom_call_targets`), which bf16 grouped-GEMM
kernel TE picks on sm_<cc> (`grouped_gemm_path`), and marking the
primitives that lower TE's calls as needing the program's devices
(`lowering_needs_devices`, for TE's custom_partitioning).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys

import jax

from moe_core.kernels import gpu

INSTALL_HINT = (
    "pip install .[te] (transformer-engine-jax, needs a CUDA jaxlib); "
    "tools/setup_te.sh builds it on a CPU machine"
)
_NOT_INSTALLED = f"Transformer Engine is not installed: {INSTALL_HINT}."

# cuBLAS versions as cublasLtGetVersion() reports them (major * 10000 +
# minor * 100 + patch). TE 2.20's cuBLAS grouped GEMM (nvte_grouped_gemm,
# behind te_grouped_gemm_v2_ffi) checks at run time for cuBLAS 13.3 on
# Blackwell and 13.4 on Hopper (transformer_engine/common/gemm/
# cublaslt_grouped_gemm.cu, check_grouped_gemm_requirements).
_CUBLAS_GROUPED_GEMM = 130300
_CUBLAS_GROUPED_GEMM_HOPPER = 130400

V2_TARGET = "te_grouped_gemm_v2_ffi"
V1_TARGET = "te_grouped_gemm_ffi"


@functools.cache
def _import():
  """(module or None, reason): imports transformer_engine.jax once."""
  if importlib.util.find_spec("transformer_engine") is None:
    return None, _NOT_INSTALLED
  try:
    module = importlib.import_module("transformer_engine.jax")
  except (ImportError, OSError) as e:
    # Installed but unusable: a missing libcuda.so.1 or NCCL, a jaxlib
    # without CUDA, an extension built for another jax. Say which.
    return None, (
        f"Transformer Engine is installed but does not import: "
        f"{type(e).__name__}: {e} ({INSTALL_HINT})."
    )
  return module, ""


def import_te():
  """The `transformer_engine.jax` module, imported on the first call.

  Raises:
    ImportError: TE is not installed, or is installed but does not import
      (the message says which, and what to install).
  """
  module, reason = _import()
  if module is None:
    raise ImportError(reason)
  return module


def _extension():
  """TE's compiled extension, `transformer_engine_jax`."""
  import_te()
  return sys.modules["transformer_engine_jax"]


def installed() -> tuple[bool, str]:
  """(True, "") if `transformer_engine.jax` imports here, else (False, why)."""
  module, reason = _import()
  return module is not None, reason


def availability(
    min_compute_capability: int | None = None, feature: str = "this feature"
) -> tuple[bool, str]:
  """(True, "") if TE can run here, else (False, the precise reason).

  Args:
    min_compute_capability: e.g. 90 (sm_90, Hopper) or 100 (Blackwell);
      None for any CUDA GPU.
    feature: what needs that capability, for the message ("MXFP8 grouped
      GEMMs", ...).
  """
  ok, reason = installed()
  if not ok:
    return False, reason
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False, f"no GPU: this device is {device.platform}."
  capability = gpu.probe(device).capability
  if capability is None:
    return False, (
        f"{device.device_kind} reports no CUDA compute capability (TE runs "
        "on NVIDIA GPUs only)."
    )
  if min_compute_capability is not None and capability < min_compute_capability:
    return False, (
        f"GPU sm_{capability} ({device.device_kind}) is older than "
        f"sm_{min_compute_capability}, which {feature} needs."
    )
  return True, ""


def te_compute_capability() -> int | None:
  """The capability TE's tracing sees (patched by `compute_capability`).

  TE asks the CUDA driver for device 0's capability; None when there is no
  driver or GPU to answer (and no patch).
  """
  try:
    return int(_extension().get_device_compute_capability(0))
  except RuntimeError:
    return None


def custom_call_targets() -> tuple[str, ...]:
  """TE's registered FFI targets, sorted: for `DisabledSafetyCheck`s.

  `jax.export` refuses custom calls it does not know to be stable; a test
  that exports TE's lowering passes
  `[jax.export.DisabledSafetyCheck.custom_call(t) for t in these]`.
  """
  return tuple(sorted(_extension().registrations()))


def _cache_clearers():
  """cache_clear of every functools cache in TE's loaded JAX modules.

  TE caches what it learns from the device (its compute capability, and
  decisions made from it: the quantize layouts, the grouped GEMM's
  alpha/beta shape) in functools caches. Changing the capability means
  forgetting them all; the rest are caches too, so clearing them changes
  nothing but time.
  """
  clearers = []
  for name, module in list(sys.modules.items()):
    if module is None or not name.startswith("transformer_engine.jax"):
      continue
    for value in list(vars(module).values()):
      candidates = [value]
      if isinstance(value, type) and value.__module__ == name:
        candidates += [getattr(value, a, None) for a in vars(value)]
      for candidate in candidates:
        clear = getattr(candidate, "cache_clear", None)
        if callable(clear) and hasattr(candidate, "cache_info"):
          clearers.append(clear)
  return clearers


def _forget_device_facts():
  for clear in _cache_clearers():
    clear()
  # Traces made under another capability would be reused by jax.jit.
  jax.clear_caches()


@contextlib.contextmanager
def compute_capability(cc: int):
  """Makes TE's tracing believe every GPU has capability `cc` (90, 100, ...).

  For `jax.export(..., platforms=["cuda"])` on a machine without a GPU: TE
  asks the driver for the capability while tracing (it picks kernels and
  quantize layouts by it) and fails without one. Patches the two names it
  reads (`transformer_engine_jax.get_device_compute_capability` and the
  copy `cpp_extensions.gemm` imported), clears TE's caches of the answer
  and JAX's traces on entry and exit, and restores both names on exit. Not
  thread-safe; never use it where a GPU runs the result.

  Args:
    cc: the capability as an int: 90 for sm_90, 100 for sm_100.
  """
  if isinstance(cc, bool) or not isinstance(cc, int) or cc <= 0:
    raise ValueError(f"cc must be a positive int such as 90, got {cc!r}.")
  extension = _extension()
  gemm_module = sys.modules["transformer_engine.jax.cpp_extensions.gemm"]

  def fake(gpu_id: int = 0) -> int:
    del gpu_id
    return cc

  saved = (
      extension.get_device_compute_capability,
      gemm_module.get_device_compute_capability,
  )
  extension.get_device_compute_capability = fake
  gemm_module.get_device_compute_capability = fake
  try:
    _forget_device_facts()
    yield cc
  finally:
    (
        extension.get_device_compute_capability,
        gemm_module.get_device_compute_capability,
    ) = saved
    _forget_device_facts()


def lowering_needs_devices(*primitives) -> None:
  """Makes JAX lower programs holding `primitives` with their devices.

  TE's primitives lower through `custom_partitioning`, whose rule needs
  the program's device assignment at a jit's top level; JAX supplies it
  only to programs holding a primitive of its registry
  (`prim_requires_devices_during_lowering`, where TE registers its own)
  and does not look inside other primitives. moe_core's kernel primitives,
  which trace TE's calls when they lower, are therefore added. Only JAX's
  lowering cache is affected (such a program is lowered per device
  assignment).
  """
  # pylint: disable-next=g-import-not-at-top
  from jax._src import dispatch

  dispatch.prim_requires_devices_during_lowering.update(primitives)


def cublas_version() -> int:
  """The run-time cuBLASLt version TE loaded, e.g. 130002 for 13.0.2."""
  return int(_extension().get_cublasLt_version())


def format_cublas_version(version: int) -> str:
  """130002 -> "13.0.2"."""
  return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def _v2_compiled() -> tuple[bool, str]:
  """(TE's core library has the cuBLAS grouped GEMM, why not).

  TE probes this once at import (cpp_extensions/gemm.py): the library
  raises when it was compiled against cuBLAS < 13.3.
  """
  import_te()
  gemm_module = sys.modules["transformer_engine.jax.cpp_extensions.gemm"]
  return (
      bool(gemm_module._v2_grouped_gemm_available),  # pylint: disable=protected-access
      str(gemm_module._v2_grouped_gemm_available_reason),  # pylint: disable=protected-access
  )


def grouped_gemm_path(cc: int) -> str:
  """Which kernel TE 2.20 runs a bf16 grouped GEMM with on sm_<cc>, and why.

  TE decides while tracing (`is_v2_grouped_gemm_supported` in
  transformer_engine/jax/cpp_extensions/gemm.py), from three facts:
    1. its core library was compiled against cuBLAS >= 13.3 (else
       `get_grouped_gemm_setup_workspace_size` raises at import and only
       the per-group path exists);
    2. the smallest local GPU has capability >= 90;
    3. the operands are unquantised bfloat16 without bias (MXFP8 takes it
       too on sm_100+ when the row and contraction sizes are multiples of
       128; float16, float32 and FP8 tensor scaling never do).
  TE does not look at the run-time cuBLAS, which the kernel checks when it
  runs: it needs 13.4 on Hopper and 13.3 on Blackwell, and fails the call
  otherwise (it does not fall back). The answer says so.

  Args:
    cc: the compute capability, 90 for sm_90.

  Returns:
    A sentence starting with the FFI target: V2_TARGET ("te_grouped_gemm_v2_
    ffi": cuBLAS's grouped GEMM, no host sync) or V1_TARGET
    ("te_grouped_gemm_ffi": group_sizes copied to the host, one GEMM per
    group), then why; "(fails at run time: ...)" when the run-time cuBLAS is
    too old for the kernel TE picks.
  """
  compiled, why_not = _v2_compiled()
  loop = (
      f"{V1_TARGET}: per-group loop, group_sizes copied to the host each "
      "call (no CUDA graphs)"
  )
  if not compiled:
    return f"{loop}; TE's library has no cuBLAS grouped GEMM: {why_not}"
  if cc < 90:
    return f"{loop}; sm_{cc} < sm_90, which TE's cuBLAS grouped GEMM needs"
  needed = _CUBLAS_GROUPED_GEMM_HOPPER if cc < 100 else _CUBLAS_GROUPED_GEMM
  runtime = cublas_version()
  path = (
      f"{V2_TARGET}: cuBLAS grouped GEMM, no host sync (sm_{cc} needs "
      f"cuBLAS >= {format_cublas_version(needed)}; loaded: "
      f"{format_cublas_version(runtime)})"
  )
  if runtime < needed:
    path += (
        f" (fails at run time: TE picks it on sm_{cc} whatever the loaded "
        "cuBLAS; install a newer nvidia-cublas)"
    )
  return path


def grouped_gemm_runs(cc: int) -> tuple[bool, str]:
  """(TE's bf16 grouped GEMM can run on sm_<cc> with this install, why not)."""
  path = grouped_gemm_path(cc)
  if "fails at run time" in path:
    return False, f"TE's bf16 grouped GEMM: {path}."
  return True, ""
