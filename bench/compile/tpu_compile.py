"""Every TPU program of workloads/tpu_programs.py through XLA's TPU compiler.

From any host, a CPU-only one included (`moe_core.aot`: libtpu, no TPU),
each program is compiled for each TPU target and must compile (a Mosaic
kernel over the generation's VMEM, or a program over its HBM, fails
there), contain the kernels its backend promises by name (`dropless_tpu_*`
inside the tpu_custom_calls) and, expert-parallel, its ragged all-to-all,
and fit the target's HBM; the named exceptions are listed, not compiled.
The records go to --out; without it, the full default run's (every target
and program, --size ci) to bench/results/tpu_compile_<jax version>.json
when it ends, any other's to the system's temporary directory (printed),
so that a partial run never replaces the committed records. Usage:
    python -m bench.compile.tpu_compile              # v5e, v6e, v5p, tpu7x
    python -m bench.compile.tpu_compile --targets v5e --programs 'deepseek_v3/*'
    python -m bench.compile.tpu_compile --size full          # the models' sizes
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback

import jax

from bench.compile import gpu_compile
from bench.workloads import tpu_programs
from moe_core import aot
from train import platforms

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_MAX_ERROR = 600


def missing(program, compiled, target: str) -> list[str]:
  """The promised kernels and collectives `compiled` lacks on `target`."""
  found = compiled.tpu_kernels
  lacking = [
      k
      for k in tpu_programs.kernels(program)
      if not any(name.startswith(k) for name in found)
  ]
  lacking += [
      c for c in program.collectives if not compiled.collective_bytes.get(c)
  ]
  del target  # The same promises on every generation.
  return lacking


def compile_one(program, target: str, size: str, topologies: dict) -> dict:
  """The record of `program` compiled for `target`: "status" is "ok",
  "failed" (with "error") or "exception" (with "reason")."""
  spec = tpu_programs.topology(target, program.workload)
  record = {
      "program": program.name,
      "workload": program.workload.name,
      "variant": program.variant.name,
      "mode": program.mode,
      "target": target,
      "topology": spec,
      "size": size,
  }
  reason = tpu_programs.exception(target, program)
  if reason is not None:
    return {**record, "status": "exception", "reason": reason}
  key = (target, spec)
  try:
    if key not in topologies:
      topologies[key] = aot.tpu_topology(target, spec)
    topology = topologies[key]
    mesh = None
    if program.workload.kind == "ep_layer":
      mesh = topology.mesh({"expert": topology.num_devices})
    fn, args, specs = program.build(size, mesh)
    compiled = aot.compile(
        fn,
        *args,
        topology=topology,
        mesh=mesh,
        name=program.name,
        in_shardings=gpu_compile._shardings(  # pylint: disable=protected-access
            specs, topology, mesh
        ),
    )
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    error = f"{type(e).__name__}: {e}"
    return {**record, "status": "failed", "error": error[:_MAX_ERROR]}
  found = compiled.to_json()
  for k in ("name", "target", "topology"):
    del found[k]
  record.update(found)
  record["vmem_bytes"] = topology.target.vmem_bytes
  problems = []
  lacking = missing(program, compiled, target)
  if lacking:
    problems.append(f"no {lacking} in the executable: a fallback")
  if not compiled.fits:
    problems.append(
        f"peak {compiled.peak_bytes / 2**30:.2f} GiB per device > usable "
        f"{compiled.usable_bytes / 2**30:.2f} GiB"
    )
  if compiled.kernel_vmem_bytes > topology.target.vmem_bytes:
    problems.append(
        f"a kernel takes {compiled.kernel_vmem_bytes / 2**20:.1f} MiB of "
        f"VMEM > {topology.target.vmem_bytes / 2**20:.0f} MiB"
    )
  record["status"] = "failed" if problems else "ok"
  if problems:
    record["error"] = "; ".join(problems)
  return record


def run(
    targets, size="ci", selected=None, on_record=None, ci_only=False
) -> list:
  """Records of every (selected) program compiled for each of `targets`
  (`ci_only`: of those, what CI compiles, `tpu_programs.CI`)."""
  selected = tpu_programs.programs() if selected is None else selected
  topologies = {}
  records = []
  for target in targets:
    for program in selected:
      if ci_only and not tpu_programs.in_ci(target, program):
        continue
      record = compile_one(program, target, size, topologies)
      records.append(record)
      print(line(record), flush=True)
      if on_record:
        on_record(record)
  return records


def line(r: dict) -> str:
  """One printed line of a record."""
  head = f"{r['target']}:{r['topology']} {r['program']}"
  if r["status"] == "exception":
    return f"skip {head}: {r['reason']}"
  if r["status"] == "failed" and "peak_bytes" not in r:
    return f"FAIL {head}: {r['error'][:300]}"
  kernels = ", ".join(f"{n} {k}" for k, n in sorted(r["tpu_kernels"].items()))
  text = (
      f"{head}: {r['compile_seconds']:.1f} s, peak "
      f"{r['peak_bytes'] / 2**20:,.0f} MiB, kernel VMEM "
      f"{r['kernel_vmem_bytes'] / 2**20:,.1f} MiB "
      f"({kernels or 'no Mosaic kernels'})"
  )
  if r["status"] == "failed":
    return f"FAIL {text}: {r['error']}"
  return f"ok   {text}"


def summary(records) -> str:
  """ "N of N compiled, plus K named exceptions" and the reasons."""
  return gpu_compile.summary(records)


def table(records) -> str:
  """Markdown: program x target, compile seconds and peak per device."""
  targets = list(dict.fromkeys(r["target"] for r in records))
  cells = collections.defaultdict(dict)
  for r in records:
    if r["status"] == "exception":
      cell = "exception"
    elif "peak_bytes" not in r:
      cell = "FAILED"
    else:
      cell = f"{r['compile_seconds']:.1f} s, {r['peak_bytes'] / 2**20:,.1f} MiB"
      if r["status"] == "failed":
        cell += " FAILED"
    cells[r["program"]][r["target"]] = cell
  lines = [
      "| program | " + " | ".join(targets) + " |",
      "| --- |" + " --- |" * len(targets),
  ]
  for program, row in cells.items():
    lines.append(
        f"| {program} | " + " | ".join(row.get(t, "") for t in targets) + " |"
    )
  return "\n".join(lines)


def write(path: str, records, seconds: float) -> None:
  gpu_compile.write(path, records, seconds)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m bench.compile.tpu_compile",
      description=__doc__.splitlines()[0],
  )
  parser.add_argument(
      "--targets",
      type=gpu_compile.names_type(tpu_programs.TARGETS),
      default=list(tpu_programs.TARGETS),
      help=f"comma-separated, of {', '.join(tpu_programs.TARGETS)}",
  )
  parser.add_argument("--size", default="ci", choices=("ci", "full", "dry"))
  parser.add_argument(
      "--programs",
      default="*",
      help="comma-separated fnmatch patterns over <workload>/<variant>/<mode>",
  )
  parser.add_argument("--table", action="store_true", help="print markdown")
  parser.add_argument(
      "--ci", action="store_true", help="only CI's selection (tpu_programs.CI)"
  )
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  selected = gpu_compile.select_or_exit(
      parser, tpu_programs.select, args.programs
  )
  committed = os.path.join(
      _REPO, "bench", "results", f"tpu_compile_{jax.__version__}.json"
  )
  narrowed = (args.size, args.programs, args.ci) != ("ci", "*", False)
  full_run = set(args.targets) == set(tpu_programs.TARGETS) and not narrowed
  progress, out = gpu_compile.output_paths(args.out, committed, full_run)
  start = time.perf_counter()
  done = []

  def on_record(record):  # Rewritten after each: a killed run keeps them.
    done.append(record)
    write(progress, done, time.perf_counter() - start)

  records = run(args.targets, args.size, selected, on_record, args.ci)
  write(out, records, time.perf_counter() - start)
  print(summary(records))
  if args.table:
    print(table(records))
  print(f"wrote {out}")
  return 1 if any(r["status"] == "failed" for r in records) else 0


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
