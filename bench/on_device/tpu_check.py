"""One TPU run: tile sweep, conformance, timing and training, one JSON.

On the TPU host run `python -m bench.on_device.tpu_check --out_dir "$OUT"` (the
set-up line: docs/benchmarks.md, "The TPU check"); `--dry_run` rehearses
every phase on the CPU at tiny shapes with interpreted kernels. Phases
(`--phases`, in this order): sweep, conformance, timing, train. One
program at a time holds the chip, so this process never opens it: each
phase is a child process (sweep and timing: this module again, with
--child; conformance: bench/on_device/tpu_conformance.py, the suites on threads;
train: `python -m train.main`), killed if it outlives its share of
--deadline_s. Every child's results land in <out_dir>/tpu_check.json,
rewritten after each measurement; a failing piece records its error and the
run goes on. Over 400 lines because it is one job: the phases of one call
on a lent chip, each in its own process, against one deadline.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# Run as a script (python bench/on_device/tpu_check.py), only its folder is on
# sys.path.
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

from bench.harness import json_report
from bench.on_device import gpu_conformance
from bench.on_device import tpu_conformance
from bench.on_device import tpu_report
from bench.workloads import programs as programs_lib
from train import platforms

# pylint: enable=g-import-not-at-top,wrong-import-position

PHASES = ("sweep", "conformance", "timing", "train")
# Phases run by this module in a child (`--child`); the others start their
# own children from here.
_CHILD_PHASES = ("sweep", "timing")
# Each phase's share of what is left of --deadline_s when it starts.
_WEIGHTS = {"sweep": 3, "conformance": 3, "timing": 3, "train": 2}
# A child still running this long past its phase's deadline is killed
# (one last compile may be under way when the deadline passes).
_GRACE_S = 20.0
REPORT_NAME = "tpu_check.json"
DRY_CONFORMANCE_FILTER = "test_forward_matches_numpy_and_reference_bf16_full"
TRAIN_FALLBACK_PRESET = "tiny_dsv3"
# Lines of a child's output kept in the JSON.
_TAIL_LINES = 30


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out_dir", default=os.path.join(_REPO, "bench", "results"))
  p.add_argument(
      "--phases",
      default=",".join(PHASES),
      help=f"comma-separated, of {','.join(PHASES)}",
  )
  p.add_argument(
      "--deadline_s",
      type=float,
      default=500.0,
      help="every phase stops by then (seconds from the start), writing "
      "what it has",
  )
  p.add_argument(
      "--dry_run",
      action="store_true",
      help="rehearse on the CPU: tiny shapes, interpreted kernels",
  )
  p.add_argument(
      "--quick",
      action="store_true",
      help="3 timed calls, at most 4 tiles per sweep unit, and only the up "
      "projections' GEMMs timed",
  )
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument(
      "--shapes",
      default="",
      help="only these models' GEMMs and layers (mixtral,dsv3,qwen3,olmoe)",
  )
  p.add_argument(
      "--profile",
      action="store_true",
      help="timing: a jax.profiler trace of a layer step in <out_dir>/profile",
  )
  p.add_argument(
      "--layer_tiles",
      default="",
      help="timing: JSON {name: mosaic_tpu tiles option (fwd/dgrad/wgrad "
      "dicts)}; each is timed as layer variant mosaic_tpu:<name>",
  )
  p.add_argument(
      "--layer_variants",
      default="xla,mosaic_tpu,megablox",
      help="timing: the layer's variants besides dense_ffn and --layer_tiles",
  )
  p.add_argument(
      "--layer_routings",
      default="uniform,zipf",
      help="timing: mosaic_tpu's layer again with each token's experts "
      "drawn from these (gemm_methods.LAYER_ROUTINGS; '' for none)",
  )
  p.add_argument(
      "--timing_parts",
      default="gemm,layer",
      help="timing: the grouped GEMMs' passes, the layers, or both",
  )
  p.add_argument(
      "--sweep_impls",
      default="mosaic_tpu,megablox",
      help="whose tiles the sweep tries",
  )
  p.add_argument("--conformance_backends", default="mosaic_tpu,xla")
  p.add_argument(
      "--conformance_threads",
      type=int,
      default=os.cpu_count() or 1,
      help="tests at a time in the conformance child",
  )
  p.add_argument(
      "--conformance_resume",
      default="",
      help="earlier conformance.log files: their passed tests are kept",
  )
  p.add_argument(
      "--conformance_filter",
      default=None,
      help="only the tests matching these unittest -k patterns",
  )
  p.add_argument("--train_preset", default="tpu_v5e_dsv3")
  p.add_argument("--train_steps", type=int, default=20)
  p.add_argument("--train_backends", default="mosaic_tpu,xla")
  p.add_argument(
      "--train_args",
      default="",
      help="more train.main flags, space-separated",
  )
  p.add_argument(
      "--compile_cache",
      default=os.path.join(tempfile.gettempdir(), "tpu_check_jax_cache"),
      help="JAX's persistent compilation cache for the children (the "
      "timing then reuses the sweep's compiles while the host stays up); "
      "'' for none; none with --dry_run",
  )
  p.add_argument(
      "--peak_tflops",
      type=float,
      default=197.0,
      help="the chip's bf16 peak, for the training MFU (v5e: 197)",
  )
  # A child's: its phase, the report to update, its deadline (time.time()).
  p.add_argument("--child", choices=_CHILD_PHASES, help=argparse.SUPPRESS)
  p.add_argument("--child_deadline", type=float, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  unknown = set(args.phases.split(",")) - set(PHASES)
  if unknown:
    p.error(f"--phases must be of {PHASES}, got {sorted(unknown)}")
  return args


def _output(cmd, **options) -> str | None:
  """What `cmd` prints, or None if it fails or takes over 2 minutes: what
  the callers ask is optional in the report."""
  try:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, check=True, **options
    ).stdout
  except Exception:  # pylint: disable=broad-except
    return None


def _git_commit() -> str | None:
  # A tree copied to the TPU host has no .git of its own (git would answer
  # for a checkout around it): the commit named by the caller comes first.
  if os.environ.get("DROPLESS_COMMIT"):
    return os.environ["DROPLESS_COMMIT"]
  out = _output(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=_REPO)
  if out is None:
    return None
  top, commit = out.split()
  # Outside a checkout of its own, git answers for a repository around the
  # folder, whose commit says nothing about this tree.
  if os.path.realpath(top) != os.path.realpath(_REPO):
    return None
  return commit


def _device_kind(env) -> str | None:
  """The kind of the chip's first device, from a child that opens it (this
  process never does); None if that fails."""
  code = "import jax; print(jax.devices()[0].device_kind)"
  out = _output([sys.executable, "-c", code], env=env)
  lines = (out or "").strip().splitlines()
  return lines[-1] if lines else None


def _installed(distribution: str) -> str | None:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _python_path() -> list[str]:
  """This process's PYTHONPATH entries (the TPU host's carried wheels)."""
  return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _child_env(compile_cache: str | None) -> dict:
  env = dict(os.environ)
  if compile_cache and "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = compile_cache
  env["PYTHONPATH"] = os.pathsep.join([_REPO, *_python_path()])
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _run_child(cmd, deadline, log_prefix, env) -> dict:
  """Runs `cmd`, echoing its output; kills it at `deadline` (time.time()).

  Returns {"returncode" (None if killed), "seconds", "tail"}.
  """
  start = time.time()
  tail = collections.deque(maxlen=_TAIL_LINES)
  child = subprocess.Popen(  # pylint: disable=consider-using-with
      cmd,
      cwd=_REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      errors="replace",
  )

  def pump():
    for line in child.stdout:
      tail.append(line.rstrip()[:400])
      print(f"{log_prefix}{line}", end="", flush=True)

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  try:
    returncode = child.wait(max(deadline - time.time(), 1.0))
  except subprocess.TimeoutExpired:
    child.kill()
    child.wait()
    returncode = None
  reader.join(10)
  return {
      "returncode": returncode,
      "seconds": round(time.time() - start, 1),
      "tail": list(tail),
  }


# --- Parent: the phases ------------------------------------------------------


class Run:
  """The parent's report, its file, and the overall deadline."""

  def __init__(self, args, argv, path, report, deadline):
    self.args, self.argv, self.path, self.report = args, argv, path, report
    self.deadline = deadline

  def write(self):
    json_report.write(self.path, self.report)

  def child_env(self) -> dict:
    """The children's environment: this one's, this repository first on
    PYTHONPATH, and the compilation cache (none in a dry run)."""
    cache = None if self.args.dry_run else self.args.compile_cache
    return _child_env(cache)

  def reload(self):
    """The report as a child left it (children write the same file)."""
    try:
      with open(self.path) as fh:
        phases = self.report["phases"]
        self.report = json.load(fh)
      for name, entry in self.report.get("phases", {}).items():
        phases.setdefault(name, {}).update(entry)
      self.report["phases"] = phases
    except (OSError, ValueError) as e:
      self.report.setdefault("errors", []).append(
          f"reload: {json_report.error_text(e)}"
      )


def child_phase(run: Run, phase: str, deadline: float) -> dict:
  """sweep or timing, in a child of this module that holds the chip."""
  argv = _without(run.argv, ("--child", "--child_deadline", "--out_dir"))
  cmd = [
      sys.executable,
      "-m",
      "bench.on_device.tpu_check",
      *argv,
      f"--out_dir={run.args.out_dir}",
      f"--child={phase}",
      f"--child_deadline={deadline}",
  ]
  result = _run_child(cmd, deadline + _GRACE_S, f"[{phase}] ", run.child_env())
  run.reload()
  return result


def _without(argv, names) -> list[str]:
  """argv less the flags `names`, as --name=value or --name value."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a in names:
      skip = True
    elif not a.startswith(tuple(f"{n}=" for n in names)):
      out.append(a)
  return out


def conformance_phase(run: Run, deadline: float) -> dict:
  """The shared suites on every backend, in one child that holds the chip
  and runs the tests on threads (tpu_conformance.py: on a TPU a test is
  mostly XLA's compile, which threads overlap)."""
  args = run.args
  test_filter = args.conformance_filter or (
      DRY_CONFORMANCE_FILTER if args.dry_run else None
  )
  entries = run.report["conformance"] = []
  names = []
  for name in filter(None, args.conformance_backends.split(",")):
    ok, why = _buildable(name, args.dry_run)
    if ok:
      names.append(name)
    else:
      entries.append({"variant": name, "status": "skipped", "reason": why})
  log = os.path.join(args.out_dir, "conformance.log")
  out = os.path.join(args.out_dir, "conformance.json")
  if os.path.exists(out):
    os.remove(out)
  cmd = [
      sys.executable,
      "-m",
      "bench.on_device.tpu_conformance",
      f"--backends={','.join(names)}",
      f"--threads={args.conformance_threads}",
      # No test starts past this: the last ones and the report then end
      # before the child is killed.
      f"--deadline_s={max(deadline - time.time() - _GRACE_S, 1.0)}",
      f"--log={log}",
      f"--out={out}",
      f"--resume={args.conformance_resume}",
  ]
  for pattern in (test_filter or "").split():
    cmd.extend(["-k", pattern])
  result = (
      _run_child(cmd, deadline + _GRACE_S, "[conformance] ", run.child_env())
      if names
      else {"returncode": 0}
  )
  found = {}
  if os.path.exists(out):
    with open(out) as fh:
      found = json.load(fh)["backends"]
  logged = tpu_conformance.read_log(log) if os.path.exists(log) else {}
  for name in names:
    entries.append(_conformance_entry(name, found.get(name), logged))
  run.write()
  gpu_conformance.print_summary(entries)
  return {"filter": test_filter, "returncode": result["returncode"]}


def _conformance_entry(name, found, logged) -> dict:
  """One backend's report entry from tpu_conformance's JSON, or from its
  log if the child ended before writing it."""
  if found is None:
    prefix = tpu_conformance.test_module(name) + "."
    records = {k: v for k, v in logged.items() if k.startswith(prefix)}
    counts = tpu_conformance.summarise(records)
    reason = "the run ended before its report: counted from its log"
  else:
    records, counts, reason = found["tests"], found["counts"], ""
  failed = sorted(
      k for k, r in records.items() if r["outcome"] in tpu_conformance.FAILING
  )
  if failed:
    status = "failed"
  elif found is None or counts["not_run"]:
    status = "incomplete"
  else:
    status = "passed"
  ran = sum(counts[o] for o in ("passed", "failed", "error", "skipped"))
  if status == "passed" and not ran:
    # A filter that matches no test (a suite's class name: -k matches the
    # test methods' names) must not read as a pass, as on the GPU.
    status, reason = "failed", "ran no test"
  entry = {
      "variant": name,
      "status": status,
      "ran": ran,
      "failures": counts["failed"],
      "errors": counts["error"],
      "skipped": counts["skipped"],
      "not_run": counts["not_run"],
      "passed_alone_only": counts["passed_alone_only"],
      "failed_tests": failed,
  }
  if reason:
    entry["reason"] = reason
  return entry


def _buildable(name: str, dry_run: bool) -> tuple[bool, str]:
  """Whether the backend can be built (registered, importable); in a dry
  run also whether it runs here. Not asked on the chip from here: this
  process never opens it (the suites skip, saying why, if it cannot run)."""
  try:
    backend = programs_lib.Variant(name, name).build(interpret=dry_run)
  except Exception as e:  # pylint: disable=broad-except
    return False, f"backend missing: {json_report.error_text(e)}"
  return backend.availability() if dry_run else (True, "")


def train_phase(run: Run, deadline: float) -> dict:
  """train.main on each backend in turn: tokens/s, loss, and the ratio."""
  from train import presets  # pylint: disable=g-import-not-at-top

  args = run.args
  info = {}
  preset = args.train_preset
  if args.dry_run or preset not in presets.PRESETS:
    info["preset_fallback"] = (
        "dry run" if args.dry_run else f"no preset {preset!r}"
    ) + f": {TRAIN_FALLBACK_PRESET}"
    preset = TRAIN_FALLBACK_PRESET
  names = [n for n in args.train_backends.split(",") if n]
  steps = args.train_steps
  extra = args.train_args.split()
  if args.dry_run:
    # Interpreted kernels in a whole model take minutes on a CPU: the
    # rehearsal trains the xla backend only, a few tiny steps.
    skipped = [n for n in names if n != "xla"]
    if skipped:
      print(
          f"train: dry run skips {skipped}: interpreted kernels are too "
          "slow for a whole model on the CPU"
      )
      info["dry_run_skipped"] = skipped
    names = ["xla"]
    steps = min(steps, 4)
    extra = ["--batch_size=2", "--seq_len=32", *extra]
  entries = run.report["train"] = []
  for i, name in enumerate(names):
    entry = {"backend": name, "preset": preset, "steps": steps}
    entries.append(entry)
    share = (deadline - time.time()) / (len(names) - i)
    if share <= 5:
      entry["skipped"] = "past the deadline"
      continue
    with tempfile.TemporaryDirectory(prefix="tpu_check_train_") as tmp:
      cmd = [
          sys.executable,
          "-m",
          "train.main",
          f"--model={preset}",
          f"--steps={steps}",
          f"--moe_backend={name}",
          f"--output_dir={tmp}",
          "--plot=false",
          "--progress=false",
          "--eval_batches=1",
          f"--eval_every={steps}",
          "--checkpoint_every=0",
          "--keep_checkpoints=1",
          "--log_every=5",
          *extra,
      ]
      entry["command"] = " ".join(cmd[1:])
      result = _run_child(
          cmd, time.time() + share, f"[train {name}] ", run.child_env()
      )
      entry.update(read_training(tmp, args.peak_tflops * 1e12))
      entry.update(result)
      kept = os.path.join(run.args.out_dir, f"train_{name}")
      _keep(tmp, kept, ("summary.json", "metrics.jsonl"))
    if result["returncode"] != 0:
      entry["error"] = (
          "killed at its time share"
          if result["returncode"] is None
          else f"exit code {result['returncode']}"
      )
    run.write()
  info["ratio"] = train_ratio(entries)
  return info


def _keep(src, dst, names) -> None:
  os.makedirs(dst, exist_ok=True)
  for n in names:
    if os.path.exists(os.path.join(src, n)):
      with (
          open(os.path.join(src, n)) as i,
          open(os.path.join(dst, n), "w") as o,
      ):
        o.write(i.read())


def read_training(output_dir: str, peak_flops: float) -> dict:
  """What a train.main run logged: steps done, median tokens/s after the
  first two (compiling) steps, the first and last loss, held-out loss,
  and the MFU of 6 x active params per token (attention not counted)."""
  out = {}
  records = []
  path = os.path.join(output_dir, "metrics.jsonl")
  if os.path.exists(path):
    with open(path) as fh:
      for line in fh:
        try:
          r = json.loads(line)
        except ValueError:
          continue
        if "step" in r and "loss" in r:
          records.append(r)
  if records:
    tps = sorted(r["tokens_per_s"] for r in records[2:] or records)
    out.update(
        steps_done=records[-1]["step"],
        tokens_per_s=tps[len(tps) // 2],
        loss_first=records[0]["loss"],
        loss_last=records[-1]["loss"],
        loss_falls=records[-1]["loss"] < records[0]["loss"],
        losses=[round(r["loss"], 4) for r in records],
    )
  path = os.path.join(output_dir, "summary.json")
  if os.path.exists(path):
    with open(path) as fh:
      s = json.load(fh)
    out["tokens_per_s"] = s.get("tokens_per_s_median") or out.get(
        "tokens_per_s"
    )
    for k in (
        "final_held_out_loss",
        "params_active",
        "params_total",
        "batch_size",
        "seq_len",
        "wall_seconds",
    ):
      out[k] = s.get(k)
    if out.get("tokens_per_s") and s.get("params_active"):
      flops = 6 * s["params_active"] * out["tokens_per_s"]
      out["mfu_6n"] = flops / peak_flops
  return out


def train_ratio(entries) -> dict | None:
  """mosaic_tpu's step time over xla's (tokens/s the other way round)."""
  tps = {e["backend"]: e.get("tokens_per_s") for e in entries}
  ours, xla = tps.get("mosaic_tpu"), tps.get("xla")
  if not ours or not xla:
    return None
  return {"step_time_over_xla": xla / ours}


def failures(report) -> list[str]:
  """What failed, a line each (skips and missed goals are not failures)."""
  out = []
  for phase, p in report.get("phases", {}).items():
    if p.get("error"):
      out.append(f"{phase}: {p['error']}")
  for e in report.get("conformance", []):
    if e["status"] == "failed":
      out.append(f"conformance {e['variant']}: {e.get('failed_tests')}")
  for section in ("gemm", "layer"):
    for r in report.get(section, []):
      if "error" in r:
        out.append(
            f"{section} {r['workload']} {r.get('variant')} {r.get('mode')}: "
            f"{r['error']}"
        )
  for e in report.get("train", []):
    if "error" in e:
      out.append(f"train {e['backend']}: {e['error']}")
  return out


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parse_args(argv)
  args.out_dir = os.path.abspath(args.out_dir)
  if hasattr(sys.stdout, "reconfigure"):  # Lines survive a hard crash.
    sys.stdout.reconfigure(line_buffering=True)
  if args.child:
    return _child_main(args)
  if args.dry_run:
    os.environ["JAX_PLATFORMS"] = "cpu"  # The children's too.
  # This process never holds the chip: its children do, one at a time.
  jax.config.update("jax_platforms", "cpu")
  start = time.time()
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, REPORT_NAME)
  versions = json_report.versions()
  for k in ("triton", "jax_triton", "jax_triton_from", "platform", "device"):
    versions.pop(k, None)  # Of this process, which sees only the CPU.
  versions["libtpu"] = _installed("libtpu") or _installed("libtpu-nightly")
  report = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      **versions,
      "git_commit": _git_commit(),
      "dry_run": args.dry_run,
      "quick": args.quick,
      "argv": argv,
      "device": None,
      "deadline_s": args.deadline_s,
      "phases": {},
  }
  run = Run(args, argv, path, report, start + args.deadline_s)
  selected = [p for p in PHASES if p in args.phases.split(",")]
  if not set(selected) & set(_CHILD_PHASES):
    # The sweep's and timing's children record it; other phases' do not.
    report["device"] = _device_kind(run.child_env())
  print(f"tpu_check: {selected} by {args.deadline_s:.0f} s into {path}")
  run.write()
  try:
    for i, phase in enumerate(selected):
      left = run.deadline - time.time()
      weights = sum(_WEIGHTS[p] for p in selected[i:])
      deadline = time.time() + left * _WEIGHTS[phase] / weights
      entry = run.report["phases"][phase] = {"status": "running"}
      if left <= 0:
        entry["status"] = "skipped: past the deadline"
        continue
      run.write()
      phase_start = time.time()
      try:
        if phase in _CHILD_PHASES:
          result = child_phase(run, phase, deadline)
          entry = run.report["phases"][phase]
          entry.update(result)
          if result["returncode"] == 0:
            del entry["tail"]  # Its results are in the report.
          else:
            ended = (
                "killed past its deadline"
                if result["returncode"] is None
                else f"child exit code {result['returncode']}"
            )
            errors = (entry.get("error"), ended)
            entry["error"] = "; ".join(e for e in errors if e)
        elif phase == "conformance":
          entry.update(conformance_phase(run, deadline))
        else:
          entry.update(train_phase(run, deadline))
        entry["status"] = "error" if entry.get("error") else "done"
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        entry.update(status="error", error=json_report.error_text(e))
      entry["seconds"] = round(time.time() - phase_start, 1)
      run.write()
  finally:  # Whatever happened (even an interrupt): write what there is.
    report = run.report
    report["seconds"] = round(time.time() - start, 1)
    report["ratios"] = tpu_report.ratio_table(report)
    report["failures"] = failures(report)
    run.write()
    print(tpu_report.markdown(report))
    print(f"wrote {path} ({report['seconds']:.0f} s)")
  for line in report["failures"]:
    print(f"FAILED {line}")
  return 1 if report["failures"] else 0


# --- Child: sweep or timing, holding the chip ---------------------------------


def _child_main(args) -> int:
  # pylint: disable-next=g-import-not-at-top
  from bench.on_device import tpu_timing

  path = os.path.join(args.out_dir, REPORT_NAME)
  with open(path) as fh:
    report = json.load(fh)

  def write():
    json_report.write(path, report)

  entry = report["phases"].setdefault(args.child, {})
  try:
    report["device"] = jax.devices()[0].device_kind
    report["platform"] = jax.default_backend()
    print(f"{args.child}: {report['device']} ({report['platform']})")
    if report["platform"] != "tpu" and not args.dry_run:
      entry["error"] = (
          f"no TPU here ({report['platform']}): --dry_run rehearses"
      )
      write()
      return 2
    ctx = tpu_timing.Context(report, write, args.child_deadline, args)
    if args.child == "sweep":
      tpu_timing.sweep_phase(ctx)
    else:
      tpu_timing.timing_phase(ctx)
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    entry["error"] = json_report.error_text(e)
  write()
  return 0


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
