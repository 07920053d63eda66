"""One short GPU run: pallas vs reference on the GPU, then bf16 TFLOP/s.

    python bench/gpu_check.py               # on a GPU (well under 5 minutes)
    python bench/gpu_check.py --dry_run     # CPU: tiny shapes, interpret mode
    python bench/gpu_check.py --lower_only  # CPU: lower every GPU program

1. Correctness: the pallas kernels (compiled through Triton) against the
   reference backend on small shapes with shared tiles, empty groups and NaN
   in the padding rows: output, dX and dW; then a small MoE layer and its
   gradients.
2. Timing at DeepSeek-V3 expert shapes (D=7168, F=2048, a 32-expert slice,
   top-8; T=4096 tokens gives M=32768 rows, about 1 TFLOP per projection, so
   a launch runs far past its overhead): bf16 forward and forward+backward
   of the gate/up-shaped [M, D] x [E, D, F] and the down-shaped
   [M, F] x [E, F, D] grouped GEMMs, and of the whole expert FFN, against a
   dense `jnp.dot` of the same FLOPs (cuBLAS), `jax.lax.ragged_dot` and the
   xla backend. Times are medians of --repeats calls after a warm-up.

Prints TFLOP/s and ratios and writes bench/results/gpu_<date>.json (date,
jax version, device). Needs only jax (with its CUDA plugin) and this
repository: no absl, no network.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
from jax import export
from jax.experimental.pallas import triton as plt
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.pallas import backend as pallas_backend
from bench import timing
from moe_core import ffn
from reference import backend as reference_backend
# pylint: enable=g-import-not-at-top,wrong-import-position

# The custom call of a Pallas Triton kernel (named in the API since jax 0.11).
_TRITON_CALL = getattr(plt, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")

# Shapes: DeepSeek-V3 experts on the GPU; tiny ones for --dry_run on a CPU.
FULL = {"tokens": 4096, "top_k": 8, "hidden": 7168, "ffn": 2048,
        "experts": 32}
DRY = {"tokens": 64, "top_k": 8, "hidden": 256, "ffn": 128, "experts": 8}

# Correctness cases: (M, K, N, group sizes, transpose_rhs).
GEMM_CASES = [
    (64, 32, 48, (10, 0, 23, 21), False),  # Shared tiles, padding rows.
    (200, 96, 160, (0, 70, 1, 64, 0, 40), False),
    (130, 64, 80, (33, 0, 60, 7), True),  # The dX layout.
    (512, 256, 384, tuple(range(0, 62, 2)) + (0,), False),
]
# Errors allowed, relative to the largest expected magnitude: bf16 keeps 8
# significant bits; float32 runs in IEEE float32 (Precision.HIGHEST).
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument("--dry_run", action="store_true",
                    help="run everything on the CPU at tiny shapes, with the "
                    "kernels interpreted")
  mode.add_argument("--lower_only", action="store_true",
                    help="only lower every GPU program for CUDA (works on a "
                    "CPU-only machine)")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--tokens", type=int, default=None,
                      help="T (default 4096; 64 with --dry_run)")
  parser.add_argument("--experts", type=int, default=None,
                      help="E on this device (default 32)")
  parser.add_argument("--skew", default="random", choices=["random", "zipf"])
  parser.add_argument("--out_dir", default=os.path.join(_REPO, "bench",
                                                        "results"))
  parser.add_argument("--skip_correctness", action="store_true")
  return parser.parse_args(argv)


# --- Methods ------------------------------------------------------------------


def _backends(on_gpu):
  """(pallas, pallas with the activation epilogue, xla) backends."""
  interpret = None if on_gpu is None else (not on_gpu)
  pallas = pallas_backend.PallasBackend(interpret=interpret)
  fused = pallas_backend.PallasBackend(interpret=interpret,
                                       fuse_activation=True)
  # On a GPU the xla backend is ragged_dot (with zeroed padding rows).
  xla = moe_core.get_backend("xla", use_ragged_dot=bool(on_gpu))
  return pallas, fused, xla


def _gemm_methods(pallas, xla):
  """name -> f(rows, weights, group_sizes) -> [M, N]."""
  def dense(x, w, g):
    del g  # Same useful FLOPs: every row times one [K, N] matrix.
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

  def ragged(x, w, g):
    return jax.lax.ragged_dot(x, w, g,
                              preferred_element_type=jnp.float32).astype(
                                  x.dtype)
  return {"dense": dense, "ragged_dot": ragged, "xla": xla.grouped_gemm,
          "pallas": pallas.grouped_gemm}


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


def _rel_err(got, want):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  scale = np.max(np.abs(want)) if want.size else 0.0
  err = np.max(np.abs(got - want)) if want.size else 0.0
  return float(err / scale) if scale else float(err)


def check_correctness(pallas, fused):
  """pallas vs reference: list of {case, dtype, quantity, rel_err, ok}."""
  results = []
  rng = np.random.default_rng(0)
  ref = reference_backend.ReferenceBackend()
  for m, k, n, sizes, transpose_rhs in GEMM_CASES:
    used = sum(sizes)
    for dtype in ("bfloat16", "float32"):
      rows = rng.standard_normal((m, k)).astype(np.float32)
      w_shape = (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n)
      weights = rng.standard_normal(w_shape).astype(np.float32) / np.sqrt(k)
      cot = rng.standard_normal((m, n)).astype(np.float32)
      poisoned = rows.copy()
      poisoned[used:] = np.nan
      gs = jnp.asarray(sizes, jnp.int32)

      def run(be, x, w, c, t=transpose_rhs):
        def f(x, w):
          return be.grouped_gemm(x, w, gs, transpose_rhs=t)
        out, vjp = jax.vjp(f, x, w)
        return (out,) + vjp(c)
      as_dtype = functools.partial(jnp.asarray, dtype=dtype)
      got = jax.jit(functools.partial(run, pallas))(
          as_dtype(poisoned), as_dtype(weights),
          as_dtype(np.where(np.arange(m)[:, None] < used, cot, np.nan)))
      want = jax.jit(functools.partial(run, ref))(
          as_dtype(rows), as_dtype(weights), as_dtype(cot * (
              np.arange(m)[:, None] < used)))
      case = f"gemm m={m} k={k} n={n} E={len(sizes)} t={transpose_rhs}"
      for name, g, w in zip(("out", "d_rows", "d_weights"), got, want):
        err = _rel_err(g, w)
        ok = err <= TOLERANCE[dtype]
        if name in ("out", "d_rows"):
          ok = ok and not np.any(np.asarray(g[used:], np.float32))
        results.append({"case": case, "dtype": dtype, "quantity": name,
                        "rel_err": err, "ok": bool(ok)})

  cfg = moe_core.MoEConfig(num_experts=8, top_k=2, hidden_size=256,
                           expert_ffn_size=512, shared_ffn_size=256)
  params = moe_core.init_params(jax.random.key(1), cfg, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(2), (2, 256, 256), jnp.bfloat16)

  def layer_grads(be, p, x):
    def loss(p, x):
      y, _ = moe_core.moe_layer(p, x, cfg, backend=be)
      return jnp.sum(jnp.square(y.astype(jnp.float32))), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1),
                                       has_aux=True)(p, x)
    return y, grads
  want_y, want_g = jax.jit(functools.partial(layer_grads, ref))(params, x)
  for label, be in (("moe_layer", pallas), ("moe_layer fused_act", fused)):
    y, grads = jax.jit(functools.partial(layer_grads, be))(params, x)
    results.append({"case": label, "dtype": "bfloat16", "quantity": "y",
                    "rel_err": _rel_err(y, want_y),
                    "ok": _rel_err(y, want_y) <= TOLERANCE["bfloat16"]})
    flat = {**{f"d {k}": v for k, v in grads[0].items()}, "d x": grads[1]}
    flat_want = {**{f"d {k}": v for k, v in want_g[0].items()},
                 "d x": want_g[1]}
    for name in flat:
      err = _rel_err(flat[name], flat_want[name])
      results.append({"case": label, "dtype": "bfloat16", "quantity": name,
                      "rel_err": err, "ok": err <= 2 * TOLERANCE["bfloat16"]})
  return results


# --- Timing -------------------------------------------------------------------


def _problems(shape, dtype, skew):
  """(name, methods kind, args builder, forward FLOPs) of each timed problem."""
  m = shape["tokens"] * shape["top_k"]
  d, f, e = shape["hidden"], shape["ffn"], shape["experts"]
  sizes = group_sizes_for(skew, m, e)
  return m, sizes, [
      ("gemm_up [M,D]x[E,D,F]", "gemm", (m, d), (e, d, f), (m, f),
       2 * m * d * f),
      ("gemm_down [M,F]x[E,F,D]", "gemm", (m, f), (e, f, d), (m, d),
       2 * m * f * d),
      ("expert_ffn", "ffn", (m, d), None, (m, d), 3 * 2 * m * d * f),
  ]


def run_timing(shape, repeats, skew, pallas, fused, xla):
  dtype = jnp.bfloat16
  cfg = moe_core.MoEConfig(num_experts=shape["experts"],
                           top_k=shape["top_k"], hidden_size=shape["hidden"],
                           expert_ffn_size=shape["ffn"])
  m, sizes, problems = _problems(shape, dtype, skew)
  group_sizes = jnp.asarray(sizes)
  keys = iter(jax.random.split(jax.random.key(3), 16))
  results = []
  for name, kind, a_shape, w_shape, out_shape, flops in problems:
    rows = jax.random.normal(next(keys), a_shape, dtype)
    cot = jax.random.normal(next(keys), out_shape, jnp.float32)
    if kind == "gemm":
      operand = (jax.random.normal(next(keys), w_shape, jnp.float32)
                 / np.sqrt(w_shape[1])).astype(dtype)
      methods = _gemm_methods(pallas, xla)
    else:
      operand = moe_core.init_params(next(keys), cfg, dtype=dtype)
      operand = {k: operand[k] for k in ("w_gate", "w_up", "w_down")}
      methods = _ffn_methods(pallas, fused, xla, cfg)
    row = {"problem": name, "fwd_flops": flops, "methods": {}}
    for method, fn in methods.items():
      entry = {}
      weights = _one_expert(operand) if method == "dense" else operand
      try:
        entry["fwd_s"] = timing.median_seconds(
            jax.jit(fn), (rows, weights, group_sizes), repeats)
        entry["fwd_bwd_s"] = timing.median_seconds(
            jax.jit(timing.with_grad(fn)), (rows, weights, group_sizes, cot),
            repeats)
        entry["fwd_tflops"] = flops / entry["fwd_s"] / 1e12
        entry["fwd_bwd_tflops"] = 3 * flops / entry["fwd_bwd_s"] / 1e12
      except Exception as e:  # pylint: disable=broad-except
        entry["error"] = f"{type(e).__name__}: {e}"[:500]
        traceback.print_exc()
      row["methods"][method] = entry
    _add_ratios(row)
    results.append(row)
  return m, sizes, results


def _add_ratios(row):
  """Throughput ratios to dense and to ragged_dot (> 1: faster than it)."""
  methods = row["methods"]
  for base in ("dense", "ragged_dot"):
    if "fwd_s" not in methods.get(base, {}):
      continue
    for entry in methods.values():
      if "fwd_s" in entry:
        entry[f"fwd_vs_{base}"] = methods[base]["fwd_s"] / entry["fwd_s"]
        entry[f"fwd_bwd_vs_{base}"] = (methods[base]["fwd_bwd_s"]
                                       / entry["fwd_bwd_s"])


def _print_timing(results):
  header = (f"{'problem':<24} {'method':<17} {'fwd ms':>8} {'TFLOP/s':>8} "
            f"{'vs dense':>8} {'fwd+bwd ms':>10} {'TFLOP/s':>8} "
            f"{'vs dense':>8} {'vs ragged':>9}")
  print(header)
  print("-" * len(header))
  for row in results:
    for method, e in row["methods"].items():
      if "error" in e:
        print(f"{row['problem']:<24} {method:<17} FAILED: {e['error'][:80]}")
        continue
      print(f"{row['problem']:<24} {method:<17} {1e3 * e['fwd_s']:8.3f} "
            f"{e['fwd_tflops']:8.1f} {e.get('fwd_vs_dense', 0):8.2f} "
            f"{1e3 * e['fwd_bwd_s']:10.3f} {e['fwd_bwd_tflops']:8.1f} "
            f"{e.get('fwd_bwd_vs_dense', 0):8.2f} "
            f"{e.get('fwd_vs_ragged_dot', float('nan')):9.2f}")
  print("'vs dense' / 'vs ragged': throughput relative to dense jnp.dot of "
        "the same FLOPs / to ragged_dot (forward); > 1 is faster.")


# --- Lowering only ------------------------------------------------------------


def lower_only(shape):
  """Lowers every timed GPU program for CUDA; returns [(name, ok, detail)]."""
  pallas, fused, xla = _backends(on_gpu=True)
  cfg = moe_core.MoEConfig(num_experts=shape["experts"],
                           top_k=shape["top_k"], hidden_size=shape["hidden"],
                           expert_ffn_size=shape["ffn"])
  m, _, problems = _problems(shape, jnp.bfloat16, "random")
  s = jax.ShapeDtypeStruct
  group_sizes = s((shape["experts"],), jnp.int32)
  out = []
  for name, kind, a_shape, w_shape, out_shape, _ in problems:
    if kind == "gemm":
      operand = s(w_shape, jnp.bfloat16)
      methods = _gemm_methods(pallas, xla)
    else:
      operand = {k: s(v, jnp.bfloat16)
                 for k, v in moe_core.param_shapes(cfg).items()
                 if k in ("w_gate", "w_up", "w_down")}
      methods = _ffn_methods(pallas, fused, xla, cfg)
    for method, fn in methods.items():
      weights = _one_expert(operand) if method == "dense" else operand
      for mode, program, args in (
          ("fwd", fn, (s(a_shape, jnp.bfloat16), weights, group_sizes)),
          ("fwd+bwd", timing.with_grad(fn),
           (s(a_shape, jnp.bfloat16), weights, group_sizes,
            s(out_shape, jnp.float32)))):
        label = f"{name} {method} {mode}"
        try:
          text = export.export(
              jax.jit(program), platforms=["cuda"],
              disabled_checks=[
                  export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
          )(*args).mlir_module()
          out.append((label, True,
                      f"{text.count(_TRITON_CALL)} triton kernels"))
        except Exception as e:  # pylint: disable=broad-except
          out.append((label, False, f"{type(e).__name__}: {e}"[:300]))
  del m
  return out


# --- Main ---------------------------------------------------------------------


def main(argv=None):
  args = _parse_args(argv)
  shape = dict(DRY if args.dry_run else FULL)
  if args.tokens:
    shape["tokens"] = args.tokens
  if args.experts:
    shape["experts"] = args.experts
  print(f"jax {jax.__version__}, python {platform.python_version()}, "
        f"default backend {jax.default_backend()}, "
        f"devices {[d.device_kind for d in jax.devices()]}")

  if args.lower_only:
    results = lower_only(shape)
    for label, ok, detail in results:
      print(f"{'ok  ' if ok else 'FAIL'} {label}: {detail}")
    failed = sum(not ok for _, ok, _ in results)
    print(f"lowered {len(results) - failed}/{len(results)} programs for CUDA")
    return 1 if failed else 0

  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.dry_run:
    print("no GPU here: run with --dry_run (CPU, tiny shapes, interpreted "
          "kernels) or --lower_only (CUDA lowering).")
    return 2
  pallas, fused, xla = _backends(on_gpu=on_gpu if on_gpu else None)
  print(f"pallas: {pallas!r}, available: {pallas.availability()}")
  start = time.perf_counter()

  correctness = []
  if not args.skip_correctness:
    correctness = check_correctness(pallas, fused)
    bad = [r for r in correctness if not r["ok"]]
    worst = max((r["rel_err"] for r in correctness), default=0.0)
    print(f"correctness vs reference: {len(correctness) - len(bad)}/"
          f"{len(correctness)} ok (worst relative error {worst:.2e})")
    for r in bad:
      print(f"  FAIL {r['case']} {r['dtype']} {r['quantity']}: "
            f"{r['rel_err']:.3e}")

  repeats = 1 if args.dry_run else args.repeats
  m, sizes, timing = run_timing(shape, repeats, args.skew, pallas, fused, xla)
  print(f"T={shape['tokens']} top-{shape['top_k']} -> M={m} rows, "
        f"D={shape['hidden']} F={shape['ffn']} E={shape['experts']}, "
        f"bf16, {args.skew} group sizes (min {sizes.min()}, max "
        f"{sizes.max()}), median of {repeats}")
  _print_timing(timing)
  elapsed = time.perf_counter() - start

  now = datetime.datetime.now(datetime.timezone.utc)
  os.makedirs(args.out_dir, exist_ok=True)
  stem = "gpu_dryrun" if args.dry_run else "gpu"
  path = os.path.join(args.out_dir, f"{stem}_{now:%Y%m%d_%H%M%S}.json")
  with open(path, "w") as fh:
    json.dump({
        "date": now.isoformat(), "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None)
                  or getattr(__import__("jaxlib"), "__version__", None),
        "python": platform.python_version(),
        "platform": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "dry_run": args.dry_run, "shape": shape, "rows": m,
        "group_sizes": sizes.tolist(), "skew": args.skew,
        "repeats": repeats, "seconds": elapsed,
        "correctness": correctness, "timing": timing,
    }, fh, indent=1)
  print(f"wrote {path} ({elapsed:.0f} s)")
  failed = any(not r["ok"] for r in correctness)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
