"""What each training step reports: a metrics.jsonl record, a console line,
the progress bar, and the history the end-of-run plot and summary read; and
the metrics.jsonl file itself (`MetricsLog`), which survives a kill."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import uuid

from absl import logging
import numpy as np

from train.parallel import mesh as mesh_lib
from train.run.inputs import run_config
from train.run.reporting import mfu as mfu_lib


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
    *,
    flops_per_token: float | None = None,
    peak: mfu_lib.Peak | None = None,
) -> dict:
  """The metrics.jsonl record of `step`, also appended to `history`.

  Args:
    history: the run's `new_history()` dict, extended in place.
    run: the run's config.
    step: the step just taken (1 for the first).
    metrics: its host metrics: "loss", "total_loss", "grad_norm", and per
      MoE layer "tokens_per_expert" [layers, E] and "dropped" [layers].
    seconds: its wall time.
    flops_per_token: the model's training FLOPs per token
      (`sizing.flops_per_token`), for the record's "mfu".
    peak: the devices' peak (`mfu.peak_of`); None: no "mfu" in the record.

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
      # Per MoE layer: assignments of tokens with NaN/Inf routing scores
      # (docs/api.md, "Guarantees"); the loss is then NaN too.
      "invalid_assignments": np.asarray(metrics["invalid"]).tolist(),
  }
  if peak is not None and flops_per_token is not None:
    record["mfu"] = mfu_lib.mfu(
        record["tokens_per_s"], flops_per_token, devices, peak
    )
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
  if "mfu" in record:
    text += f" MFU {record['mfu']:.1%}"
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


class MetricsLogError(ValueError):
  """A metrics log that a resume cannot continue (a damaged line)."""


class MetricsLog:
  """metrics.jsonl: one JSON record per line, one line per step.

  Each line goes to the operating system in one unbuffered write, so a
  killed process loses none that it wrote (at worst the one being written
  is cut short); `sync` also puts them on disk, at checkpoints.
  """

  def __init__(self, path: str | None, *, resume_step: int | None = None):
    """Opens the log for appending.

    Args:
      path: the metrics.jsonl file; None writes nothing (the processes
        other than 0 of a run).
      resume_step: None to start the log afresh; else the step a resumed
        run starts from: the records up to it are kept (see
        `keep_records_up_to`).

    Raises:
      ValueError: a line of the old log other than its last is not a
        record; named, with its number.
    """
    self._file = None
    if path is None:
      return
    _remove_temporaries(path)
    if resume_step is None:
      self._file = open(path, "wb", buffering=0)
    else:
      keep_records_up_to(path, resume_step)
      self._file = open(path, "ab", buffering=0)

  def append(self, record: dict) -> None:
    if self._file is not None:
      self._file.write((json.dumps(record) + "\n").encode())

  def sync(self) -> None:
    """Puts the lines written so far on disk (fsync)."""
    if self._file is not None:
      os.fsync(self._file.fileno())

  def close(self) -> None:
    if self._file is not None:
      self.sync()
      self._file.close()
      self._file = None

  def __enter__(self) -> MetricsLog:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _temporary(path: str, token: str) -> str:
  """A hidden file beside log `path`, that a rewrite of it goes to first."""
  return os.path.join(
      os.path.dirname(path), f".{os.path.basename(path)}.{token}.tmp"
  )


def _remove_temporaries(path: str) -> None:
  """Deletes what a rewrite of log `path` killed midway left beside it."""
  directory = os.path.dirname(path) or "."
  if not os.path.isdir(directory):
    return
  pattern = re.compile(
      rf"\.{re.escape(os.path.basename(path))}\.[0-9a-f]+\.tmp"
  )
  for name in os.listdir(directory):
    if pattern.fullmatch(name):
      os.remove(os.path.join(directory, name))
      logging.warning(
          "removed %s, left by an interrupted rewrite of %s", name, path
      )


def _records(path: str, data: bytes) -> list[tuple[bytes, dict]]:
  """(line, record) of each line of `data`, the contents of log `path`.

  A last line without its newline, or not valid JSON, is what a kill
  during its write leaves: it is dropped with a warning. Blank lines are
  skipped.
  """
  lines = data.split(b"\n")
  found = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    last = number == len(lines)  # No newline after it.
    try:
      record = json.loads(line)
      if not isinstance(record, dict) or not isinstance(
          record.get("step"), int
      ):
        raise ValueError("expected an object with an int 'step'")
    except ValueError as e:
      if last:
        logging.warning(
            "%s: dropped line %d, cut short by an interrupted write (%s)",
            path,
            number,
            e,
        )
        continue
      raise MetricsLogError(
          f"{path}: line {number} is not a metrics record ({e}); only the "
          "last line may be cut short by a kill. Move the file aside to "
          "resume."
      ) from e
    found.append((line, record))
  return found


def keep_records_up_to(path: str, step: int) -> None:
  """Keeps only the records of steps <= `step` in log `path` (if any).

  A run killed after its last checkpoint logged steps that the resumed run
  repeats: those lines are dropped, not duplicated. The kept lines are
  written to a file beside the log, which then replaces it (os.replace is
  atomic): a kill at any point leaves either the old log or the new one.
  Nothing is written if nothing is dropped.

  Raises:
    ValueError: a line other than the last is not a record.
  """
  if not os.path.exists(path):
    return
  with open(path, "rb") as f:
    data = f.read()
  kept = b"".join(
      line + b"\n"
      for line, record in _records(path, data)
      if record["step"] <= step
  )
  if kept == data:
    return
  temporary = _temporary(path, uuid.uuid4().hex)
  with open(temporary, "wb") as f:
    f.write(kept)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)
  _sync_directory(os.path.dirname(path) or ".")


def _sync_directory(directory: str) -> None:
  """Makes a rename in `directory` durable (POSIX: fsync the directory)."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
