"""gpu_check phase 1: pallas, mosaic_gpu, triton, te against the reference.

Output, dX and dW of the grouped GEMM and of the expert FFN (bf16, plain
and with the fused activation), with NaN in the padding rows, then a small
MoE layer and its gradients, for each backend: pallas (Pallas Triton) in
bf16 and float32, mosaic_gpu (Mosaic GPU forward and dX, Pallas Triton dW)
in bf16; its float32 cases are recorded as skipped with the
NotImplementedError it raises for them. triton (raw Triton kernels through
jax-triton) in bf16 and float32, the GEMMs, the expert FFN with
fuse_activation False and True, and the layer with fuse_routing_weights
False and True (on `gpu_workloads.TritonCases`: everyone's cases on a GPU,
smaller ones of its own when interpreted); where it is unavailable (no
jax-triton, or no torch for its interpreter) its cases are skipped with
the reason. te (Transformer Engine's grouped GEMM) in bf16 on everyone's
GEMM, FFN and layer cases, its grouped-GEMM kernel recorded in place of
tiles; where TE is not installed (the GPU machine's case) each is skipped
with `gpu_workloads.TE_NOT_INSTALLED`. Then, for pallas and xla, the
forward grouped GEMM of each quantised recipe of `moe_core.precision`
against the reference backend's on the same inputs (bf16, NaN padding
rows), with a float32 output: both multiply the same quantised operands,
so only the order of float32 sums differs and the float32 budget applies.
Each result is an entry {case,
backend, dtype, quantity, rel_err, ok, ...} (`gpu_tolerances.rel_err`
against its budget); each case runs guarded, so one that raises leaves an
entry with quantity "error" and the next case runs.
"""

from __future__ import annotations

import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.mosaic_gpu import tiling as mosaic_tiling
from backends.pallas import tiling
from bench import gpu_report
from bench import gpu_tolerances
from bench import gpu_workloads
from moe_core import precision

# Outputs whose padding rows (past sum(group sizes)) must come out as zeros.
_ZERO_PADDED = ("out", "d_rows")
PALLAS = "pallas"
MOSAIC = "mosaic_gpu"
TRITON = "triton"
TE = "te"
# Budgets of one product and of a deep chain (the expert FFN, the layer's
# gradients), per dtype. float32 has one for both: gpu_tolerances.FLOAT32
# is above even the conformance float32 gradient row (atol + rtol = 6e-5).
_SHALLOW_DEEP = {
    "bfloat16": (gpu_tolerances.BF16, gpu_tolerances.BF16_DEEP),
    "float32": (gpu_tolerances.FLOAT32, gpu_tolerances.FLOAT32),
}


def _gpu_fwd_tiles(backend, m, c, n, num_groups, dtype, num_operands=1):
  """The forward's tiles on a GPU, whatever runs here: for the record."""
  try:
    if backend == TRITON:
      # pylint: disable-next=g-import-not-at-top
      from backends.triton import configs as triton_configs

      return repr(
          triton_configs.choose(
              None,
              triton_configs.generation() or "sm90",
              "gated" if num_operands == 2 else "fwd",
              m,
              c,
              n,
              num_groups,
              jnp.dtype(dtype),
          )
      )
    if backend == TE:  # No tiles of ours: which kernel TE picks, and why.
      # pylint: disable-next=g-import-not-at-top
      from backends.te import _te

      cc = _te.device_compute_capability()
      return _te.grouped_gemm_path(cc or gpu_workloads.TE_LOWERING_CAPABILITY)
    if backend == MOSAIC:
      return repr(
          mosaic_tiling.choose(
              mosaic_tiling.TileConfig(),
              "fwd",
              m,
              num_groups,
              dtype,
              num_rhs=num_operands,
              num_accs=num_operands,
              num_outputs=num_operands,
          )
      )
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


def _entry(case, backend, dtype, quantity, err, tol, **extra):
  return {
      "case": case,
      "backend": backend,
      "dtype": dtype,
      "quantity": quantity,
      "rel_err": err,
      "ok": bool(err <= tol),
      **extra,
  }


def _padded_entries(case, backend, dtype, compared, tol, used, tiles):
  """Entries of (quantity, got, want) triples; padding rows must be zero."""
  out = []
  for name, got, want in compared:
    entry = _entry(
        case,
        backend,
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


def _guarded(results, case, backend, dtype, run_case):
  """Appends run_case()'s entries, or one entry with the error it raised."""
  try:
    results.extend(run_case())
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    results.append(
        {
            "case": case,
            "backend": backend,
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


def _skipped(case, backend, dtype, reason):
  """The entry of a case not run: ok, and why (not a failure)."""
  return {
      "case": case,
      "backend": backend,
      "dtype": dtype,
      "quantity": "skipped",
      "rel_err": None,
      "ok": True,
      "skipped": reason,
  }


def _run_or_skip(results, case, backend, dtype, be, run_case):
  """_guarded, or a "skipped" entry if `be` is unavailable here."""
  if isinstance(be, gpu_workloads.Unavailable):
    results.append(_skipped(case, backend, dtype, be.reason))
  else:
    _guarded(results, case, backend, dtype, run_case)


def _nan_and_zero_padded(a, used):
  """(a with NaN rows from `used` on, a with zero rows there)."""
  valid = np.arange(a.shape[0])[:, None] < used
  return np.where(valid, a, np.nan), a * valid


def _suffix(backend):
  # pallas names stay as they were: its entries compare with older JSON.
  return "" if backend == PALLAS else f" {backend}"


def gemm_name(m, c, n, sizes, transpose_rhs, backend=PALLAS):
  # "k=" is the contraction C: the label stays comparable with older JSON.
  return f"gemm m={m} k={c} n={n} E={len(sizes)} t={transpose_rhs}" + _suffix(
      backend
  )


def ffn_name(label, m, d, f, sizes):
  return f"expert_ffn {label} m={m} d={d} f={f} E={len(sizes)}"


def _gemm_operands(m, c, n, sizes, transpose_rhs, seed):
  """(rows [M, C], weights, cotangent [M, N]) in float32, from `seed`."""
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal((m, c)).astype(np.float32)
  w_shape = (len(sizes), n, c) if transpose_rhs else (len(sizes), c, n)
  weights = rng.standard_normal(w_shape).astype(np.float32) / np.sqrt(c)
  cot = rng.standard_normal((m, n)).astype(np.float32)
  return rows, weights, cot


def _gemm_program(be, group_sizes, transpose_rhs):
  """(rows, weights, cotangent) -> (out, d rows, d weights) through `be`."""

  def run(x, w, ct):
    def f(x, w):
      return be.grouped_gemm(x, w, group_sizes, transpose_rhs=transpose_rhs)

    return gpu_workloads.output_and_grads(f, x, w, ct)

  return run


def unsupported(be, m, c, n, sizes, transpose_rhs, dtype):
  """The NotImplementedError `be` raises for this GEMM case, else None.

  Traced only (jax.eval_shape): nothing compiles or runs.
  """
  e = len(sizes)
  rows = jax.ShapeDtypeStruct((m, c), dtype)
  weights = jax.ShapeDtypeStruct(
      (e, n, c) if transpose_rhs else (e, c, n), dtype
  )
  cot = jax.ShapeDtypeStruct((m, n), dtype)
  gs = jnp.asarray(sizes, jnp.int32)
  try:
    jax.eval_shape(_gemm_program(be, gs, transpose_rhs), rows, weights, cot)
  except NotImplementedError as e:
    return e
  return None


def gemm_case(
    be, ref, m, c, n, sizes, transpose_rhs, dtype, seed, backend=PALLAS
):
  """Output, dX and dW of one grouped GEMM [M, C] x [E, C, N] -> [M, N].

  `be` gets NaN in the padding rows of its rows and cotangent, the
  reference zeros; transpose_rhs gives the weights as [E, N, C].
  """
  used = sum(sizes)
  rows, weights, cot = _gemm_operands(m, c, n, sizes, transpose_rhs, seed)
  gs = jnp.asarray(sizes, jnp.int32)
  as_dtype = functools.partial(jnp.asarray, dtype=dtype)
  nan_rows, zero_rows = _nan_and_zero_padded(rows, used)
  nan_cot, zero_cot = _nan_and_zero_padded(cot, used)
  got = jax.jit(_gemm_program(be, gs, transpose_rhs))(
      as_dtype(nan_rows), as_dtype(weights), as_dtype(nan_cot)
  )
  want = jax.jit(_gemm_program(ref, gs, transpose_rhs))(
      as_dtype(zero_rows), as_dtype(weights), as_dtype(zero_cot)
  )
  return _padded_entries(
      gemm_name(m, c, n, sizes, transpose_rhs, backend),
      backend,
      dtype,
      zip(("out", "d_rows", "d_weights"), got, want),
      gpu_tolerances.for_dtype(dtype),
      used,
      _gpu_fwd_tiles(backend, m, c, n, len(sizes), dtype),
  )


def mosaic_gemm_case(
    be, ref, m, c, n, sizes, transpose_rhs, dtype, seed, backend=MOSAIC
):
  """gemm_case, or one "skipped" entry if the backend refuses the case.

  mosaic_gpu raises NotImplementedError for float32 (wgmma would take it as
  TF32); the entry keeps that message, so the day it takes float32 the
  case runs instead. te uses it too, for what TE's grouped GEMM refuses.
  """
  refused = unsupported(be, m, c, n, sizes, transpose_rhs, dtype)
  if refused is None:
    return gemm_case(
        be, ref, m, c, n, sizes, transpose_rhs, dtype, seed, backend=backend
    )
  return [
      _skipped(
          gemm_name(m, c, n, sizes, transpose_rhs, backend),
          backend,
          dtype,
          gpu_report.error_text(refused),
      )
  ]


def quantized_gemm_name(case, recipe, backend):
  m, c, n, sizes = case
  return f"quantized_gemm {recipe} m={m} k={c} n={n} E={len(sizes)} {backend}"


def _quantized_output(be, case, recipe, seed, *, trace_only=False):
  """`be`'s forward on `recipe`: [M, N] float32.

  trace_only gives its jax.ShapeDtypeStruct (nothing compiles). case is
  (M, C, N, group sizes); the inputs are bf16, rows [M, C] with NaN padding
  rows and weights [E, C, N], drawn from `seed`.
  """
  m, c, n, sizes = case
  rows, weights, _ = _gemm_operands(m, c, n, sizes, False, seed)
  nan_rows, _ = _nan_and_zero_padded(rows, sum(sizes))
  group_sizes = jnp.asarray(sizes, jnp.int32)

  def run(x, w):
    return be.grouped_gemm(
        x, w, group_sizes, precision=recipe, out_dtype=jnp.float32
    )

  bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
  if trace_only:
    program = functools.partial(jax.eval_shape, run)
  else:
    program = jax.jit(run)
  return program(bf16(nan_rows), bf16(weights))


def quantized_gemm_case(be, want, case, recipe, seed, backend):
  """The forward of `be` on `recipe` against the reference's: entries.

  `want()` is the reference's output on the same inputs. One "skipped"
  entry, with the message, if `be` raises NotImplementedError for the
  recipe (found by tracing alone); else the output (padding rows zero)
  within the float32 budget.
  """
  name = quantized_gemm_name(case, recipe, backend)
  try:
    _quantized_output(be, case, recipe, seed, trace_only=True)
  except NotImplementedError as e:
    return [_skipped(name, backend, "bfloat16", gpu_report.error_text(e))]
  m, c, n, sizes = case
  entries = _padded_entries(
      name,
      backend,
      "bfloat16",
      [("out", _quantized_output(be, case, recipe, seed), want())],
      gpu_tolerances.FLOAT32,
      sum(sizes),
      _gpu_fwd_tiles(backend, m, c, n, len(sizes), "bfloat16"),
  )
  for entry in entries:
    entry["recipe"] = recipe
  return entries


def quantized_cases(bes, ref, results):
  """Each recipe's forward on pallas and xla vs the reference's.

  xla is `bes.ragged` (on jax.lax.ragged_dot: the xla backend's path on a
  GPU). The reference runs once per case and recipe, for both backends (a
  failure there fails each backend's entry).
  """
  backends = ((PALLAS, bes.pallas), ("xla", bes.ragged))
  for index, case in enumerate(gpu_workloads.QUANTIZED_GEMM_CASES):
    seed = 20 + index
    for recipe in precision.QUANTIZED_RECIPES:
      want = functools.cache(
          functools.partial(_quantized_output, ref, case, recipe, seed)
      )
      for backend, be in backends:
        _run_or_skip(
            results,
            quantized_gemm_name(case, recipe, backend),
            backend,
            "bfloat16",
            be,
            functools.partial(
                quantized_gemm_case, be, want, case, recipe, seed, backend
            ),
        )


def ffn_case(be, label, m, d, f, sizes, seed, backend=PALLAS, dtype="bfloat16"):
  """Output and gradients of expert_ffn with NaN padding rows."""
  e = len(sizes)
  used = sum(sizes)
  cfg = moe_core.MoEConfig(
      num_experts=e, top_k=min(2, e), hidden_size=d, expert_ffn_size=f
  )
  params = gpu_workloads.expert_weights(
      moe_core.init_params(jax.random.key(seed), cfg, dtype=jnp.dtype(dtype))
  )
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal((m, d)).astype(np.float32)
  cot = rng.standard_normal((m, d)).astype(np.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def run(be, x, p, ct):
    return gpu_workloads.output_and_grads(
        lambda x, p: be.expert_ffn(x, gs, p, cfg), x, p, ct
    )

  as_dtype = functools.partial(jnp.asarray, dtype=dtype)
  nan_rows, zero_rows = _nan_and_zero_padded(rows, used)
  nan_cot, zero_cot = _nan_and_zero_padded(cot, used)
  got, got_dx, got_dp = jax.jit(functools.partial(run, be))(
      as_dtype(nan_rows), params, as_dtype(nan_cot)
  )
  want, want_dx, want_dp = jax.jit(
      functools.partial(run, moe_core.get_backend("reference"))
  )(as_dtype(zero_rows), params, as_dtype(zero_cot))
  return _padded_entries(
      ffn_name(label, m, d, f, sizes),
      backend,
      dtype,
      (
          ("out", got, want),
          ("d_rows", got_dx, want_dx),
          *((f"d {k}", got_dp[k], want_dp[k]) for k in params),
      ),
      _SHALLOW_DEEP[dtype][1],
      used,
      _gpu_fwd_tiles(backend, m, d, f, e, dtype, num_operands=2),
  )


def _named_layer_grads(grads):
  """{"d <param>": ..., "d x": ...} of (param grads, input grad)."""
  param_grads, x_grad = grads
  return {**{f"d {k}": v for k, v in param_grads.items()}, "d x": x_grad}


def layer_cases(cases, ref, results, *, layer=None, dtype="bfloat16"):
  """A small MoE layer and its gradients: each (label, backend name, be).

  layer: (MoEConfig fields, the input's [batch, sequence]); None for
  (LAYER_CONFIG, LAYER_BATCH). Params and input in `dtype`. The reference
  runs once, for every case.
  """
  config, batch = layer or (
      gpu_workloads.LAYER_CONFIG,
      gpu_workloads.LAYER_BATCH,
  )
  cfg = moe_core.MoEConfig(**config)
  shallow, deep = _SHALLOW_DEEP[dtype]
  memo = {}

  def layer_grads(be, p, x):
    def loss(p, x):
      y, _ = moe_core.moe_layer(p, x, cfg, backend=be)
      return jnp.sum(jnp.square(y.astype(jnp.float32))), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x)
    return y, grads

  def run_case(label, backend, be):
    if not memo:  # Shared by every case; a failure fails each of them.
      memo["params"] = moe_core.init_params(
          jax.random.key(1), cfg, dtype=jnp.dtype(dtype)
      )
      memo["x"] = jax.random.normal(
          jax.random.key(2),
          tuple(batch) + (cfg.hidden_size,),
          jnp.dtype(dtype),
      )
      memo["want"] = jax.jit(functools.partial(layer_grads, ref))(
          memo["params"], memo["x"]
      )
    want_y, want_grads = memo["want"]
    y, grads = jax.jit(functools.partial(layer_grads, be))(
        memo["params"], memo["x"]
    )
    rel_err = gpu_tolerances.rel_err
    out = [_entry(label, backend, dtype, "y", rel_err(y, want_y), shallow)]
    got, want = _named_layer_grads(grads), _named_layer_grads(want_grads)
    for name in got:
      err = rel_err(got[name], want[name])
      out.append(_entry(label, backend, dtype, name, err, deep))
    return out

  for label, backend, be in cases:
    _run_or_skip(
        results,
        label,
        backend,
        dtype,
        be,
        functools.partial(run_case, label, backend, be),
    )


def triton_cases(bes, ref, results, cases):
  """triton's GEMM and expert FFN cases (`gpu_workloads.TritonCases`).

  With NaN padding rows; the FFN with fuse_activation False and True. Its
  layer cases are `triton_layers`'.
  """
  for seed, (m, c, n, sizes, t, dtype) in enumerate(cases.gemm):
    _run_or_skip(
        results,
        gemm_name(m, c, n, sizes, t, TRITON),
        TRITON,
        dtype,
        bes.triton,
        functools.partial(
            gemm_case,
            bes.triton,
            ref,
            m,
            c,
            n,
            sizes,
            t,
            dtype,
            seed,
            backend=TRITON,
        ),
    )
  ffn_backends = (
      ("triton", bes.triton),
      ("triton fused_act", bes.triton_fused),
  )
  for seed, (m, d, f, sizes, dtype) in enumerate(cases.ffn):
    for label, be in ffn_backends:
      _run_or_skip(
          results,
          ffn_name(label, m, d, f, sizes),
          TRITON,
          dtype,
          be,
          functools.partial(
              ffn_case, be, label, m, d, f, sizes, 10 + seed, TRITON, dtype
          ),
      )


def triton_layers(bes, cases):
  """{dtype: [(label, backend name, be)]}: triton's layer cases.

  The layer with neither fusion ("plain"), the fused activation
  ("fused_act"), and both the activation and the routing weights fused
  ("fused_routing": fuse_routing_weights), as `cases.layers` names them.
  """
  variants = {
      "plain": ("moe_layer triton", TRITON, bes.triton),
      "fused_act": ("moe_layer triton fused_act", TRITON, bes.triton_fused),
      "fused_routing": (
          "moe_layer triton fused_routing",
          TRITON,
          bes.triton_routed,
      ),
  }
  by_dtype = {}
  for variant, dtype in cases.layers:
    by_dtype.setdefault(dtype, []).append(variants[variant])
  return by_dtype


def te_cases(bes, ref, results):
  """te's (Transformer Engine's) GEMM and expert FFN cases, bf16.

  Everyone's GEMM_CASES (a layout or case TE's grouped GEMM refuses:
  skipped with the NotImplementedError) and FFN_CASES, NaN padding rows;
  its layer case is `check_correctness`'s. Where TE is not installed every
  case is skipped with `gpu_workloads.TE_NOT_INSTALLED`.
  """
  for seed, (m, c, n, sizes, t) in enumerate(gpu_workloads.GEMM_CASES):
    _run_or_skip(
        results,
        gemm_name(m, c, n, sizes, t, TE),
        TE,
        "bfloat16",
        bes.te,
        functools.partial(
            mosaic_gemm_case,
            bes.te,
            ref,
            m,
            c,
            n,
            sizes,
            t,
            "bfloat16",
            seed,
            backend=TE,
        ),
    )
  for seed, (m, d, f, sizes) in enumerate(gpu_workloads.FFN_CASES):
    _run_or_skip(
        results,
        ffn_name(TE, m, d, f, sizes),
        TE,
        "bfloat16",
        bes.te,
        functools.partial(ffn_case, bes.te, TE, m, d, f, sizes, 10 + seed, TE),
    )


def check_correctness(
    bes, results=None, *, mosaic_gemm_cases=None, triton=None
):
  """pallas, mosaic_gpu, triton, te, xla vs reference: [{case, ...}].

  xla only for the quantised recipes (`quantized_cases`).

  Args:
    bes: a `gpu_workloads.Backends`.
    results: the list to append to (default a new one).
    mosaic_gemm_cases: None checks mosaic_gpu on every case; an int, on
      that many GEMM cases only and no FFN or layer case (--dry_run: its
      interpreter takes seconds a call).
    triton: the `gpu_workloads.TritonCases` triton is checked on (None:
      `gpu_workloads.triton_cases()`, everyone's).

  Each case runs guarded: one that raises adds an entry with quantity
  "error", ok False and the error, and the next case runs. A backend
  unavailable here (`gpu_workloads.Unavailable`) gives "skipped" entries.
  """
  results = [] if results is None else results
  ref = moe_core.get_backend("reference")
  mosaic_all = mosaic_gemm_cases is None
  for seed, (m, c, n, sizes, t) in enumerate(gpu_workloads.GEMM_CASES):
    for dtype in ("bfloat16", "float32"):
      _run_or_skip(
          results,
          gemm_name(m, c, n, sizes, t),
          PALLAS,
          dtype,
          bes.pallas,
          functools.partial(
              gemm_case, bes.pallas, ref, m, c, n, sizes, t, dtype, seed
          ),
      )
    if not mosaic_all and seed >= mosaic_gemm_cases:
      continue
    for dtype in ("bfloat16", "float32"):
      _run_or_skip(
          results,
          gemm_name(m, c, n, sizes, t, MOSAIC),
          MOSAIC,
          dtype,
          bes.mosaic,
          functools.partial(
              mosaic_gemm_case, bes.mosaic, ref, m, c, n, sizes, t, dtype, seed
          ),
      )
  ffn_backends = [
      ("pallas", PALLAS, bes.pallas),
      ("fused_act", PALLAS, bes.pallas_fused),
  ]
  if mosaic_all:
    ffn_backends += [
        ("mosaic_gpu", MOSAIC, bes.mosaic),
        ("mosaic_gpu fused_act", MOSAIC, bes.mosaic_fused),
    ]
  for seed, (m, d, f, sizes) in enumerate(gpu_workloads.FFN_CASES):
    for label, backend, be in ffn_backends:
      _run_or_skip(
          results,
          ffn_name(label, m, d, f, sizes),
          backend,
          "bfloat16",
          be,
          functools.partial(
              ffn_case, be, label, m, d, f, sizes, 10 + seed, backend
          ),
      )
  layers = [
      ("moe_layer", PALLAS, bes.pallas),
      ("moe_layer fused_act", PALLAS, bes.pallas_fused),
  ]
  if mosaic_all:
    layers += [
        ("moe_layer mosaic_gpu", MOSAIC, bes.mosaic),
        ("moe_layer mosaic_gpu fused_act", MOSAIC, bes.mosaic_fused),
    ]
  triton = triton or gpu_workloads.triton_cases()
  triton_cases(bes, ref, results, triton)
  te_cases(bes, ref, results)
  layers.append(("moe_layer te", TE, bes.te))
  more = triton_layers(bes, triton)
  if triton.layer is None:  # The same layer: the same reference run.
    layers += more.pop("bfloat16", [])
  layer_cases(layers, ref, results)
  for dtype, cases in more.items():
    layer_cases(cases, ref, results, layer=triton.layer, dtype=dtype)
  quantized_cases(bes, ref, results)
  return results


def print_summary(correctness):
  """How many entries passed, the worst error, each skip and failure."""
  bad = [r for r in correctness if not r["ok"]]
  skipped = [r for r in correctness if r["quantity"] == "skipped"]
  errs = [r["rel_err"] for r in correctness if r["rel_err"] is not None]
  print(
      f"correctness vs reference: {len(correctness) - len(bad)}/"
      f"{len(correctness)} ok, {len(skipped)} of them skipped (worst "
      f"relative error {max(errs, default=0.0):.2e})"
  )
  for r in skipped:
    print(f"  skipped {r['case']} {r['dtype']}: {r['skipped'][:120]}")
  for r in bad:
    detail = r.get("error") or f"{r['rel_err']:.3e}"
    print(f"  FAIL {r['case']} {r['dtype']} {r['quantity']}: {detail}")
