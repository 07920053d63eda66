"""What the compile driver (driver.py) does differently for GPUs: the table
of bench/workloads/programs.py, the CUDA plugin's H100, B200, ... topologies,
the kernels found among the executable's custom calls, and one target a
process (Mosaic GPU keeps the first target's arch)."""

from __future__ import annotations

from bench.workloads import programs as programs_lib
from moe_core import aot
from moe_core import compat

TARGETS = tuple(aot.GPU_TARGETS)
# A run without --targets: the GPUs whose records bench/results/ keeps.
DEFAULT_TARGETS = ("h100", "b200")
XLA_OPTIONS = ("default", "quick")
# The CUDA plugin's Mosaic GPU pipeline keeps the GPU of the first Mosaic
# GPU kernel it compiles for the whole process (jax 0.11.2 and 0.12.0.1;
# `jax.clear_caches()` does not reset it), so a second target's kernels fail
# ("SM version specified by .target is higher than default SM version
# assumed" on 0.12, "Pass pipeline failed" on 0.11): the driver compiles
# each target in a child process of its own.
ONE_TARGET_A_PROCESS = True

programs = programs_lib.programs
select = programs_lib.select
exception = programs_lib.exception
quiet = compat.filter_triton_deprecation

# The target this process compiles for (`refuse`).
_PROCESS_TARGET = []


def options_record(name: str) -> str:
  """The record's "xla_options": every GPU record names its set."""
  return name


def in_ci(target: str, program) -> bool:
  """CI compiles every GPU program (.ci/run picks targets and passes)."""
  del target, program
  return True


def topology_spec(target: str, workload) -> str:
  """The GPUs `workload` runs on, "SxHxG", the same on every target."""
  del target
  return workload.topology


def topology(target: str, spec: str):
  return aot.gpu_topology(target, spec)


def refuse(target: str) -> str | None:
  """Why this process cannot compile for `target` (it compiled for another
  one: ONE_TARGET_A_PROCESS), or None; the first call claims the process."""
  if _PROCESS_TARGET and _PROCESS_TARGET[0] != target:
    return (
        f"this process compiled for {_PROCESS_TARGET[0]}: compile for "
        f"{target} in another (Mosaic GPU keeps the first target's arch)"
    )
  _PROCESS_TARGET[:1] = [target]
  return None


def missing(program, compiled) -> list[str]:
  """The promised kernels (custom-call prefixes) and collectives
  `compiled` lacks."""
  calls = compiled.custom_calls
  lacking = [
      k for k in program.kernels if not any(c.startswith(k) for c in calls)
  ]
  lacking += [
      c for c in program.collectives if not compiled.collective_bytes.get(c)
  ]
  return lacking


def checks(record: dict, compiled, topology_) -> list[str]:
  """No check beyond the driver's on a GPU."""
  del record, compiled, topology_
  return []
