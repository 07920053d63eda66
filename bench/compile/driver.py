"""The one compile driver: benchmark programs through XLA's compilers.

From any host, a CPU-only one included (`moe_core.aot`: the CUDA plugin of
the installed jax for GPUs, libtpu for TPUs; no device), each program of a
platform's table is compiled for each target and must compile, contain the
kernels and collectives its backend promises and fit the target's memory;
the named exceptions are listed, not compiled. What differs between GPUs
and TPUs (targets, topologies, the kernels' names, a TPU kernel's VMEM)
is a platform module's: bench/compile/gpu.py and bench/compile/tpu.py.
The records go to --out; without it, the full default run's (the
platform's default targets, every program, --size ci) to
bench/results/<platform>_compile_[<options>_]<jax version>.json when it
ends, any other's to the system's temporary directory (printed), so that a
partial run never replaces the committed records (docs/benchmarks.md,
"bench/compile/"). Usage:
    python -m bench.compile.driver --platform=gpu     # H100 and B200
    python -m bench.compile.driver --platform=gpu --xla_options quick
    python -m bench.compile.driver --platform=tpu     # v5e, v6e, v5p, tpu7x
    python -m bench.compile.driver --platform=tpu --targets v5e \\
        --programs 'deepseek_v3/*' --size full
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import jax

from bench.compile import gpu
from bench.compile import tpu
from moe_core import aot
from train import platforms

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PLATFORMS = {"gpu": gpu, "tpu": tpu}
# --xla_options: XLA's defaults, or `aot.QUICK_OPTIONS` (on a GPU, cuBLAS
# for XLA's own GEMMs: CI's).
XLA_OPTIONS = {"default": None, "quick": aot.QUICK_OPTIONS}
_MAX_ERROR = 600


# --- The command line, shared with bench/compile/tpu_memory.py ---------------


def names_type(valid):
  """An argparse `type` for an option such as --targets: comma-separated
  names of `valid`, at least one; else a usage error (exit status 2) naming
  the option and listing them."""

  def parse(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in valid]
    if not names or unknown:
      raise argparse.ArgumentTypeError(
          f"takes a comma-separated list of {', '.join(valid)}; got {text!r}"
          + (f" ({', '.join(map(repr, unknown))} unknown)" if unknown else "")
      )
    return names

  return parse


def select_or_exit(parser, select, patterns: str):
  """select(patterns), or a usage error naming --programs."""
  try:
    return select(patterns)
  except ValueError as e:
    parser.error(f"argument --programs: {e}")


def output_paths(out: str | None, committed: str, full_run: bool):
  """(where the records go as they come, where the finished run's go).

  --out: there, both. Without it, records go to a file of that name in the
  system's temporary directory, and only a full default run (`full_run`)
  then writes the committed `committed` (bench/results/) when it ends: a
  partial or killed run never replaces the committed records.
  """
  if out:
    return out, out
  scratch = os.path.join(
      tempfile.gettempdir(), "dropless_bench", os.path.basename(committed)
  )
  return scratch, committed if full_run else scratch


def _shardings(specs, topology, mesh):
  """in_shardings for `aot.compile`: the topology's first device, or specs."""
  if mesh is None:
    return jax.sharding.SingleDeviceSharding(topology.devices[0])
  return jax.tree.map(
      lambda spec: jax.sharding.NamedSharding(mesh, spec),
      specs,
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
  )


# --- Compiling --------------------------------------------------------------


def compile_one(
    platform, program, target: str, size: str, topologies: dict, options=None
) -> dict:
  """The record of `program` compiled for `target` of `platform` (a module
  of PLATFORMS) with `XLA_OPTIONS[options]`: "status" is "ok", "failed"
  (with "error") or "exception" (with "reason"). `topologies` caches the
  topologies made, by (target, topology)."""
  spec = platform.topology_spec(target, program.workload)
  record = {
      "program": program.name,
      "workload": program.workload.name,
      "variant": program.variant.name,
      "mode": program.mode,
      "target": target,
      "topology": spec,
      "size": size,
  }
  if options is not None:
    record["xla_options"] = options
  reason = platform.exception(target, program)
  if reason is not None:
    return {**record, "status": "exception", "reason": reason}
  refused = platform.refuse(target)
  if refused:
    return {**record, "status": "failed", "error": refused}
  try:
    if (target, spec) not in topologies:
      topologies[target, spec] = platform.topology(target, spec)
    topology = topologies[target, spec]
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
        xla_options=XLA_OPTIONS[options or "default"],
        in_shardings=_shardings(specs, topology, mesh),
    )
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    error = f"{type(e).__name__}: {e}"
    return {**record, "status": "failed", "error": error[:_MAX_ERROR]}
  found = compiled.to_json()
  for k in ("name", "target", "topology"):
    del found[k]
  record.update(found)
  problems = []
  lacking = platform.missing(program, compiled)
  if lacking:
    problems.append(f"no {lacking} in the executable: a fallback")
  if not compiled.fits:
    problems.append(
        f"peak {compiled.peak_bytes / 2**30:.2f} GiB per device > usable "
        f"{compiled.usable_bytes / 2**30:.2f} GiB"
    )
  problems += platform.checks(record, compiled, topology)
  record["status"] = "failed" if problems else "ok"
  if problems:
    record["error"] = "; ".join(problems)
  return record


def run(
    platform,
    targets,
    size="ci",
    selected=None,
    on_record=None,
    options=None,
    ci_only=False,
) -> list:
  """Records of every (selected) program of `platform` compiled for each
  of `targets` (`ci_only`: of those, what CI compiles, `platform.in_ci`)."""
  selected = platform.programs() if selected is None else selected
  topologies = {}
  records = []
  with platform.quiet():
    for target in targets:
      for program in selected:
        if ci_only and not platform.in_ci(target, program):
          continue
        record = compile_one(
            platform, program, target, size, topologies, options
        )
        records.append(record)
        print(line(record), flush=True)
        if on_record:
          on_record(record)
  return records


# --- Records ----------------------------------------------------------------


def line(r: dict) -> str:
  """One printed line of a record."""
  head = f"{r['target']}:{r['topology']} {r['program']}"
  if r["status"] == "exception":
    return f"skip {head}: {r['reason']}"
  if r["status"] == "failed" and "peak_bytes" not in r:
    return f"FAIL {head}: {r['error'][:300]}"
  if "vmem_bytes" in r:  # A TPU's: its Mosaic kernels by name, their VMEM.
    kernels = r["tpu_kernels"]
    vmem = f", kernel VMEM {r['kernel_vmem_bytes'] / 2**20:,.1f} MiB"
  else:
    kernels, vmem = r["custom_calls"], ""
  found = ", ".join(f"{n} {k}" for k, n in sorted(kernels.items()))
  text = (
      f"{head}: {r['compile_seconds']:.1f} s, peak "
      f"{r['peak_bytes'] / 2**20:,.0f} MiB{vmem} ({found or 'no kernels'})"
  )
  if r["status"] == "failed":
    return f"FAIL {text}: {r['error']}"
  return f"ok   {text}"


def summary(records) -> str:
  """ "N of N compiled, plus K named exceptions" and the reasons."""
  counts = collections.Counter(r["status"] for r in records)
  tried = counts["ok"] + counts["failed"]
  reasons = sorted({r["reason"] for r in records if "reason" in r})
  text = (
      f"{counts['ok']} of {tried} programs compiled, plus "
      f"{counts['exception']} named exceptions"
  )
  for reason in reasons:
    n = sum(r.get("reason") == reason for r in records)
    text += f"\n  {n}: {reason}"
  return text


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
  """The records as JSON at `path`, with jax's version and the summary."""
  report = {
      "jax": jax.__version__,
      "seconds": round(seconds, 1),
      "summary": summary(records).splitlines()[0],
      "programs": records,
  }
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path + ".tmp", "w") as fh:
    json.dump(report, fh, indent=1)
  os.replace(path + ".tmp", path)


def _finish(out: str, records, start: float, tables: bool = False) -> int:
  """Writes and prints the run's records; 1 if any failed."""
  write(out, records, time.perf_counter() - start)
  print(summary(records))
  if tables:
    print(table(records))
  print(f"wrote {out}")
  return 1 if any(r["status"] == "failed" for r in records) else 0


# --- The program ------------------------------------------------------------


def _parser(platform) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m bench.compile.driver",
      description=__doc__.splitlines()[0],
  )
  parser.add_argument("--platform", choices=tuple(PLATFORMS), required=True)
  parser.add_argument(
      "--targets",
      type=names_type(platform.TARGETS),
      default=list(platform.DEFAULT_TARGETS),
      help=f"comma-separated, of {', '.join(platform.TARGETS)}",
  )
  parser.add_argument("--size", default="ci", choices=("ci", "full", "dry"))
  parser.add_argument(
      "--programs",
      default="*",
      help="comma-separated fnmatch patterns over <workload>/<variant>/<mode>",
  )
  parser.add_argument(
      "--shard",
      default="0/1",
      help="I/N: compile every N-th program from the I-th (N processes)",
  )
  parser.add_argument(
      "--xla_options",
      default="default",
      choices=tuple(platform.XLA_OPTIONS),
      help="quick: aot.QUICK_OPTIONS (cuBLAS for XLA's own GEMMs)",
  )
  parser.add_argument(
      "--ci", action="store_true", help="only CI's selection of the table"
  )
  parser.add_argument("--table", action="store_true", help="print markdown")
  parser.add_argument("--out", default=None)
  return parser


def _platform_of(argv) -> str:
  """--platform's value in `argv`, before the parser that depends on it."""
  early = argparse.ArgumentParser(add_help=False)
  early.add_argument("--platform", choices=tuple(PLATFORMS))
  known, _ = early.parse_known_args(argv)
  return known.platform or "gpu"


def main(argv=None) -> int:
  platform = PLATFORMS[_platform_of(argv)]
  parser = _parser(platform)
  args = parser.parse_args(argv)
  index, count = _shard(parser, args.shard)
  selected = select_or_exit(parser, platform.select, args.programs)
  # The default options' records keep their name; another set's carry it.
  options = "" if args.xla_options == "default" else f"{args.xla_options}_"
  committed = os.path.join(
      _REPO,
      "bench",
      "results",
      f"{args.platform}_compile_{options}{jax.__version__}.json",
  )
  narrowed = (args.size, args.programs, count, args.ci) != ("ci", "*", 1, False)
  full_run = set(args.targets) == set(platform.DEFAULT_TARGETS) and not narrowed
  progress, out = output_paths(args.out, committed, full_run)
  if platform.ONE_TARGET_A_PROCESS and len(args.targets) > 1:
    return _each_target_apart(args, out)
  start = time.perf_counter()
  done = []

  def on_record(record):  # Rewritten after each: a killed run keeps them.
    done.append(record)
    write(progress, done, time.perf_counter() - start)

  records = run(
      platform,
      args.targets,
      args.size,
      selected[index::count],
      on_record,
      platform.options_record(args.xla_options),
      args.ci,
  )
  return _finish(out, records, start, args.table)


def _shard(parser, text: str) -> tuple[int, int]:
  """--shard I/N as (I, N), 0 <= I < N; else a usage error naming it."""
  index, _, count = text.partition("/")
  if index.isdigit() and count.isdigit() and int(index) < int(count):
    return int(index), int(count)
  parser.error(
      f"argument --shard: takes I/N with 0 <= I < N (e.g. 0/4), got {text!r}"
  )


def command(
    platform: str,
    target: str,
    out: str,
    patterns: str = "*",
    size: str = "ci",
    shard: str = "0/1",
    options: str = "default",
) -> list[str]:
  """The command line of a child process that compiles `patterns` for one
  `target` and writes its records to `out` (gpu_check starts such
  children too)."""
  return [
      sys.executable,
      "-m",
      "bench.compile.driver",
      f"--platform={platform}",
      f"--targets={target}",
      f"--size={size}",
      f"--programs={patterns}",
      f"--shard={shard}",
      f"--xla_options={options}",
      f"--out={out}",
  ]


def compile_apart(
    platform: str,
    target: str,
    patterns: str = "*",
    size: str = "ci",
    shard: str = "0/1",
    quiet: bool = False,
    options: str = "default",
):
  """(records, output): the programs matching `patterns` compiled for
  `target` in a child process of its own (`command`). records is None if
  the child wrote none; output is its stdout and stderr when `quiet`, else
  they pass through and it is ""."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "records.json")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    proc = subprocess.run(
        command(platform, target, out, patterns, size, shard, options),
        cwd=_REPO,
        check=False,
        text=True,
        **(pipes if quiet else {}),
    )
    output = proc.stdout or ""
    if not os.path.exists(out):
      return None, output
    with open(out) as fh:
      return json.load(fh)["programs"], output


def _each_target_apart(args, out) -> int:
  """main for several targets: a child process each, their JSON merged."""
  start, records = time.perf_counter(), []
  for target in args.targets:
    found, _ = compile_apart(
        args.platform,
        target,
        args.programs,
        args.size,
        args.shard,
        options=args.xla_options,
    )
    if found is None:
      found = [
          {
              "program": "*",
              "target": target,
              "status": "failed",
              "error": "its child process wrote no records",
          }
      ]
    records += found
  return _finish(out, records, start, args.table)


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
