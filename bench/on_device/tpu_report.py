"""tpu_check's JSON as markdown tables (for docs/benchmarks.md), and its
table of ratios. Usage: `python -m bench.on_device.tpu_report
<out_dir>/tpu_check.json`.

Ratios are times over a baseline's, same shape, routing and pass (< 1 is
faster: `timing.ratio_key`); TF/s count useful FLOPs (2*M*K*N a pass).
"""

from __future__ import annotations

import json
import sys

from train import platforms

GEMM_VARIANTS = (
    "dense",
    "ragged_dot",
    "xla",
    "megablox",
    "mosaic_tpu",
    "mosaic_tpu_swept",
)
LAYER_VARIANTS = ("dense_ffn", "xla", "megablox", "mosaic_tpu")
OURS = ("mosaic_tpu", "mosaic_tpu_swept")


def _f(v, spec=".3g") -> str:
  return "-" if v is None else format(v, spec)


def ratio_table(report: dict) -> list[dict]:
  """One row per timed GEMM pass and layer of ours (and xla, megablox): its
  TF/s and its time over each baseline; and the training's."""
  out = []
  for r in report.get("gemm", []):
    if r.get("variant") in ("dense", None) or r.get("seconds") is None:
      continue
    out.append(
        {
            "kind": "gemm",
            "workload": r["workload"],
            "pass": r["mode"],
            "variant": r["variant"],
            "tflops": r.get("tflops"),
            **{k: v for k, v in r.items() if "_time_over_" in k},
        }
    )
  for r in report.get("layer", []):
    if r.get("variant") in ("dense_ffn", None) or r.get("seconds") is None:
      continue
    out.append(
        {
            "kind": "layer",
            "workload": r["workload"],
            "pass": r["mode"],
            "variant": r["variant"],
            "tflops": r.get("tflops"),
            **{k: v for k, v in r.items() if "_time_over_" in k},
        }
    )
  ratio = report.get("phases", {}).get("train", {}).get("ratio")
  if ratio:
    out.append({"kind": "train", "variant": "mosaic_tpu", **ratio})
  return out


def _by(rows, *keys):
  found = {}
  for r in rows:
    found[tuple(r.get(k) for k in keys)] = r
  return found


def markdown(report: dict) -> str:
  """Every section the report has, as markdown."""
  lines = [
      f"TPU check of {report.get('git_commit') or '?'} on "
      f"{report.get('device') or '?'}, jax {report.get('jax')}"
      + (" (dry run)" if report.get("dry_run") else "")
      + f", {report.get('seconds') or 0:.0f} s.",
      "",
  ]
  for name, p in report.get("phases", {}).items():
    lines.append(
        f"- {name}: {p.get('status')} ({p.get('seconds', '-')} s)"
        + (f": {p['error']}" if p.get("error") else "")
    )
  lines.append("")
  lines += _sweep(report.get("sweep") or {})
  lines += _gemm(report.get("gemm") or [])
  lines += _layer(report.get("layer") or [])
  lines += _conformance(report.get("conformance") or [])
  lines += _train(report.get("train") or [], report)
  goals = report.get("goals", [])
  gemm_goals = [g for g in goals if "/" in g["workload"]]
  if gemm_goals:
    met = sum(1 for g in gemm_goals if g["met"])
    lines.append(
        f"- grouped GEMM goals (JSON: goals): {met} of {len(gemm_goals)} met"
    )
  for g in goals:
    if g in gemm_goals:
      continue
    met = {None: "not judged", True: "met", False: "MISSED"}[g["met"]]
    lines.append(
        f"- goal {g['workload']} {g['goal']} = {_f(g['value'], '.2f')}"
        f" ({g['target']}): {met}"
    )
  return "\n".join(lines)


def _tile(t) -> str:
  if isinstance(t, dict):
    return (
        "("
        + ", ".join(
            str(t.get(k)) for k in ("bm", "bk", "bn", "chunk") if k in t
        )
        + ")"
    )
  return "(" + ", ".join(str(v) for v in t) + ")" if t else "-"


def _sweep(sec) -> list[str]:
  best = [b for b in sec.get("best", []) if b["routing"] != "all"]
  if not best:
    return []
  found = _by(best, "impl", "shape", "routing", "pass")
  keys = sorted(
      {(b["shape"], b["routing"], b["pass"]) for b in best},
      key=lambda k: (k[0], k[1], "fwd dx dw".split().index(k[2])),
  )
  lines = [
      "### Tile sweep: the best tile per shape, routing and pass (TF/s)",
      "",
      "| shape | routing | pass | mosaic_tpu tile | TF/s | megablox tile "
      "| TF/s |",
      "|---|---|---|---|---|---|---|",
  ]
  for shape, routing, pass_ in keys:
    cells = []
    for impl in ("mosaic_tpu", "megablox"):
      b = found.get((impl, shape, routing, pass_))
      cells += [_tile(b["tile"]), _f(b["tflops"])] if b else ["-", "-"]
    lines.append(
        f"| {shape} | {routing} | {pass_} | " + " | ".join(cells) + " |"
    )
  errors = sum(1 for r in sec.get("rows", []) if "error" in r)
  lines += [
      "",
      f"{errors} candidates failed to compile or run "
      "(JSON: sweep.rows[].error).",
      "",
  ]
  return lines


def _gemm(rows) -> list[str]:
  rows = [r for r in rows if "mode" in r]
  if not rows:
    return []
  found = _by(rows, "workload", "mode", "variant")
  variants = [v for v in GEMM_VARIANTS if any(r["variant"] == v for r in rows)]
  keys = []
  for r in rows:
    if (r["workload"], r["mode"]) not in keys:
      keys.append((r["workload"], r["mode"]))
  lines = [
      "### Grouped GEMM, bf16 (TF/s of useful work; ours: time over each "
      "baseline, < 1 is faster)",
      "",
      "| shape/routing | pass | "
      + " | ".join(variants)
      + " | ours/dense | ours/ragged_dot | ours/megablox |",
      "|---|---|" + "---|" * (len(variants) + 3),
  ]
  for workload, mode in keys:
    cells = [
        _f(found.get((workload, mode, v), {}).get("tflops")) for v in variants
    ]
    ours = found.get((workload, mode, "mosaic_tpu"), {})
    cells += [
        _f(ours.get(f"{mode}_time_over_{b}"), ".2f")
        for b in ("dense", "ragged_dot", "megablox")
    ]
    lines.append(f"| {workload} | {mode} | " + " | ".join(cells) + " |")
  return lines + [""]


def _layer(rows) -> list[str]:
  rows = [r for r in rows if "mode" in r]
  if not rows:
    return []
  found = _by(rows, "workload", "variant")
  names = []
  for r in rows:
    if r["workload"] not in names:
      names.append(r["workload"])
  lines = [
      "### MoE layer forward+backward vs the dense SwiGLU FFN of the same "
      "FLOPs (ms; time over dense, goal <= 1.25)",
      "",
      "| layer | "
      + " | ".join(LAYER_VARIANTS)
      + " | "
      + " | ".join(f"{v}/dense" for v in LAYER_VARIANTS[1:])
      + " |",
      "|---|" + "---|" * (2 * len(LAYER_VARIANTS) - 1),
  ]
  for name in names:
    ms = [found.get((name, v), {}).get("seconds") for v in LAYER_VARIANTS]
    cells = [_f(None if s is None else 1e3 * s, ".2f") for s in ms]
    cells += [
        _f(found.get((name, v), {}).get("fwd_bwd_time_over_dense_ffn"), ".2f")
        for v in LAYER_VARIANTS[1:]
    ]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return lines + [""]


def _conformance(entries) -> list[str]:
  if not entries:
    return []
  lines = [
      "### Conformance on the chip",
      "",
      "| backend | status | ran | failures | errors | skipped |",
      "|---|---|---|---|---|---|",
  ]
  for e in entries:
    lines.append(
        f"| {e['variant']} | {e['status']} | {e.get('ran', '-')} | "
        f"{e.get('failures', '-')} | {e.get('errors', '-')} | "
        f"{e.get('skipped', '-')} |"
    )
  return lines + [""]


def _train(entries, report) -> list[str]:
  if not entries:
    return []
  lines = [
      "### Training (train.main)",
      "",
      "| backend | preset | steps | tokens/s | MFU (6N) | loss first -> "
      "last | held-out |",
      "|---|---|---|---|---|---|---|",
  ]
  for e in entries:
    lines.append(
        f"| {e['backend']} | {e['preset']} | {e.get('steps_done', '-')}/"
        f"{e['steps']} | {_f(e.get('tokens_per_s'), ',.0f')} | "
        f"{_f(e.get('mfu_6n'), '.1%')} | {_f(e.get('loss_first'), '.3f')} -> "
        f"{_f(e.get('loss_last'), '.3f')} | "
        f"{_f(e.get('final_held_out_loss'), '.3f')} |"
    )
  ratio = report.get("phases", {}).get("train", {}).get("ratio")
  if ratio:
    lines += [
        "",
        f"mosaic_tpu step time / xla: " f"{ratio['step_time_over_xla']:.2f}",
    ]
  return lines + [""]


def main(argv) -> int:
  if len(argv) != 2:
    print(__doc__)
    return 2
  with open(argv[1]) as fh:
    print(markdown(json.load(fh)))
  return 0


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main(sys.argv))
