"""The timing harness every benchmark shares (no absl: gpu_check uses it).

A time is the median of samples after a warm-up (`sample_seconds`); a
timed row carries its seconds, TFLOP/s and whether its outputs are finite
(`time_one`); rows become ratios over baselines of the same run
(`add_ratios`), and ratios are judged against goals (`goals`).

Every ratio the benchmarks print or write is one convention: a cost over
the same cost of a baseline measured in the same run, here a time over the
baseline's time (< 1: faster than the baseline). Its JSON key says so:
`<phase>_time_over_<baseline>`, e.g. `fwd_time_over_dense` (ep_bench's
`<bytes>_over_ideal` read the same way), and a printed column header says
`time/<baseline>`.
"""

from __future__ import annotations

import fnmatch
import math
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

from bench.harness import json_report

# Timed calls stop after this many seconds (at least one call).
PHASE_BUDGET_S = 2.0
# The on-chip benchmarks' `sample_seconds(pipelined_s=)`: each sample a
# batch of back-to-back calls this long at least, the chip's time per call
# without the host's dispatch (most of a sub-millisecond kernel's wall time).
PIPELINED_S = 0.05
# Hopper device kinds: "NVIDIA H100 80GB HBM3", "NVIDIA H200", ...
_HOPPER = re.compile(r"\bG?H(20|100|200|800)\b")


def median_seconds(fn, args, repeats: int) -> float:
  """Median wall time of fn(*args) over `repeats` calls after a warm-up.

  The first call compiles and warms up and is not counted; every call is
  waited for with block_until_ready, so the time covers the device work.
  """
  return sample_seconds(fn, args, repeats, math.inf)[0]


def sample_seconds(
    fn, args, repeats, budget_s=PHASE_BUDGET_S, *, pipelined_s=0.0
):
  """(median seconds, calls timed, first call's seconds, first output) of
  fn(*args): up to `repeats` samples after the first call, fewer once they
  add up to `budget_s` (at least one).

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
  (`sample_seconds`' pipelined_s, within PHASE_BUDGET_S)."""
  try:
    seconds, calls, first, out = sample_seconds(
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
    row["error"] = json_report.error_text(e)
  return row


def with_grad(fn):
  """f(a, b, g, cotangent) -> (loss, (d a, d b)): forward, dX and dW.

  The loss vdot(fn(a, b, g), cotangent) is returned so that the forward is
  not dead code (the gradients of a linear map do not need its output).
  """

  def loss(a, b, g, cotangent):
    return jnp.vdot(fn(a, b, g).astype(jnp.float32), cotangent)

  return jax.value_and_grad(loss, argnums=(0, 1))


# What the benchmarks time of a method: its forward, and its forward and
# backward (`with_grad`: dX and dW too, three times the forward's FLOPs).
PHASES = ("fwd", "fwd_bwd")
FLOPS_OVER_FWD = {"fwd": 1, "fwd_bwd": 3}


def phase_programs(fn):
  """{phase: jitted program} of f(rows, weights, group_sizes)."""
  return {"fwd": jax.jit(fn), "fwd_bwd": jax.jit(with_grad(fn))}


def phase_args(phase: str, args: tuple, cotangent) -> tuple:
  """A phase's arguments: fwd takes `args`, fwd_bwd also the cotangent."""
  return args if phase == "fwd" else args + (cotangent,)


def ratio_key(phase: str, baseline: str) -> str:
  """The JSON key of a phase's time over a baseline's: "fwd_time_over_dense"."""
  return f"{phase}_time_over_{baseline}"


def time_over(seconds: float | None, baseline_seconds: float | None):
  """seconds / baseline_seconds (< 1: faster), None if either is missing."""
  if seconds is None or baseline_seconds is None:
    return None
  return seconds / baseline_seconds


def add_ratios(rows, baselines) -> None:
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
      r[ratio_key(r["mode"], base)] = time_over(
          r.get("seconds"), seconds.get((r["workload"], r["mode"], base))
      )


def goals(rows, table, device_kind=None) -> list[dict]:
  """The entries of `table` the rows can judge: value, target and met.

  An entry is (workload pattern, variant, mode, baseline, largest time over
  the baseline's, what it says); one whose words start "hopper:" is judged
  on a Hopper GPU (`device_kind`) only.
  """
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
      value = r.get(ratio_key(r["mode"], base))
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
