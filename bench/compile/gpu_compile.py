"""Every GPU program of bench/workloads/programs.py through XLA's GPU compiler.

From any host, a CPU-only one included (`moe_core.aot`: the CUDA plugin of
the installed jax, no GPU), each program is compiled for each target (one
target a child process, `compile_one`) and must compile, contain the
kernels its backend promises and fit the target's usable HBM; the named
exceptions are listed, not compiled, and the records go to --out; without
it, the full default run's (H100 and B200, every program, --size ci) to
bench/results/gpu_compile_[quick_]<jax version>.json when it ends, any
other's to the system's temporary directory (printed), so that a partial
run never replaces the committed records (docs/benchmarks.md,
"bench/compile/gpu_compile.py"). Usage:
    python -m bench.compile.gpu_compile            # H100 and B200, CI sizes
    python -m bench.compile.gpu_compile --size full --targets h100,b200,h200
    python -m bench.compile.gpu_compile --xla_options quick   # CI's, faster
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

from bench.workloads import programs as programs_lib
from moe_core import aot
from moe_core import compat
from train import platforms

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

TARGETS = ("h100", "b200")
# --xla_options: XLA's defaults (no GPU to autotune on), or `aot.QUICK_OPTIONS`
# (cuBLAS for XLA's own GEMMs; CI's).
XLA_OPTIONS = {"default": None, "quick": aot.QUICK_OPTIONS}
_MAX_ERROR = 600


# --- The command line, shared with bench/compile/tpu_compile.py -------------


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
  """in_shardings for `aot.compile`: the topology's first GPU, or specs."""
  if mesh is None:
    return jax.sharding.SingleDeviceSharding(topology.devices[0])
  return jax.tree.map(
      lambda spec: jax.sharding.NamedSharding(mesh, spec),
      specs,
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
  )


def missing(program, compiled) -> list[str]:
  """The promised kernels and collectives `compiled` lacks."""
  calls = compiled.custom_calls
  lacking = [
      k for k in program.kernels if not any(c.startswith(k) for c in calls)
  ]
  lacking += [
      c for c in program.collectives if not compiled.collective_bytes.get(c)
  ]
  return lacking


# The target this process compiles for (`compile_one` says why only one).
_PROCESS_TARGET = []


def compile_one(
    program, target: str, size: str, topologies: dict, options="default"
) -> dict:
  """The record of `program` compiled for `target` with `XLA_OPTIONS[options]`:
  "status" is "ok", "failed" (with "error") or "exception" (with "reason").

  Every call of a process must name the same target, and a second target
  is refused: the CUDA plugin's Mosaic GPU pipeline keeps the GPU of the
  first Mosaic GPU kernel it compiles for the whole process (jax 0.11.2
  and 0.12.0.1; `jax.clear_caches()` does not reset it), so a second
  target's kernels fail ("SM version specified by .target is higher than
  default SM version assumed" on 0.12, "Pass pipeline failed" on 0.11).
  `main` therefore compiles each target in a child process of its own.
  """
  record = {
      "program": program.name,
      "workload": program.workload.name,
      "variant": program.variant.name,
      "mode": program.mode,
      "target": target,
      "topology": program.workload.topology,
      "size": size,
      "xla_options": options,
  }
  reason = programs_lib.exception(target, program)
  if reason is not None:
    return {**record, "status": "exception", "reason": reason}
  if _PROCESS_TARGET and _PROCESS_TARGET[0] != target:
    error = (
        f"this process compiled for {_PROCESS_TARGET[0]}: compile for "
        f"{target} in another (Mosaic GPU keeps the first target's arch)"
    )
    return {**record, "status": "failed", "error": error}
  _PROCESS_TARGET[:1] = [target]
  key = (target, program.workload.topology)
  try:
    if key not in topologies:
      topologies[key] = aot.gpu_topology(target, program.workload.topology)
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
        xla_options=XLA_OPTIONS[options],
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
  lacking = missing(program, compiled)
  if lacking:
    problems.append(f"no {lacking} in the executable: a fallback")
  if not compiled.fits:
    problems.append(
        f"peak {compiled.peak_bytes / 2**30:.2f} GiB per device > usable "
        f"{compiled.usable_bytes / 2**30:.2f} GiB"
    )
  record["status"] = "failed" if problems else "ok"
  if problems:
    record["error"] = "; ".join(problems)
  return record


def run(
    targets, size="ci", selected=None, on_record=None, options="default"
) -> list:
  """Records of every (selected) program compiled for each of `targets`
  (one, unless it is the last: `compile_one`)."""
  selected = programs_lib.programs() if selected is None else selected
  topologies = {}
  records = []
  with compat.filter_triton_deprecation():
    for target in targets:
      for program in selected:
        record = compile_one(program, target, size, topologies, options)
        records.append(record)
        print(line(record), flush=True)
        if on_record:
          on_record(record)
  return records


def line(r: dict) -> str:
  """One printed line of a record."""
  head = f"{r['target']} {r['program']}"
  if r["status"] == "exception":
    return f"skip {head}: {r['reason']}"
  if r["status"] == "failed" and "peak_bytes" not in r:
    return f"FAIL {head}: {r['error'][:300]}"
  calls = ", ".join(f"{n} {c}" for c, n in sorted(r["custom_calls"].items()))
  text = (
      f"{head}: {r['compile_seconds']:.1f} s, peak "
      f"{r['peak_bytes'] / 2**20:,.0f} MiB ({calls or 'no custom calls'})"
  )
  if r["status"] == "failed":
    return f"FAIL {text}: {r['error']}"
  return f"ok   {text}"


def summary(records) -> str:
  """ "N of N compiled, plus K named exceptions" and the failures' count."""
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


def write(path: str, records, seconds: float) -> None:
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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m bench.compile.gpu_compile",
      description=__doc__.splitlines()[0],
  )
  parser.add_argument(
      "--targets",
      type=names_type(tuple(aot.GPU_TARGETS)),
      default=list(TARGETS),
      help=f"comma-separated, of {', '.join(aot.GPU_TARGETS)}",
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
      choices=tuple(XLA_OPTIONS),
      help="quick: aot.QUICK_OPTIONS (cuBLAS for XLA's own GEMMs)",
  )
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  index, count = _shard(parser, args.shard)
  selected = select_or_exit(parser, programs_lib.select, args.programs)
  # The default options' records keep their name; another set's carry it.
  options = "" if args.xla_options == "default" else f"{args.xla_options}_"
  committed = os.path.join(
      _REPO, "bench", "results", f"gpu_compile_{options}{jax.__version__}.json"
  )
  narrowed = (args.size, args.programs, count) != ("ci", "*", 1)
  full_run = set(args.targets) == set(TARGETS) and not narrowed
  progress, out = output_paths(args.out, committed, full_run)
  targets = args.targets
  if len(targets) > 1:
    return _each_target_apart(args, targets, out)
  selected = selected[index::count]
  start = time.perf_counter()
  done = []

  def on_record(record):  # Rewritten after each: a killed run keeps them.
    done.append(record)
    write(progress, done, time.perf_counter() - start)

  records = run(targets, args.size, selected, on_record, args.xla_options)
  write(out, records, time.perf_counter() - start)
  print(summary(records))
  print(f"wrote {out}")
  return 1 if any(r["status"] == "failed" for r in records) else 0


def _shard(parser, text: str) -> tuple[int, int]:
  """--shard I/N as (I, N), 0 <= I < N; else a usage error naming it."""
  index, _, count = text.partition("/")
  if index.isdigit() and count.isdigit() and int(index) < int(count):
    return int(index), int(count)
  parser.error(
      f"argument --shard: takes I/N with 0 <= I < N (e.g. 0/4), got {text!r}"
  )


def compile_apart(
    target: str,
    patterns: str = "*",
    size: str = "ci",
    shard: str = "0/1",
    quiet: bool = False,
    options: str = "default",
):
  """(records, output): the programs matching `patterns` compiled for
  `target` by `python -m bench.compile.gpu_compile` in a child process of its
  own (one target a process). records is None if the child wrote none; output is
  its stdout and stderr when `quiet`, else they pass through and it is
  ""."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "records.json")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.compile.gpu_compile",
            f"--targets={target}",
            f"--size={size}",
            f"--programs={patterns}",
            f"--shard={shard}",
            f"--xla_options={options}",
            f"--out={out}",
        ],
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


def _each_target_apart(args, targets, out) -> int:
  """main for several targets: a child process each, their JSON merged."""
  start, records = time.perf_counter(), []
  for target in targets:
    found, _ = compile_apart(
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
  write(out, records, time.perf_counter() - start)
  print(summary(records))
  print(f"wrote {out}")
  return 1 if any(r["status"] == "failed" for r in records) else 0


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
