"""End-of-run outputs: the run's summary (JSON), a PNG of loss curves and
expert load."""

from __future__ import annotations

import json
import os

import numpy as np

from train.parallel import mesh as mesh_lib
from train.presets import sizing
from train.run.inputs import data as data_lib
from train.run.inputs import run_config
from train.run.reporting import mfu as mfu_lib


def run_summary(
    run: run_config.RunConfig,
    corpus: data_lib.Corpus,
    history: dict[str, list],
    *,
    steps: int,
    backend: str,
    wall_seconds: float,
    checkpoint_path: str | None,
    interrupted: str | None,
    num_processes: int = 1,
    peak: mfu_lib.Peak | None = None,
) -> dict:
  """The summary of a run (written as summary.json by `train.main`).

  Args:
    run: the run's config.
    corpus: the text it trained on.
    history: its `step_log.new_history()` series.
    steps: the steps it took.
    backend: the MoE backend as the Trainer names it.
    wall_seconds: the loop's wall time.
    checkpoint_path: the last checkpoint written, if any.
    interrupted: the signal or exception that stopped it early, if any.
    num_processes: how many processes ran it (jax.process_count()).
    peak: its devices' peak bf16 FLOP/s (`mfu.peak_of`); None when unknown
      (a CPU): "mfu_median" is then None.
  """
  counts = sizing.param_counts(run.model)
  sizes = mesh_lib.parse(run.mesh)
  devices = mesh_lib.num_devices(sizes)
  # Skip the first steps of a run: they include compilation.
  tps = history["tokens_per_s"][2:] or history["tokens_per_s"]
  flops = sizing.flops_per_token(run.model, run.seq_len)["train"]
  return {
      "model": run.model.name,
      "backend": backend,
      "steps": steps,
      "batch_size": run.batch_size,
      "seq_len": run.seq_len,
      "remat": run.remat,
      "compute_dtype": run.compute_dtype,
      "precision": run.precision,
      "data": corpus.name,
      "train_bytes": int(len(corpus.train)),
      "held_out_bytes": int(len(corpus.held_out)),
      "params_total": counts.total,
      "params_active": counts.active,
      "final_train_loss": history["loss"][-1] if history["loss"] else None,
      "final_held_out_loss": (
          history["eval_loss"][-1] if history["eval_loss"] else None
      ),
      "unigram_entropy": data_lib.unigram_entropy(
          np.concatenate([corpus.train, corpus.held_out])
      ),
      "unigram_held_out_cross_entropy": data_lib.unigram_cross_entropy(
          corpus.train, corpus.held_out
      ),
      "mesh": mesh_lib.describe(sizes),
      "num_devices": devices,
      "num_processes": num_processes,
      "tokens_per_s_median": float(np.median(tps)) if tps else None,
      "tokens_per_s_per_device_median": (
          float(np.median(tps)) / devices if tps else None
      ),
      "model_flops_per_token": flops,
      "peak_flops_per_device": peak.flops_per_device if peak else None,
      "mfu_median": (
          mfu_lib.mfu(float(np.median(tps)), flops, devices, peak)
          if tps and peak
          else None
      ),
      "max_dropped_fraction": max(
          (max(d, default=0.0) for d in history["dropped"]), default=0.0
      ),
      "wall_seconds": wall_seconds,
      "checkpoint": checkpoint_path,
      "interrupted": interrupted,
  }


def write_summary(path: str, summary: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
  if len(values) < window or window < 2:
    return values
  kernel = np.ones(window) / window
  head = np.array([values[: i + 1].mean() for i in range(window - 1)])
  return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def plot_unavailable() -> str | None:
  """None if the plot can be drawn here, else the one line saying why it is
  skipped: matplotlib (the `train` extra) is not installed."""
  try:
    import matplotlib  # noqa: F401  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return (
        f"plot skipped: matplotlib is not installed ({e}); pip install "
        "matplotlib (or '.[train]') to draw training.png, or pass "
        "--noplot"
    )
  return None


def plot(path: str, history: dict, summary: dict, moe_layers: list[int]) -> str:
  """Saves the training figure to `path` and returns it.

  Left: training loss (raw and smoothed), held-out loss, and the unigram
  baselines. Right: expert load over training, tokens per expert divided by
  the mean, one row per (MoE layer, expert), one column per step: 1.0 is
  perfect balance.
  """
  # Imported here, and with the file-only Agg backend chosen before pyplot:
  # training never needs a display, and runs without --plot skip matplotlib.
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  load = np.asarray(history["load"], np.float64)  # [steps, layers, E]
  has_load = load.ndim == 3 and load.size > 0
  fig, axes = plt.subplots(
      1,
      2 if has_load else 1,
      figsize=(13 if has_load else 7, 4.8),
      squeeze=False,
  )
  ax = axes[0, 0]
  steps = np.asarray(history["step"])
  loss = np.asarray(history["loss"])
  ax.plot(
      steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train (per step)"
  )
  ax.plot(
      steps,
      _smooth(loss, 10),
      color="tab:blue",
      lw=1.5,
      label="train (10-step mean)",
  )
  if history["eval_step"]:
    ax.plot(
        history["eval_step"],
        history["eval_loss"],
        "o-",
        color="tab:orange",
        label="held-out",
    )
  ax.axhline(
      summary["unigram_entropy"],
      color="gray",
      ls="--",
      label=f"unigram entropy {summary['unigram_entropy']:.3f}",
  )
  ax.set_xlabel("step")
  ax.set_ylabel("next-byte loss (nats)")
  ax.set_title(
      f"{summary['model']} on {os.path.basename(summary['data'])}, "
      f"backend {summary['backend']}"
  )
  ax.set_ylim(
      bottom=max(0.0, float(np.min(loss)) - 0.5),
      top=float(np.percentile(loss, 99)) + 0.3,
  )
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)

  if has_load:
    ax = axes[0, 1]
    num_steps, num_layers, num_experts = load.shape
    image = load.transpose(1, 2, 0).reshape(num_layers * num_experts, num_steps)
    shown = ax.imshow(
        image,
        aspect="auto",
        cmap="viridis",
        interpolation="nearest",
        extent=(
            steps[0] - 0.5,
            steps[-1] + 0.5,
            num_layers * num_experts - 0.5,
            -0.5,
        ),
        vmin=0.0,
        vmax=max(2.0, float(image.max())),
    )
    for boundary in range(1, num_layers):
      ax.axhline(boundary * num_experts - 0.5, color="white", lw=1)
    ax.set_yticks(
        [i * num_experts + (num_experts - 1) / 2 for i in range(num_layers)]
    )
    ax.set_yticklabels([f"layer {i}" for i in moe_layers])
    ax.set_xlabel("step")
    ax.set_title("expert load: tokens per expert / mean (1 = balanced)")
    fig.colorbar(shown, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
