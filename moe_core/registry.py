"""Backend registry: names -> lazily imported Backend classes, and "auto"."""

from __future__ import annotations

import importlib
from typing import Callable


from moe_core import backend as backend_lib
from moe_core.kernels import gpu

# name -> "module:ClassName". Modules are imported on first use only, so
# importing moe_core never imports a backend's hardware-only dependencies.
_REGISTRY: dict[str, str | Callable[..., backend_lib.Backend]] = {
    "reference": "reference.backend:ReferenceBackend",
    "xla": "backends.xla.backend:XlaBackend",
    "cpu": "backends.cpu.backend:CpuBackend",
    "pallas": "backends.pallas.backend:PallasBackend",
    "mosaic_gpu": "backends.mosaic_gpu.backend:MosaicGpuBackend",
    "triton": "backends.triton.backend:TritonBackend",
    "te": "backends.te.backend:TEBackend",
    "mosaic_tpu": "backends.mosaic_tpu.backend:MosaicTpuBackend",
}

# What "auto" tries, per platform, first to last. Every order ends at
# "reference", which runs everywhere. Names not registered are skipped, and
# so are backends whose availability() says no (mosaic_gpu off Hopper); a
# backend that raises NotImplementedError for an input (mosaic_gpu for
# float32) passes it on to the next. On a GPU, mosaic_gpu comes first:
# tokamax's H100 data has Mosaic GPU at or above Triton forward and 2.6x
# it at small K with 256 groups (bench/on_device/gpu_check.py measures
# ours). triton (raw Triton through jax-triton) comes after pallas until a
# GPU run has measured it; it needs jax-triton installed, and says so when
# it is not.
# te (Transformer Engine's kernels) comes after triton, for the same reason,
# and only where TE is installed. On the CPU, cpu (native custom calls) comes
# first where its library was built and the kernels it runs on this CPU beat
# xla's (its `auto_choice()`: measured per kernel set, backends/cpu/
# verdicts.py, docs/cpu.md); otherwise xla runs.
# On a TPU, mosaic_tpu (its own Mosaic TPU kernels) comes first,
# then xla (lax.ragged_dot, which XLA also lowers to a Mosaic kernel):
# bench/results/tpu_check_*.json measures both on a v5e. The platform is
# the one the program is lowered for, not the host's (`auto_order`).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "gpu": ("mosaic_gpu", "pallas", "triton", "te", "xla", "reference"),
    "cpu": ("cpu", "xla", "pallas", "reference"),
    "tpu": ("mosaic_tpu", "xla", "reference"),
}
_DEFAULT_AUTO_ORDER = ("xla", "reference")

_instances: dict[tuple, backend_lib.Backend] = {}


def register_backend(
    name: str,
    target: str | Callable[..., backend_lib.Backend],
    *,
    overwrite: bool = False,
) -> None:
  """Registers a backend under `name`.

  Args:
    name: what users pass as `backend=` or `--moe_backend`.
    target: "package.module:ClassName" (imported lazily) or a callable that
      returns a `Backend` given the options of `get_backend`.
    overwrite: allow replacing an existing registration.
  """
  if not isinstance(name, str) or not name or name == "auto":
    raise ValueError(
        f"backend name must be a non-empty string other than "
        f"'auto', got {name!r}."
    )
  if name in _REGISTRY and not overwrite:
    raise ValueError(
        f"backend {name!r} is already registered; pass "
        "overwrite=True to replace it."
    )
  _REGISTRY[name] = target
  for key in [k for k in _instances if k[0] == name]:
    del _instances[key]


def registered_backends() -> list[str]:
  """Every registered name, usable here or not."""
  return list(_REGISTRY)


def _check_name(name) -> None:
  if name != "auto" and name not in _REGISTRY:
    raise ValueError(
        f"unknown MoE backend {name!r}; valid names: "
        f"{['auto'] + registered_backends()}."
    )


def _resolve(name: str) -> Callable[..., backend_lib.Backend]:
  """The class (or factory) registered as `name`, its module imported."""
  target = _REGISTRY[name]
  if isinstance(target, str):
    module_name, _, attr = target.partition(":")
    target = getattr(importlib.import_module(module_name), attr)
  return target


def backend_class(name: str) -> type[backend_lib.Backend] | None:
  """The Backend class registered as `name`, without building one (nor
  touching a device): its `dtypes` and `precisions` say what it computes.
  None for a backend registered as a factory.

  Raises:
    ValueError: unknown name (or "auto", which is no one class).
    ImportError: the backend's module needs a package that is absent.
  """
  if name == "auto":
    raise ValueError("backend 'auto' is no one class; name a backend.")
  _check_name(name)
  target = _resolve(name)
  if isinstance(target, type) and issubclass(target, backend_lib.Backend):
    return target
  return None


def _construct(name: str, options: dict) -> backend_lib.Backend:
  instance = _resolve(name)(**options)
  if not isinstance(instance, backend_lib.Backend):
    raise TypeError(
        f"backend {name!r} built {type(instance)}, not a " "moe_core Backend."
    )
  return instance


def get_backend(name: str = "auto", **options) -> backend_lib.Backend:
  """The backend called `name`, built with `options` (cached per options).

  "auto" gives the first available backend of `auto_order()`. A named
  backend is returned even if it cannot run here: ask its `availability()`.

  Raises:
    ValueError: unknown name (the message lists the valid ones).
    ImportError: the backend's module needs a package that is absent.
  """
  if isinstance(name, backend_lib.Backend):
    return name
  _check_name(name)
  if name == "auto":
    if options:
      raise ValueError(
          "backend 'auto' takes no options, got "
          f"{sorted(options)}; name a backend to configure it."
      )
    return auto_candidates()[0]
  key = (name, tuple(sorted(options.items())))
  try:
    hash(key)
  except TypeError:
    return _construct(name, options)
  if key not in _instances:
    _instances[key] = _construct(name, options)
  return _instances[key]


def availability(name: str) -> tuple[bool, str]:
  """(usable here, why not) for a registered name, without raising."""
  _check_name(name)
  if name == "auto":
    return True, ""
  try:
    return get_backend(name).availability()
  except ImportError as e:
    return False, str(e)


def auto_choice(name: str) -> tuple[bool, str]:
  """(may "auto" pick `name` here, why not): available, and not passed over
  by its own `auto_choice()` (slower here than the next in the order)."""
  ok, why = availability(name)
  if ok and name != "auto":
    ok, why = get_backend(name).auto_choice()
  return ok, why


def available_backends() -> list[str]:
  """The registered names usable on this machine now."""
  return [n for n in registered_backends() if availability(n)[0]]


def auto_order(platform: str | None = None) -> tuple[str, ...]:
  """The documented "auto" order for `platform`.

  The default is the platform of the program being traced
  (`gpu.lowering_platform`, as the kernel backends' `interpret=None`
  reads it): `moe_core.aot.compile` for a TPU or GPU lowers on a CPU host,
  and the CPU's order would put the cpu backend's custom calls, which only
  a CPU runs, in that program. Outside a lowering it is JAX's default.
  """
  platform = platform or gpu.lowering_platform()
  order = AUTO_ORDER.get(platform, _DEFAULT_AUTO_ORDER)
  return tuple(n for n in order if n in _REGISTRY)


def call_backend(name, fn):
  """fn(backend) for the backend called `name` (or a Backend instance).

  For "auto", fn runs on each of `auto_candidates()` in turn until one does
  not raise NotImplementedError (valid input that backend cannot handle).
  """
  if not (isinstance(name, str) and name == "auto"):
    return fn(get_backend(name))
  unsupported = []
  for candidate in auto_candidates():
    try:
      return fn(candidate)
    except NotImplementedError as e:
      unsupported.append(f"{candidate.name}: {e}")
  raise NotImplementedError(
      "no available backend supports this call: " + "; ".join(unsupported)
  )


def auto_candidates() -> list[backend_lib.Backend]:
  """The available backends "auto" would try, in order (never empty)."""
  found = [get_backend(n) for n in auto_order() if auto_choice(n)[0]]
  if not found:
    found = [get_backend("reference")]
  return found
