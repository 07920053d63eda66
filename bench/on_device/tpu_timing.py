"""tpu_check's phases on the chip: the tile sweep and the timing.

Both run in one child process of tpu_check (it alone holds the chip) and
write the report after every measurement. sweep: per workload shape and
pass, each candidate tile of mosaic_tpu and megablox compiled (one that
fails is recorded with its error's first line) and timed at even and Zipf
routing; the best per (shape, routing, pass). timing: the grouped GEMM's
passes for every method side by side, then the MoE layer's
forward+backward against the dense SwiGLU FFN of the same FLOPs. Times are
`timing.sample_seconds` (median after a warm-up, each sample a
batch of back-to-back calls, `timing.PIPELINED_S`); ratios are
`timing.ratio_key` times over a baseline's (< 1 is faster). Over 400
lines because it is the one module of what runs on the chip.
"""

from __future__ import annotations

import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from bench.harness import json_report
from bench.harness import timing
from bench.micro import gemm_methods
from bench.micro import layer_bench
from bench.workloads import programs as programs_lib

GEMM_BASELINES = ("dense", "ragged_dot", "megablox")
LAYER_BASELINES = (
    "dense_ffn",
    "xla",
    "megablox",
    f"{gemm_methods.OURS}@uniform",
)
# (workload pattern, variant, mode, baseline, largest time / baseline, says)
GOALS = (
    ("*", "mosaic_tpu", "fwd_bwd", "dense_ffn", 1.25, "layer <= 1.25x dense"),
    ("*/*", "mosaic_tpu*", "*", "megablox", 1.0, "as fast as megablox"),
    (
        "*",
        "mosaic_tpu@zipf",
        "fwd_bwd",
        "mosaic_tpu@uniform",
        1.2,
        "Zipf routing <= 1.2x uniform",
    ),
)
# A measurement stops timing calls after this many seconds (one at least).
MEASURE_S = 1.0
# The sweep's share of time per (impl, shape, pass): ours has the longer
# list worth trying; megablox's best is known within a step or two.
SWEEP_WEIGHTS = {gemm_methods.OURS: 2.0, "megablox": 1.0}


def error_line(e: BaseException) -> str:
  """The type and the first non-empty line of an error's message."""
  lines = [l for l in str(e).splitlines() if l.strip()]
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _time(compiled, args, repeats) -> dict:
  seconds, calls, first, _ = timing.sample_seconds(
      compiled, args, repeats, MEASURE_S, pipelined_s=timing.PIPELINED_S
  )
  return {"seconds": seconds, "calls": calls, "first_call_s": first}


class Context:
  """What a phase needs: the report, how to write it, its deadline (a
  time.time()), the shapes, and the run's settings."""

  def __init__(self, report, write, deadline, args):
    self.report, self.write, self.deadline = report, write, deadline
    self.dry = args.dry_run
    self.quick = args.quick
    self.repeats = 1 if args.dry_run else (3 if args.quick else args.repeats)
    # Ranking tiles needs fewer calls than a reported time.
    self.sweep_repeats = min(self.repeats, 5)
    wanted = set(args.shapes.split(",")) if args.shapes else None
    pick = lambda items: tuple(
        i for i in items if wanted is None or i.name.split("_")[0] in wanted
    )
    self.gemms = (
        gemm_methods.DRY_GEMMS if self.dry else pick(gemm_methods.GEMMS)
    )
    # --quick times the up projections only (the sweep still tries both).
    self.timed_gemms = tuple(
        g for g in self.gemms if not (self.quick and g.name.endswith("_down"))
    )
    self.layers = (
        gemm_methods.DRY_LAYERS if self.dry else pick(gemm_methods.LAYERS)
    )
    self.sweep_impls = [i for i in args.sweep_impls.split(",") if i]
    # name -> mosaic_tpu's `tiles` option (a TileConfig dict).
    self.layer_tiles = json.loads(args.layer_tiles or "{}")
    self.layer_variants = args.layer_variants.split(",")
    self.layer_routings = [r for r in args.layer_routings.split(",") if r]
    self.timing_parts = args.timing_parts.split(",")
    self.profile_dir = (
        os.path.join(args.out_dir, "profile") if args.profile else None
    )

  def left(self) -> float:
    return self.deadline - time.time()


# --- sweep -------------------------------------------------------------------


def sweep_phase(ctx: Context) -> None:
  """Times every candidate tile; records the best per shape, routing, pass."""
  sec = ctx.report.setdefault(
      "sweep", {"rows": [], "best": [], "candidates_from": {}, "skipped": {}}
  )
  impls = [i for i in ctx.sweep_impls if i in SWEEP_WEIGHTS]
  missing = gemm_methods.our_status(interpret=ctx.dry)
  if missing and gemm_methods.OURS in impls:
    print(f"sweep: skipping {gemm_methods.OURS}: {missing}")
    sec["skipped"][gemm_methods.OURS] = missing
    impls.remove(gemm_methods.OURS)
  units = [
      (i, g, p) for g in ctx.gemms for p in gemm_methods.PASSES for i in impls
  ]
  arrays = {}
  for done, (impl, gemm, pass_) in enumerate(units):
    if ctx.left() <= 0:
      sec["skipped"]["units"] = [
          f"{i} {g.name} {p}" for i, g, p in units[done:]
      ]
      break
    if gemm.name not in arrays:
      arrays.clear()  # One shape's arrays on the chip at a time.
      arrays[gemm.name] = _gemm_arrays(gemm)
    weights = sum(SWEEP_WEIGHTS[u[0]] for u in units[done:])
    share = time.time() + ctx.left() * SWEEP_WEIGHTS[impl] / weights
    _sweep_unit(ctx, sec, impl, gemm, pass_, arrays[gemm.name], share)
    sec["best"] = best_tiles(sec["rows"])
    ctx.write()


def _gemm_arrays(gemm):
  x, w, dy = gemm_methods.inputs(gemm, jax.random.key(0))
  sizes = {r: gemm_methods.group_sizes(r, gemm) for r in gemm_methods.ROUTINGS}
  return x, w, dy, sizes


def _sweep_unit(ctx, sec, impl, gemm, pass_, arrays, share_deadline):
  x, w, dy, sizes = arrays
  if impl == gemm_methods.OURS:
    cands, source = gemm_methods.our_candidates(gemm, pass_, ctx.dry)
  else:
    cands = gemm_methods.megablox_candidates(gemm, pass_, ctx.dry)
    source = "gemm_methods.megablox_candidates"
  sec["candidates_from"][impl] = source
  if ctx.quick:
    cands = cands[:4]
  timed = 0
  for n, tile in enumerate(cands):
    if n and (timed or ctx.left() <= 0) and time.time() > share_deadline:
      sec["rows"].append(
          {
              "impl": impl,
              "shape": gemm.name,
              "pass": pass_,
              "untried": len(cands) - n,
          }
      )
      return
    row = {
        "impl": impl,
        "shape": gemm.name,
        "pass": pass_,
        "tile": _plain(tile),
    }
    sec["rows"].append(row)
    try:
      if impl == gemm_methods.OURS:
        backend = gemm_methods.our_backend({pass_: tile}, interpret=ctx.dry)
        fn = gemm_methods.backend_passes(backend)[pass_]
      else:
        fn = gemm_methods.megablox_passes({pass_: tile}, interpret=ctx.dry)[
            pass_
        ]
      start = time.perf_counter()
      compiled = jax.jit(fn).lower(x, w, sizes["even"], dy).compile()
      row["compile_s"] = round(time.perf_counter() - start, 2)
      for routing, gs in sizes.items():
        t = _time(compiled, (x, w, gs, dy), ctx.sweep_repeats)
        row[routing] = {**t, "tflops": gemm.flops() / t["seconds"] / 1e12}
      timed += 1
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = error_line(e)
      row["vmem"] = "vmem" in str(e).lower()
    print(
        f"sweep {impl} {gemm.name} {pass_} {tile}: "
        f"{row.get('error') or {r: round(row[r]['tflops'], 1) for r in sizes}}"
    )
    ctx.write()


def _plain(tile):
  """A tile for the JSON: mosaic_tpu's field dict, megablox's list."""
  return dict(tile) if isinstance(tile, dict) else list(tile)


def best_tiles(rows) -> list[dict]:
  """The fastest tile per (impl, shape, routing, pass); "all" routings: the
  tile of the least summed time over the routings (what timing uses)."""
  best = {}
  for r in rows:
    if "tile" not in r or "error" in r:
      continue
    times = {k: r[k]["seconds"] for k in gemm_methods.ROUTINGS if k in r}
    if len(times) == len(gemm_methods.ROUTINGS):
      times["all"] = sum(times.values())
    for routing, seconds in times.items():
      key = (r["impl"], r["shape"], routing, r["pass"])
      if key not in best or seconds < best[key]["seconds"]:
        tflops = r[routing]["tflops"] if routing in r else None
        best[key] = {
            "impl": r["impl"],
            "shape": r["shape"],
            "routing": routing,
            "pass": r["pass"],
            "tile": r["tile"],
            "seconds": seconds,
            "tflops": tflops,
        }
  return list(best.values())


def swept_tiles(report, impl: str, shape: str) -> dict:
  """pass -> the sweep's best tile over both routings ({} if none)."""
  return {
      b["pass"]: b["tile"] if isinstance(b["tile"], dict) else tuple(b["tile"])
      for b in report.get("sweep", {}).get("best", [])
      if (b["impl"], b["shape"], b["routing"]) == (impl, shape, "all")
  }


# --- timing ------------------------------------------------------------------


def timing_phase(ctx: Context) -> None:
  """The GEMMs' passes, then the layers (the layers keep >= 40% of the
  time), then the profile if asked."""
  rows = ctx.report.setdefault("gemm", [])
  layer_rows = ctx.report.setdefault("layer", [])
  end = ctx.deadline
  ctx.deadline = time.time() + 0.6 * ctx.left()
  gemms = ctx.timed_gemms if "gemm" in ctx.timing_parts else ()
  layers = ctx.layers if "layer" in ctx.timing_parts else ()
  if not layers:
    ctx.deadline = end
  for gemm in gemms:
    if ctx.left() <= 0:
      rows.append({"workload": gemm.name, "skipped": "past the deadline"})
      continue
    _time_gemm(ctx, gemm, rows)
  ctx.deadline = end
  for layer in layers:
    if ctx.left() <= 0:
      layer_rows.append(
          {"workload": layer.name, "skipped": "past the deadline"}
      )
      continue
    _time_layer(ctx, layer, layer_rows)
  if ctx.profile_dir and ctx.layers:
    _profile(ctx, ctx.layers[:2])
  timed = [r for r in rows + layer_rows if r.get("seconds") is not None]
  ctx.report["goals"] = timing.goals(timed, GOALS)
  ctx.write()


def _gemm_methods(ctx, gemm):
  """[(variant, pass -> fn, tiles or None)] of one shape; a method that
  cannot be built is (variant, error, None)."""
  out = [("dense", gemm_methods.dense_passes(), None)]
  out.append(("ragged_dot", gemm_methods.ragged_dot_passes(), None))
  try:
    out.append(
        ("xla", gemm_methods.backend_passes(moe_core.get_backend("xla")), None)
    )
  except Exception as e:  # pylint: disable=broad-except
    out.append(("xla", error_line(e), None))
  tiles = swept_tiles(ctx.report, "megablox", gemm.name)
  fixed = gemm_methods.MegabloxBackend(interpret=ctx.dry)
  for p in gemm_methods.PASSES:
    tiles.setdefault(p, fixed.tiling(*gemm.pass_dims(p)[1:]))
  out.append(("megablox", gemm_methods.megablox_passes(tiles, ctx.dry), tiles))
  missing = gemm_methods.our_status(interpret=ctx.dry)
  if missing:
    out.append((gemm_methods.OURS, missing, None))
    return out
  out.append(
      (
          gemm_methods.OURS,
          gemm_methods.backend_passes(
              gemm_methods.our_backend(interpret=ctx.dry)
          ),
          None,
      )
  )
  ours = swept_tiles(ctx.report, gemm_methods.OURS, gemm.name)
  if ours:
    backend = gemm_methods.our_backend(ours, interpret=ctx.dry)
    out.append(
        (
            f"{gemm_methods.OURS}_swept",
            gemm_methods.backend_passes(backend),
            ours,
        )
    )
  return out


def _time_gemm(ctx, gemm, rows):
  x, w, dy, sizes = _gemm_arrays(gemm)
  w_dense = w[0]
  for variant, passes, tiles in _gemm_methods(ctx, gemm):
    for pass_ in gemm_methods.PASSES:
      base = {"variant": variant, "mode": pass_, "shape": gemm.name}
      if tiles:
        base["tile"] = _plain(tiles[pass_]) if pass_ in tiles else None
      new = [dict(base, workload=f"{gemm.name}/{r}", routing=r) for r in sizes]
      rows.extend(new)
      if isinstance(passes, str):  # The method could not be built.
        for row in new:
          row["skipped" if "missing" in passes else "error"] = passes
        continue
      if ctx.left() <= 0:
        for row in new:
          row["skipped"] = "past the deadline"
        continue
      weights = w_dense if variant == "dense" else w
      try:
        compiled = (
            jax.jit(passes[pass_])
            .lower(x, weights, sizes["even"], dy)
            .compile()
        )
        for row in new:
          if variant == "dense" and row is not new[0]:
            row.update({k: new[0][k] for k in ("seconds", "calls")})
            row["routing_independent"] = True
          else:
            row.update(
                _time(
                    compiled,
                    (x, weights, sizes[row["routing"]], dy),
                    ctx.repeats,
                )
            )
          row["tflops"] = gemm.flops() / row["seconds"] / 1e12
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        for row in new:
          row["error"] = error_line(e)
      for row in new:
        print(
            f"gemm {row['workload']} {variant} {pass_}: "
            f"{row.get('error') or round(row['tflops'], 1)}"
        )
      timing.add_ratios(rows, GEMM_BASELINES)
      ctx.write()


def _layer_methods(ctx):
  missing = gemm_methods.our_status(interpret=ctx.dry)
  out = []
  if "xla" in ctx.layer_variants:
    out.append(("xla", moe_core.get_backend("xla")))
  if gemm_methods.OURS in ctx.layer_variants:
    out.append(
        (
            gemm_methods.OURS,
            missing or gemm_methods.our_backend(interpret=ctx.dry),
        )
    )
  # --layer_tiles: mosaic_tpu again at each named TileConfig.
  for name, tiles in ctx.layer_tiles.items():
    options = {"tiles": tiles, **({"interpret": True} if ctx.dry else {})}
    out.append(
        (
            f"{gemm_methods.OURS}:{name}",
            missing or moe_core.get_backend(gemm_methods.OURS, **options),
        )
    )
  if "megablox" in ctx.layer_variants:
    out.append(("megablox", gemm_methods.MegabloxBackend(interpret=ctx.dry)))
  # --layer_routings: mosaic_tpu again with each token's experts drawn.
  for routing in ctx.layer_routings:
    out.append(
        (
            f"{gemm_methods.OURS}@{routing}",
            missing or gemm_methods.our_backend(interpret=ctx.dry),
        )
    )
  return out


def _time_layer(ctx, layer, rows):
  key = jax.random.key(1)
  kx, kp, kd, kc = jax.random.split(key, 4)
  x = jax.random.normal(kx, (layer.tokens, layer.hidden), jnp.bfloat16)
  cot = jax.random.normal(kc, x.shape, jnp.float32)
  cfg = layer.config()
  methods = [("dense_ffn", None)] + _layer_methods(ctx)
  for variant, backend in methods:
    row = {"workload": layer.name, "variant": variant, "mode": "fwd_bwd"}
    rows.append(row)
    if isinstance(backend, str):
      row["skipped"] = backend
      continue
    if ctx.left() <= 0:
      row["skipped"] = "past the deadline"
      continue
    try:
      if backend is None:
        fn, params = layer_bench.dense_ffn, gemm_methods.dense_ffn_params(
            layer, kd
        )
      else:
        fn = _layer_fn(layer, variant, backend, row)
        params = moe_core.init_params(kp, cfg, dtype=jnp.bfloat16)
      step = jax.jit(programs_lib.with_grad(fn))
      start = time.perf_counter()
      compiled = step.lower(params, x, cot).compile()
      row["compile_s"] = round(time.perf_counter() - start, 2)
      row.update(_time(compiled, (params, x, cot), ctx.repeats))
      row["tflops"] = layer.flops() / row["seconds"] / 1e12
      del params
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      row["error"] = error_line(e)
    print(
        f"layer {layer.name} {variant}: "
        f"{row.get('error') or row.get('seconds')}"
    )
    timing.add_ratios(rows, LAYER_BASELINES)
    ctx.write()


def _layer_fn(layer, variant, backend, row):
  """The layer's f(params, x) for a variant: "<name>@<routing>" with the
  experts drawn by `gemm_methods.layer_expert_ids` (the largest group's share
  of the copies into `row`), otherwise the router's own choice."""
  if "@" not in variant:
    return gemm_methods.moe_fn(layer, backend)
  ids = gemm_methods.layer_expert_ids(layer, variant.split("@")[1])
  counts = np.bincount(ids.ravel(), minlength=layer.experts)
  row["largest_group_share"] = round(float(counts.max() / ids.size), 4)
  return gemm_methods.moe_fn_with_ids(layer, backend, ids)


def _profile(ctx, layers) -> None:
  """A jax.profiler trace of one forward+backward of each of `layers` on
  mosaic_tpu (xla where it is missing) into <out_dir>/profile, with a
  Perfetto trace (perfetto_trace.json.gz) beside the XPlane one."""
  entry = ctx.report.setdefault("profile", {"dir": ctx.profile_dir})
  try:
    missing = gemm_methods.our_status(interpret=ctx.dry)
    backend = (
        moe_core.get_backend("xla")
        if missing
        else gemm_methods.our_backend(interpret=ctx.dry)
    )
    entry["backend"] = backend.name
    entry["layers"] = [layer.name for layer in layers]
    steps = []
    for layer in layers:
      cfg = layer.config()
      kx, kp, kc = jax.random.split(jax.random.key(2), 3)
      x = jax.random.normal(kx, (layer.tokens, layer.hidden), jnp.bfloat16)
      args = (
          moe_core.init_params(kp, cfg, dtype=jnp.bfloat16),
          x,
          jax.random.normal(kc, x.shape, jnp.float32),
      )
      step = jax.jit(
          programs_lib.with_grad(gemm_methods.moe_fn(layer, backend))
      )
      jax.block_until_ready(step(*args))  # Compiled outside the trace.
      steps.append((step, args))
    with jax.profiler.trace(ctx.profile_dir, create_perfetto_trace=True):
      for step, args in steps:
        jax.block_until_ready(step(*args))
    entry["bytes"] = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(ctx.profile_dir)
        for f in files
    )
  except Exception as e:  # pylint: disable=broad-except
    entry["error"] = json_report.error_text(e)
  ctx.write()
