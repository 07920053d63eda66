"""tokamax's tuned TPU table, run side by side with mosaic_tpu.

tokamax ships the ragged_dot timings it tuned on a TPU v5e
(`tokamax/data/autotuning/tpu_v5_lite/pallas_mosaic_tpu_ragged_dot.json`):
each entry is one call (operand shapes, its skewed group sizes, the pass:
forward, dlhs = dX, drhs = dW) with the tiles that won and their median
time. For every bf16 entry this runs, in one process on the chip and on the
entry's own group sizes:

  tokamax   its `ragged_dot_general` (implementation "mosaic") with the
            entry's stored config passed explicitly, or its heuristics for
            an entry stored without one;
  ours      mosaic_tpu through the backend API (`grouped_gemm`, its dW
            through the VJP) at the generation's tile table;
  raw       mosaic_tpu's kernels alone (`kernels.gmm` / `kernels.tgmm`) at
            the table's tiles, tokamax's stored tiles and a few neighbours;

and reports each in TF/s of useful work with the ratios to tokamax's time
here and to its stored time. Each time is the chip's per call: a sample is
a batch of back-to-back calls (`--pipelined_s`), as tokamax's table was
measured with a profiler; a call waited for on its own adds the host's
dispatch and wait, up to 0.7 ms on a 0.8 ms entry.

Why tokamax misses its own table when called plainly: its cache key holds
the group sizes' representative values (a `tokamax.RaggedDotGroupSizes`),
so a call with a plain array of sizes, as any model makes, never matches a
stored entry; the fallback is its heuristic LUT, which has none of these
shapes, so it runs 128 x 128 x 128 tiles. Passing the config (or the
representative sizes) is how a user gets the table's speed.

  python -m bench.micro.tokamax_compare --out=/tmp/tokamax_compare.json
  python -m bench.micro.tokamax_compare --dry_run  # CPU, interpreted, tiny

tokamax and its dependencies are the bench's optional requirements
(`bench/requirements-tokamax.txt`), not the library's; without them the
tokamax rows say so and the rest still runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from importlib import resources
import json
import os
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.mosaic_tpu import kernels
from backends.mosaic_tpu import tiling
from bench.harness import json_report
from bench.harness import timing
from train import platforms

TABLE_PATH = "data/autotuning/tpu_v5_lite/pallas_mosaic_tpu_ragged_dot.json"
# (dot dimension numbers, rhs group dimensions) of each pass, as tokamax's
# JSON writes them: ((lhs contracting, rhs contracting), (batch, batch)).
_PASS_OF_DIMS = {
    (((1,), (1,)), (0,)): "fwd",
    (((1,), (2,)), (0,)): "dlhs",
    (((0,), (0,)), ()): "drhs",
}
_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]$")
# Raw-kernel tiles tried besides the table's and tokamax's: (bm, bk, bn,
# chunk); bk None is the whole K for gmm.
# On the v5e (2026-12-07) K in 512-wide steps at 1024 x 1024 (tokamax's
# favourite) lost 7-50% to the table's whole K, 1024-row tgmm steps and
# unchunked 512-row tiles lost too (within 1% once); 1024-row tiles with
# the whole K won on the Mixtral shape: the one neighbour kept.
_NEIGHBOURS = {"gmm": ((1024, None, 1024, None),), "tgmm": ()}
# The table's row with finer rows, (bm, chunk) in place of its own: the
# waste at group boundaries is about half a chunk each (tokamax's v5e
# entries use 128- and 256-row tiles), against a step's fixed cost.
_FINER_ROWS = ((512, 128), (256, 128), (128, None))


@dataclasses.dataclass(frozen=True)
class Entry:
  """One bf16 entry of tokamax's table.

  Attributes:
    name: "<pass> <lhs> x <rhs>" (with "+res" when tokamax returned
      residuals, a forward whose output it keeps for its VJP).
    pass_: "fwd" (lhs [M, K] x rhs [G, K, N]), "dlhs" (lhs [M, N] x rhs
      [G, K, N] contracted over N: dX) or "drhs" (lhs [M, K], rhs [M, N]
      -> [G, K, N]: dW).
    lhs, rhs: operand shapes.
    group_sizes: the entry's G sizes.
    config: tokamax's stored config (tile_m, tile_k, tile_n, ...), or None.
    stored_ms: its stored median time, or None.
  """

  name: str
  pass_: str
  lhs: tuple[int, ...]
  rhs: tuple[int, ...]
  group_sizes: tuple[int, ...]
  config: dict | None
  stored_ms: float | None

  @property
  def flops(self) -> int:
    """Useful FLOPs: 2 * M * K * N."""
    if self.pass_ == "drhs":
      (m, k), (_, n) = self.lhs, self.rhs
    elif self.pass_ == "dlhs":
      (m, n), (_, k, _) = self.lhs, self.rhs
    else:
      (m, k), (_, _, n) = self.lhs, self.rhs
    return 2 * m * k * n


def _shape(text: str) -> tuple[str, tuple[int, ...]]:
  match = _SHAPE.match(text)
  if not match:
    raise ValueError(f"an operand spec like 'bf16[8,128]', got {text!r}.")
  return match.group(1), tuple(int(d) for d in match.group(2).split(",") if d)


def parse_table(table: dict) -> tuple[list[Entry], list[str]]:
  """(bf16 entries, why each other one is left out) of tokamax's JSON."""
  entries, left_out = [], []
  for key, stored in table.items():
    spec = json.loads(key)
    (lhs_dtype, lhs), (rhs_dtype, rhs) = _shape(spec["lhs"]), _shape(
        spec["rhs"]
    )
    dims = spec["ragged_dot_dimension_numbers"]
    pass_ = _PASS_OF_DIMS.get(
        (
            tuple(tuple(d) for d in dims["dot_dimension_numbers"][0]),
            tuple(dims["rhs_group_dimensions"]),
        )
    )
    name = f"{pass_} {spec['lhs']} x {spec['rhs']}"
    if spec.get("return_residuals"):
      name += " +res"
    if (lhs_dtype, rhs_dtype) != ("bf16", "bf16") or pass_ is None:
      left_out.append(f"{name}: not a bf16 fwd/dlhs/drhs call")
      continue
    if spec.get("activation") is not None:
      left_out.append(f"{name}: a fused activation")
      continue
    config, stored_ms = None, None
    if stored:  # {config JSON: {"evaluation_times_ms": [...], ...}}
      config_text, data = min(
          stored.items(),
          key=lambda kv: float(np.median(kv[1]["evaluation_times_ms"])),
      )
      config = json.loads(config_text)
      stored_ms = float(np.median(data["evaluation_times_ms"]))
    entries.append(
        Entry(
            name=name,
            pass_=pass_,
            lhs=lhs,
            rhs=rhs,
            group_sizes=tuple(int(g) for g in spec["group_sizes"]),
            config=config,
            stored_ms=stored_ms,
        )
    )
  return entries, left_out


def load_table() -> dict:
  """tokamax's v5e ragged_dot table; ImportError if tokamax is absent."""
  # files() imports the package: ImportError (ModuleNotFoundError) here.
  table = resources.files("tokamax").joinpath(TABLE_PATH)
  return json.loads(table.read_text())


# --- The methods: entry -> f(lhs, rhs, group_sizes) ---------------------------


def tokamax_fn(entry: Entry, interpret: bool = False):
  """tokamax's ragged_dot_general for the entry, its stored config passed."""
  # pylint: disable-next=g-import-not-at-top
  import tokamax
  # pylint: disable-next=g-import-not-at-top
  from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk_tpu

  options = {"interpret": interpret}
  if entry.config:
    options["config"] = tk_tpu.Config(**entry.config)
  op = tk_tpu.PallasMosaicTpuRaggedDot(**options)
  dims = {
      "fwd": tk_tpu.DEFAULT_RAGGED_DOT_DIM_NUMS,
      "dlhs": tk_tpu.DLHS_RAGGED_DOT_DIM_NUMS,
      "drhs": tk_tpu.DRHS_RAGGED_DOT_DIM_NUMS,
  }[entry.pass_]

  def fn(lhs, rhs, group_sizes):
    return tokamax.ragged_dot_general(
        lhs, rhs, group_sizes, dims, implementation=(op,)
    )

  return fn


def ours_api_fn(backend: moe_core.Backend, entry: Entry):
  """mosaic_tpu through `grouped_gemm` (dW: its VJP in the weights)."""
  if entry.pass_ == "drhs":
    groups, (_, k), (_, n) = len(entry.group_sizes), entry.lhs, entry.rhs

    def dw(lhs, rhs, group_sizes):
      w = jnp.zeros((groups, k, n), lhs.dtype)
      gemm = lambda w: backend.grouped_gemm(lhs, w, group_sizes)
      return jax.vjp(gemm, w)[1](rhs)[0]

    return dw
  transpose = entry.pass_ == "dlhs"
  return lambda lhs, rhs, gs: backend.grouped_gemm(
      lhs, rhs, gs, transpose_rhs=transpose
  )


def ours_raw_fn(
    entry: Entry, tiles: tiling.Tiles, launch: kernels.KernelLaunch
):
  """mosaic_tpu's kernel alone at `tiles`."""
  if entry.pass_ == "drhs":
    groups = len(entry.group_sizes)
    return lambda lhs, rhs, gs: kernels.tgmm(
        lhs, [rhs], gs, tiles=tiles, launch=launch, num_groups=groups
    )[0]
  transpose = entry.pass_ == "dlhs"
  return lambda lhs, rhs, gs: kernels.gmm(
      [lhs], [rhs], gs, tiles=tiles, launch=launch, transpose_rhs=transpose
  )[0]


def raw_call(entry: Entry) -> tiling.Call:
  """The kernel call of the entry, as the tile table sees it."""
  if entry.pass_ == "drhs":
    (m, k), (_, n) = entry.lhs, entry.rhs
    kind = "wgrad"
  elif entry.pass_ == "dlhs":
    (m, n), (_, k, _) = entry.lhs, entry.rhs
    # dX's kernel: [M, N] x [G, K, N]^T -> [M, K]: contracts N, writes K.
    k, n = n, k
    kind = "dgrad"
  else:
    (m, k), (_, _, n) = entry.lhs, entry.rhs
    kind = "fwd"
  return tiling.Call(kind, m, k, n, len(entry.group_sizes), 2, 2)


def raw_candidates(
    entry: Entry, generation: str
) -> list[tuple[str, tiling.Tiles]]:
  """[(label, tiles)]: the table's, tokamax's stored ones, neighbours;
  each fitted to the call (tiles of the caller: the shape only)."""
  call = raw_call(entry)
  found = [("table", tiling.choose(tiling.TileConfig(), call, generation))]
  wanted = []
  if entry.config:
    c = entry.config
    round_up = lambda v: max(tiling.LANE, -(-v // tiling.LANE) * tiling.LANE)
    bk = round_up(c["tile_k"])
    if call.kind != "wgrad" and bk >= call.k:
      bk = None
    wanted.append(
        ("tokamax", (round_up(c["tile_m"]), bk, round_up(c["tile_n"]), None))
    )
  kernel = "tgmm" if call.kind == "wgrad" else "gmm"
  wanted += [("neighbour", t) for t in _NEIGHBOURS[kernel]]
  table = found[0][1]
  wanted += [
      (f"rows{bm}x{chunk or bm}", (bm, table.bk, table.bn, chunk))
      for bm, chunk in _FINER_ROWS
      if bm <= table.bm
  ]
  for label, (bm, bk, bn, chunk) in wanted:
    tiles = tiling.choose(
        tiling.TileConfig(**{call.kind: tiling.Tiles(bm, bk, bn, chunk)}),
        call,
        generation,
    )
    if all(tiles != t for _, t in found):
      found.append((label, tiles))
  return found


# --- The run ------------------------------------------------------------------


def arrays(entry: Entry, key):
  """(lhs, rhs, group_sizes) on the default device, bf16 and int32."""
  k1, k2 = jax.random.split(key)
  lhs = jax.random.normal(k1, entry.lhs, jnp.bfloat16)
  rhs = jax.random.normal(k2, entry.rhs, jnp.bfloat16)
  scale = entry.rhs[-2] if entry.pass_ == "fwd" else entry.rhs[-1]
  if entry.pass_ != "drhs":
    rhs = rhs * jnp.asarray(scale**-0.5, jnp.bfloat16)
  sizes = jnp.asarray(entry.group_sizes, jnp.int32)
  return lhs, rhs, sizes


@jax.jit
def _relative_max_diff(out, reference):
  """max |out - reference| / max |reference|, in one fused pass: an entry's
  output is up to 3.5 GB in bf16, and a float32 copy of it does not fit
  beside the operands."""
  diff = jnp.max(
      jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))
  )
  scale = jnp.max(jnp.abs(reference.astype(jnp.float32)))
  return diff / jnp.maximum(scale, 1e-30)


def _time(
    row: dict,
    fn,
    args,
    entry: Entry,
    repeats: int,
    reference,
    pipelined_s: float = 0.0,
):
  """Times fn on args into `row`; returns its output (None on error).

  With a `reference` output (tokamax's), also records the largest
  difference from it over the reference's largest magnitude: two
  independent kernels agreeing is the check that both computed the entry.
  """
  try:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    row["compile_s"] = round(time.perf_counter() - start, 2)
    timing.time_one(
        row, compiled, args, repeats, entry.flops, pipelined_s=pipelined_s
    )
    out = compiled(*args)
    if reference is not None:
      row["diff_over_tokamax_max"] = float(_relative_max_diff(out, reference))
    return out
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    row["error"] = json_report.error_text(e)
    return None


def dry_entries() -> list[Entry]:
  """Tiny entries, one per pass, for --dry_run on the CPU."""
  sizes = (96, 0, 160, 0)
  return [
      Entry(
          "fwd dry",
          "fwd",
          (256, 256),
          (4, 256, 384),
          sizes,
          {"tile_m": 128, "tile_k": 128, "tile_n": 128},
          None,
      ),
      Entry("dlhs dry", "dlhs", (256, 384), (4, 256, 384), sizes, None, None),
      Entry(
          "drhs dry",
          "drhs",
          (256, 256),
          (256, 384),
          sizes,
          {"tile_m": 128, "tile_k": 128, "tile_n": 128},
          None,
      ),
  ]


def run(args) -> dict:
  """Times every entry's methods; returns the report (also written)."""
  report = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      **json_report.versions(),
      "git_commit": os.environ.get("DROPLESS_COMMIT"),
      "tokamax": json_report._installed_version("tokamax"),  # pylint: disable=protected-access
      "dry_run": args.dry_run,
      "pipelined_s": args.pipelined_s,
      "rows": [],
      "left_out": [],
  }
  deadline = time.time() + args.deadline_s
  try:
    entries, left_out = parse_table(load_table())
    report["left_out"] = left_out
    tokamax_missing = None
  except ImportError as e:
    entries, tokamax_missing = [], (
        f"tokamax not installed ({e}); pip install -r "
        "bench/requirements-tokamax.txt"
    )
  if args.dry_run:
    entries = dry_entries()
  if args.entries:
    entries = [e for e in entries if re.search(args.entries, e.name)]
  generation = "v5e"
  launch = kernels.KernelLaunch(interpret=args.dry_run, generation=generation)
  backend = moe_core.get_backend(
      "mosaic_tpu", interpret=True if args.dry_run else None
  )
  repeats = 1 if args.dry_run else args.repeats

  def write():
    if args.out:
      json_report.write(args.out, report)

  for i, entry in enumerate(entries):
    args_i = arrays(entry, jax.random.key(i))
    base = {
        "entry": entry.name,
        "pass": entry.pass_,
        "groups": len(entry.group_sizes),
        "empty_groups": sum(1 for g in entry.group_sizes if g == 0),
        "stored_config": entry.config,
        "stored_ms": entry.stored_ms,
        "stored_tflops": (
            entry.flops / entry.stored_ms / 1e9 if entry.stored_ms else None
        ),
    }
    methods = []
    # A "+res" entry is its twin's computation (tokamax keeps the output
    # for its VJP): ours is timed once, on the twin.
    twin = entry.name.removesuffix(" +res")
    ours_timed = twin != entry.name and any(e.name == twin for e in entries)
    if ours_timed:
      base["ours_as"] = twin
    if tokamax_missing:
      report["rows"].append(
          dict(base, method="tokamax", skipped=tokamax_missing)
      )
    else:
      methods.append(("tokamax", None, lambda: tokamax_fn(entry, args.dry_run)))
    if not ours_timed:
      methods.append(("ours_api", None, lambda: ours_api_fn(backend, entry)))
    for label, tiles in [] if ours_timed else raw_candidates(entry, generation):
      methods.append(
          (f"raw_{label}", tiles, lambda t=tiles: ours_raw_fn(entry, t, launch))
      )
    if args.methods:
      methods = [m for m in methods if re.fullmatch(args.methods, m[0])]
    reference = None
    for method, tiles, build in methods:
      row = dict(base, method=method)
      if tiles is not None:
        row["tiles"] = dataclasses.asdict(tiles)
      report["rows"].append(row)
      if time.time() > deadline:
        row["skipped"] = "past the deadline"
        continue
      try:
        fn = build()
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = json_report.error_text(e)
        continue
      out = _time(row, fn, args_i, entry, repeats, reference, args.pipelined_s)
      if method == "tokamax" and out is not None:
        reference = out
      del out
      print(
          f"{entry.name} {method}: "
          f"{row.get('error') or round(row['tflops'], 1)}",
          flush=True,
      )
      write()
    del args_i, reference
  report["summary"] = summary(report["rows"])
  write()
  return report


def summary(rows) -> list[dict]:
  """Per entry: tokamax's TF/s here and stored, ours (API) and our best raw
  kernel, and the ratios of ours to each (> 1: ours is faster)."""
  by_entry = {}
  for row in rows:
    by_entry.setdefault(row["entry"], []).append(row)
  out = []
  for name, group in by_entry.items():
    twin = group[0].get("ours_as")
    if twin in by_entry:
      group = group + [r for r in by_entry[twin] if r["method"] != "tokamax"]
    rate = lambda r: r.get("tflops") if not r.get("error") else None
    tk = next((rate(r) for r in group if r["method"] == "tokamax"), None)
    api = next((rate(r) for r in group if r["method"] == "ours_api"), None)
    raws = [(rate(r), r) for r in group if r["method"].startswith("raw_")]
    raws = [(t, r) for t, r in raws if t]
    best_raw = max(raws, key=lambda tr: tr[0]) if raws else (None, None)
    stored = group[0]["stored_tflops"]
    ratio = lambda a, b: a / b if a and b else None
    out.append(
        {
            "entry": name,
            "tokamax_tflops": tk,
            "stored_tflops": stored,
            "ours_api_tflops": api,
            "ours_raw_best_tflops": best_raw[0],
            "ours_raw_best": best_raw[1]["method"] if best_raw[1] else None,
            "ours_raw_best_tiles": best_raw[1].get("tiles")
            if best_raw[1]
            else None,
            "api_over_tokamax": ratio(api, tk),
            "api_over_stored": ratio(api, stored),
            "raw_over_tokamax": ratio(best_raw[0], tk),
            "raw_over_stored": ratio(best_raw[0], stored),
        }
    )
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="", help="the report's JSON path")
  p.add_argument(
      "--dry_run",
      action="store_true",
      help="tiny entries, interpreted kernels, on the CPU",
  )
  p.add_argument(
      "--entries", default="", help="only entries whose name matches this regex"
  )
  p.add_argument(
      "--methods",
      default="",
      help="only methods whose whole name matches this regex (tokamax,"
      " ours_api, raw_<label>), e.g. 'tokamax|ours_api'",
  )
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument(
      "--pipelined_s",
      type=float,
      default=timing.PIPELINED_S,
      help="each timed sample is back-to-back calls this long, over their"
      " number (the chip's time per call, as tokamax's table, measured with"
      " a profiler, has it); 0: each call waited for on its own",
  )
  p.add_argument(
      "--deadline_s",
      type=float,
      default=480.0,
      help="no new measurement starts after this many seconds",
  )
  args = p.parse_args(argv)
  # tokamax defines absl flags and parses sys.argv when it first reads
  # them: our flags are not its, so it sees the program name alone.
  sys.argv = sys.argv[:1]
  if args.dry_run:
    jax.config.update("jax_platforms", "cpu")
  report = run(args)
  for s in report["summary"]:
    print(json.dumps(s))
  return 0


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
