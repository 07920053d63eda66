"""One short GPU run: pallas, mosaic_gpu, triton, te vs reference; TFLOP/s.

On the device machine, where only $OUT comes back:

    python -m bench.gpu_check --out_dir "$OUT"  # H200, aims at 8 minutes

With triton's correctness cases the whole run may come near the device
tool's 10 minutes a command (untimed yet: the correctness phase has no
budget). Two calls split it, at the cost of a second start:

    python -m bench.gpu_check --out_dir "$OUT" \
        --workloads deepseek_v3,deepseek_v3_grads,deepseek_v3_routed
    python -m bench.gpu_check --out_dir "$OUT" --skip_correctness \
        --workloads small_k,deepseek_v3_precision,mixtral_8x7b

Elsewhere:

    python -m bench.gpu_check                # GPU; JSON in bench/results/
    python -m bench.gpu_check --dry_run      # CPU: tiny shapes, interpreted
    python -m bench.gpu_check --lower_only   # CPU: lower every GPU program

(`python bench/gpu_check.py ...` from the repository root works the same.)

0. jax-triton (the triton backend's launcher): the GPU machine has none
   installed, so before anything imports it, an installed jax_triton that
   imports is kept, else the pure-Python wheel carried in bench/wheels/
   (jax-triton 0.3.1, with absl-py's where absl is missing: README.md
   there) goes on sys.path, importable from the zip without pip
   (`gpu_report.provide_jax_triton`). Which one ran, or why none could, is
   printed first and recorded with the versions.
1. Correctness (bench/gpu_correctness.py): the pallas kernels (Pallas
   Triton), the mosaic_gpu kernels (Mosaic GPU forward and dX, Pallas
   Triton dW) and the triton kernels (raw Triton through jax-triton)
   against the reference backend with shared tiles, empty groups and NaN
   in the padding rows: output, dX and dW of the grouped GEMM (both weight
   layouts) and of the expert FFN (plain and with the fused activation),
   then a small MoE layer and its gradients (for triton also with the
   combine weights fused into the down GEMM: fuse_routing_weights). pallas
   runs in bf16 and float32, mosaic_gpu in bf16 (it raises
   NotImplementedError for float32: those cases are recorded as skipped,
   with its message), triton in bf16 and, on a GEMM of each layout, an FFN
   case and the fused layer, float32 (where Triton's dot must not round to
   TF32); triton also on a many-rows GEMM and FFN that reach its widest
   tiles, as Mixtral's shapes do. Two cases have enough rows per expert and
   a wide enough N for the GPU tile choices the timing runs. te
   (Transformer Engine's grouped GEMM, `cpp_extensions.grouped_gemm`) runs
   everyone's GEMM, FFN and layer cases in bf16 where TE is installed, with
   the kernel TE picks (`_te.grouped_gemm_path`: cuBLAS's grouped GEMM, or
   a per-group loop that copies group_sizes to the host) recorded; the GPU
   machine has no TE (its wheels are too large to carry), and there every
   te case and method is recorded as skipped: "Transformer Engine is not
   installed on this machine". Then the
   forward grouped GEMM of each quantised recipe of moe_core.precision
   (fp8_tensor, fp8_block, mxfp8, nvfp4) on pallas and on xla against the
   reference backend's, bf16 inputs, a float32 output, ragged groups with
   an empty one: the same quantised operands, so within the float32
   budget (a backend that refuses a recipe: recorded as skipped, with its
   message). Budgets: bench/gpu_tolerances.py, from
   conformance/tolerances.py.
   Then, where Transformer Engine is installed, the whole shared
   conformance suite on te (bench/gpu_conformance.py: a child process,
   stopped after --conformance_timeout_s and then recorded as incomplete;
   absltest from TE's own dependencies); its counts go in the JSON's
   "conformance". Where TE is missing (the lent GPU machine) it is recorded
   as skipped: "Transformer Engine is not installed on this machine".
2. Timing (bench/gpu_timing.py), bf16, of the workloads of
   bench/gpu_workloads.py: DeepSeek-V3 experts (D=7168, F=2048, all 256
   experts, top-8, T=4096: M=32768 rows, about 1 TFLOP per projection) and
   Mixtral 8x7B's (D=4096, F=14336, 8 experts, top-2, T=8192: M=16384),
   forward and forward+backward of the gate/up-shaped [M, D] x [E, D, F]
   and the down-shaped [M, F] x [E, F, D] grouped GEMMs and of the whole
   expert FFN; then the forward of a small-K GEMM [M, 1024] x [256, 1024,
   7168]; then the low-precision recipes at DeepSeek-V3's gate/up GEMM,
   forward: the bf16 pallas GEMM again (the baseline of the ratios, in the
   same row) and each recipe on pallas (its time includes quantising both
   operands; xla's rows are recorded as skipped there: its float32
   ragged_dot would be expanded over 256 groups); then DeepSeek-V3's two
   GEMMs with the backward in halves, dX alone and dW alone (the forward
   is dropped from those programs); then DeepSeek-V3's routed experts
   (dispatch, expert FFN, combine) from a fixed routing with the same group
   sizes. Methods: a dense `jnp.dot` of the same FLOPs (cuBLAS),
   `jax.lax.ragged_dot`, pallas, mosaic_gpu, triton and te (for the FFN
   also each but te with the fused activation; for the routed experts,
   pallas and triton, and triton with the routing weights fused too; te
   on DeepSeek-V3's and Mixtral's GEMMs and FFN, forward and backward).
   Times are medians of up to --repeats calls after a warm-up (fewer past
   2 s a phase); ratios are time / baseline time (`fwd_time_over_dense`,
   `fwd_time_over_pallas`, ...: < 1 is faster). The timed programs' own
   output and gradients are checked on a few sampled groups (the routed
   experts: tokens and experts) against a float32 per-group `jnp.dot` (a
   recipe's, against the reference's quantised product of the group).
   "goals" holds the targets: mosaic_gpu's forward >= 0.6x dense cuBLAS
   throughput, and faster than pallas at small K; triton's forward, dX and
   dW each >= 0.6x dense cuBLAS throughput, and its fused-activation FFN
   faster than its unfused one (the fused routing weights' cost over the
   fused activation alone, reported); fp8_tensor's and fp8_block's pallas
   forward >= 1.5x the bf16 pallas forward's throughput on Hopper; mxfp8's
   and nvfp4's (emulated) cost over bf16, reported (goals are reported,
   never failed).

No timed problem starts past --budget_s (360 s) into the run: its row says
"skipped" (not a failure), so the run ends well under 8 minutes on an H200
even if compiles are slow; the workloads go in the order of
`gpu_workloads.FULL` (DeepSeek-V3, small K, the recipes, DeepSeek-V3's
backward in halves, its routed experts, Mixtral).

The shapes, cases and programs of both phases, and of --lower_only
(bench/gpu_lowering.py, which also checks each program's custom calls:
Triton for pallas, mosaic_gpu_v2 for mosaic_gpu and Triton for its dW), are
in bench/gpu_workloads.py. --workloads picks some of them. --lower_only
cannot lower triton's programs on a CPU-only machine (a jax-triton call is
lowered by compiling its kernel through the CUDA plugin, which a CPU jaxlib
lacks): they are listed as skipped, with that reason (gpu_check_test
lowers them through the carried wheel with the plugin's bindings stubbed).
te's are lowered where TE is installed (off a GPU, with TE told the GPU is
sm_90) and must call TE's grouped GEMM; elsewhere listed as skipped.

Every backend, case and method is guarded: a failure (a compile error, a
backend that cannot be built) is recorded with its error and the run goes
on; a triton backend whose availability() says no (jax-triton not
importable, no GPU) has its cases and methods recorded as skipped, with
its reason. The JSON (date; versions of python, jax, jaxlib, triton and
jax-triton and where jax-triton came from, also printed first; device;
backends; workloads with their group sizes; correctness; timing; goals;
how many of JAX's Pallas Triton deprecation warnings were filtered;
failures) is rewritten after every timed method and once more at the end,
whatever happened, as <out_dir>/gpu_<date>.json (gpu_dryrun_<date>.json
with --dry_run; out_dir defaults to bench/results/ in this repository).
The exit status is 1 if anything failed, decided after the last write.
Needs only jax (with its CUDA plugin) and this repository: no absl, no
network.

--dry_run interprets the kernels on the CPU at tiny shapes; Mosaic GPU's
interpreter takes seconds a call, so there mosaic_gpu is checked on one
GEMM case and timed on the small-K row only; Triton's interpreter (torch
on the CPU: where torch is missing, triton is skipped with that reason) a
tenth of a second or more a launch, so there triton is checked on its own
smaller cases (`gpu_workloads.DRY_TRITON_CASES`) and timed at a smaller
shape.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

# Run as a script (python bench/gpu_check.py), only bench/ is on sys.path:
# put the repository there before importing from it.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

from bench import gpu_conformance
from bench import gpu_correctness
from bench import gpu_lowering
from bench import gpu_report
from bench import gpu_timing
from bench import gpu_workloads
from moe_core import compat
from moe_core import registry

# pylint: enable=g-import-not-at-top,wrong-import-position


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument(
      "--dry_run",
      action="store_true",
      help="run everything on the CPU at tiny shapes, with the "
      "kernels interpreted",
  )
  mode.add_argument(
      "--lower_only",
      action="store_true",
      help="only lower every GPU program for CUDA (works on a "
      "CPU-only machine)",
  )
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument(
      "--tokens",
      type=int,
      default=None,
      help="T of every workload (default: each workload's; 64 with "
      "--dry_run)",
  )
  parser.add_argument(
      "--experts",
      type=int,
      default=None,
      help="E on this device: a slice of each model's experts, at most "
      "all of them (default: all)",
  )
  parser.add_argument(
      "--workloads",
      default=None,
      help="comma-separated workload names (default: all; "
      f"{','.join(w.name for w in gpu_workloads.FULL)} on a GPU)",
  )
  parser.add_argument("--skew", default="random", choices=["random", "zipf"])
  parser.add_argument(
      "--out_dir",
      default=os.path.join(_REPO, "bench", "results"),
      help="where the JSON goes (on the device machine: "
      '"$OUT", the only folder that comes back)',
  )
  parser.add_argument("--skip_correctness", action="store_true")
  parser.add_argument(
      "--conformance_timeout_s",
      type=float,
      default=240.0,
      help="the te conformance suite (where Transformer Engine is "
      "installed) is stopped after this long and recorded as incomplete",
  )
  parser.add_argument(
      "--budget_s",
      type=float,
      default=360.0,
      help="no timed problem starts this many seconds after the run began "
      "(its row says skipped; the one running finishes, a minute at most "
      "at the default shapes)",
  )
  return parser.parse_args(argv)


def _workloads(args):
  """The timed workloads (DRY ones with --dry_run), flags applied.

  Raises:
    ValueError: --workloads names one that does not exist.
  """
  every = gpu_workloads.dry_workloads() if args.dry_run else gpu_workloads.FULL
  if args.workloads:
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - {w.name for w in every})
    if unknown:
      raise ValueError(
          f"unknown workloads {unknown}; there are "
          f"{[w.name for w in every]}."
      )
    every = tuple(w for w in every if w.name in names)
  out = []
  for w in every:
    shape = dict(w.shape)
    if args.tokens:
      shape["tokens"] = args.tokens
    if args.experts:
      shape["experts"] = min(args.experts, w.model_experts)
    out.append(w._replace(shape=shape))
  return tuple(out)


def _workload_entry(workload, skew):
  """What the JSON says of a workload: shape, rows, group sizes, slice."""
  m, sizes, problems = gpu_workloads.problems(
      workload.shape, skew, workload.problems
  )
  experts = workload.shape["experts"]
  return {
      "name": workload.name,
      "note": workload.note,
      "shape": workload.shape,
      "model_experts": workload.model_experts,
      "experts": (
          "all of the model's"
          if experts == workload.model_experts
          else f"a slice: {experts} of the model's {workload.model_experts}"
      ),
      "rows": m,
      "group_sizes": sizes.tolist(),
      "problems": [p.name for p in problems],
      "methods": workload.methods,
      "phases": workload.phases,
  }


def _new_report(args, workloads, versions, now, repeats):
  """The report before any phase has run."""
  return {
      "date": now.isoformat(),
      **versions,
      "dry_run": args.dry_run,
      "workloads": [_workload_entry(w, args.skew) for w in workloads],
      "skew": args.skew,
      "repeats": repeats,
      "budget_s": args.budget_s,
      "seconds": None,
      "triton_deprecation_warnings": None,
      "backends": None,
      "correctness": [],
      "conformance": [],
      "timing": [],
      "goals": [],
  }


def _run_phases(args, workloads, on_gpu, report, path, deadline):
  """Correctness, then timing, each written as soon as it is done."""
  bes = gpu_workloads.backends(on_gpu=on_gpu if on_gpu else None)
  report["backends"] = bes.describe()
  for name, description in report["backends"].items():
    print(f"{name}: {description}")
  if not args.skip_correctness:
    gpu_correctness.check_correctness(
        bes,
        report["correctness"],
        mosaic_gemm_cases=(
            gpu_workloads.DRY_MOSAIC_GEMM_CASES if args.dry_run else None
        ),
        triton=gpu_workloads.DRY_TRITON_CASES if args.dry_run else None,
    )
    gpu_report.write(path, report)
    gpu_correctness.print_summary(report["correctness"])
    report["conformance"].append(
        gpu_conformance.run_suite(
            "te", args.conformance_timeout_s, _te_availability(on_gpu)
        )
    )
    gpu_report.write(path, report)
    gpu_conformance.print_summary(report["conformance"])
  for workload, entry in zip(workloads, report["workloads"]):
    sizes = entry["group_sizes"]
    shape = workload.shape
    recipes = sorted(
        {gpu_workloads.method_recipe(m) for m in workload.methods or ()}
        - {"bf16"}
    )
    print(
        f"{workload.name}: T={shape['tokens']} top-{shape['top_k']} -> "
        f"M={entry['rows']} rows, D={shape['hidden']} F={shape['ffn']} "
        f"E={shape['experts']} ({entry['experts']}), bf16"
        f"{' and ' + ', '.join(recipes) if recipes else ''}, {args.skew} "
        f"group sizes (min {min(sizes)}, max {max(sizes)}), median of up "
        f"to {report['repeats']}"
    )
    gpu_timing.run_timing(
        workload,
        report["repeats"],
        args.skew,
        bes,
        report["timing"],
        on_row=lambda: gpu_report.write(path, report),
        deadline=deadline,
    )
  gpu_timing.print_timing(report["timing"])
  gpu_timing.print_goals(
      gpu_timing.goals(report["timing"], report.get("device"))
  )


def _te_availability(on_gpu: bool) -> tuple[bool, str]:
  """Whether the te conformance suite can run here, and why not."""
  from backends.te import _te  # pylint: disable=import-outside-toplevel

  installed, _ = _te.installed()
  if not installed:
    return False, "Transformer Engine is not installed on this machine"
  if not on_gpu:
    return False, "no GPU (a --dry_run): the te suite runs on a GPU only"
  return registry.availability("te")


def main(argv=None):
  args = _parse_args(argv)
  workloads = _workloads(args)
  if hasattr(sys.stdout, "reconfigure"):  # Lines survive a hard crash.
    sys.stdout.reconfigure(line_buffering=True)
  # Before any backend imports jax_triton (the triton backend does so
  # lazily): the GPU machine has none installed, bench/wheels/ carries it.
  gpu_report.provide_jax_triton()
  versions = gpu_report.versions()
  print(gpu_report.versions_line(versions))

  if args.lower_only:
    return gpu_lowering.run(workloads)

  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.dry_run:
    print(
        "no GPU here: run with --dry_run (CPU, tiny shapes, interpreted "
        "kernels) or --lower_only (CUDA lowering)."
    )
    return 2
  now = datetime.datetime.now(datetime.timezone.utc)
  os.makedirs(args.out_dir, exist_ok=True)
  stem = "gpu_dryrun" if args.dry_run else "gpu"
  path = os.path.join(args.out_dir, f"{stem}_{now:%Y%m%d_%H%M%S}.json")
  repeats = 1 if args.dry_run else args.repeats
  report = _new_report(args, workloads, versions, now, repeats)
  start = time.perf_counter()
  filtered = compat.triton_deprecations_filtered()
  try:
    # jax >= 0.11 warns once per Triton kernel compiled: counted in the
    # JSON, not printed.
    with compat.filter_triton_deprecation():
      _run_phases(args, workloads, on_gpu, report, path, start + args.budget_s)
  except Exception as e:  # pylint: disable=broad-except
    report["fatal_error"] = gpu_report.error_text(e)
    traceback.print_exc()
  finally:  # Whatever happened (even an interrupt): write what there is.
    report["seconds"] = time.perf_counter() - start
    # From whatever rows there are, even after a crash.
    report["goals"] = gpu_timing.goals(report["timing"], report.get("device"))
    report["triton_deprecation_warnings"] = (
        compat.triton_deprecations_filtered() - filtered
    )
    report["failures"] = gpu_report.failures(report)
    gpu_report.write(path, report)
    print(
        f"Pallas Triton deprecation warnings filtered: "
        f"{report['triton_deprecation_warnings']}"
    )
    print(f"wrote {path} ({report['seconds']:.0f} s)")
  for line in report["failures"]:
    print(f"FAILED {line}")
  return 1 if report["failures"] else 0


if __name__ == "__main__":
  sys.exit(main())
