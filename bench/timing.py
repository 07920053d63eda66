"""Timing helpers shared by the benchmarks (no absl: gpu_check uses them).

Every ratio the benchmarks print or write is one convention: a cost over
the same cost of a baseline measured in the same run, here a time over the
baseline's time (< 1: faster than the baseline). Its JSON key says so:
`<phase>_time_over_<baseline>`, e.g. `fwd_time_over_dense` (ep_bench's
`<bytes>_over_ideal` read the same way), and a printed column header says
`time/<baseline>`.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_seconds(fn, args, repeats: int) -> float:
  """Median wall time of fn(*args) over `repeats` calls after a warm-up.

  The first call compiles and warms up and is not counted; every call is
  waited for with block_until_ready, so the time covers the device work.
  """
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


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
