"""Grouped-GEMM benchmark: every backend against dense and ragged_dot, one run.

Times rows [M, D] x weights [E, D, F] -> [M, F] over ragged groups (even,
random, Zipf-skewed), forward and forward+backward, for E in --experts,
each as a ratio over a dense `jnp.dot` of the same useful FLOPs timed in
the same run; prints a table and writes
bench/results/grouped_gemm_<platform>_<date>.json (docs/benchmarks.md,
"bench/micro/grouped_gemm_bench.py"). Usage:
    python -m bench.micro.grouped_gemm_bench [--quick] [--dtype float32]
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu import allocator
import moe_core
from bench.harness import json_report
from bench.harness import text_table
from bench.harness import timing
from bench.workloads import gemm_workloads
from train import platforms

_QUICK = flags.DEFINE_bool(
    "quick", False, "One repeat and one warm-up call: proves the script runs."
)
_ROWS = flags.DEFINE_integer("rows", 4096, "M: dispatched rows (T * top_k).")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "D: the contraction size.")
_FFN = flags.DEFINE_integer("ffn", 1024, "F: the output size.")
_EXPERTS = flags.DEFINE_list("experts", ["8", "64"], "E values to run.")
_SKEWS = flags.DEFINE_list(
    "skews", list(gemm_workloads.SKEWS), "Group-size distributions."
)
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "Operand dtype."
)
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed calls per measurement.")
_BACKENDS = flags.DEFINE_list(
    "backends",
    ["dense", "ragged_dot", "xla", "cpu", "pallas"],
    "What to time: dense, ragged_dot, or registered backend names.",
)
_ZIPF_EXPONENT = flags.DEFINE_float(
    "zipf_exponent", 1.2, "s in p(rank r) ~ r^-s."
)
_OUT_DIR = flags.DEFINE_string(
    "out_dir",
    os.path.join(os.path.dirname(__file__), "..", "results"),
    "Where the JSON goes.",
)


_BASELINES = {
    "dense": gemm_workloads.dense_gemm,
    "ragged_dot": gemm_workloads.ragged_dot_gemm,
}


def _gemm_fn(name):
  """f(rows, weights, group_sizes) -> [M, F] for one measured method."""
  if name in _BASELINES:
    return _BASELINES[name]
  return moe_core.get_backend(name).grouped_gemm


def _measure(names, weights, rows, group_sizes, cotangent, repeats):
  """{name: {"fwd_s": ..., "fwd_bwd_s": ...}}: median times of each method.

  The calls are interleaved: every repeat times each method's phase once,
  in turn, so a change of load on a shared machine (other processes on the
  same cores) lands on every method alike instead of on whichever method
  was being timed when it happened.
  """
  calls = {}
  for name in names:
    programs = timing.phase_programs(_gemm_fn(name))
    w = gemm_workloads.one_expert(weights) if name == "dense" else weights
    args = (rows, w, group_sizes)
    for phase in timing.PHASES:
      calls[name, phase] = (
          programs[phase],
          timing.phase_args(phase, args, cotangent),
      )
  for fn, args in calls.values():  # Compile and warm up.
    jax.block_until_ready(fn(*args))
  seconds = {key: [] for key in calls}
  for _ in range(repeats):
    for key, (fn, args) in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      seconds[key].append(time.perf_counter() - start)
  return {
      name: {
          f"{phase}_s": statistics.median(seconds[name, phase])
          for phase in timing.PHASES
      }
      for name in names
  }


def _available(name):
  if name in _BASELINES:
    return True, ""
  return moe_core.registry.availability(name)


def _methods():
  """The --backends that can run here, dense first (every ratio's base)."""
  names = []
  for name in _BACKENDS.value:
    ok, why = _available(name)
    if ok:
      names.append(name)
    else:
      print(f"skipping {name}: {why}")
  if "dense" not in names:
    names.insert(0, "dense")
  return names


def _result(experts, skew, sizes, name, times, timings, fwd_flops):
  """One JSON row: a method's times, their ratios to dense's (and xla's),
  GFLOP/s."""
  dense_times = timings["dense"]
  over_xla = {}
  if "xla" in timings:
    over_xla = {
        timing.ratio_key(p, "xla"): timing.time_over(
            times[f"{p}_s"], timings["xla"][f"{p}_s"]
        )
        for p in timing.PHASES
    }
  return {
      "experts": experts,
      "skew": skew,
      "method": name,
      "largest_group": int(sizes.max()),
      "empty_groups": int(np.sum(sizes == 0)),
      **{f"{p}_ms": 1e3 * times[f"{p}_s"] for p in timing.PHASES},
      **{
          timing.ratio_key(p, "dense"): timing.time_over(
              times[f"{p}_s"], dense_times[f"{p}_s"]
          )
          for p in timing.PHASES
      },
      **over_xla,
      "fwd_gflops": fwd_flops / times["fwd_s"] / 1e9,
  }


def _run(names, m, d, f, dtype, repeats):
  """Times every method at every E and skew; returns the JSON rows."""
  k_rows, k_cot, k_w = jax.random.split(jax.random.key(0), 3)
  rows = jax.random.normal(k_rows, (m, d), dtype)
  cotangent = jax.random.normal(k_cot, (m, f), jnp.float32)
  results = []
  for experts in (int(e) for e in _EXPERTS.value):
    weights = (
        jax.random.normal(k_w, (experts, d, f), jnp.float32) / np.sqrt(d)
    ).astype(dtype)
    for skew in _SKEWS.value:
      sizes = gemm_workloads.skewed_group_sizes(
          skew, m, experts, zipf_exponent=_ZIPF_EXPONENT.value
      )
      group_sizes = jnp.asarray(sizes)
      timings = _measure(names, weights, rows, group_sizes, cotangent, repeats)
      results += [
          _result(
              experts,
              skew,
              sizes,
              name,
              timings[name],
              timings,
              2 * m * d * f,
          )
          for name in names
      ]
  return results


_COLUMNS = (
    text_table.Column("E", 3, "d"),
    text_table.Column("skew", 7, align="<"),
    text_table.Column("method", 11, align="<"),
    *(
        column
        for label, width in (("fwd", 8), ("fwd+bwd", 11))
        for column in (
            text_table.Column(f"{label} ms", width, ".2f"),
            text_table.Column("time/dense", 10, ".2f"),
        )
    ),
    text_table.Column("GFLOP/s", 8, ".1f"),
)


def _cells(r: dict) -> list:
  """A result's values, one a column of _COLUMNS."""
  values = [r["experts"], r["skew"], r["method"]]
  for phase in timing.PHASES:
    values += [r[f"{phase}_ms"], r[timing.ratio_key(phase, "dense")]]
  return values + [r["fwd_gflops"]]


def _print_results(results):
  text_table.print_table(
      _COLUMNS,
      results,
      _cells,
      "'time/dense': the method's time / the time of a dense jnp.dot of the "
      "same useful FLOPs in this run (< 1 is faster).",
  )


def _print_skew_stability(results, names):
  """Per method and E: slowest skew's time / fastest's (1.0: insensitive)."""
  print("skew stability (fwd+bwd time, slowest skew / fastest skew):")
  for name in names:
    for experts in sorted({r["experts"] for r in results}):
      times = [
          r["fwd_bwd_ms"]
          for r in results
          if r["method"] == name and r["experts"] == experts
      ]
      if times:
        print(f"  {name:<11} E={experts:<3} {max(times) / min(times):5.2f}")


def _cpu_kernels(names):
  """Which kernels the cpu backend ran ("amx", "avx512-bf16", ...), or
  None."""
  if "cpu" not in names:
    return None
  return moe_core.get_backend("cpu").kernels()


def main(argv):
  del argv
  repeats = 1 if _QUICK.value else _REPEATS.value
  dtype = jnp.dtype(_DTYPE.value)
  m, d, f = _ROWS.value, _HIDDEN.value, _FFN.value
  device = jax.devices()[0]
  names = _methods()
  print(
      f"jax {jax.__version__} on {jax.default_backend()} "
      f"({device.device_kind}); M={m} D={d} F={f} dtype={dtype.name} "
      f"repeats={repeats}"
  )
  results = _run(names, m, d, f, dtype, repeats)
  _print_results(results)
  _print_skew_stability(results, names)

  json_report.save_run(
      _OUT_DIR.value,
      "grouped_gemm",
      {
          "quick": _QUICK.value,
          "repeats": repeats,
          "shape": {"rows": m, "hidden": d, "ffn": f},
          "dtype": dtype.name,
          "cpu_kernels": _cpu_kernels(names),
          # backends/cpu/allocator.py: glibc's, or freed memory kept.
          "cpu_allocator": allocator.state(),
          "results": results,
      },
  )


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
