"""gpu_check phase 1: the pallas kernels against the reference backend.

Output, dX and dW of the grouped GEMM (bf16 and float32) and of the expert
FFN (bf16, plain and with the fused activation), with NaN in the padding
rows, then a small MoE layer and its gradients. Each result is an entry
{case, dtype, quantity, rel_err, ok, ...} (`gpu_tolerances.rel_err` against
its budget); each case runs guarded, so one that raises leaves an entry
with quantity "error" and the next case runs.
"""

from __future__ import annotations

import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.pallas import tiling
from bench import gpu_report
from bench import gpu_tolerances
from bench import gpu_workloads

# Outputs whose padding rows (past sum(group sizes)) must come out as zeros.
_ZERO_PADDED = ("out", "d_rows")


def _gpu_fwd_tiles(m, c, n, num_groups, dtype, num_operands=1):
  """The forward's tiles on a GPU, whatever runs here: for the record."""
  try:
    return repr(
        tiling.heuristic(
            "fwd",
            m,
            c,
            n,
            num_groups,
            dtype,
            interpret=False,
            num_operands=num_operands,
        )
    )
  except Exception as e:  # pylint: disable=broad-except
    return gpu_report.error_text(e)


def _entry(case, dtype, quantity, err, tol, **extra):
  return {
      "case": case,
      "dtype": dtype,
      "quantity": quantity,
      "rel_err": err,
      "ok": bool(err <= tol),
      **extra,
  }


def _padded_entries(case, dtype, compared, tol, used, tiles):
  """Entries of (quantity, got, want) triples; padding rows must be zero."""
  out = []
  for name, got, want in compared:
    entry = _entry(
        case,
        dtype,
        name,
        gpu_tolerances.rel_err(got, want),
        tol,
        gpu_fwd_tiles=tiles,
    )
    if name in _ZERO_PADDED:
      padding = np.asarray(got[used:], np.float32)
      entry["ok"] = entry["ok"] and not np.any(padding)
    out.append(entry)
  return out


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
            "error": gpu_report.error_text(e),
        }
    )
    print(
        f"  FAIL {case} {dtype}: {gpu_report.error_text(e)[:200]}", flush=True
    )


def _nan_and_zero_padded(a, used):
  """(a with NaN rows from `used` on, a with zero rows there)."""
  valid = np.arange(a.shape[0])[:, None] < used
  return np.where(valid, a, np.nan), a * valid


def gemm_name(m, c, n, sizes, transpose_rhs):
  # "k=" is the contraction C: the label stays comparable with older JSON.
  return f"gemm m={m} k={c} n={n} E={len(sizes)} t={transpose_rhs}"


def ffn_name(label, m, d, f, sizes):
  return f"expert_ffn {label} m={m} d={d} f={f} E={len(sizes)}"


def gemm_case(pallas, ref, m, c, n, sizes, transpose_rhs, dtype, seed):
  """Output, dX and dW of one grouped GEMM [M, C] x [E, C, N] -> [M, N].

  pallas gets NaN in the padding rows of its rows and cotangent, the
  reference zeros; transpose_rhs gives the weights as [E, N, C].
  """
  rng = np.random.default_rng(seed)
  used = sum(sizes)
  rows = rng.standard_normal((m, c)).astype(np.float32)
  w_shape = (len(sizes), n, c) if transpose_rhs else (len(sizes), c, n)
  weights = rng.standard_normal(w_shape).astype(np.float32) / np.sqrt(c)
  cot = rng.standard_normal((m, n)).astype(np.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def run(be, x, w, ct):
    def f(x, w):
      return be.grouped_gemm(x, w, gs, transpose_rhs=transpose_rhs)

    return gpu_workloads.output_and_grads(f, x, w, ct)

  as_dtype = functools.partial(jnp.asarray, dtype=dtype)
  nan_rows, zero_rows = _nan_and_zero_padded(rows, used)
  nan_cot, zero_cot = _nan_and_zero_padded(cot, used)
  got = jax.jit(functools.partial(run, pallas))(
      as_dtype(nan_rows), as_dtype(weights), as_dtype(nan_cot)
  )
  want = jax.jit(functools.partial(run, ref))(
      as_dtype(zero_rows), as_dtype(weights), as_dtype(zero_cot)
  )
  return _padded_entries(
      gemm_name(m, c, n, sizes, transpose_rhs),
      dtype,
      zip(("out", "d_rows", "d_weights"), got, want),
      gpu_tolerances.for_dtype(dtype),
      used,
      _gpu_fwd_tiles(m, c, n, len(sizes), dtype),
  )


def ffn_case(be, label, m, d, f, sizes, seed):
  """Output and gradients of expert_ffn (bf16) with NaN padding rows."""
  e = len(sizes)
  used = sum(sizes)
  cfg = moe_core.MoEConfig(
      num_experts=e, top_k=min(2, e), hidden_size=d, expert_ffn_size=f
  )
  params = gpu_workloads.expert_weights(
      moe_core.init_params(jax.random.key(seed), cfg, dtype=jnp.bfloat16)
  )
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal((m, d)).astype(np.float32)
  cot = rng.standard_normal((m, d)).astype(np.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def run(be, x, p, ct):
    return gpu_workloads.output_and_grads(
        lambda x, p: be.expert_ffn(x, gs, p, cfg), x, p, ct
    )

  bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
  nan_rows, zero_rows = _nan_and_zero_padded(rows, used)
  nan_cot, zero_cot = _nan_and_zero_padded(cot, used)
  got, got_dx, got_dp = jax.jit(functools.partial(run, be))(
      bf16(nan_rows), params, bf16(nan_cot)
  )
  want, want_dx, want_dp = jax.jit(
      functools.partial(run, moe_core.get_backend("reference"))
  )(bf16(zero_rows), params, bf16(zero_cot))
  return _padded_entries(
      ffn_name(label, m, d, f, sizes),
      "bfloat16",
      (
          ("out", got, want),
          ("d_rows", got_dx, want_dx),
          *((f"d {k}", got_dp[k], want_dp[k]) for k in params),
      ),
      gpu_tolerances.BF16_DEEP,
      used,
      _gpu_fwd_tiles(m, d, f, e, "bfloat16", num_operands=2),
  )


def _named_layer_grads(grads):
  """{"d <param>": ..., "d x": ...} of (param grads, input grad)."""
  param_grads, x_grad = grads
  return {**{f"d {k}": v for k, v in param_grads.items()}, "d x": x_grad}


def layer_cases(pallas, fused, ref, results):
  """A small MoE layer and its gradients: pallas and fused vs reference."""
  cfg = moe_core.MoEConfig(**gpu_workloads.LAYER_CONFIG)
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
          jax.random.key(2),
          gpu_workloads.LAYER_BATCH + (cfg.hidden_size,),
          jnp.bfloat16,
      )
      memo["want"] = jax.jit(functools.partial(layer_grads, ref))(
          memo["params"], memo["x"]
      )
    want_y, want_grads = memo["want"]
    y, grads = jax.jit(functools.partial(layer_grads, be))(
        memo["params"], memo["x"]
    )
    rel_err = gpu_tolerances.rel_err
    out = [
        _entry(label, "bfloat16", "y", rel_err(y, want_y), gpu_tolerances.BF16)
    ]
    got, want = _named_layer_grads(grads), _named_layer_grads(want_grads)
    for name in got:
      err = rel_err(got[name], want[name])
      out.append(_entry(label, "bfloat16", name, err, gpu_tolerances.BF16_DEEP))
    return out

  for label, be in (("moe_layer", pallas), ("moe_layer fused_act", fused)):
    _guarded(results, label, "bfloat16", functools.partial(run_case, label, be))


def check_correctness(pallas, fused, results=None):
  """pallas vs reference: list of {case, dtype, quantity, rel_err, ok}.

  Each case runs guarded: one that raises adds an entry with quantity
  "error", ok False and the error, and the next case runs.
  """
  results = [] if results is None else results
  ref = moe_core.get_backend("reference")
  for seed, (m, c, n, sizes, t) in enumerate(gpu_workloads.GEMM_CASES):
    for dtype in ("bfloat16", "float32"):
      _guarded(
          results,
          gemm_name(m, c, n, sizes, t),
          dtype,
          functools.partial(
              gemm_case, pallas, ref, m, c, n, sizes, t, dtype, seed
          ),
      )
  for seed, (m, d, f, sizes) in enumerate(gpu_workloads.FFN_CASES):
    for label, be in (("pallas", pallas), ("fused_act", fused)):
      _guarded(
          results,
          ffn_name(label, m, d, f, sizes),
          "bfloat16",
          functools.partial(ffn_case, be, label, m, d, f, sizes, 10 + seed),
      )
  layer_cases(pallas, fused, ref, results)
  return results


def print_summary(correctness):
  """How many entries passed, the worst error, and each failure."""
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
