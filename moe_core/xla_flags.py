"""The XLA flags that expert parallelism wants on GPU, with the reason for each.

Call `xla_flags.apply_gpu_ep_flags()` before jax creates its GPU client
(docs/expert_parallel.md, "XLA flags for EP on GPU"): XLA reads XLA_FLAGS
once, when jax first creates a backend, and aborts the process on a flag it
does not know ("Unknown flag in XLA_FLAGS"). Every flag here exists in
jaxlib 0.10.2 (checked by `xla_flags_test.py`, which starts jax with them);
on a newer jaxlib run that test again.
"""

from __future__ import annotations

import dataclasses
import os
import sys

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Flag:
  name: str
  value: str
  why: str


def gpu_ep_flags(
    *,
    collective_overlap_limit: int = 2,
    combine_threshold_bytes: int = 128 * _MIB,
    pipeline_collectives: bool = True,
) -> list[Flag]:
  """The flags, in order, with what each does for an EP layer.

  Args:
    collective_overlap_limit: async collectives that may be in flight at
      once (XLA's default is 1). 2 lets one chunk's all-to-all run while the
      data-parallel gradient all-reduce or the next chunk's exchange runs.
    combine_threshold_bytes: small all-reduce / all-gather / reduce-scatter
      ops (the replicated router and shared expert's gradients over the data
      axis) are merged up to this size: fewer launches, at the cost of memory
      and of less room to overlap each piece.
    pipeline_collectives: let XLA move a scanned layer's collectives into the
      previous iteration, so they overlap its compute.
  """
  if collective_overlap_limit < 1:
    raise ValueError(
        "collective_overlap_limit must be >= 1, got "
        f"{collective_overlap_limit}."
    )
  if combine_threshold_bytes < 0:
    raise ValueError(
        "combine_threshold_bytes must be >= 0, got "
        f"{combine_threshold_bytes}."
    )
  flags = [
      Flag(
          "xla_gpu_enable_latency_hiding_scheduler",
          "true",
          "Schedules each async collective's start early and its done late "
          "around independent compute, by a cost model; without it the "
          "dispatch/combine all-to-alls run back to back with the expert "
          "GEMMs and nothing overlaps (off by default).",
      ),
      Flag(
          "xla_gpu_experimental_parallel_collective_overlap_limit",
          str(collective_overlap_limit),
          "How many async collectives may be in flight at once, each on its "
          "own stream (multi-streamed collectives); 1 serialises an EP "
          "all-to-all behind any other collective.",
      ),
      Flag(
          "xla_gpu_enable_highest_priority_async_stream",
          "true",
          "Gives the collective streams the highest priority, so the GEMMs "
          "they overlap with do not starve them of SMs.",
      ),
      Flag(
          "xla_gpu_all_reduce_combine_threshold_bytes",
          str(combine_threshold_bytes),
          "Merges all-reduces up to this size (gradients of the replicated "
          "router and shared expert over the data axes).",
      ),
      Flag(
          "xla_gpu_all_gather_combine_threshold_bytes",
          str(combine_threshold_bytes),
          "Merges all-gathers up to this size (FSDP weight gathers).",
      ),
      Flag(
          "xla_gpu_reduce_scatter_combine_threshold_bytes",
          str(combine_threshold_bytes),
          "Merges reduce-scatters up to this size (FSDP gradients).",
      ),
  ]
  if pipeline_collectives:
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
      flags.append(
          Flag(
              f"xla_gpu_enable_pipelined_{op}",
              "true",
              f"Moves a scanned layer's {op.replace('_', '-')} into the "
              "previous loop iteration so it overlaps that iteration's "
              "compute.",
          )
      )
  return flags


def format_flags(flags: list[Flag]) -> str:
  return " ".join(f"--{f.name}={f.value}" for f in flags)


def explain(flags: list[Flag] | None = None) -> str:
  """A readable list: one flag per line with why it is set."""
  flags = gpu_ep_flags() if flags is None else flags
  return "\n".join(f"--{f.name}={f.value}\n    {f.why}" for f in flags)


def merge(existing: str, flags: list[Flag]) -> str:
  """`existing` XLA_FLAGS plus `flags`; a flag already set there wins."""
  present = {
      part.split("=", 1)[0].lstrip("-")
      for part in existing.split()
      if part.startswith("--")
  }
  added = [f for f in flags if f.name not in present]
  return " ".join(p for p in (existing.strip(), format_flags(added)) if p)


def apply_gpu_ep_flags(flags: list[Flag] | None = None, *, environ=None) -> str:
  """Adds `flags` (default `gpu_ep_flags()`) to XLA_FLAGS and returns it.

  Flags the user already set in XLA_FLAGS are kept as they are. Call before
  jax initialises its backends (before the first computation or
  jax.devices()); later, XLA has read XLA_FLAGS and this raises.
  """
  environ = os.environ if environ is None else environ
  if environ is os.environ and _backends_initialized():
    raise RuntimeError(
        "apply_gpu_ep_flags must run before jax initialises its backends "
        "(XLA reads XLA_FLAGS once); call it before the first jax "
        "computation or jax.devices()."
    )
  flags = gpu_ep_flags() if flags is None else flags
  environ["XLA_FLAGS"] = merge(environ.get("XLA_FLAGS", ""), flags)
  return environ["XLA_FLAGS"]


def _backends_initialized() -> bool:
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  check = getattr(xla_bridge, "backends_are_initialized", None)
  return bool(check and check())
