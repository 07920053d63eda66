"""Where a profiled program's device time goes, by op kind and source line.

Reads the Perfetto trace `jax.profiler.trace(..., create_perfetto_trace=
True)` writes (`train.main --profile_dir=DIR` traces three training
steps) and sums the device's XLA ops, leaf ops only (a `while` of scanned
layers holds the ops it runs), per step, grouped by the op's kind (its
name less the number: `gather_fusion`, `dropless_tpu_gmm`, ...) and the
Python line that made it. The top groups are what dominates the step.

  python -m bench.harness.trace_summary DIR_OR_FILE --steps=3 --top=40 [--out=J]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

from train import platforms

# Container ops whose time is the sum of the ops they run.
_CONTAINERS = ("while", "conditional", "call")


def _trace_file(path: str) -> str:
  if os.path.isfile(path):
    return path
  found = glob.glob(
      os.path.join(path, "**", "*perfetto_trace.json.gz"), recursive=True
  ) or glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
  if not found:
    raise FileNotFoundError(f"no Perfetto trace under {path!r}.")
  return sorted(found)[-1]


def summarise(events: list[dict], steps: int, repo: str = "") -> dict:
  """{"device", "step_ms", "groups": [{"kind", "source", "ms_per_step",
  "calls_per_step", "share"}]}, biggest first, from the trace's events."""
  names = {
      e["pid"]: e["args"]["name"]
      for e in events
      if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  threads = {
      (e["pid"], e["tid"]): e["args"]["name"]
      for e in events
      if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  device = next((p for p, n in names.items() if "TPU" in n or "GPU" in n), None)
  if device is None:
    raise ValueError(f"no device in the trace's processes: {names}.")
  ops = [
      e
      for e in events
      if e.get("pid") == device
      and e.get("ph") == "X"
      and threads.get((device, e.get("tid"))) == "XLA Ops"
  ]
  step_events = [
      e
      for e in events
      if e.get("pid") == device
      and e.get("ph") == "X"
      and threads.get((device, e.get("tid"))) == "Steps"
  ]
  groups = collections.defaultdict(lambda: [0.0, 0])
  for e in ops:
    kind = re.sub(r"[.\d]+$", "", e["name"])
    if kind in _CONTAINERS:
      continue
    source = e.get("args", {}).get("source", "?")
    if repo and source.startswith(repo):
      source = source[len(repo) :].lstrip("/")
    groups[(kind, source)][0] += e["dur"]
    groups[(kind, source)][1] += 1
  total = sum(us for us, _ in groups.values())
  rows = [
      {
          "kind": kind,
          "source": source,
          "ms_per_step": us / 1e3 / steps,
          "calls_per_step": calls / steps,
          "share": us / total if total else 0.0,
      }
      for (kind, source), (us, calls) in sorted(
          groups.items(), key=lambda kv: -kv[1][0]
      )
  ]
  return {
      "device": names[device],
      "device_ms_per_step": total / 1e3 / steps,
      "step_ms": sorted(e["dur"] / 1e3 for e in step_events),
      "groups": rows,
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("trace", help="a Perfetto trace, or a folder holding one")
  p.add_argument("--steps", type=int, default=3, help="steps traced")
  p.add_argument("--top", type=int, default=40)
  p.add_argument("--out", default="", help="write the summary as JSON here")
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")
  path = _trace_file(args.trace)
  with gzip.open(path) as fh:
    trace = json.load(fh)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
  summary = summarise(events, args.steps, repo)
  summary["trace"] = os.path.basename(path)
  summary["groups"] = summary["groups"][: args.top]
  print(
      f"{summary['device']}: {summary['device_ms_per_step']:.1f} ms of device"
      f" ops a step"
  )
  for g in summary["groups"]:
    print(
        f"{g['ms_per_step']:8.2f} ms {g['share']:6.1%} "
        f"{g['calls_per_step']:6.0f}x  {g['kind']:38s} {g['source']}"
    )
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(summary, fh, indent=1)
  return 0


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(main())
