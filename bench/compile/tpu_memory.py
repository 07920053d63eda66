"""memory_analysis() of the one-chip TPU programs: on a v5e chip against
the deviceless compile for v5e here, program by program.

Both sides compile the same programs (`bench.workloads.tpu_programs`: every
one-chip program, at CI's sizes and the models' own) with
`moe_core.aot.compile`, one for the chip JAX sees (`--where=chip`, on the TPU
host: JAX 0.10.2 and its libtpu there), the other for libtpu's description of a
v5e chip (`--where=here`, any host with this leg's libtpu); each writes every
program's memory figures to JSON, and `--compare` lines them up (a program over
HBM is recorded with the compiler's figures, as the compile failed). Usage:
    python -m bench.compile.tpu_memory --where=chip --out=/tmp/chip.json  # TPU
    python -m bench.compile.tpu_memory --where=here --out=/tmp/here.json
    python -m bench.compile.tpu_memory --compare /tmp/here.json /tmp/chip.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from bench.compile import driver
from bench.workloads import tpu_programs
from moe_core import aot
from train import platforms

FIELDS = (
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "temp_bytes",
    "code_bytes",
    "peak_bytes",
    "kernel_vmem_bytes",
)
SIZES = ("ci", "full")


def chip_topology() -> aot.TpuTopology:
  """The attached chip as a one-device topology of its target."""
  device = jax.devices()[0]
  found = [
      t for t in aot.TPU_TARGETS.values() if t.device_kind == device.device_kind
  ]
  if device.platform != "tpu" or not found:
    raise RuntimeError(
        f"--where=chip needs a TPU of {sorted(aot.TPU_TARGETS)}; JAX's first "
        f"device is {device.platform} {device.device_kind!r} (set "
        "JAX_PLATFORMS=tpu,cpu on the TPU host)."
    )
  chips = "x".join(["1"] * found[0].chip_dims)
  return aot.TpuTopology(found[0], 1, 1, 1, (device,), chips=chips)


def measure(topology, sizes=SIZES, patterns="*") -> list[dict]:
  """A record per one-chip program and size: the memory figures, or the
  error (with the compiler's figures where it ran out of HBM)."""
  records = []
  for program in tpu_programs.select(patterns):
    if program.workload.kind == "ep_layer":
      continue  # One chip here: the expert-parallel layers need several.
    reason = tpu_programs.exception(topology.target.name, program)
    for size in sizes:
      record = {"program": program.name, "size": size}
      if reason is not None:
        records.append({**record, "status": "exception", "reason": reason})
        continue
      try:
        fn, args, _ = program.build(size)
        compiled = aot.compile(fn, *args, topology=topology, name=program.name)
      except aot.HbmOomError as e:
        record.update(
            status="over_hbm",
            required_bytes=e.required_bytes,
            available_bytes=e.available_bytes,
        )
      except Exception as e:  # pylint: disable=broad-except
        record.update(status="failed", error=f"{type(e).__name__}: {e}"[:600])
      else:
        found = compiled.to_json()
        record.update(status="ok", compile_seconds=compiled.compile_seconds)
        record.update({k: found[k] for k in FIELDS})
      print(json.dumps(record), flush=True)
      records.append(record)
  return records


def compare(here: dict, chip: dict) -> str:
  """Markdown: each program's figures here and on the chip, and where they
  differ."""
  theirs = {(r["program"], r["size"]): r for r in chip["programs"]}
  lines = [
      f"deviceless ({here['where']}, jax {here['jax']}) vs chip "
      f"({chip['where']}, jax {chip['jax']}, {chip['device_kind']})",
      "",
      "| program | size | peak here | peak on chip | temp here | temp on "
      "chip | args, out, code equal | kernel VMEM equal |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  same = differ = 0
  for r in here["programs"]:
    c = theirs.get((r["program"], r["size"]))
    if c is None or r["status"] != "ok" or c["status"] != "ok":
      status = "missing" if c is None else c["status"]
      lines.append(
          f"| {r['program']} | {r['size']} | {r['status']} | {status} | | | | |"
      )
      continue
    equal = all(
        r[k] == c[k] for k in ("argument_bytes", "output_bytes", "code_bytes")
    )
    if r["peak_bytes"] == c["peak_bytes"]:
      same += 1
    else:
      differ += 1
    mib = lambda b: f"{b / 2**20:,.2f} MiB"  # pylint: disable=unnecessary-lambda-assignment
    lines.append(
        f"| {r['program']} | {r['size']} | {mib(r['peak_bytes'])} | "
        f"{mib(c['peak_bytes'])} | {mib(r['temp_bytes'])} | "
        f"{mib(c['temp_bytes'])} | {'yes' if equal else 'NO'} | "
        f"{'yes' if r['kernel_vmem_bytes'] == c['kernel_vmem_bytes'] else 'NO'}"
        " |"
    )
  lines.append("")
  lines.append(f"peaks equal: {same}; peaks that differ: {differ}")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m bench.compile.tpu_memory",
      description=__doc__.splitlines()[0],
  )
  parser.add_argument("--where", choices=("chip", "here"), default="here")
  parser.add_argument(
      "--sizes",
      type=driver.names_type(SIZES),
      default=list(SIZES),
      help=f"comma-separated, of {', '.join(SIZES)}",
  )
  parser.add_argument("--programs", default="*")
  parser.add_argument("--out", default=None)
  parser.add_argument("--compare", nargs=2, metavar=("HERE", "CHIP"))
  args = parser.parse_args(argv)
  driver.select_or_exit(parser, tpu_programs.select, args.programs)
  if args.compare:
    with open(args.compare[0]) as a, open(args.compare[1]) as b:
      print(compare(json.load(a), json.load(b)))
    return 0
  if args.where == "chip":
    topology = chip_topology()
  else:
    topology = aot.tpu_topology("v5e", "1x1")
  start = time.perf_counter()
  records = measure(topology, tuple(args.sizes), args.programs)
  report = {
      "where": args.where,
      "jax": jax.__version__,
      "device_kind": topology.devices[0].device_kind,
      "target": topology.target.name,
      "seconds": round(time.perf_counter() - start, 1),
      "programs": records,
  }
  out = args.out or f"tpu_memory_{args.where}_{jax.__version__}.json"
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as fh:
    json.dump(report, fh, indent=1)
  print(f"wrote {out}")
  return 1 if any(r["status"] == "failed" for r in records) else 0


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
