"""Grouped-GEMM benchmark: every backend against dense and ragged_dot, one run.

    python -m bench.grouped_gemm_bench [--quick] [--dtype float32]

Times rows [M, D] x weights [E, D, F] -> [M, F] over ragged groups that fill
all M rows, forward and forward+backward (dX and dW), for E in --experts and
even, random (multinomial) and Zipf-skewed group sizes. Every time is the
median of --repeats calls after a warm-up; ratios are to a dense `jnp.dot`
[M, D] x [D, F] (the same useful FLOPs) timed in the same run, so a noisy
machine shifts all of them together. Prints a table and writes JSON to
bench/results/grouped_gemm_<platform>_<date>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import platform as platform_lib

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from bench import timing

_QUICK = flags.DEFINE_bool(
    "quick", False, "One repeat and one warm-up call: proves the script runs."
)
_ROWS = flags.DEFINE_integer("rows", 4096, "M: dispatched rows (T * top_k).")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "D: the contraction size.")
_FFN = flags.DEFINE_integer("ffn", 1024, "F: the output size.")
_EXPERTS = flags.DEFINE_list("experts", ["8", "64"], "E values to run.")
_SKEWS = flags.DEFINE_list(
    "skews", ["even", "random", "zipf"], "Group-size distributions."
)
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "Operand dtype."
)
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed calls per measurement.")
_BACKENDS = flags.DEFINE_list(
    "backends",
    ["dense", "ragged_dot", "xla", "pallas"],
    "What to time: dense, ragged_dot, or registered backend names.",
)
_ZIPF_EXPONENT = flags.DEFINE_float(
    "zipf_exponent", 1.2, "s in p(rank r) ~ r^-s."
)
_OUT_DIR = flags.DEFINE_string(
    "out_dir",
    os.path.join(os.path.dirname(__file__), "results"),
    "Where the JSON goes.",
)


def group_sizes_for(
    skew: str, rows: int, experts: int, seed: int = 0
) -> np.ndarray:
  """[E] int32 sizes summing to `rows`: even, random or Zipf-skewed."""
  rng = np.random.default_rng(seed)
  if skew == "even":
    sizes = np.full(experts, rows // experts)
    sizes[: rows % experts] += 1
  elif skew == "random":
    sizes = rng.multinomial(rows, np.full(experts, 1.0 / experts))
  elif skew == "zipf":
    p = 1.0 / np.arange(1, experts + 1) ** _ZIPF_EXPONENT.value
    sizes = rng.multinomial(rows, rng.permutation(p / p.sum()))
  else:
    raise ValueError(f"skew must be even, random or zipf, got {skew!r}.")
  return sizes.astype(np.int32)


def _gemm_fn(name):
  """f(rows, weights, group_sizes) -> [M, F] for one measured method."""
  if name == "dense":
    # The same useful FLOPs as the grouped GEMM: every row times one [D, F]
    # matrix (the caller passes one expert's weights).
    return lambda x, w, g: jnp.dot(
        x, w, preferred_element_type=jnp.float32
    ).astype(x.dtype)
  if name == "ragged_dot":
    return lambda x, w, g: jax.lax.ragged_dot(
        x, w, g, preferred_element_type=jnp.float32
    ).astype(x.dtype)
  be = moe_core.get_backend(name)
  return be.grouped_gemm


def _measure(name, rows, weights, group_sizes, cotangent, repeats):
  gemm = _gemm_fn(name)
  fwd = jax.jit(gemm)
  train = jax.jit(timing.with_grad(gemm))
  return {
      "fwd_s": timing.median_seconds(
          fwd, (rows, weights, group_sizes), repeats
      ),
      "fwd_bwd_s": timing.median_seconds(
          train, (rows, weights, group_sizes, cotangent), repeats
      ),
  }


def _available(name):
  if name in ("dense", "ragged_dot"):
    return True, ""
  return moe_core.registry.availability(name)


def main(argv):
  del argv
  repeats = 1 if _QUICK.value else _REPEATS.value
  dtype = jnp.dtype(_DTYPE.value)
  m, d, f = _ROWS.value, _HIDDEN.value, _FFN.value
  device = jax.devices()[0]
  names = []
  for name in _BACKENDS.value:
    ok, why = _available(name)
    if ok:
      names.append(name)
    else:
      print(f"skipping {name}: {why}")
  if "dense" not in names:
    names.insert(0, "dense")
  print(
      f"jax {jax.__version__} on {jax.default_backend()} "
      f"({device.device_kind}); M={m} D={d} F={f} dtype={dtype.name} "
      f"repeats={repeats}"
  )

  key = jax.random.key(0)
  k_rows, k_cot, k_w = jax.random.split(key, 3)
  rows = jax.random.normal(k_rows, (m, d), dtype)
  cotangent = jax.random.normal(k_cot, (m, f), jnp.float32)
  results = []
  for experts in (int(e) for e in _EXPERTS.value):
    weights = (
        jax.random.normal(k_w, (experts, d, f), jnp.float32) / np.sqrt(d)
    ).astype(dtype)
    for skew in _SKEWS.value:
      sizes = group_sizes_for(skew, m, experts)
      group_sizes = jnp.asarray(sizes)
      # Dense gets one expert's [D, F] weights, so that its dW is [D, F]
      # too and not a mostly-zero [E, D, F].
      timings = {
          name: _measure(
              name,
              rows,
              weights[0] if name == "dense" else weights,
              group_sizes,
              cotangent,
              repeats,
          )
          for name in names
      }
      dense = timings["dense"]
      for name in names:
        t = timings[name]
        results.append(
            {
                "experts": experts,
                "skew": skew,
                "method": name,
                "largest_group": int(sizes.max()),
                "empty_groups": int(np.sum(sizes == 0)),
                "fwd_ms": 1e3 * t["fwd_s"],
                "fwd_bwd_ms": 1e3 * t["fwd_bwd_s"],
                "fwd_vs_dense": t["fwd_s"] / dense["fwd_s"],
                "fwd_bwd_vs_dense": t["fwd_bwd_s"] / dense["fwd_bwd_s"],
                "fwd_gflops": 2 * m * d * f / t["fwd_s"] / 1e9,
            }
        )

  header = (
      f"{'E':>3} {'skew':<7} {'method':<11} {'fwd ms':>8} "
      f"{'x dense':>8} {'fwd+bwd ms':>11} {'x dense':>8} "
      f"{'GFLOP/s':>8}"
  )
  print(header)
  print("-" * len(header))
  for r in results:
    print(
        f"{r['experts']:>3} {r['skew']:<7} {r['method']:<11} "
        f"{r['fwd_ms']:8.2f} {r['fwd_vs_dense']:8.2f} "
        f"{r['fwd_bwd_ms']:11.2f} {r['fwd_bwd_vs_dense']:8.2f} "
        f"{r['fwd_gflops']:8.1f}"
    )
  print(
      "'x dense': time / time of a dense jnp.dot of the same useful FLOPs "
      "in this run (lower is better)."
  )
  _print_skew_stability(results, names)

  now = datetime.datetime.now(datetime.timezone.utc)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  path = os.path.join(
      _OUT_DIR.value,
      f"grouped_gemm_{jax.default_backend()}_{now:%Y%m%d_%H%M%S}.json",
  )
  with open(path, "w") as fh:
    json.dump(
        {
            "date": now.isoformat(),
            "jax": jax.__version__,
            "platform": jax.default_backend(),
            "device": device.device_kind,
            "host": platform_lib.node(),
            "cpu_count": os.cpu_count(),
            "quick": _QUICK.value,
            "repeats": repeats,
            "shape": {"rows": m, "hidden": d, "ffn": f},
            "dtype": dtype.name,
            "results": results,
        },
        fh,
        indent=1,
    )
  print(f"wrote {path}")


def _print_skew_stability(results, names):
  """Per method and E: slowest skew / fastest skew (1.0 = skew-insensitive)."""
  print("skew stability (slowest / fastest skew, fwd+bwd):")
  for name in names:
    for experts in sorted({r["experts"] for r in results}):
      times = [
          r["fwd_bwd_ms"]
          for r in results
          if r["method"] == name and r["experts"] == experts
      ]
      if times:
        print(f"  {name:<11} E={experts:<3} {max(times) / min(times):5.2f}")


if __name__ == "__main__":
  app.run(main)
