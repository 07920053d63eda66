"""One short GPU run: pallas vs reference on the GPU, then bf16 TFLOP/s.

On the device machine, where only $OUT comes back:

    python -m bench.gpu_check --out_dir "$OUT"  # GPU, well under 5 minutes

Elsewhere:

    python -m bench.gpu_check                # GPU; JSON in bench/results/
    python -m bench.gpu_check --dry_run      # CPU: tiny shapes, interpreted
    python -m bench.gpu_check --lower_only   # CPU: lower every GPU program

1. Correctness: the pallas kernels (compiled through Triton) against the
   reference backend with shared tiles, empty groups and NaN in the padding
   rows: output, dX and dW of the grouped GEMM and of the expert FFN (plain
   and with the fused activation), then a small MoE layer and its gradients.
   Two cases have enough rows per expert and a wide enough N for the GPU
   heuristic to pick the large tiles the timing runs (and, for the fused
   gate+up, their register-fitted two-accumulator variant).
2. Timing at DeepSeek-V3 expert shapes (D=7168, F=2048, a 32-expert slice,
   top-8; T=4096 tokens gives M=32768 rows, about 1 TFLOP per projection, so
   a launch runs far past its overhead): bf16 forward and forward+backward
   of the gate/up-shaped [M, D] x [E, D, F] and the down-shaped
   [M, F] x [E, F, D] grouped GEMMs, and of the whole expert FFN, against a
   dense `jnp.dot` of the same FLOPs (cuBLAS), `jax.lax.ragged_dot` and the
   xla backend. Times are medians of --repeats calls after a warm-up. The
   timed programs' own output and gradients are checked on a few sampled
   groups against a float32 per-group `jnp.dot` (max relative error per
   method).

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
import functools
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.pallas import backend as pallas_backend
from backends.pallas import tiling
from bench import timing
from moe_core import compat
from moe_core import ffn
from moe_core.testing import cuda_export
from reference import backend as reference_backend

# pylint: enable=g-import-not-at-top,wrong-import-position

# Shapes: DeepSeek-V3 experts on the GPU; tiny ones for --dry_run on a CPU.
FULL = {"tokens": 4096, "top_k": 8, "hidden": 7168, "ffn": 2048, "experts": 32}
DRY = {"tokens": 64, "top_k": 8, "hidden": 256, "ffn": 128, "experts": 8}

# Correctness cases: (M, K, N, group sizes, transpose_rhs). Every case leaves
# padding rows (sum(group sizes) < M), filled with NaN.
GEMM_CASES = [
    (64, 32, 48, (10, 0, 23, 21), False),  # Shared tiles, padding rows.
    (200, 96, 160, (0, 70, 1, 64, 0, 40), False),
    (130, 64, 80, (33, 0, 60, 7), True),  # The dX layout.
    # 32 groups of 0-30 rows (465 of 512 rows), the first and last empty.
    (512, 256, 384, tuple(range(0, 31)) + (0,), False),
    # 288 rows per expert and N = 2048: in bf16 the GPU heuristic picks
    # gmm_bf16_large for the forward, as at the timed shapes.
    (1152, 128, 2048, (300, 0, 517, 211), False),
]
# Expert FFN cases: (M, D, F, group sizes), bf16, plain and with the fused
# activation. This one's fused gate+up forward runs gmm_bf16_large fitted to
# two accumulators (tiling.fit_gpu), as at the timed shapes.
FFN_CASES = [
    (1152, 128, 2048, (300, 0, 517, 211)),
]
# The MoE layer case: its config and the [batch, sequence] of its input.
LAYER_CONFIG = {
    "num_experts": 8,
    "top_k": 2,
    "hidden_size": 256,
    "expert_ffn_size": 512,
    "shared_ffn_size": 256,
}
LAYER_BATCH = (2, 256)
# Errors allowed, relative to the largest expected magnitude: bf16 keeps 8
# significant bits; float32 runs in IEEE float32 (Precision.HIGHEST).
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}
# Error messages kept in the JSON, in characters.
_MAX_ERROR_CHARS = 500


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


# --- Methods ------------------------------------------------------------------


def _backends(on_gpu):
  """(pallas, pallas with the activation epilogue, xla) backends."""
  interpret = None if on_gpu is None else (not on_gpu)
  pallas = pallas_backend.PallasBackend(interpret=interpret)
  fused = pallas_backend.PallasBackend(
      interpret=interpret, fuse_activation=True
  )
  # On a GPU the xla backend is ragged_dot (with zeroed padding rows).
  xla = moe_core.get_backend("xla", use_ragged_dot=bool(on_gpu))
  return pallas, fused, xla


def _gemm_methods(pallas, xla):
  """name -> f(rows, weights, group_sizes) -> [M, N]."""

  def dense(x, w, g):
    del g  # Same useful FLOPs: every row times one [K, N] matrix.
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

  def ragged(x, w, g):
    return jax.lax.ragged_dot(
        x, w, g, preferred_element_type=jnp.float32
    ).astype(x.dtype)

  return {
      "dense": dense,
      "ragged_dot": ragged,
      "xla": xla.grouped_gemm,
      "pallas": pallas.grouped_gemm,
  }


def _ffn_methods(pallas, fused, xla, cfg):
  """name -> f(rows, params, group_sizes) -> [M, D]."""

  def dense(x, p, g):
    del g  # Every row through one expert's [D, F], [D, F], [F, D].
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    gate = dot(x, p["w_gate"]).astype(x.dtype)
    up = dot(x, p["w_up"]).astype(x.dtype)
    h = ffn.gated(gate, up, cfg.activation)
    return dot(h, p["w_down"]).astype(x.dtype)

  return {
      "dense": dense,
      "xla": lambda x, p, g: xla.expert_ffn(x, g, p, cfg),
      "pallas": lambda x, p, g: pallas.expert_ffn(x, g, p, cfg),
      "pallas_fused_act": lambda x, p, g: fused.expert_ffn(x, g, p, cfg),
  }


def _one_expert(weights):
  """Expert 0's weights (arrays or ShapeDtypeStructs): the dense baseline's.

  Dense then has a [K, N] dW like a real dense layer, not a mostly-zero
  [E, K, N] one.
  """

  def first(a):
    if isinstance(a, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[0]

  return jax.tree.map(first, weights)


def group_sizes_for(skew, rows, experts, seed=0):
  rng = np.random.default_rng(seed)
  if skew == "zipf":
    p = 1.0 / np.arange(1, experts + 1) ** 1.2
    p = rng.permutation(p / p.sum())
  else:
    p = np.full(experts, 1.0 / experts)
  return rng.multinomial(rows, p).astype(np.int32)


# --- Correctness --------------------------------------------------------------


def _error_text(e):
  return f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]


def _rel_err(got, want):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  scale = np.max(np.abs(want)) if want.size else 0.0
  err = np.max(np.abs(got - want)) if want.size else 0.0
  return float(err / scale) if scale else float(err)


def _gpu_fwd_tiles(m, k, n, num_groups, dtype, num_operands=1):
  """The forward's tiles on a GPU, whatever runs here: for the record."""
  try:
    return repr(
        tiling.heuristic(
            "fwd",
            m,
            k,
            n,
            num_groups,
            dtype,
            interpret=False,
            num_operands=num_operands,
        )
    )
  except Exception as e:  # pylint: disable=broad-except
    return _error_text(e)


def _entry(case, dtype, quantity, err, tol, **extra):
  return {
      "case": case,
      "dtype": dtype,
      "quantity": quantity,
      "rel_err": err,
      "ok": bool(err <= tol),
      **extra,
  }


def _guarded(results, case, dtype, run_case):
  """Appends run_case()'s entries, or one entry with the error it raised."""
  try:
    results.extend(run_case())
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    results.append(
        {
            "case": case,
            "dtype": dtype,
            "quantity": "error",
            "rel_err": None,
            "ok": False,
            "error": _error_text(e),
        }
    )
    print(f"  FAIL {case} {dtype}: {_error_text(e)[:200]}", flush=True)


def _gemm_name(m, k, n, sizes, transpose_rhs):
  return f"gemm m={m} k={k} n={n} E={len(sizes)} t={transpose_rhs}"


def _ffn_name(label, m, d, f, sizes):
  return f"expert_ffn {label} m={m} d={d} f={f} E={len(sizes)}"


def _gemm_case(pallas, ref, m, k, n, sizes, transpose_rhs, dtype, seed):
  """Output, dX and dW of one grouped GEMM with NaN padding rows."""
  rng = np.random.default_rng(seed)
  used = sum(sizes)
  rows = rng.standard_normal((m, k)).astype(np.float32)
  w_shape = (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n)
  weights = rng.standard_normal(w_shape).astype(np.float32) / np.sqrt(k)
  cot = rng.standard_normal((m, n)).astype(np.float32)
  valid = np.arange(m)[:, None] < used
  gs = jnp.asarray(sizes, jnp.int32)

  def run(be, x, w, c):
    def f(x, w):
      return be.grouped_gemm(x, w, gs, transpose_rhs=transpose_rhs)

    out, vjp = jax.vjp(f, x, w)
    return (out,) + vjp(c)

  as_dtype = functools.partial(jnp.asarray, dtype=dtype)
  got = jax.jit(functools.partial(run, pallas))(
      as_dtype(np.where(valid, rows, np.nan)),
      as_dtype(weights),
      as_dtype(np.where(valid, cot, np.nan)),
  )
  want = jax.jit(functools.partial(run, ref))(
      as_dtype(rows * valid), as_dtype(weights), as_dtype(cot * valid)
  )
  case = _gemm_name(m, k, n, sizes, transpose_rhs)
  tiles = _gpu_fwd_tiles(m, k, n, len(sizes), dtype)
  out = []
  for name, g, w in zip(("out", "d_rows", "d_weights"), got, want):
    entry = _entry(
        case, dtype, name, _rel_err(g, w), TOLERANCE[dtype], gpu_fwd_tiles=tiles
    )
    if name in ("out", "d_rows"):  # Padding rows come out as zeros.
      entry["ok"] = entry["ok"] and not np.any(np.asarray(g[used:], np.float32))
    out.append(entry)
  return out


def _ffn_case(be, label, m, d, f, sizes, seed):
  """Output and gradients of expert_ffn (bf16) with NaN padding rows."""
  e = len(sizes)
  used = sum(sizes)
  cfg = moe_core.MoEConfig(
      num_experts=e, top_k=min(2, e), hidden_size=d, expert_ffn_size=f
  )
  params = moe_core.init_params(jax.random.key(seed), cfg, dtype=jnp.bfloat16)
  params = {k: params[k] for k in ("w_gate", "w_up", "w_down")}
  rng = np.random.default_rng(seed)
  valid = np.arange(m)[:, None] < used
  rows = rng.standard_normal((m, d)).astype(np.float32)
  cot = rng.standard_normal((m, d)).astype(np.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def run(be, x, p, c):
    out, vjp = jax.vjp(lambda x, p: be.expert_ffn(x, gs, p, cfg), x, p)
    return out, vjp(c)

  bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
  got, (got_dx, got_dp) = jax.jit(functools.partial(run, be))(
      bf16(np.where(valid, rows, np.nan)),
      params,
      bf16(np.where(valid, cot, np.nan)),
  )
  want, (want_dx, want_dp) = jax.jit(
      functools.partial(run, reference_backend.ReferenceBackend())
  )(bf16(rows * valid), params, bf16(cot * valid))
  case = _ffn_name(label, m, d, f, sizes)
  tiles = _gpu_fwd_tiles(m, d, f, e, "bfloat16", num_operands=2)
  tol = 2 * TOLERANCE["bfloat16"]  # Three GEMMs and the activation in bf16.
  out = []
  for name, g, w in (
      ("out", got, want),
      ("d_rows", got_dx, want_dx),
      *((f"d {k}", got_dp[k], want_dp[k]) for k in params),
  ):
    entry = _entry(
        case, "bfloat16", name, _rel_err(g, w), tol, gpu_fwd_tiles=tiles
    )
    if name in ("out", "d_rows"):
      entry["ok"] = entry["ok"] and not np.any(np.asarray(g[used:], np.float32))
    out.append(entry)
  return out


def _layer_cases(pallas, fused, ref, results):
  """A small MoE layer and its gradients: pallas and fused vs reference."""
  cfg = moe_core.MoEConfig(**LAYER_CONFIG)
  memo = {}

  def layer_grads(be, p, x):
    def loss(p, x):
      y, _ = moe_core.moe_layer(p, x, cfg, backend=be)
      return jnp.sum(jnp.square(y.astype(jnp.float32))), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x)
    return y, grads

  def run_case(label, be):
    if not memo:  # Shared by both cases; a failure fails each of them.
      memo["params"] = moe_core.init_params(
          jax.random.key(1), cfg, dtype=jnp.bfloat16
      )
      memo["x"] = jax.random.normal(
          jax.random.key(2), LAYER_BATCH + (cfg.hidden_size,), jnp.bfloat16
      )
      memo["want"] = jax.jit(functools.partial(layer_grads, ref))(
          memo["params"], memo["x"]
      )
    want_y, want_g = memo["want"]
    y, grads = jax.jit(functools.partial(layer_grads, be))(
        memo["params"], memo["x"]
    )
    out = [
        _entry(
            label, "bfloat16", "y", _rel_err(y, want_y), TOLERANCE["bfloat16"]
        )
    ]
    flat = {**{f"d {k}": v for k, v in grads[0].items()}, "d x": grads[1]}
    flat_want = {
        **{f"d {k}": v for k, v in want_g[0].items()},
        "d x": want_g[1],
    }
    for name in flat:
      out.append(
          _entry(
              label,
              "bfloat16",
              name,
              _rel_err(flat[name], flat_want[name]),
              2 * TOLERANCE["bfloat16"],
          )
      )
    return out

  for label, be in (("moe_layer", pallas), ("moe_layer fused_act", fused)):
    _guarded(results, label, "bfloat16", functools.partial(run_case, label, be))


def check_correctness(pallas, fused, results=None):
  """pallas vs reference: list of {case, dtype, quantity, rel_err, ok}.

  Each case runs guarded: one that raises adds an entry with quantity
  "error", ok False and the error, and the next case runs.
  """
  results = [] if results is None else results
  ref = reference_backend.ReferenceBackend()
  for seed, (m, k, n, sizes, transpose_rhs) in enumerate(GEMM_CASES):
    for dtype in ("bfloat16", "float32"):
      _guarded(
          results,
          _gemm_name(m, k, n, sizes, transpose_rhs),
          dtype,
          functools.partial(
              _gemm_case,
              pallas,
              ref,
              m,
              k,
              n,
              sizes,
              transpose_rhs,
              dtype,
              seed,
          ),
      )
  for seed, (m, d, f, sizes) in enumerate(FFN_CASES):
    for label, be in (("pallas", pallas), ("fused_act", fused)):
      _guarded(
          results,
          _ffn_name(label, m, d, f, sizes),
          "bfloat16",
          functools.partial(_ffn_case, be, label, m, d, f, sizes, 10 + seed),
      )
  _layer_cases(pallas, fused, ref, results)
  return results


def _print_correctness(correctness):
  bad = [r for r in correctness if not r["ok"]]
  errs = [r["rel_err"] for r in correctness if r["rel_err"] is not None]
  print(
      f"correctness vs reference: {len(correctness) - len(bad)}/"
      f"{len(correctness)} ok (worst relative error "
      f"{max(errs, default=0.0):.2e})"
  )
  for r in bad:
    detail = r.get("error") or f"{r['rel_err']:.3e}"
    print(f"  FAIL {r['case']} {r['dtype']} {r['quantity']}: {detail}")


# --- Timing -------------------------------------------------------------------


def _problems(shape, dtype, skew):
  """(name, methods kind, args builder, forward FLOPs) of each timed problem."""
  m = shape["tokens"] * shape["top_k"]
  d, f, e = shape["hidden"], shape["ffn"], shape["experts"]
  sizes = group_sizes_for(skew, m, e)
  return (
      m,
      sizes,
      [
          (
              "gemm_up [M,D]x[E,D,F]",
              "gemm",
              (m, d),
              (e, d, f),
              (m, f),
              2 * m * d * f,
          ),
          (
              "gemm_down [M,F]x[E,F,D]",
              "gemm",
              (m, f),
              (e, f, d),
              (m, d),
              2 * m * f * d,
          ),
          ("expert_ffn", "ffn", (m, d), None, (m, d), 3 * 2 * m * d * f),
      ],
  )


def _ffn_config(shape):
  # The expert FFN reads only its sizes and activation; top_k only has to be
  # valid (<= E) when --experts is small.
  return moe_core.MoEConfig(
      num_experts=shape["experts"],
      top_k=min(shape["top_k"], shape["experts"]),
      hidden_size=shape["hidden"],
      expert_ffn_size=shape["ffn"],
  )


def _sample_groups(sizes):
  """The first, the largest and the last non-empty group."""
  nonempty = np.flatnonzero(sizes)
  if not nonempty.size:
    return []
  return sorted({int(nonempty[0]), int(np.argmax(sizes)), int(nonempty[-1])})


def _group_oracle(kind, activation):
  """(rows_g, weights_g) -> out_g in float32: one group, plain jnp.dot."""
  dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
  if kind == "gemm":
    return dot

  def expert(x, p):
    h = ffn.gated(dot(x, p["w_gate"]), dot(x, p["w_up"]), activation)
    return dot(h, p["w_down"])

  return expert


def _oracle_values(kind, activation, rows, weights, cot, sizes):
  """[(group, lo, hi, out, d_rows, d_weights)] of the sampled groups.

  Computed once per problem, in float32 from the same bf16 inputs; the
  cotangent is rounded to the output's dtype, as the timed programs see it.
  """
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  oracle = _group_oracle(kind, activation)

  @jax.jit
  def values(x, w, c):
    out, vjp = jax.vjp(oracle, x, w)
    return (out,) + vjp(c)

  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  found = []
  for g in _sample_groups(sizes):
    lo, hi = int(offsets[g]), int(offsets[g + 1])
    found.append(
        (g, lo, hi)
        + values(
            f32(rows[lo:hi]),
            jax.tree.map(lambda a, g=g: f32(a[g]), weights),
            f32(cot[lo:hi].astype(rows.dtype)),
        )
    )
  return found


def _check_timed(oracle, out, grads, tol):
  """Max relative errors of a timed method's outputs on the sampled groups.

  grads is (d_rows, d_weights), or None when the backward failed: the
  forward is checked alone (and the entry holds that error).
  """
  errs = {"out": 0.0}
  if grads is not None:
    errs.update(d_rows=0.0, d_weights=0.0)
  for g, lo, hi, want, want_dx, want_dw in oracle:
    errs["out"] = max(errs["out"], _rel_err(out[lo:hi], want))
    if grads is None:
      continue
    d_rows, d_weights = grads
    errs["d_rows"] = max(errs["d_rows"], _rel_err(d_rows[lo:hi], want_dx))
    got_dw = jax.tree.leaves(jax.tree.map(lambda a, g=g: a[g], d_weights))
    for got, want_w in zip(got_dw, jax.tree.leaves(want_dw)):
      errs["d_weights"] = max(errs["d_weights"], _rel_err(got, want_w))
  worst = max(errs.values())
  return {
      "groups": [g for g, *_ in oracle],
      **errs,
      "max_rel_err": worst,
      "tolerance": tol,
      "ok": bool(oracle) and worst <= tol,
  }


def _time_method(fn, args, cot, repeats, flops, oracle, tol):
  """One method's entry: times, TFLOP/s, the output check, or the error.

  A phase that raises leaves "error" ("fwd: ..." or "fwd_bwd: ...") and no
  times from there on; what did run is still checked.
  """
  entry = {}
  fwd = jax.jit(fn)
  fwd_bwd = jax.jit(timing.with_grad(fn))
  for phase, program, phase_args, passes in (
      ("fwd", fwd, args, 1),
      ("fwd_bwd", fwd_bwd, args + (cot,), 3),
  ):
    try:
      seconds = timing.median_seconds(program, phase_args, repeats)
      entry[f"{phase}_s"] = seconds
      entry[f"{phase}_tflops"] = passes * flops / seconds / 1e12
    except Exception as e:  # pylint: disable=broad-except
      entry["error"] = f"{phase}: {_error_text(e)}"
      traceback.print_exc()
      break
  if oracle is None or "fwd_s" not in entry:
    return entry
  if not oracle:
    entry["check"] = {
        "ok": False,
        "error": "no group to check against (the "
        "row's check_error says why)",
    }
    return entry
  try:  # The programs are compiled: one more call of each.
    out = fwd(*args)
    grads = fwd_bwd(*args, cot)[1] if "fwd_bwd_s" in entry else None
    entry["check"] = _check_timed(oracle, out, grads, tol)
    entry["max_rel_err"] = entry["check"]["max_rel_err"]
  except Exception as e:  # pylint: disable=broad-except
    entry["check"] = {"error": _error_text(e), "ok": False}
    traceback.print_exc()
  return entry


def run_timing(
    shape, repeats, skew, pallas, fused, xla, results=None, on_row=None
):
  """Times every method of every problem; appends one row per problem.

  Every method is guarded (its entry then holds "error"); on_row() runs
  after each problem, e.g. to write what there is so far.
  """
  results = [] if results is None else results
  dtype = jnp.bfloat16
  cfg = _ffn_config(shape)
  m, sizes, problems = _problems(shape, dtype, skew)
  group_sizes = jnp.asarray(sizes)
  keys = iter(jax.random.split(jax.random.key(3), 16))
  for name, kind, a_shape, w_shape, out_shape, flops in problems:
    row = {"problem": name, "fwd_flops": flops, "methods": {}}
    results.append(row)
    try:
      rows = jax.random.normal(next(keys), a_shape, dtype)
      cot = jax.random.normal(next(keys), out_shape, jnp.float32)
      if kind == "gemm":
        operand = (
            jax.random.normal(next(keys), w_shape, jnp.float32)
            / np.sqrt(w_shape[1])
        ).astype(dtype)
        methods = _gemm_methods(pallas, xla)
        tol = TOLERANCE["bfloat16"]
      else:
        operand = moe_core.init_params(next(keys), cfg, dtype=dtype)
        operand = {k: operand[k] for k in ("w_gate", "w_up", "w_down")}
        methods = _ffn_methods(pallas, fused, xla, cfg)
        tol = 2 * TOLERANCE["bfloat16"]
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = _error_text(e)
      traceback.print_exc()
      if on_row is not None:
        on_row()
      continue
    try:
      oracle = _oracle_values(kind, cfg.activation, rows, operand, cot, sizes)
    except Exception as e:  # pylint: disable=broad-except
      oracle = []  # Every method's check then fails, saying why.
      row["check_error"] = _error_text(e)
      traceback.print_exc()
    for method, fn in methods.items():
      dense = method == "dense"  # Not a grouped product: nothing to check.
      weights = _one_expert(operand) if dense else operand
      entry = _time_method(
          fn,
          (rows, weights, group_sizes),
          cot,
          repeats,
          flops,
          None if dense else oracle,
          tol,
      )
      row["methods"][method] = entry
      print(f"  {name} {method}: {_summary(entry)}", flush=True)
    _add_ratios(row)
    del rows, cot, operand, oracle
    if on_row is not None:
      on_row()
  return m, sizes, results


def _summary(entry):
  parts = [
      f"{k} {1e3 * entry[k + '_s']:.3f} ms"
      for k in ("fwd", "fwd_bwd")
      if k + "_s" in entry
  ]
  check = entry.get("check")
  if check is not None:
    parts.append(
        f"max rel err {check['max_rel_err']:.2e}"
        if "max_rel_err" in check
        else f"check FAILED: {check.get('error', '')[:80]}"
    )
  if "error" in entry:
    parts.append(f"FAILED {entry['error'][:120]}")
  return ", ".join(parts)


def _add_ratios(row):
  """Throughput ratios to dense and to ragged_dot (> 1: faster than it).

  A ratio is None where either time is missing (that method failed).
  """
  methods = row["methods"]
  for base in ("dense", "ragged_dot"):
    base_entry = methods.get(base, {})
    for entry in methods.values():
      for phase in ("fwd", "fwd_bwd"):
        key = f"{phase}_s"
        entry[f"{phase}_vs_{base}"] = (
            base_entry[key] / entry[key]
            if key in base_entry and key in entry
            else None
        )


def _cell(value, width, spec):
  return f"{'-':>{width}}" if value is None else f"{value:{width}{spec}}"


def _print_timing(results):
  header = (
      f"{'problem':<24} {'method':<17} {'fwd ms':>8} {'TFLOP/s':>7} "
      f"{'/dense':>6} {'/ragged':>7} {'f+b ms':>8} {'TFLOP/s':>7} "
      f"{'/dense':>6} {'/ragged':>7} {'max err':>8}"
  )
  print(header)
  print("-" * len(header))
  for row in results:
    if "error" in row:
      print(f"{row['problem']:<24} FAILED: {row['error'][:100]}")
    for method, e in row["methods"].items():
      ms = {
          k: None if f"{k}_s" not in e else 1e3 * e[f"{k}_s"]
          for k in ("fwd", "fwd_bwd")
      }
      line = (
          f"{row['problem']:<24} {method:<17} "
          f"{_cell(ms['fwd'], 8, '.3f')} "
          f"{_cell(e.get('fwd_tflops'), 7, '.1f')} "
          f"{_cell(e.get('fwd_vs_dense'), 6, '.2f')} "
          f"{_cell(e.get('fwd_vs_ragged_dot'), 7, '.2f')} "
          f"{_cell(ms['fwd_bwd'], 8, '.3f')} "
          f"{_cell(e.get('fwd_bwd_tflops'), 7, '.1f')} "
          f"{_cell(e.get('fwd_bwd_vs_dense'), 6, '.2f')} "
          f"{_cell(e.get('fwd_bwd_vs_ragged_dot'), 7, '.2f')} "
          f"{_cell(e.get('max_rel_err'), 8, '.1e')}"
      )
      if not e.get("check", {"ok": True})["ok"]:
        line += "  CHECK FAILED"
      if "error" in e:
        line += f"  FAILED {e['error'][:80]}"
      print(line)
  print(
      "'/dense', '/ragged': throughput relative to a dense jnp.dot of the "
      "same FLOPs and to ragged_dot (> 1 is faster); 'max err': of the "
      "timed output and gradients on sampled groups vs float32 jnp.dot."
  )


# --- Lowering only ------------------------------------------------------------


def lower_only(shape):
  """Lowers every timed GPU program for CUDA; returns [(name, ok, detail)]."""
  pallas, fused, xla = _backends(on_gpu=True)
  cfg = _ffn_config(shape)
  m, _, problems = _problems(shape, jnp.bfloat16, "random")
  s = jax.ShapeDtypeStruct
  group_sizes = s((shape["experts"],), jnp.int32)
  out = []
  for name, kind, a_shape, w_shape, out_shape, _ in problems:
    if kind == "gemm":
      operand = s(w_shape, jnp.bfloat16)
      methods = _gemm_methods(pallas, xla)
    else:
      operand = {
          k: s(v, jnp.bfloat16)
          for k, v in moe_core.param_shapes(cfg).items()
          if k in ("w_gate", "w_up", "w_down")
      }
      methods = _ffn_methods(pallas, fused, xla, cfg)
    for method, fn in methods.items():
      weights = _one_expert(operand) if method == "dense" else operand
      for mode, program, args in (
          ("fwd", fn, (s(a_shape, jnp.bfloat16), weights, group_sizes)),
          (
              "fwd+bwd",
              timing.with_grad(fn),
              (
                  s(a_shape, jnp.bfloat16),
                  weights,
                  group_sizes,
                  s(out_shape, jnp.float32),
              ),
          ),
      ):
        label = f"{name} {method} {mode}"
        try:
          text = cuda_export.export_for_cuda(program, *args).mlir_module()
          calls = cuda_export.custom_calls(text)
          others = sorted(set(calls) - {cuda_export.TRITON_CALL})
          out.append(
              (
                  label,
                  True,
                  f"{calls.count(cuda_export.TRITON_CALL)} triton kernels"
                  + (f", other custom calls {others}" if others else ""),
              )
          )
        except Exception as e:  # pylint: disable=broad-except
          out.append((label, False, f"{type(e).__name__}: {e}"[:300]))
  del m
  return out


# --- Main ---------------------------------------------------------------------


def _installed_version(distribution):
  """The installed version of a pip distribution, None if it is absent.

  Read from its metadata, not imported: jax-triton 0.3.1 raises at import
  without a GPU build of jax, and the Pallas Triton lowering needs neither.
  """
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _versions():
  jaxlib = getattr(jax.lib, "__version__", None)
  if jaxlib is None:
    try:
      jaxlib = __import__("jaxlib").__version__
    except Exception:  # pylint: disable=broad-except
      pass
  try:
    device = jax.devices()[0].device_kind
  except Exception as e:  # pylint: disable=broad-except
    device = _error_text(e)
  return {
      "jax": jax.__version__,
      "jaxlib": jaxlib,
      "python": platform.python_version(),
      "triton": _installed_version("triton"),
      "jax_triton": _installed_version("jax-triton"),
      "platform": jax.default_backend(),
      "device": device,
  }


def _write(path, report):
  """Writes the report whole or not at all (a crash keeps the last one)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as fh:
    json.dump(report, fh, indent=1, default=str)
  os.replace(tmp, path)


def failures(report):
  """What failed, one line each: checks, timed methods, whole phases."""
  out = [
      f"correctness {r['case']} {r['dtype']} {r['quantity']}"
      for r in report.get("correctness", [])
      if not r["ok"]
  ]
  for row in report.get("timing", []):
    if "error" in row:
      out.append(f"timing {row['problem']}: {row['error']}")
    for method, e in row["methods"].items():
      if "error" in e:
        out.append(f"timing {row['problem']} {method}: {e['error']}")
      if not e.get("check", {"ok": True})["ok"]:
        out.append(f"check {row['problem']} {method}")
  if "fatal_error" in report:
    out.append(f"fatal: {report['fatal_error']}")
  return out


def main(argv=None):
  args = _parse_args(argv)
  shape = dict(DRY if args.dry_run else FULL)
  if args.tokens:
    shape["tokens"] = args.tokens
  if args.experts:
    shape["experts"] = args.experts
  if hasattr(sys.stdout, "reconfigure"):  # Lines survive a hard crash.
    sys.stdout.reconfigure(line_buffering=True)
  versions = _versions()
  print(
      f"python {versions['python']}, jax {versions['jax']}, jaxlib "
      f"{versions['jaxlib']}, triton {versions['triton']}, jax-triton "
      f"{versions['jax_triton']}; default backend {versions['platform']}, "
      f"device {versions['device']}"
  )

  if args.lower_only:
    filtered = compat.triton_deprecations_filtered()
    results = lower_only(shape)
    for label, ok, detail in results:
      print(f"{'ok  ' if ok else 'FAIL'} {label}: {detail}")
    failed = sum(not ok for _, ok, _ in results)
    print(f"lowered {len(results) - failed}/{len(results)} programs for CUDA")
    print(
        f"Pallas Triton deprecation warnings filtered: "
        f"{compat.triton_deprecations_filtered() - filtered}"
    )
    return 1 if failed else 0

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
  m, sizes, _ = _problems(shape, jnp.bfloat16, args.skew)
  report = {
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
  start = time.perf_counter()
  filtered = compat.triton_deprecations_filtered()
  try:
    # jax >= 0.11 warns once per Triton kernel compiled: counted in the
    # JSON, not printed.
    with compat.filter_triton_deprecation():
      pallas, fused, xla = _backends(on_gpu=on_gpu if on_gpu else None)
      print(f"pallas: {pallas!r}, available: {pallas.availability()}")
      if not args.skip_correctness:
        check_correctness(pallas, fused, report["correctness"])
        _write(path, report)
        _print_correctness(report["correctness"])
      print(
          f"T={shape['tokens']} top-{shape['top_k']} -> M={m} rows, "
          f"D={shape['hidden']} F={shape['ffn']} E={shape['experts']}, "
          f"bf16, {args.skew} group sizes (min {sizes.min()}, max "
          f"{sizes.max()}), median of {repeats}"
      )
      run_timing(
          shape,
          repeats,
          args.skew,
          pallas,
          fused,
          xla,
          report["timing"],
          on_row=lambda: _write(path, report),
      )
      _print_timing(report["timing"])
  except Exception as e:  # pylint: disable=broad-except
    report["fatal_error"] = _error_text(e)
    traceback.print_exc()
  finally:  # Whatever happened (even an interrupt): write what there is.
    report["seconds"] = time.perf_counter() - start
    report["triton_deprecation_warnings"] = (
        compat.triton_deprecations_filtered() - filtered
    )
    report["failures"] = failures(report)
    _write(path, report)
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
