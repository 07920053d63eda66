"""What each training step reports: a metrics.jsonl record, a console line,
the progress bar, and the history the end-of-run plot and summary read."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np

from train import mesh as mesh_lib
from train import run_config


def new_history() -> dict[str, list]:
  """Per-step series a run accumulates (checkpointed with it)."""
  return {
      "step": [],
      "loss": [],
      "tokens_per_s": [],
      "eval_step": [],
      "eval_loss": [],
      "load": [],
      "dropped": [],
  }


def log_step(
    history: dict[str, list],
    run: run_config.RunConfig,
    step: int,
    metrics: dict,
    seconds: float,
) -> dict:
  """The metrics.jsonl record of `step`, also appended to `history`.

  Args:
    history: the run's `new_history()` dict, extended in place.
    run: the run's config.
    step: the step just taken (1 for the first).
    metrics: its host metrics: "loss", "total_loss", "grad_norm", and per
      MoE layer "tokens_per_expert" [layers, E] and "dropped" [layers].
    seconds: its wall time.

  Raises:
    FloatingPointError: the loss is not finite.
  """
  tokens = run.batch_size * run.seq_len
  devices = mesh_lib.num_devices(mesh_lib.parse(run.mesh))
  loss = float(metrics["loss"])
  if not math.isfinite(loss):
    raise FloatingPointError(f"loss is {loss} at step {step}.")
  tpe = np.asarray(metrics["tokens_per_expert"], np.float64)
  load = (
      tpe / tpe.mean(axis=-1, keepdims=True) if tpe.size else np.zeros((0, 0))
  )
  assignments = tokens * (run.model.moe.top_k if run.model.moe else 0)
  dropped = (
      np.asarray(metrics["dropped"], np.float64) / assignments
      if assignments
      else np.zeros(0)
  )
  record = {
      "step": step,
      "loss": loss,
      "total_loss": float(metrics["total_loss"]),
      "grad_norm": float(metrics["grad_norm"]),
      "tokens_per_s": tokens / seconds,
      "tokens_per_s_per_device": tokens / seconds / devices,
      "seconds": seconds,
      "tokens_per_expert": tpe.astype(np.int64).tolist(),
      "load_min": load.min(axis=-1).round(3).tolist() if load.size else [],
      "load_max": load.max(axis=-1).round(3).tolist() if load.size else [],
      "dropped_fraction": dropped.tolist(),
  }
  history["step"].append(step)
  history["loss"].append(loss)
  history["tokens_per_s"].append(record["tokens_per_s"])
  history["load"].append(load.round(4).tolist())
  history["dropped"].append(dropped.tolist())
  return record


def format_record(run: run_config.RunConfig, record: dict) -> str:
  """The console line of a `log_step` record."""
  layers = [i for i in range(run.model.num_layers) if run.model.is_moe_layer(i)]
  load = " ".join(
      f"L{i}:{lo:.2f}/{hi:.2f}"
      for i, lo, hi in zip(layers, record["load_min"], record["load_max"])
  )
  dropped = max(record["dropped_fraction"], default=0.0)
  text = (
      f"step {record['step']:5d}/{run.steps} loss {record['loss']:.4f} "
      f"{record['tokens_per_s']:8,.0f} tok/s"
  )
  per_device = record.get("tokens_per_s_per_device", record["tokens_per_s"])
  if per_device != record["tokens_per_s"]:
    text += f" ({per_device:,.0f}/device)"
  if layers:
    text += f" | load min/max over mean {load} | dropped {dropped:.3f}"
  return text


def show_progress(
    run: run_config.RunConfig,
    step: int,
    loss: float,
    tps: float,
    *,
    start: float,
    first_step: int,
) -> None:
  """Redraws the progress bar on stderr (only on a terminal, if wanted).

  Args:
    run: the run's config (its steps and `progress` setting).
    step: the step just taken.
    loss: its training loss.
    tps: its tokens per second.
    start: `time.perf_counter()` when this process's loop began.
    first_step: the step the loop began at (not 0 after a resume).
  """
  if not run.progress or not sys.stderr.isatty():
    return
  width = 30
  done = int(width * step / run.steps)
  elapsed = time.perf_counter() - start
  eta = elapsed / max(step - first_step, 1) * (run.steps - step)
  sys.stderr.write(
      f"\r[{'#' * done}{'.' * (width - done)}] {step}/"
      f"{run.steps} loss {loss:.3f} {tps:,.0f} tok/s "
      f"eta {eta:.0f}s "
  )
  sys.stderr.flush()
  if step == run.steps:
    sys.stderr.write("\n")


def logged_lines_up_to_step(path: str, step: int) -> list[str]:
  """Lines of a previous metrics.jsonl up to `step`, the resumed one.

  A run killed after its last checkpoint logged steps that the resumed run
  repeats; those lines are dropped, not duplicated.
  """
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [
        line for line in f if line.strip() and json.loads(line)["step"] <= step
    ]
