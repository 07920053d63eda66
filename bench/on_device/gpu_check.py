"""One GPU run: every program of workloads/programs.py compiled, checked, timed.

On the device machine (an H200), where only $OUT comes back, run
`python -m bench.on_device.gpu_check --out_dir "$OUT"`; `--dry_run`
rehearses it on the CPU and `--lower_only` exports for CUDA on any host.
Its phases (compile, conformance, run), what each records and how the
budget flags stop them: docs/benchmarks.md, "The GPU check". Over 400
lines because it is one job: one call on a lent GPU that compiles, checks
and times every program against one deadline, writing its JSON as it goes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

# Run as a script (python bench/on_device/gpu_check.py), only its folder is on
# sys.path.
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

from bench.compile import driver
from bench.harness import json_report
from bench.harness import timing
from bench.on_device import gpu_conformance
from bench.on_device import gpu_timing
from bench.workloads import programs as programs_lib
from moe_core import aot
from moe_core import compat
from moe_core import precision as moe_precision
from moe_core.testing import cuda_export
from train import platforms

# pylint: enable=g-import-not-at-top,wrong-import-position

# --dry_run's programs: the layer with few experts and a GEMM, interpreted.
DRY_PROGRAMS = (
    "mixtral_8x7b/pallas/*,mixtral_8x7b/xla/*,deepseek_v3_gemm/pallas/fwd,"
    "deepseek_v3_gemm/pallas_fp8_tensor/fwd"
)
# --dry_run's conformance: two variants, a few tests each.
DRY_CONFORMANCE = ("xla,pallas", "test_forward_matches_numpy_and_reference")
_MEMORY = ("argument", "output", "alias", "temp", "generated_code")


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument(
      "--dry_run",
      action="store_true",
      help="rehearse on the CPU: tiny shapes, interpreted kernels",
  )
  mode.add_argument(
      "--lower_only",
      action="store_true",
      help="only export every one-GPU program for CUDA (any host)",
  )
  parser.add_argument(
      "--programs",
      default=None,
      help="comma-separated fnmatch patterns over <workload>/<variant>/"
      f"<mode> (default: all; {DRY_PROGRAMS} with --dry_run)",
  )
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument(
      "--out_dir", default=os.path.join(_REPO, "bench", "results")
  )
  parser.add_argument("--skip_conformance", action="store_true")
  parser.add_argument(
      "--conformance_variants",
      default=None,
      help="comma-separated variants the suites run on (default: every "
      "unquantized variant; xla,pallas with --dry_run)",
  )
  parser.add_argument(
      "--conformance_filter",
      default=None,
      help="only the tests matching these unittest -k patterns",
  )
  parser.add_argument("--compile_s", type=float, default=180.0)
  parser.add_argument("--conformance_s", type=float, default=180.0)
  parser.add_argument("--compile_workers", type=int, default=4)
  parser.add_argument(
      "--budget_s",
      type=float,
      default=540.0,
      help="no timed program starts this many seconds after the run began",
  )
  return parser.parse_args(argv)


def _memory(compiled) -> dict:
  """memory_analysis() of a compiled program, and its peak (per device)."""
  m = compiled.memory_analysis()
  out = {f"{k}_bytes": int(getattr(m, f"{k}_size_in_bytes")) for k in _MEMORY}
  out["peak_bytes"] = (
      out["argument_bytes"]
      + out["output_bytes"]
      - out["alias_bytes"]
      + out["temp_bytes"]
      + out["generated_code_bytes"]
  )
  return out


def _available(variant, interpret):
  """(the variant's backend runs here, why not); raises if it cannot be
  built for another reason than a missing package."""
  try:
    return variant.build(interpret=interpret).availability()
  except ImportError as e:
    return False, json_report.error_text(e)


def _target_name() -> str:
  """The `aot.TARGETS` entry of this GPU (h200 off a GPU: the rehearsal's)."""
  kind = jax.devices()[0].device_kind
  for name, t in aot.TARGETS.items():
    if t.device_kind == kind:
      return name
  return "h200"


def _start_deviceless(selected, size, target, workers, tmp):
  """Compile-driver children compiling `selected` for `target`, no GPU."""
  patterns = ",".join(p.name for p in selected)
  # The carried wheels too (jax-triton: `json_report.provide_jax_triton`).
  path = [_REPO, *(p for p in sys.path if p.endswith(".whl"))]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(path))
  children = []
  for i in range(workers):
    out = os.path.join(tmp, f"deviceless_{i}.json")
    with open(os.path.join(tmp, f"deviceless_{i}.log"), "w") as log:
      child = subprocess.Popen(  # pylint: disable=consider-using-with
          driver.command("gpu", target, out, patterns, size, f"{i}/{workers}"),
          cwd=_REPO,
          env=env,
          stdout=log,
          stderr=subprocess.STDOUT,
      )
    children.append((child, out))
  return children


def _collect_deviceless(children, deadline) -> tuple[dict, bool]:
  """(program name -> deviceless record, whether a child was killed):
  children still running at `deadline` (time.monotonic()) are killed,
  keeping the records they wrote."""
  found, killed = {}, False
  for child, out in children:
    try:
      child.wait(max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      child.kill()
      child.wait()
      killed = True
    if os.path.exists(out):
      with open(out) as fh:
        for r in json.load(fh)["programs"]:
          found[r["program"]] = r
  return found, killed


def compile_phase(selected, size, interpret, report, write, children, deadline):
  """Compiles each program here, none past `deadline` (time.monotonic());
  returns {name: compiled} of those that compiled, for the run phase."""
  compiled_here = {}
  for program in selected:
    entry = {"program": program.name}
    report["compile"].append(entry)
    if time.monotonic() > deadline:
      entry["device"] = {"skipped": "not started: past --compile_s"}
      continue
    try:
      ok, why = _available(program.variant, interpret)
    except Exception as e:  # pylint: disable=broad-except
      ok, why = False, None
      entry["device"] = {"error": json_report.error_text(e)}
    if not ok:
      entry.setdefault("device", {"skipped": why})
      continue
    if program.workload.num_devices > jax.device_count():
      entry["device"] = {
          "skipped": f"needs {program.workload.num_devices} GPUs"
      }
      continue
    start = time.perf_counter()
    try:
      fn, args, _ = program.build(size, interpret=interpret)
      compiled = jax.jit(fn).lower(*args).compile()
      entry["device"] = {
          "compile_seconds": round(time.perf_counter() - start, 2),
          **_memory(compiled),
      }
      compiled_here[program.name] = compiled
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      entry["device"] = {"error": json_report.error_text(e)}
    print(f"compiled {program.name}: {entry['device']}", flush=True)
    write()
  deviceless, killed = _collect_deviceless(children, deadline + 60)
  missing = (
      {"skipped": "not compiled deviceless by --compile_s + 60 s"}
      if killed
      else {"error": "no deviceless record"}
  )
  for entry in report["compile"]:
    d = deviceless.get(entry["program"], missing)
    entry["deviceless"] = d
    here = entry["device"]
    for key in ("peak", "temp"):
      if here.get(f"{key}_bytes") and d.get(f"{key}_bytes"):
        entry[f"{key}_ratio"] = here[f"{key}_bytes"] / d[f"{key}_bytes"]
  write()
  return compiled_here


def timing_phase(
    selected, compiled_here, size, repeats, report, write, deadline
):
  """Times every compiled one-GPU program, and each GEMM's dense baseline."""
  rows = report["timing"]
  key = jax.random.key(3)
  dense_done = set()
  for program in selected:
    if program.name not in compiled_here:
      continue
    w = program.workload
    todo = [(program.variant.name, program.name, compiled_here[program.name])]
    if w.kind == "gemm" and (w.name, program.mode) not in dense_done:
      dense_done.add((w.name, program.mode))
      fn, args = gpu_timing.dense_program(w, program.mode, size)
      try:
        dense = jax.jit(fn).lower(*args).compile()
        todo.insert(0, ("dense", f"{w.name}/dense/{program.mode}", dense))
      except Exception as e:  # pylint: disable=broad-except
        rows.append(
            {
                "program": f"{w.name}/dense/{program.mode}",
                "workload": w.name,
                "variant": "dense",
                "mode": program.mode,
                "error": json_report.error_text(e),
            }
        )
    for variant, name, compiled in todo:
      row = {
          "program": name,
          "workload": w.name,
          "variant": variant,
          "mode": program.mode,
      }
      rows.append(row)
      if time.perf_counter() > deadline:
        row["skipped"] = "not started: the run was past its time budget"
        continue
      if variant == "dense":
        args = gpu_timing.dense_args(w, program.mode, size, key)
      else:
        args = programs_lib.concrete_args(program, size, key)
      timing.time_one(row, compiled, args, repeats, program.expert_flops(size))
      del args
      print(f"timed {name}: {row.get('seconds', row.get('error'))}", flush=True)
      timing.add_ratios(rows, gpu_timing.BASELINES)
      write()


def failures(report: dict) -> list[str]:
  """What failed, a line each (skips and missed goals are not failures)."""
  out = []
  for e in report.get("compile", []):
    if "error" in e.get("device", {}):
      out.append(f"compile here {e['program']}: {e['device']['error']}")
    d = e.get("deviceless", {})
    if d.get("status") == "failed" or "error" in d:
      out.append(f"compile deviceless {e['program']}: {d.get('error')}")
  for e in report.get("conformance", []):
    if e["status"] == "failed":
      out.append(f"conformance {e['variant']}: {e.get('failed_tests')}")
  for r in report.get("timing", []):
    if "error" in r:
      out.append(f"run {r['program']}: {r['error']}")
  if "fatal_error" in report:
    out.append(f"fatal: {report['fatal_error']}")
  return out


def lower(selected) -> int:
  """--lower_only: each one-GPU program exported for CUDA, its kernels checked.

  jax.export catches what the compile (bench/compile/) cannot where the
  compile cannot run: on a leg without jax's CUDA plugin (jax 0.10.2)
  and in Transformer Engine's environment; and it checks that a program can be
  serialised for CUDA at all (host callbacks, unstable custom calls). A program
  that fails and has a named exception (`programs.EXCEPTIONS`, for H100) is
  listed with the reason and its error, not counted failed.
  """
  counts = {"ok": 0, "FAIL": 0, "skip": 0}
  with compat.filter_triton_deprecation():
    for program in selected:
      if program.workload.num_devices > 1:
        continue  # An exported shard_map needs its concrete mesh here.
      try:
        fn, args, _ = program.build("full")
        text = cuda_export.export_for_cuda(
            fn,
            *args,
            disabled_custom_calls=programs_lib.JAX_TRITON_CALLS,
        ).mlir_module()
        calls = set(cuda_export.custom_calls(text))
        lacking = [
            k
            for k in program.kernels
            if not any(c.startswith(k) for c in calls)
        ]
        status = "FAIL" if lacking else "ok"
        detail = ", ".join(sorted(calls)) or "no custom calls"
        if lacking:
          detail = f"no {lacking} in {detail}"
      except Exception as e:  # pylint: disable=broad-except
        status, detail = "FAIL", json_report.error_text(e)
        reason = programs_lib.exception("h100", program)
        if reason is not None:
          status, detail = "skip", f"{reason} ({detail})"
      counts[status] += 1
      print(f"{status:4} {program.name}: {detail}", flush=True)
  print(
      f"lowered {counts['ok']} of {counts['ok'] + counts['FAIL']} one-GPU "
      f"programs for CUDA, plus {counts['skip']} named exceptions"
  )
  return 1 if counts["FAIL"] else 0


def main(argv=None):
  args = _parse_args(argv)
  if hasattr(sys.stdout, "reconfigure"):  # Lines survive a hard crash.
    sys.stdout.reconfigure(line_buffering=True)
  # Before the triton backend imports jax_triton: bench/wheels/ carries it.
  json_report.provide_jax_triton()
  versions = json_report.versions()
  print(json_report.versions_line(versions))
  patterns = args.programs or (DRY_PROGRAMS if args.dry_run else "*")
  selected = programs_lib.select(patterns)
  if args.lower_only:
    return lower(selected)
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.dry_run:
    print("no GPU here: --dry_run rehearses on the CPU, --lower_only exports.")
    return 2
  size = "dry" if args.dry_run else "full"
  target = _target_name()
  now = datetime.datetime.now(datetime.timezone.utc)
  os.makedirs(args.out_dir, exist_ok=True)
  stem = "gpu_dryrun" if args.dry_run else "gpu"
  path = os.path.join(args.out_dir, f"{stem}_{now:%Y%m%d_%H%M%S}.json")
  report = {
      "date": now.isoformat(),
      **versions,
      "dry_run": args.dry_run,
      "size": size,
      "target": target,
      "programs": [p.name for p in selected],
      "seconds": None,
      "compile": [],
      "conformance": [],
      "timing": [],
      "goals": [],
  }
  start = time.perf_counter()
  filtered = compat.triton_deprecations_filtered()

  def write():
    json_report.write(path, report)

  try:
    with (
        tempfile.TemporaryDirectory() as tmp,
        compat.filter_triton_deprecation(),
    ):
      children = _start_deviceless(
          selected, size, target, args.compile_workers, tmp
      )
      compiled = compile_phase(
          selected,
          size,
          args.dry_run,
          report,
          write,
          children,
          time.monotonic() + args.compile_s,
      )
      if not args.skip_conformance:
        variants, test_filter = (
            args.conformance_variants,
            args.conformance_filter,
        )
        if args.dry_run:
          variants = variants or DRY_CONFORMANCE[0]
          test_filter = test_filter or DRY_CONFORMANCE[1]
        conformance_phase(args, variants, test_filter, report, write)
      timing_phase(
          selected,
          compiled,
          size,
          1 if args.dry_run else args.repeats,
          report,
          write,
          start + args.budget_s,
      )
  except Exception as e:  # pylint: disable=broad-except
    report["fatal_error"] = json_report.error_text(e)
    traceback.print_exc()
  finally:  # Whatever happened (even an interrupt): write what there is.
    report["seconds"] = time.perf_counter() - start
    report["goals"] = timing.goals(
        report["timing"], gpu_timing.GOALS, report.get("device")
    )
    report["triton_deprecation_warnings"] = (
        compat.triton_deprecations_filtered() - filtered
    )
    report["failures"] = failures(report)
    write()
    _print_report(report)
    print(f"wrote {path} ({report['seconds']:.0f} s)")
  for line in report["failures"]:
    print(f"FAILED {line}")
  return 1 if report["failures"] else 0


def conformance_phase(args, variants, test_filter, report, write):
  """The shared suites on the chosen variants (the unquantized ones by
  default)."""
  chosen = [
      v
      for v in programs_lib.variants()
      if v.precision == moe_precision.UNQUANTIZED
  ]
  if variants:
    chosen = [v for v in chosen if v.name in variants.split(",")]
  cores = os.cpu_count() or 2
  report["conformance"] = gpu_conformance.run_suites(
      chosen,
      args.conformance_s,
      available=lambda v: _available(v, args.dry_run),
      interpret=args.dry_run,
      shards=max(1, (cores - 2) // 2),
      workers=max(1, cores - 2),
      extra_path=[p for p in sys.path if p.endswith(".whl")],
      test_filter=test_filter,
  )
  write()


def _print_report(report) -> None:
  for e in report["compile"]:
    d, here = e.get("deviceless", {}), e.get("device", {})
    ratio = e.get("peak_ratio")
    print(
        f"compile {e['program']}: here "
        f"{here.get('peak_bytes', here.get('skipped', here.get('error')))}, "
        f"deviceless {d.get('peak_bytes', d.get('reason', d.get('error')))}"
        + ("" if ratio is None else f", peak here/deviceless {ratio:.3f}")
    )
  gpu_conformance.print_summary(report["conformance"])
  gpu_timing.print_rows(report["timing"])
  gpu_timing.print_goals(report["goals"])


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
