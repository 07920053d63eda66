"""Shims over the JAX versions dropless runs on (0.10.2 to 0.12.0.1).

Everything here that depends on the JAX version is one small function, so
that the rest of the library and its tests have one spelling. `import
moe_core` must not import Pallas (import_test), so the Pallas names are
looked up inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator
import warnings

import jax

# --- Sharding (moe_core.parallel) ---------------------------------------------


def axis_size(axis_name) -> int:
  """The size of a mapped mesh axis, inside shard_map (psum(1) without
  `jax.lax.axis_size`)."""
  if hasattr(jax.lax, "axis_size"):
    return jax.lax.axis_size(axis_name)
  return jax.lax.psum(1, axis_name)


def is_explicit(mesh) -> bool:
  """Whether any axis of `mesh` has explicit sharding (AxisType.Explicit)."""
  types = getattr(mesh, "axis_types", None) or ()
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  return explicit is not None and any(t == explicit for t in types)


def reshard(x, sharding):
  """`jax.reshard`, or `jax.sharding.reshard` where jax lacks the former."""
  reshard_fn = getattr(jax, "reshard", None) or jax.sharding.reshard
  return reshard_fn(x, sharding)


def sharding_of(x):
  """x's sharding in its type (explicit sharding), or None if untyped."""
  typeof = getattr(jax, "typeof", None)
  return getattr(typeof(x), "sharding", None) if typeof else None


# --- Trace-time state ---------------------------------------------------------


def trace_context_flag(name: str, help_text: str):
  """A thread-local bool that JAX's trace caches key on.

  Returns a `jax._src.config` State: `.value` reads it, `flag(True)` is a
  context manager that sets it. Because it is part of JAX's trace context,
  a function jitted and traced once with the flag off is traced again when
  called with it on (and the reverse), so what the flag decides at trace
  time never comes from a stale cache. The same private constructor on
  every supported JAX (0.10.2 to 0.12).
  """
  # pylint: disable-next=g-import-not-at-top
  from jax._src import config as jax_config

  return jax_config.bool_state(
      name, False, help_text, include_in_trace_context=True
  )


def per_device_tracing():
  """A context in which code is traced as one device's, untyped by mesh.

  Inside `shard_map(check_vma=True)` JAX types every value by the mesh
  axes it varies over, and Pallas then wants each `pallas_call` out_shape
  to say how it varies. A kernel traced while its primitive is lowered is
  one device's computation: this turns that typing off for its trace
  (`check_vma`, private to shard_map, on every supported JAX).
  """
  # pylint: disable-next=g-import-not-at-top
  from jax._src import config as jax_config

  state = getattr(jax_config, "_check_vma", None)
  return contextlib.nullcontext() if state is None else state(False)


# --- Pallas Triton ------------------------------------------------------------


def triton_call_target() -> str:
  """The custom-call target of a Pallas Triton kernel in a lowered module.

  Named in the API (`pallas.triton.CUSTOM_CALL_TARGET_NAME`) since jax 0.11;
  the same string before.
  """
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas import triton as plt

  return getattr(plt, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")


def abstract_gpu_mesh(device_kind: str = "NVIDIA H200", num_cores: int = 132):
  """A context in which Pallas Triton kernels lower for `device_kind`.

  In jax 0.11.2 and 0.12 the Triton lowering reads the compute capability
  from the GPU it runs on, or else from the context mesh's abstract device;
  on a machine without a GPU it raises "No supported GPU devices found,
  please specify an abstract GPU device using AbstractDevice". A one-device
  abstract mesh of that GPU supplies it. jax 0.10.2 has AbstractDevice too
  (and lowers the same module inside it); a jax without it gets no context.

  The context mesh must agree with the mesh of any shard_map in the
  program: lower those without it.

  Args:
    device_kind: a GPU name as `jax.Device.device_kind` spells it (JAX maps
      it to a compute capability: H100/H200 -> sm_90).
    num_cores: its number of SMs (132 on an H100 SXM and an H200).
  """
  abstract_device = getattr(jax.sharding, "AbstractDevice", None)
  if abstract_device is None:
    return contextlib.nullcontext()
  # Auto, as on jax 0.10.2: the default turned Explicit on 0.11.2, under
  # which ragged_dot (xla backend, gpu_check's baseline) refuses to lower
  # ("Explicit sharding inference for ragged_dot_general is not currently
  # implemented").
  mesh = jax.sharding.AbstractMesh(
      (1,),
      ("x",),
      axis_types=(jax.sharding.AxisType.Auto,),
      abstract_device=abstract_device(
          device_kind=device_kind, num_cores=num_cores, platform="gpu"
      ),
  )
  return jax.sharding.use_abstract_mesh(mesh)


# jax >= 0.11 warns at every lowering of a pallas_call to Triton (the
# deprecation "jax-pallas-triton", jax/_src/pallas/triton/
# pallas_call_registration.py); dropless chooses the Triton lowering on
# purpose, so its users can do nothing about it.
TRITON_DEPRECATION_MESSAGE = (
    "The Pallas Triton backend is deprecated and will be removed in a future "
    "JAX version. To keep using Pallas on GPU, please migrate to the Mosaic "
    "GPU backend. To keep using Triton, switch to the official Triton "
    "bindings and jax_triton."
)
_triton_deprecations_filtered = 0


def triton_deprecations_filtered() -> int:
  """How many Triton deprecation warnings `filter_triton_deprecation` ate."""
  return _triton_deprecations_filtered


@contextlib.contextmanager
def filter_triton_deprecation() -> Iterator[None]:
  """Swallows and counts JAX's Pallas Triton deprecation warning.

  Only a DeprecationWarning whose message is exactly
  TRITON_DEPRECATION_MESSAGE is swallowed (each one, whatever the filters
  outside say, so the count is complete); every other warning goes through
  the filters and `warnings.showwarning` as it would without this context.
  The warning is raised when the program is lowered, not when pallas_call is
  traced: wrap the lowering (`jax.jit(f).lower`, `jax.export.export`, the
  first call of a jitted function). Like `warnings.catch_warnings`, not
  thread-safe.
  """
  with warnings.catch_warnings():
    warnings.filterwarnings(
        "always",
        message=re.escape(TRITON_DEPRECATION_MESSAGE) + r"\Z",
        category=DeprecationWarning,
    )
    show = warnings.showwarning

    def count_or_show(
        message, category, filename, lineno, file=None, line=None
    ):
      global _triton_deprecations_filtered
      if (
          category is DeprecationWarning
          and str(message) == TRITON_DEPRECATION_MESSAGE
      ):
        _triton_deprecations_filtered += 1
      else:
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = count_or_show
    yield
