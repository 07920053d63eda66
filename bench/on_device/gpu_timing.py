"""gpu_check's run phase: the programs of workloads/programs.py timed on a GPU.

Each one-GPU program (the layers of DeepSeek-V3, Mixtral 8x7B and
Qwen3-30B-A3B, and the grouped GEMMs; forward and forward+backward) runs as
compiled by gpu_check's compile phase: the median of up to `repeats`
calls after a warm-up (fewer once they take `timing.PHASE_BUDGET_S`), the
expert GEMMs' TFLOP/s, and the time over the same workload and mode's baselines
(`BASELINES`, `timing.ratio_key`: < 1 is faster). A grouped GEMM also has a
dense baseline: one expert's weights for every row, a cuBLAS `jnp.dot` of
the same FLOPs. The outputs must be finite (their numerics are the
conformance suites'). `timing.goals` reads GOALS off the rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.harness import text_table
from bench.harness import timing
from bench.workloads import gemm_workloads
from bench.workloads import programs as programs_lib

# What every time is divided by, where the row's workload and mode have it:
# a dense cuBLAS GEMM of the same FLOPs, pallas, and xla on ragged_dot.
BASELINES = ("dense", "pallas", "xla")
# The targets, read off the rows by `timing.goals`: (workload pattern,
# variant, mode, baseline, largest time / baseline time, what it says).
# "hopper": judged on a Hopper GPU only.
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
