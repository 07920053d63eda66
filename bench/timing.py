"""Timing helpers shared by the benchmarks (no absl: gpu_check uses them)."""

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
