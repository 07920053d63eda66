"""What the compile driver (driver.py) does differently for TPUs: the table
of bench/workloads/tpu_programs.py, libtpu's v5e, v6e, v5p and tpu7x
topologies, the kernels found by name (`dropless_tpu_*` inside the
tpu_custom_calls), and a kernel's VMEM against the generation's."""

from __future__ import annotations

import contextlib

from bench.workloads import tpu_programs
from moe_core import aot

TARGETS = tpu_programs.TARGETS
DEFAULT_TARGETS = tpu_programs.TARGETS
XLA_OPTIONS = ("default",)
ONE_TARGET_A_PROCESS = False

programs = tpu_programs.programs
select = tpu_programs.select
exception = tpu_programs.exception
in_ci = tpu_programs.in_ci
topology_spec = tpu_programs.topology
quiet = contextlib.nullcontext


def options_record(name: str) -> None:
  """A TPU record names no XLA options: it has only the defaults."""
  del name


def topology(target: str, spec: str):
  return aot.tpu_topology(target, spec)


def refuse(target: str) -> None:
  """One process compiles for every TPU target."""
  del target


def missing(program, compiled) -> list[str]:
  """The promised kernels (by name) and collectives `compiled` lacks; the
  same promises on every generation."""
  found = compiled.tpu_kernels
  lacking = [
      k
      for k in tpu_programs.kernels(program)
      if not any(name.startswith(k) for name in found)
  ]
  lacking += [
      c for c in program.collectives if not compiled.collective_bytes.get(c)
  ]
  return lacking


def checks(record: dict, compiled, topology_) -> list[str]:
  """Records the generation's VMEM; a kernel over it is a problem (the
  compile of a Mosaic kernel over VMEM usually fails first)."""
  vmem = topology_.target.vmem_bytes
  record["vmem_bytes"] = vmem
  if compiled.kernel_vmem_bytes > vmem:
    return [
        f"a kernel takes {compiled.kernel_vmem_bytes / 2**20:.1f} MiB of "
        f"VMEM > {vmem / 2**20:.0f} MiB"
    ]
  return []
