"""gpu_check's run phase: the programs of bench/programs.py timed on a GPU.

Each one-GPU program (the layers of DeepSeek-V3, Mixtral 8x7B and
Qwen3-30B-A3B, and the grouped GEMMs; forward and forward+backward) runs as
compiled by gpu_check's compile phase: the median of up to `repeats` calls
after a warm-up (fewer once they take PHASE_BUDGET_S), the expert GEMMs'
TFLOP/s, and the time over the same workload and mode's baselines
(`BASELINES`, `timing.ratio_key`: < 1 is faster). A grouped GEMM also has a
dense baseline: one expert's weights for every row, a cuBLAS `jnp.dot` of
the same FLOPs. The outputs must be finite (their numerics are the
conformance suites'). `goals` reads the targets off the rows.
"""

from __future__ import annotations

import fnmatch
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

from bench import gemm_workloads
from bench import gpu_report
from bench import programs as programs_lib
from bench import text_table
from bench import timing

# What every time is divided by, where the row's workload and mode have it:
# a dense cuBLAS GEMM of the same FLOPs, pallas, and xla on ragged_dot.
BASELINES = ("dense", "pallas", "xla")
# Timed calls stop after this many seconds (at least one call).
PHASE_BUDGET_S = 2.0
# The on-chip benchmarks' `median_seconds(pipelined_s=)`: each sample a
# batch of back-to-back calls this long at least, the chip's time per call
# without the host's dispatch (most of a sub-millisecond kernel's wall time).
PIPELINED_S = 0.05
# The targets, read off the rows: (workload pattern, variant, mode,
# baseline, largest time / baseline time, what it says). "hopper": judged
# on a Hopper GPU only.
GOALS = (
    ("*_gemm", "mosaic_gpu", "fwd", "dense", 1 / 0.6, ">= 0.6x dense cuBLAS"),
    ("small_k", "mosaic_gpu", "fwd", "pallas", 1.0, "faster than pallas"),
    ("*_gemm", "triton", "*", "dense", 1 / 0.6, ">= 0.6x dense cuBLAS"),
    ("*", "triton", "*", "triton_unfused_act", 1.0, "fused act. faster"),
    (
        "*_gemm",
        "pallas_fp8_*",
        "fwd",
        "pallas",
        1 / 1.5,
        "hopper: >= 1.5x bf16",
    ),
)
# Hopper device kinds: "NVIDIA H100 80GB HBM3", "NVIDIA H200", ...
_HOPPER = re.compile(r"\bG?H(20|100|200|800)\b")


def dense_program(workload, mode: str, size: str):
  """(fn, args) of a grouped GEMM workload's dense baseline, abstract."""
  s = workload.size(size)
  rows = jax.ShapeDtypeStruct((s.tokens, s.hidden), jnp.bfloat16)
  weights = jax.ShapeDtypeStruct((s.hidden, s.ffn), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((1,), jnp.int32)
  fn, args = gemm_workloads.dense_gemm, (rows, weights, sizes)
  if mode == "fwd_bwd":
    cot = jax.ShapeDtypeStruct((s.tokens, s.ffn), jnp.float32)
    fn, args = programs_lib.with_grad(fn), args + (cot,)
  return fn, args


def dense_args(workload, mode: str, size: str, key):
  """Random arrays for `dense_program`: every row in one group."""
  s = workload.size(size)
  k1, k2, k3 = jax.random.split(key, 3)
  args = (
      jax.random.normal(k1, (s.tokens, s.hidden), jnp.bfloat16),
      jax.random.normal(k2, (s.hidden, s.ffn), jnp.bfloat16)
      * jnp.asarray(s.hidden**-0.5, jnp.bfloat16),
      jnp.full((1,), s.tokens, jnp.int32),
  )
  if mode == "fwd_bwd":
    args += (jax.random.normal(k3, (s.tokens, s.ffn), jnp.float32),)
  return args


def median_seconds(
    fn, args, repeats, budget_s=PHASE_BUDGET_S, *, pipelined_s=0.0
):
  """(median seconds, calls timed, first call's seconds) of fn(*args).

  With `pipelined_s` > 0 a sample is a batch of calls dispatched back to
  back and waited for once, at least `pipelined_s` long, over its size:
  the device's time per call, as a profiler reports it, with the host's
  dispatch (tens of microseconds a call) hidden behind the device's work
  as in a training loop. With 0, each call is waited for on its own.
  """
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  batch = 1
  if pipelined_s > 0:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    batch = max(1, min(64, round(pipelined_s / max(once, 1e-6))))
  times = []
  while len(times) < max(repeats, 1) and (not times or sum(times) < budget_s):
    start = time.perf_counter()
    for _ in range(batch):
      # Only the last output is kept: the device runs the calls in order,
      # and an earlier one's buffers are freed as soon as it is done.
      result = fn(*args)
    jax.block_until_ready(result)
    times.append((time.perf_counter() - start) / batch)
    del result
  return statistics.median(times), len(times) * batch, first, out


@jax.jit
def _all_finite(x):
  """Whether every element of x is finite, in one fused reduction: an eager
  isfinite would hold a bool copy of x (1.75 GiB for a [262144, 7168]
  output, which ran the chip out of memory beside the output)."""
  return jnp.all(jnp.isfinite(x))


def time_one(
    row: dict, compiled, args, repeats: int, flops: int, pipelined_s=0.0
) -> dict:
  """Fills `row` with the times of `compiled` on `args`, or its error
  (`median_seconds`' pipelined_s)."""
  try:
    seconds, calls, first, out = median_seconds(
        compiled, args, repeats, pipelined_s=pipelined_s
    )
    row.update(
        seconds=seconds,
        calls=calls,
        first_call_s=first,
        tflops=flops / seconds / 1e12,
        finite=all(bool(_all_finite(x)) for x in jax.tree.leaves(out)),
    )
    if not row["finite"]:
      row["error"] = "non-finite output"
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    row["error"] = gpu_report.error_text(e)
  return row


def add_ratios(rows, baselines=BASELINES) -> None:
  """Each row's time over its workload and mode's `baselines` rows."""
  seconds = {
      (r["workload"], r["mode"], r["variant"]): r.get("seconds")
      for r in rows
      if "mode" in r
  }
  for r in rows:
    if "mode" not in r:
      continue
    for base in baselines:
      r[timing.ratio_key(r["mode"], base)] = timing.time_over(
          r.get("seconds"), seconds.get((r["workload"], r["mode"], base))
      )


def goals(rows, device_kind=None, table=GOALS) -> list[dict]:
  """The entries of `table` (`GOALS`) the rows can judge: value, target
  and met."""
  hopper = bool(device_kind) and bool(_HOPPER.search(str(device_kind)))
  out = []
  for pattern, variant, mode, base, most, says in table:
    for r in rows:
      match = "mode" in r and (
          fnmatch.fnmatchcase(r["workload"], pattern)
          and fnmatch.fnmatchcase(r["variant"], variant)
          and fnmatch.fnmatchcase(r["mode"], mode)
      )
      if not match:
        continue
      value = r.get(timing.ratio_key(r["mode"], base))
      judged = value is not None and (hopper or not says.startswith("hopper"))
      out.append(
          {
              "goal": f"{r['variant']} {r['mode']} time / {base}: {says}",
              "workload": r["workload"],
              "value": value,
              "target": f"<= {most:.2f}",
              "met": bool(value <= most) if judged else None,
          }
      )
  return out


_COLUMNS = (
    text_table.Column("workload", 16, align="<"),
    text_table.Column("variant", 22, align="<"),
    text_table.Column("mode", 7, align="<"),
    text_table.Column("ms", 9, ".3f"),
    text_table.Column("TFLOP/s", 7, ".1f"),
    *(text_table.Column(f"time/{b}", 11, ".2f") for b in BASELINES),
)


def print_rows(rows) -> None:
  """The timing table and its legend."""
  print(text_table.heading(_COLUMNS))
  for r in rows:
    ms = r.get("seconds")
    line = text_table.row(
        _COLUMNS,
        [
            r["workload"],
            r["variant"],
            r["mode"],
            None if ms is None else 1e3 * ms,
            r.get("tflops"),
            *(r.get(timing.ratio_key(r["mode"], b)) for b in BASELINES),
        ],
    )
    for key in ("error", "skipped"):
      if key in r:
        line += f"  {key.upper()} {r[key][:80]}"
    print(line)
  print(
      "TFLOP/s: of the expert GEMMs; 'time/X': this time over X's, same "
      "workload and mode (< 1 is faster); dense: one expert's [D, F] for "
      "every row (cuBLAS, the same FLOPs)."
  )


def print_goals(found) -> None:
  for g in found:
    value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
    met = {None: "not judged", True: "met", False: "MISSED"}[g["met"]]
    print(f"goal {g['workload']} {g['goal']} = {value} ({g['target']}): {met}")
