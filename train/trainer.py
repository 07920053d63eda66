"""The training loop: a Trainer builds the model and trains it.

Around the compiled steps (`train/steps.py`) it draws batches, evaluates,
checkpoints, resumes, and logs each step (`train/step_log.py`); signals
stop it cleanly after the step in flight.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import moe_core
from moe_core import flax as moe_flax
from train import checkpoint
from train import data as data_lib
from train import model as model_lib
from train import report
from train import run_config
from train import step_log
from train import steps

# Their old home: the run config and the compiled steps used to live here.
RunConfig = run_config.RunConfig
run_config_from_preset = run_config.run_config_from_preset
make_optimizer = steps.make_optimizer
cross_entropy = steps.cross_entropy


class Trainer:
  """Builds the model and optimiser for `run` and trains it.

  State is a dict pytree {"params", "opt_state", "bias"}: float32 master
  weights (`nnx.Param`), the optax state, and the MoE correction biases
  (`moe_flax.CorrectionBias`, float32, updated by the aux-loss-free rule and
  never by the optimiser).
  """

  def __init__(
      self,
      run: RunConfig,
      corpus: data_lib.Corpus | None = None,
      out=sys.stdout,
  ):
    self.run = run
    self.out = out
    self.corpus = corpus or data_lib.load(run.data)
    if run.model.vocab_size < data_lib.VOCAB_SIZE:
      raise ValueError(
          f"byte tokens need vocab_size >= 256, got " f"{run.model.vocab_size}."
      )
    dtype = jnp.dtype(run.compute_dtype)
    model = model_lib.Transformer(
        run.model,
        backend=run.backend,
        compute_dtype=dtype,
        remat=run.remat,
        rngs=nnx.Rngs(params=run.seed),
    )
    graphdef, params, bias = nnx.split(
        model, nnx.Param, moe_flax.CorrectionBias
    )
    self.program = steps.program(run, graphdef)
    self.state = {
        "params": params,
        "opt_state": self.program.optimizer.init(params),
        "bias": bias,
    }
    self.step = 0
    self.sampler = data_lib.BatchSampler(
        self.corpus.train, run.batch_size, run.seq_len, run.seed
    )
    self.eval_set = data_lib.eval_batches(
        self.corpus.held_out, run.batch_size, run.seq_len, run.eval_batches
    )
    self.history = step_log.new_history()
    self.backend_name = self._resolve_backend()
    self._stop_signal = None

  # --- Host side -------------------------------------------------------------

  def _resolve_backend(self) -> str:
    if self.run.model.moe is None:
      return "none (dense model)"
    name = self.run.backend
    if name == "auto":
      return f"auto -> {moe_core.get_backend('auto').name}"
    ok, why = moe_core.get_backend(name).availability()
    if not ok:
      raise ValueError(
          f"--moe_backend={name} is not available here: {why} "
          f"Available: {moe_core.available_backends()}."
      )
    return name

  def train_step(self, batch: np.ndarray) -> dict:
    """One optimiser step on `batch` [B, T+1]; returns host metrics.

    The step is committed (state and step counter) only once its metrics
    are on the host: dispatch is asynchronous, so a Ctrl-C most likely lands
    in the wait, and then neither the state nor the step may have moved.
    """
    state, metrics = self.program.train_step(self.state, jnp.asarray(batch))
    metrics = jax.device_get(metrics)
    self.state, self.step = state, self.step + 1
    return metrics

  def evaluate(self) -> float:
    """Mean held-out next-byte loss (nats) over the fixed eval batches."""
    losses = [
        float(
            self.program.eval_step(
                self.state["params"], self.state["bias"], jnp.asarray(b)
            )
        )
        for b in self.eval_set
    ]
    weights = [len(b) for b in self.eval_set]
    return float(np.average(losses, weights=weights))

  # --- Checkpoints -----------------------------------------------------------

  @property
  def checkpoint_dir(self) -> str:
    return os.path.join(self.run.output_dir, "checkpoints")

  # Settings a run may be resumed with changed (with a note): they change
  # the trajectory but not the shapes of the state.
  _SOFT_SETTINGS = (
      "steps",
      "learning_rate",
      "warmup_steps",
      "weight_decay",
      "grad_clip",
      "bias_update_rate",
      "aux_loss_weight",
      "z_loss_weight",
      "backend",
      "remat",
  )

  def _soft_settings(self) -> dict:
    return {k: getattr(self.run, k) for k in self._SOFT_SETTINGS}

  def save_checkpoint(self) -> str:
    return checkpoint.save(
        self.checkpoint_dir,
        self.step,
        self.state,
        fingerprint=self.run.fingerprint(self.corpus.name),
        extra={
            "data": self.sampler.state(),
            "history": self.history,
            "settings": self._soft_settings(),
        },
        keep=self.run.keep_checkpoints,
    )

  def restore_checkpoint(self, path: str) -> None:
    state, meta = checkpoint.restore(
        path, self.state, fingerprint=self.run.fingerprint(self.corpus.name)
    )
    self.state = jax.tree.map(jnp.asarray, state)
    self.step = meta["step"]
    extra = meta.get("extra", {})
    if "data" not in extra:
      raise checkpoint.CheckpointError(
          f"checkpoint {path!r} lacks the data position; cannot resume "
          "exactly."
      )
    self.sampler.restore(extra["data"])
    self.history = extra.get("history", self.history)
    settings = extra.get("settings", {})
    changed = {
        k: (settings[k], v)
        for k, v in self._soft_settings().items()
        if k in settings and settings[k] != v
    }
    if changed:
      self._print(
          f"note: resuming with changed settings {changed} "
          "(checkpoint value, now); the run will not match an "
          "uninterrupted one."
      )

  def prepare_output_dir(self) -> None:
    """Resumes from the newest checkpoint, or clears old ones when fresh."""
    found = checkpoint.list_checkpoints(self.checkpoint_dir)
    if self.run.resume:
      if not found:
        raise checkpoint.CheckpointError(
            f"--resume: no checkpoint in {self.checkpoint_dir!r}; run without "
            "--resume to start a new run."
        )
      self.restore_checkpoint(found[-1][1])
      self._print(f"resumed from {found[-1][1]} at step {self.step}")
    elif found:
      self._print(
          f"starting fresh: removing {len(found)} checkpoint(s) of a "
          f"previous run in {self.checkpoint_dir} (pass --resume to "
          "continue it instead)"
      )
      shutil.rmtree(self.checkpoint_dir)

  # --- The loop --------------------------------------------------------------

  def _print(self, text: str) -> None:
    if self.out is not None:
      print(text, file=self.out, flush=True)

  def _on_signal(self, signum, frame):
    """Asks the loop to stop after the current step (then it checkpoints).

    A second Ctrl-C is not deferred: it raises KeyboardInterrupt at once.
    """
    del frame
    self._stop_signal = signum
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)

  def fit(self, *, handle_signals: bool = False) -> dict:
    """Trains to `run.steps`, evaluating and checkpointing on the way.

    Returns:
      A summary dict (also written as summary.json by `train.main`).
    """
    run = self.run
    os.makedirs(run.output_dir, exist_ok=True)
    metrics_path = os.path.join(run.output_dir, "metrics.jsonl")
    previous = {}
    if handle_signals:
      # Ctrl-C and SIGTERM finish the step in flight, then checkpoint: an
      # exception inside the step could leave a half-logged step behind.
      for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, self._on_signal)
    self._first_step = self.step
    interrupted = None
    start = time.perf_counter()
    kept = (
        step_log.logged_lines_up_to_step(metrics_path, self.step)
        if run.resume
        else []
    )
    try:
      with open(metrics_path, "w") as log:
        log.writelines(kept)
        while self.step < run.steps:
          position = self.sampler.state()
          batch = self.sampler.next()
          t0 = time.perf_counter()
          try:
            metrics = self.train_step(batch)
          except KeyboardInterrupt:
            # The step did not happen: its batch must be drawn again.
            self.sampler.restore(position)
            raise
          record = step_log.log_step(
              self.history, run, self.step, metrics, time.perf_counter() - t0
          )
          log.write(json.dumps(record) + "\n")
          step_log.show_progress(
              run,
              self.step,
              record["loss"],
              record["tokens_per_s"],
              start=start,
              first_step=self._first_step,
          )
          if self.step % run.log_every == 0 or self.step == 1:
            self._print(step_log.format_record(run, record))
          if self.step % run.eval_every == 0 or self.step == run.steps:
            eval_loss = self.evaluate()
            self.history["eval_step"].append(self.step)
            self.history["eval_loss"].append(eval_loss)
            self._print(f"step {self.step:5d} held-out loss {eval_loss:.4f}")
          if (
              run.checkpoint_every
              and self.step % run.checkpoint_every == 0
              and self.step < run.steps
          ):
            self.save_checkpoint()
          if self._stop_signal is not None:
            interrupted = signal.Signals(self._stop_signal).name
            break
    except KeyboardInterrupt:
      interrupted = "KeyboardInterrupt"
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
    path = self.save_checkpoint()  # At the end, and on an interrupt.
    if interrupted:
      self._print(
          f"\ninterrupted ({interrupted}) at step {self.step}; saved "
          f"{path}; continue with --resume"
      )
    return self.summary(
        wall_seconds=time.perf_counter() - start,
        checkpoint_path=path,
        interrupted=interrupted,
    )

  def summary(
      self,
      *,
      wall_seconds: float,
      checkpoint_path: str | None,
      interrupted: str | None,
  ) -> dict:
    """The run's summary so far (see `report.run_summary`)."""
    return report.run_summary(
        self.run,
        self.corpus,
        self.history,
        steps=self.step,
        backend=self.backend_name,
        wall_seconds=wall_seconds,
        checkpoint_path=checkpoint_path,
        interrupted=interrupted,
    )
