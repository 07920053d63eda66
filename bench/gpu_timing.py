"""gpu_check phase 2: times and TFLOP/s of every method, checked.

For each workload (`gpu_workloads.FULL`: DeepSeek-V3, a small-K GEMM, the
low-precision recipes at DeepSeek-V3's gate/up GEMM, DeepSeek-V3's GEMM
backward in halves, its routed experts, Mixtral), timed problem and method,
the median time of the jitted forward and forward+backward (or of dX alone
and dW alone: `PHASES`), their TFLOP/s, and the times over the dense,
ragged_dot and pallas baselines (`timing.ratio_key`: time / baseline time,
< 1 faster). Inputs are bf16; a quantised method ("pallas_fp8_block", ...)
quantises them by its recipe inside the timed program. The timed programs'
own output and gradients are then checked on a few sampled groups against
a float32 per-group `jnp.dot` (the routed experts: on sampled tokens and
experts), or for a quantised method against the reference backend's
product of the same quantised group. Every method is guarded: one that
raises records its error and the next one runs. `goals` reads the targets
off the rows: mosaic_gpu's forward at >= 0.6x dense cuBLAS throughput and
faster than pallas at small K; triton's forward, dX and dW each at >= 0.6x
dense cuBLAS throughput and its fused-activation FFN faster than its
unfused one (the fused routing weights' cost over the fused activation
alone's, reported); the FP8 recipes' pallas forward at >= 1.5x the bf16
pallas forward's throughput on Hopper; the emulated recipes' (mxfp8,
nvfp4) cost over bf16, reported.
"""

from __future__ import annotations

import functools
import re
import statistics
import time
import traceback
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from bench import gemm_workloads
from bench import gpu_report
from bench import gpu_tolerances
from bench import gpu_workloads
from bench import text_table
from bench import timing
from moe_core import ffn

# The baselines every method's time is divided by.
BASELINES = ("dense", "ragged_dot", "pallas")
# Timed calls of one phase stop after this many seconds (at least one
# call): a method far slower than the others (ragged_dot expanded into a
# dense product over every group) then costs a few calls, not --repeats.
PHASE_BUDGET_S = 2.0
# mosaic_gpu's targets (`goals`): forward throughput at least this fraction
# of dense cuBLAS bf16's, i.e. fwd_time_over_dense <= 1 / 0.6.
FWD_THROUGHPUT_OVER_DENSE = 0.6
# The FP8 recipes' target on Hopper (H100's dense FP8 tensor-core peak is
# twice its bf16 one; 1.5x leaves room for quantising both operands): the
# pallas forward's throughput over the bf16 pallas forward's in the same
# row, i.e. fwd_time_over_pallas <= 1 / 1.5.
FP8_THROUGHPUT_OVER_BF16 = 1.5
FP8_METHODS = ("pallas_fp8_tensor", "pallas_fp8_block")
# Recipes with no tensor-core path on Hopper: dequantised in the kernel,
# their cost over bf16 reported, no target.
EMULATED_METHODS = ("pallas_mxfp8", "pallas_nvfp4")
# Hopper device kinds: "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA
# GH200 480GB", "NVIDIA H800", "NVIDIA H20".
_HOPPER = re.compile(r"\bG?H(20|100|200|800)\b")
# What a method can be timed on: bench/timing's forward and forward+backward,
# and a GEMM's backward in halves, dX alone and dW alone (`_grad_program`),
# each the forward's FLOPs.
PHASES = timing.PHASES + gpu_workloads.GRAD_PHASES
FLOPS_OVER_FWD = {**timing.FLOPS_OVER_FWD, "dx": 1, "dw": 1}
# triton's target (`goals`), as mosaic_gpu's: forward, dX alone and dW alone
# each at >= this fraction of dense cuBLAS bf16's throughput.
TRITON_THROUGHPUT_OVER_DENSE = FWD_THROUGHPUT_OVER_DENSE
# The triton methods held to it, where a row has a dense method.
TRITON_DENSE_METHODS = ("triton", "triton_fused_act")


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


def _quantized_oracle_values(rows, weights, cot, sizes, recipe):
  """`_oracle_values` of a quantised GEMM: the reference's, on its groups.

  The sampled groups alone, as one small grouped GEMM (one compile): rows
  are quantised per group and weights per expert, so each quantises as
  among the others, and this is the reference's product of the timed
  program's own quantised operands, in float32 (quantising casts to
  float32 first). Gradients are straight-through, the unquantised GEMM's.
  """
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  groups = _sample_groups(sizes)
  spans = [(g, int(offsets[g]), int(offsets[g + 1])) for g in groups]
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  x = f32(jnp.concatenate([rows[lo:hi] for _, lo, hi in spans]))
  ct = jnp.concatenate([cot[lo:hi] for _, lo, hi in spans])
  ct = f32(ct.astype(rows.dtype))
  w = f32(weights[np.asarray(groups, np.int32)])
  group_sizes = jnp.asarray([hi - lo for _, lo, hi in spans], jnp.int32)
  reference = moe_core.get_backend("reference")

  def gemm(x, w):
    return reference.grouped_gemm(
        x, w, group_sizes, precision=recipe, out_dtype=jnp.float32
    )

  out, d_x, d_w = jax.jit(
      functools.partial(gpu_workloads.output_and_grads, gemm)
  )(x, w, ct)
  found, start = [], 0
  for i, (g, lo, hi) in enumerate(spans):
    end = start + hi - lo
    found.append((g, lo, hi, out[start:end], d_x[start:end], d_w[i]))
    start = end
  return found


def _oracle_values(kind, activation, rows, weights, cot, sizes, recipe="bf16"):
  """[(group, lo, hi, out, d_rows, d_weights)] of the sampled groups.

  Computed once per problem and recipe, in float32 from the same bf16
  inputs; the cotangent is rounded to the output's dtype, as the timed
  programs see it. A quantised `recipe` (GEMMs only): the reference's
  product of the same quantised operands (`_quantized_oracle_values`).
  """
  if recipe != "bf16":
    return _quantized_oracle_values(rows, weights, cot, sizes, recipe)
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  values = jax.jit(
      functools.partial(
          gpu_workloads.output_and_grads, _group_oracle(kind, activation)
      )
  )
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


class _Compared(NamedTuple):
  """One comparison of a timed method's outputs with the oracle.

  quantity is "out", "d_rows" or "d_weights", the output it reads; pick
  takes the part compared out of that output (a few rows, one expert's
  weights); want is the float32 oracle's value there (a pytree like it).
  """

  quantity: str
  pick: Callable[[Any], Any]
  want: Any


class _Oracle(NamedTuple):
  """What the timed outputs are compared with: comparisons and where.

  sampled: what the comparisons cover, for the JSON ({"groups": [...]},
  and "tokens" for the routed experts). An empty `compared` fails every
  check (the row's check_error says why).
  """

  compared: list
  sampled: dict


def _group_comparisons(found):
  """_Oracle of `_oracle_values`' [(group, lo, hi, out, d_rows, d_w)]."""
  compared = []
  for g, lo, hi, want, want_dx, want_dw in found:
    rows = functools.partial(_rows, lo, hi)
    compared += [
        _Compared("out", rows, want),
        _Compared("d_rows", rows, want_dx),
        _Compared("d_weights", functools.partial(_expert, g), want_dw),
    ]
  return _Oracle(compared, {"groups": [g for g, *_ in found]})


def _rows(lo, hi, a):
  return a[lo:hi]


def _expert(g, weights):
  return jax.tree.map(lambda a: a[g], weights)


def _check_timed(oracle, outputs, tol):
  """Max relative errors of a timed method's outputs against the oracle.

  outputs holds what was computed of "out", "d_rows" and "d_weights" (a
  phase that failed leaves its outputs out: the others are checked alone,
  and the entry holds that error).
  """
  rel_err = gpu_tolerances.rel_err
  errs = {q: 0.0 for q in ("out", "d_rows", "d_weights") if q in outputs}
  for c in oracle.compared:
    if c.quantity not in outputs:
      continue
    got = jax.tree.leaves(c.pick(outputs[c.quantity]))
    for got_leaf, want_leaf in zip(got, jax.tree.leaves(c.want), strict=True):
      errs[c.quantity] = max(errs[c.quantity], rel_err(got_leaf, want_leaf))
  worst = max(errs.values())
  return {
      **oracle.sampled,
      **errs,
      "max_rel_err": worst,
      "tolerance": tol,
      "ok": bool(oracle.compared) and worst <= tol,
  }


def median_seconds(fn, args, repeats, budget_s=PHASE_BUDGET_S):
  """(median seconds, calls timed, first call's seconds) of fn(*args).

  The first call compiles and warms up and is not counted; then up to
  `repeats` calls, fewer once they have taken `budget_s` (at least one).
  Every call is waited for (block_until_ready): the time covers the device
  work.
  """
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  times = []
  while len(times) < max(repeats, 1) and (not times or sum(times) < budget_s):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times), len(times), first


def _grad_program(fn, argnum):
  """f(rows, weights, group_sizes, cotangent) -> the gradient of one alone.

  argnum 0 gives d rows (dX), 1 d weights (dW). The forward's output is not
  used (a grouped GEMM's VJP keeps its inputs, not its output), so XLA
  drops the forward kernel and this times one half of the backward. The
  cotangent is rounded to the output's dtype, as in `timing.with_grad`.
  """

  def grad(rows, weights, group_sizes, cotangent):
    def of_one(operand):
      pair = (operand, weights) if argnum == 0 else (rows, operand)
      return fn(*pair, group_sizes)

    out, vjp = jax.vjp(of_one, (rows, weights)[argnum])
    return vjp(cotangent.astype(out.dtype))[0]

  return jax.jit(grad)


def phase_programs(fn):
  """{phase: jitted program} of f(rows, weights, group_sizes), `PHASES`."""
  return {
      **timing.phase_programs(fn),
      "dx": _grad_program(fn, 0),
      "dw": _grad_program(fn, 1),
  }


def _outputs(programs, entry, args, cot):
  """{"out", "d_rows", "d_weights"} of the phases `entry` timed."""
  outputs = {}
  if "fwd_s" in entry:
    outputs["out"] = programs["fwd"](*args)
  if "fwd_bwd_s" in entry:
    outputs["d_rows"], outputs["d_weights"] = programs["fwd_bwd"](*args, cot)[1]
  if "dx_s" in entry:
    outputs["d_rows"] = programs["dx"](*args, cot)
  if "dw_s" in entry:
    outputs["d_weights"] = programs["dw"](*args, cot)
  return outputs


def _time_method(fn, args, cot, repeats, flops, oracle, tol, phases):
  """One method's entry: times, TFLOP/s, the output check, or the error.

  A phase that raises leaves "error" ("fwd: ..." or "fwd_bwd: ...") and no
  times from there on; what did run is still checked (oracle None: no
  check).
  """
  entry = {}
  programs = phase_programs(fn)
  for phase in phases:
    try:
      seconds, calls, first = median_seconds(
          programs[phase], timing.phase_args(phase, args, cot), repeats
      )
      entry[f"{phase}_s"] = seconds
      entry[f"{phase}_calls"] = calls
      # Compile and warm-up: what the method costs a run like this one.
      entry[f"{phase}_first_call_s"] = first
      flops_run = FLOPS_OVER_FWD[phase] * flops
      entry[f"{phase}_tflops"] = flops_run / seconds / 1e12
    except Exception as e:  # pylint: disable=broad-except
      entry["error"] = f"{phase}: {gpu_report.error_text(e)}"
      traceback.print_exc()
      break
  if oracle is None or not any(f"{p}_s" in entry for p in PHASES):
    return entry
  if not oracle.compared:
    entry["check"] = {
        "ok": False,
        "error": "no group to check against (the "
        "row's check_error says why)",
    }
    return entry
  try:  # The programs are compiled: one more call of each.
    outputs = _outputs(programs, entry, args, cot)
    entry["check"] = _check_timed(oracle, outputs, tol)
    entry["max_rel_err"] = entry["check"]["max_rel_err"]
  except Exception as e:  # pylint: disable=broad-except
    entry["check"] = {"error": gpu_report.error_text(e), "ok": False}
    traceback.print_exc()
  return entry


def _timed_inputs(problem, cfg, keys, dtype):
  """(rows, float32 cotangent, weights) of one problem, random.

  Drawn in `dtype`: DeepSeek-V3's [256, 7168, 2048] weights would take
  15 GB more drawn in float32.
  """
  rows = jax.random.normal(next(keys), problem.rows_shape, dtype)
  cot = jax.random.normal(next(keys), problem.out_shape, jnp.float32)
  if problem.kind == "gemm":
    w_shape = problem.weights_shape
    weights = jax.random.normal(next(keys), w_shape, dtype)
    return rows, cot, weights * jnp.asarray(w_shape[1] ** -0.5, dtype)
  params = moe_core.init_params(next(keys), cfg, dtype=dtype)
  return rows, cot, gpu_workloads.expert_weights(params)


def run_timing(
    workload, repeats, skew, bes, results=None, on_row=None, deadline=None
):
  """Times every method of every problem of a workload; a row per problem.

  Args:
    workload: a `gpu_workloads.Workload`.
    repeats: timed calls per phase (fewer past PHASE_BUDGET_S).
    skew: of the group sizes (`gemm_workloads.skewed_group_sizes`).
    bes: a `gpu_workloads.Backends`.
    results: the list the rows are appended to (default a new one).
    on_row: called after each method and each problem, e.g. to write what
      there is so far.
    deadline: a time.perf_counter() value past which no problem starts: its
      row says "skipped" (the one running finishes). None: no limit.

  Every method is guarded (its entry then holds "error").

  Returns:
    (M, [E] group sizes, results).
  """
  results = [] if results is None else results
  on_row = on_row or (lambda: None)
  dtype = jnp.bfloat16
  shape = workload.shape
  cfg = gpu_workloads.ffn_config(shape)
  m, sizes, problems = gpu_workloads.problems(shape, skew, workload.problems)
  group_sizes = jnp.asarray(sizes)
  keys = iter(jax.random.split(jax.random.key(3), 16))
  for problem in problems:
    row = {
        "workload": workload.name,
        "problem": problem.name,
        "kind": problem.kind,
        "phases": list(workload.phases),
        "fwd_flops": problem.fwd_flops,
        "methods": {},
    }
    results.append(row)
    if deadline is not None and time.perf_counter() > deadline:
      row["skipped"] = "not started: the run was past its time budget"
      print(f"  {workload.name} {problem.name}: {row['skipped']}", flush=True)
      on_row()
      continue
    try:
      rows, cot, operand = _timed_inputs(problem, cfg, keys, dtype)
      methods = gpu_workloads.methods_for(
          problem.kind, bes, cfg, workload.methods, workload.skipped
      )
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = gpu_report.error_text(e)
      traceback.print_exc()
      on_row()
      continue
    # One GEMM, or the whole expert FFN (three GEMMs and the activation).
    # A quantised GEMM against the reference's product of the same
    # quantised operands: as a bf16 GEMM, only the order of the float32
    # sums and the bf16 output's rounding differ.
    tol = (
        gpu_tolerances.BF16
        if problem.kind == "gemm"
        else gpu_tolerances.BF16_DEEP
    )
    oracle = _Oracles(problem.kind, cfg, rows, operand, cot, sizes)
    for method, fn in methods.items():
      if isinstance(fn, gpu_workloads.Skip):  # Unavailable here: why.
        row["methods"][method] = {"skipped": fn.reason}
        print(
            f"  {workload.name} {problem.name} {method}: skipped, {fn.reason}"
        )
        on_row()
        continue
      dense = method == "dense"  # Not a grouped product: nothing to check.
      entry = _time_method(
          fn,
          (
              rows,
              gemm_workloads.one_expert(operand) if dense else operand,
              group_sizes,
          ),
          cot,
          repeats,
          problem.fwd_flops,
          None if dense else oracle.of(gpu_workloads.method_recipe(method)),
          tol,
          workload.phases,
      )
      if oracle.error:
        row["check_error"] = oracle.error
      row["methods"][method] = entry
      print(
          f"  {workload.name} {problem.name} {method}: {_summary(entry)}",
          flush=True,
      )
      on_row()
    add_ratios(row)
    del rows, cot, operand, oracle
    on_row()
  return m, sizes, results


def _routed_oracle(cfg, tokens, weights, cot, sizes):
  """_Oracle of the routed experts on `gpu_workloads.fixed_routing(sizes)`.

  On the first, middle and last token, y[t] = sum_k w[t, k] *
  ffn_{e[t, k]}(x[t]) and its d x[t]; on the sampled experts
  (`_sample_groups`), d weights: their FFN over the copies routed to them,
  each copy's cotangent times its combine weight. In float32 from the same
  bf16 inputs, one expert at a time with a plain jnp.dot; the cotangent
  rounded to the output's dtype, as the timed programs see it.
  """
  num_tokens = tokens.shape[0]
  aux = gpu_workloads.fixed_routing(jnp.asarray(sizes), num_tokens, cfg)
  ids = np.asarray(aux.expert_ids)
  combine = np.asarray(aux.combine_weights)
  expert = jax.jit(
      functools.partial(
          gpu_workloads.output_and_grads, _group_oracle("ffn", cfg.activation)
      )
  )
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  cot = f32(cot.astype(tokens.dtype))

  def weights_of(e):
    return jax.tree.map(lambda a: f32(a[e]), weights)

  compared = []
  sampled_tokens = sorted({0, num_tokens // 2, num_tokens - 1})
  for t in sampled_tokens:
    y, d_x = 0.0, 0.0
    for k in range(cfg.top_k):
      w = float(combine[t, k])
      out, d_copy, _ = expert(
          f32(tokens[t : t + 1]), weights_of(int(ids[t, k])), w * cot[t : t + 1]
      )
      y, d_x = y + w * out, d_x + d_copy
    rows = functools.partial(_rows, t, t + 1)
    compared += [_Compared("out", rows, y), _Compared("d_rows", rows, d_x)]
  groups = _sample_groups(sizes)
  for g in groups:
    copies = np.flatnonzero(ids.reshape(-1) == g)
    who = copies // cfg.top_k
    scale = f32(combine.reshape(-1)[copies])[:, None]
    _, _, want_dw = expert(f32(tokens[who]), weights_of(g), scale * cot[who])
    compared.append(
        _Compared("d_weights", functools.partial(_expert, g), want_dw)
    )
  return _Oracle(compared, {"groups": groups, "tokens": sampled_tokens})


class _Oracles:
  """The `_Oracle` of one problem, per recipe, computed when first asked.

  A recipe whose oracle raised gives one with nothing to compare (every
  method's check then fails, saying why) and leaves the error in `error`
  (the row's check_error).
  """

  def __init__(self, kind, cfg, rows, weights, cot, sizes):
    self._kind = kind
    self._args = (cfg, rows, weights, cot, sizes)
    self._found = {}
    self.error = None

  def _oracle(self, recipe):
    cfg, rows, weights, cot, sizes = self._args
    if self._kind == "routed":
      return _routed_oracle(cfg, rows, weights, cot, sizes)
    found = _oracle_values(
        self._kind, cfg.activation, rows, weights, cot, sizes, recipe=recipe
    )
    return _group_comparisons(found)

  def of(self, recipe):
    if recipe not in self._found:
      try:
        self._found[recipe] = self._oracle(recipe)
      except Exception as e:  # pylint: disable=broad-except
        self._found[recipe] = _Oracle([], {})
        self.error = f"{recipe}: {gpu_report.error_text(e)}"
        traceback.print_exc()
    return self._found[recipe]


def _summary(entry):
  parts = [
      f"{k} {1e3 * entry[k + '_s']:.3f} ms (first call "
      f"{entry[k + '_first_call_s']:.1f} s)"
      for k in PHASES
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


def add_ratios(row):
  """Each method's time over each baseline's (`BASELINES`), per phase.

  `timing.ratio_key` names them ("fwd_time_over_dense": < 1 is faster than
  dense); a ratio is None where either time is missing (that method failed,
  or the problem has no such baseline).
  """
  methods = row["methods"]
  for base in BASELINES:
    base_entry = methods.get(base, {})
    for entry in methods.values():
      for phase in PHASES:
        entry[timing.ratio_key(phase, base)] = timing.time_over(
            entry.get(f"{phase}_s"), base_entry.get(f"{phase}_s")
        )


def is_hopper(device_kind) -> bool:
  """Whether a jax device_kind ("NVIDIA H200", ...) names a Hopper GPU."""
  return bool(device_kind) and bool(_HOPPER.search(str(device_kind)))


def _precision_goals(row, hopper):
  """The recipes' entries of one row: FP8 targets, emulated costs."""
  out = []
  for method in FP8_METHODS:
    entry = row["methods"].get(method)
    if entry is None:
      continue
    ratio = entry.get(timing.ratio_key("fwd", "pallas"))
    value = None if not ratio else 1.0 / ratio
    out.append(
        {
            "goal": "fwd throughput / bf16 pallas fwd throughput on Hopper",
            "workload": row.get("workload"),
            "problem": row["problem"],
            "method": method,
            "value": value,
            "target": f">= {FP8_THROUGHPUT_OVER_BF16} (Hopper only)",
            # Elsewhere (the CPU's dry run, another GPU) only reported.
            "met": None
            if value is None or not hopper
            else bool(value >= FP8_THROUGHPUT_OVER_BF16),
        }
    )
  for method in EMULATED_METHODS:
    entry = row["methods"].get(method)
    if entry is None:
      continue
    out.append(
        {
            "goal": "emulated: cost vs bf16 (fwd time / bf16 pallas fwd "
            "time)",
            "workload": row.get("workload"),
            "problem": row["problem"],
            "method": method,
            "value": entry.get(timing.ratio_key("fwd", "pallas")),
            "target": None,
            "met": None,
        }
    )
  return out


def _goal(row, method, goal, value, target, met):
  return {
      "goal": goal,
      "workload": row.get("workload"),
      "problem": row["problem"],
      "method": method,
      "value": value,
      "target": target,
      "met": met,
  }


def _triton_goals(row):
  """triton's entries of one row: throughput over dense, fusions' gains.

  Where the row has a dense method: the forward's, dX's and dW's
  throughput over dense's (the phases the row timed). On the expert FFN:
  the fused activation's time over the unfused one's, per phase (target
  < 1). On the routed experts: the fused routing weights' time over the
  fused activation alone's, per phase (reported).
  """
  methods = row["methods"]
  out = []
  if "dense" in methods:
    for method in TRITON_DENSE_METHODS:
      entry = methods.get(method)
      if entry is None:
        continue
      for phase, label in (("fwd", "fwd"), ("dx", "dX"), ("dw", "dW")):
        if phase not in row.get("phases", timing.PHASES):
          continue
        ratio = entry.get(timing.ratio_key(phase, "dense"))
        value = None if not ratio else 1.0 / ratio
        target = TRITON_THROUGHPUT_OVER_DENSE
        out.append(
            _goal(
                row,
                method,
                f"{label} throughput / dense cuBLAS bf16 {label} throughput",
                value,
                f">= {target}",
                None if value is None else bool(value >= target),
            )
        )
  pairs = {
      "ffn": ("triton_fused_act", "triton", "fused activation", "< 1"),
      "routed": (
          "triton_fused_routing",
          "triton_fused_act",
          "fused routing weights",
          None,
      ),
  }
  if row.get("kind") in pairs:
    fused, plain, label, target = pairs[row["kind"]]
    if fused in methods and plain in methods:
      for phase in timing.PHASES:
        value = timing.time_over(
            methods[fused].get(f"{phase}_s"), methods[plain].get(f"{phase}_s")
        )
        met = None if value is None or target is None else bool(value < 1)
        out.append(
            _goal(
                row,
                fused,
                f"{label}: {phase} time / {plain} {phase} time",
                value,
                target,
                met,
            )
        )
  return out


def goals(results, device_kind=None):
  """The targets, read off the timing rows: [{goal, ..., met}].

  On every row, each mosaic_gpu method's forward throughput over dense
  cuBLAS's (1 / fwd_time_over_dense; target >= 0.6); on the small-K
  workloads', mosaic_gpu's forward time over pallas' (target < 1). triton
  (`_triton_goals`): its forward, dX and dW throughput over dense cuBLAS's
  (target >= 0.6), its fused-activation FFN's time over its unfused one's
  (target < 1) and its fused routing weights' time over the fused
  activation alone's (reported). Where a row times the recipes:
  fp8_tensor's and fp8_block's pallas forward throughput over the bf16
  pallas forward's (target >= 1.5, judged only when `device_kind` is a
  Hopper GPU's), and mxfp8's and nvfp4's forward time over bf16's
  (reported: target None). met is None where a time is missing or nothing
  is judged. Targets, not checks: a miss is no failure.
  """
  out = []
  hopper = is_hopper(device_kind)
  for row in results:
    for method in gpu_workloads.MOSAIC_METHODS:
      entry = row["methods"].get(method)
      if entry is None or "fwd" not in row.get("phases", timing.PHASES):
        continue
      ratio = entry.get(timing.ratio_key("fwd", "dense"))
      value = None if not ratio else 1.0 / ratio
      out.append(
          {
              "goal": "fwd throughput / dense cuBLAS bf16 throughput",
              "workload": row.get("workload"),
              "problem": row["problem"],
              "method": method,
              "value": value,
              "target": f">= {FWD_THROUGHPUT_OVER_DENSE}",
              "met": None
              if value is None
              else bool(value >= FWD_THROUGHPUT_OVER_DENSE),
          }
      )
      if "small_k" in (row.get("workload") or ""):
        value = entry.get(timing.ratio_key("fwd", "pallas"))
        out.append(
            {
                "goal": "fwd time / pallas (Pallas Triton) fwd time at small K",
                "workload": row.get("workload"),
                "problem": row["problem"],
                "method": method,
                "value": value,
                "target": "< 1",
                "met": None if value is None else bool(value < 1),
            }
        )
    out.extend(_triton_goals(row))
    out.extend(_precision_goals(row, hopper))
  return out


def print_goals(found):
  for g in found:
    value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
    if g["target"] is None:
      print(
          f"report {g['workload']} {g['problem']} {g['method']}: "
          f"{g['goal']} = {value}"
      )
      continue
    met = {None: "UNKNOWN", True: "met", False: "MISSED"}[g["met"]]
    print(
        f"goal {g['workload']} {g['problem']} {g['method']}: {g['goal']} = "
        f"{value} (target {g['target']}): {met}"
    )


# Per phase: its time, TFLOP/s and time over each baseline.
_BASELINE_HEADERS = {
    "dense": "time/dense",
    "ragged_dot": "time/ragged",
    "pallas": "time/pallas",
}


def _phase_columns(label):
  return (
      text_table.Column(f"{label} ms", 8, ".3f"),
      text_table.Column("TFLOP/s", 7, ".1f"),
      *(text_table.Column(_BASELINE_HEADERS[b], 11, ".2f") for b in BASELINES),
  )


# The table's two phases: a row that times dX and dW alone goes in a
# second table with these in place of the forward and forward+backward.
_TABLES = (
    (timing.PHASES, ("fwd", "f+b")),
    (gpu_workloads.GRAD_PHASES, ("dX", "dW")),
)


def _columns(labels):
  return (
      text_table.Column("workload", 12, align="<"),
      text_table.Column("problem", 24, align="<"),
      text_table.Column("method", 20, align="<"),
      *(c for label in labels for c in _phase_columns(label)),
      text_table.Column("max err", 8, ".1e"),
  )


def _table_values(workload, problem, method, entry, phases):
  values = [workload, problem, method]
  for phase in phases:
    seconds = entry.get(f"{phase}_s")
    values += [
        None if seconds is None else 1e3 * seconds,
        entry.get(f"{phase}_tflops"),
        *(entry.get(timing.ratio_key(phase, base)) for base in BASELINES),
    ]
  return values + [entry.get("max_rel_err")]


def _table_of(row):
  """Which of `_TABLES` a row goes in: the one holding its phases."""
  timed = set(row.get("phases", timing.PHASES))
  for phases, labels in _TABLES:
    if timed <= set(phases):
      return phases, labels
  return _TABLES[0]


def print_timing(results):
  """The timing tables, one line per problem and method, and the legend."""
  for phases, labels in _TABLES:
    rows = [r for r in results if _table_of(r)[0] == phases]
    if not rows and phases != timing.PHASES:
      continue
    columns = _columns(labels)
    print(text_table.heading(columns))
    for row in rows:
      workload = row.get("workload", "")
      if "skipped" in row:
        print(f"{workload:<12} {row['problem']:<24} SKIPPED: {row['skipped']}")
      if "error" in row:
        print(
            f"{workload:<12} {row['problem']:<24} FAILED: {row['error'][:100]}"
        )
      for method, e in row["methods"].items():
        line = text_table.row(
            columns, _table_values(workload, row["problem"], method, e, phases)
        )
        if not e.get("check", {"ok": True})["ok"]:
          line += "  CHECK FAILED"
        if "error" in e:
          line += f"  FAILED {e['error'][:80]}"
        if "skipped" in e:
          line += f"  SKIPPED {e['skipped'][:80]}"
        print(line)
  print(
      "'time/dense', 'time/ragged', 'time/pallas': the method's time / the "
      "time of a dense jnp.dot of the same FLOPs, of ragged_dot, of pallas, "
      "in this run (< 1 is faster); 'dX', 'dW': one half of the backward "
      "alone; 'max err': of the timed output and gradients on sampled "
      "groups (routed experts: tokens) vs float32 jnp.dot (a recipe's "
      "output: vs the reference's product of the same quantised group)."
  )
