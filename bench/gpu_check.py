"""One short GPU run: pallas vs reference on the GPU, then bf16 TFLOP/s.

On the device machine, where only $OUT comes back:

    python -m bench.gpu_check --out_dir "$OUT"  # GPU, well under 5 minutes

Elsewhere:

    python -m bench.gpu_check                # GPU; JSON in bench/results/
    python -m bench.gpu_check --dry_run      # CPU: tiny shapes, interpreted
    python -m bench.gpu_check --lower_only   # CPU: lower every GPU program

(`python bench/gpu_check.py ...` from the repository root works the same.)

1. Correctness (bench/gpu_correctness.py): the pallas kernels (compiled
   through Triton) against the reference backend with shared tiles, empty
   groups and NaN in the padding rows: output, dX and dW of the grouped
   GEMM and of the expert FFN (plain and with the fused activation), then a
   small MoE layer and its gradients. Two cases have enough rows per expert
   and a wide enough N for the GPU heuristic to pick the large tiles the
   timing runs (and, for the fused gate+up, their register-fitted
   two-accumulator variant). Budgets: bench/gpu_tolerances.py, from
   conformance/tolerances.py.
2. Timing (bench/gpu_timing.py) at DeepSeek-V3 expert shapes (D=7168,
   F=2048, a 32-expert slice, top-8; T=4096 tokens gives M=32768 rows,
   about 1 TFLOP per projection, so a launch runs far past its overhead):
   bf16 forward and forward+backward of the gate/up-shaped [M, D] x
   [E, D, F] and the down-shaped [M, F] x [E, F, D] grouped GEMMs, and of
   the whole expert FFN, against a dense `jnp.dot` of the same FLOPs
   (cuBLAS), `jax.lax.ragged_dot` and the xla backend. Times are medians of
   --repeats calls after a warm-up; ratios are time / baseline time
   (`fwd_time_over_dense`, ...: < 1 is faster). The timed programs' own
   output and gradients are checked on a few sampled groups against a
   float32 per-group `jnp.dot` (max relative error per method).

The shapes, cases and programs of both phases, and of --lower_only
(bench/gpu_lowering.py), are in bench/gpu_workloads.py.

Every case and method is guarded: a failure (a Triton compile error, say)
is recorded with its error and the run goes on. The JSON (date; versions of
python, jax, jaxlib, triton and jax-triton, also printed first; device;
correctness; timing; how many of JAX's Pallas Triton deprecation warnings
were filtered; failures) is rewritten after every phase and once more at
the end, whatever happened, as <out_dir>/gpu_<date>.json
(gpu_dryrun_<date>.json with --dry_run; out_dir defaults to bench/results/
in this repository). The exit status is 1 if anything failed, decided after
the last write. Needs only jax (with its CUDA plugin) and this repository:
no absl, no network.
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

from bench import gpu_correctness
from bench import gpu_lowering
from bench import gpu_report
from bench import gpu_timing
from bench import gpu_workloads
from moe_core import compat

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
      help="T (default 4096; 64 with --dry_run)",
  )
  parser.add_argument(
      "--experts", type=int, default=None, help="E on this device (default 32)"
  )
  parser.add_argument("--skew", default="random", choices=["random", "zipf"])
  parser.add_argument(
      "--out_dir",
      default=os.path.join(_REPO, "bench", "results"),
      help="where the JSON goes (on the device machine: "
      '"$OUT", the only folder that comes back)',
  )
  parser.add_argument("--skip_correctness", action="store_true")
  return parser.parse_args(argv)


def _shape(args):
  """The timed shape: FULL (DRY with --dry_run), --tokens, --experts."""
  full = gpu_workloads.DRY if args.dry_run else gpu_workloads.FULL
  shape = dict(full)
  if args.tokens:
    shape["tokens"] = args.tokens
  if args.experts:
    shape["experts"] = args.experts
  return shape


def _new_report(args, shape, versions, now, repeats):
  """The report before any phase has run."""
  m, sizes, _ = gpu_workloads.problems(shape, args.skew)
  return {
      "date": now.isoformat(),
      **versions,
      "dry_run": args.dry_run,
      "shape": shape,
      "rows": m,
      "group_sizes": sizes.tolist(),
      "skew": args.skew,
      "repeats": repeats,
      "seconds": None,
      "triton_deprecation_warnings": None,
      "correctness": [],
      "timing": [],
  }


def _run_phases(args, shape, on_gpu, report, path):
  """Correctness, then timing, each written as soon as it is done."""
  pallas, fused, xla = gpu_workloads.backends(on_gpu=on_gpu if on_gpu else None)
  print(f"pallas: {pallas!r}, available: {pallas.availability()}")
  if not args.skip_correctness:
    gpu_correctness.check_correctness(pallas, fused, report["correctness"])
    gpu_report.write(path, report)
    gpu_correctness.print_summary(report["correctness"])
  sizes = report["group_sizes"]
  print(
      f"T={shape['tokens']} top-{shape['top_k']} -> M={report['rows']} rows, "
      f"D={shape['hidden']} F={shape['ffn']} E={shape['experts']}, "
      f"bf16, {args.skew} group sizes (min {min(sizes)}, max "
      f"{max(sizes)}), median of {report['repeats']}"
  )
  gpu_timing.run_timing(
      shape,
      report["repeats"],
      args.skew,
      pallas,
      fused,
      xla,
      report["timing"],
      on_row=lambda: gpu_report.write(path, report),
  )
  gpu_timing.print_timing(report["timing"])


def main(argv=None):
  args = _parse_args(argv)
  shape = _shape(args)
  if hasattr(sys.stdout, "reconfigure"):  # Lines survive a hard crash.
    sys.stdout.reconfigure(line_buffering=True)
  versions = gpu_report.versions()
  print(gpu_report.versions_line(versions))

  if args.lower_only:
    return gpu_lowering.run(shape)

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
  report = _new_report(args, shape, versions, now, repeats)
  start = time.perf_counter()
  filtered = compat.triton_deprecations_filtered()
  try:
    # jax >= 0.11 warns once per Triton kernel compiled: counted in the
    # JSON, not printed.
    with compat.filter_triton_deprecation():
      _run_phases(args, shape, on_gpu, report, path)
  except Exception as e:  # pylint: disable=broad-except
    report["fatal_error"] = gpu_report.error_text(e)
    traceback.print_exc()
  finally:  # Whatever happened (even an interrupt): write what there is.
    report["seconds"] = time.perf_counter() - start
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
