"""The training loop: `Trainer.fit` and what each step does around the
compiled step.

`TrainingLoop` is the half of `trainer.Trainer` that drives it: it trains to
`run.steps`, logging every step (`step_log.py`), evaluating and
checkpointing as due, stops after the step in flight on a signal
(`stop_signals.py`), meets the device's memory running out with one line
(`training_faults.py`) and returns the run's summary (`report.py`). It
calls the trainer's own steps, evaluation and checkpoints; the trainer's
module holds those, and the state and output directory they work on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import jax

from train.run.reporting import cost_report
from train.run.reporting import mfu
from train.run.reporting import report
from train.run.reporting import step_log
from train.run.training import training_faults

# The steps `--profile_dir` traces: after the compile and a few warm-up
# steps, so the trace holds steady-state steps only.
PROFILE_STEPS = (6, 7, 8)


def _profiles(run, step: int) -> int | None:
  """`step` if `run.profile_dir` asks for its trace, else None; starts the
  trace at the first of `PROFILE_STEPS` (the caller stops it after the
  last)."""
  if not run.profile_dir or step not in PROFILE_STEPS:
    return None
  if step == PROFILE_STEPS[0]:
    jax.profiler.start_trace(run.profile_dir, create_perfetto_trace=True)
  return step


class TrainingLoop:
  """The loop of `trainer.Trainer`, which it is a base of (a Trainer's
  attributes: `run`, `step`, `history`, `sampler`, the output directory's
  lock and the checkpointer)."""

  def deferring_signals(self) -> contextlib.AbstractContextManager[None]:
    """Inside, SIGINT and SIGTERM ask the run to stop after the step in flight.

    Before the last step that is an interruption (checkpointed, resumable);
    after it, the run finishes as usual: the final evaluation, save and
    report still happen, and nothing counts as interrupted. The previous
    handlers come back on exit. Nested uses are one. Main thread only
    (`stop_signals.StopSignals`).
    """
    return self._signals.deferring()

  def fit(self, *, handle_signals: bool = False) -> dict:
    """Trains to `run.steps`, evaluating and checkpointing on the way.

    Takes --output_dir first, if `prepare_output_dir` did not. With
    `handle_signals`, Ctrl-C and SIGTERM are deferred as
    `deferring_signals` says, up to the end of the final save.

    Returns:
      A summary dict (also written as summary.json by `train.main`).

    Raises:
      training_faults.NonFiniteError: a step's loss or state is not finite
        (not kept).
      training_faults.OutOfMemoryError: the devices ran out of memory.
      checkpoint_failures.CheckpointSaveError: a checkpoint could not be
        written; raised after the step that started it.
    """
    self._take_output_dir()
    signals = (
        self.deferring_signals() if handle_signals else contextlib.nullcontext()
    )
    with signals:
      return self._fit()

  def _fit(self) -> dict:
    run = self.run
    os.makedirs(run.output_dir, exist_ok=True)
    metrics_path = os.path.join(run.output_dir, "metrics.jsonl")
    self._first_step = self.step
    interrupted = None
    start = time.perf_counter()
    if self.step < run.steps:
      self._show_memory()
      self._print(
          mfu.describe(self.device_kind, self.peak, self.flops_per_token)
      )
    try:
      # Only the holder of --output_dir's lock (process 0) writes the
      # metrics; the others compute the same ones. A resumed run keeps the
      # records up to the step it resumed from.
      with step_log.MetricsLog(
          metrics_path if self._output_lock is not None else None,
          resume_step=self.step if run.resume else None,
      ) as log:
        while self.step < run.steps:
          self._one_step(log, start)
          received = self._signals.received
          if received is not None and self.step < run.steps:
            interrupted = signal.Signals(received).name
            break
    except KeyboardInterrupt:
      interrupted = "KeyboardInterrupt"
    except RuntimeError as e:
      if not training_faults.is_out_of_memory(e):
        raise
      raise training_faults.out_of_memory_error(
          run, e, when=f"at step {self.step + 1}", memory=self.memory
      ) from e
    path = self.save_checkpoint()  # At the end, and on an interrupt.
    self.checkpointer.wait()
    if interrupted:
      self._print(
          f"\ninterrupted ({interrupted}) at step {self.step}; saved "
          f"{path}; continue with --resume"
      )
    elif self._signals.received is not None:
      self._print(
          f"note: {signal.Signals(self._signals.received).name} arrived "
          "after the last step; the run finished as usual"
      )
    return self.summary(
        wall_seconds=time.perf_counter() - start,
        checkpoint_path=path,
        interrupted=interrupted,
    )

  def _show_memory(self) -> None:
    """Prints the compiled train step's memory beside the estimate."""
    if self.memory is not None:
      analytic = cost_report.analytic_bytes_per_device(self.run)
      self._print(
          "memory: " + cost_report.compiled_memory_line(self.memory, analytic)
      )

  def _one_step(self, log: step_log.MetricsLog, start: float) -> None:
    """Trains, logs, evaluates and checkpoints one step, as due."""
    run = self.run
    position = self.sampler.state()
    batch = self._next_batch()
    profiling = _profiles(run, self.step + 1)
    t0 = time.perf_counter()
    interrupted = None
    try:
      metrics = self.train_step(batch)
    except training_faults.StepInterrupted as e:
      metrics, interrupted = e.metrics, e  # Taken: logged, then raised.
    except KeyboardInterrupt:
      # The step did not happen: its batch must be drawn again.
      self.sampler.restore(position)
      raise
    record = step_log.log_step(
        self.history,
        run,
        self.step,
        metrics,
        time.perf_counter() - t0,
        flops_per_token=self.flops_per_token,
        peak=self.peak,
    )
    log.append(record)
    if profiling == PROFILE_STEPS[-1]:
      # After the step's time is logged: writing the trace takes seconds.
      jax.profiler.stop_trace()
    if interrupted is not None:
      raise interrupted
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
    if self._checkpointer is not None:
      # A save started at an earlier step that has failed since stops the
      # run now, not at the next save.
      self._checkpointer.poll()
    if (
        run.checkpoint_every
        and self.step % run.checkpoint_every == 0
        and self.step < run.steps
    ):
      self.save_checkpoint()
      log.sync()  # The log on disk reaches at least the checkpoint.

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
        num_processes=jax.process_count(),
        peak=self.peak,
    )
