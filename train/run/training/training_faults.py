"""The faults that end a training run, each in one line.

A non-finite loss or state (`NonFiniteError`, nothing of it kept or
saved), the device's memory (`OutOfMemoryError`, naming the estimate and
the flags that lower it), and a KeyboardInterrupt that landed during a
train step (`StepInterrupted`, raised once the step is committed).
`train.main` prints a `TrainingFault`'s message, without a traceback.
"""

from __future__ import annotations

import math
import os

from train.run.inputs import run_config
from train.run.reporting import cost_report
from train.run.step import steps


class TrainingFault(RuntimeError):
  """A fault that ends a run; its message is the one line to show."""


class NonFiniteError(TrainingFault):
  """The loss or the updated state is not finite (NaN or Inf)."""


class OutOfMemoryError(TrainingFault):
  """The device ran out of memory (XLA's RESOURCE_EXHAUSTED)."""


class StepInterrupted(KeyboardInterrupt):
  """A KeyboardInterrupt during a train step, raised once the step that
  was under way is committed; `metrics` are its host metrics."""

  def __init__(self, metrics: dict):
    super().__init__()
    self.metrics = metrics


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA running out of device memory.

  XLA raises `jax.errors.JaxRuntimeError` (a RuntimeError) whose message
  starts with its status, RESOURCE_EXHAUSTED; tensorstore's disk-full
  errors use that status too, but as ValueErrors.
  """
  return isinstance(error, RuntimeError) and (
      "RESOURCE_EXHAUSTED" in str(error)
  )


def out_of_memory_error(
    run: run_config.RunConfig,
    error: BaseException,
    *,
    when: str,
    memory: steps.StepMemory | None = None,
) -> OutOfMemoryError:
  """The one-line OutOfMemoryError for `error`, met `when`.

  It names XLA's complaint, the estimate for the run's flags (XLA's figure
  for the compiled step where known, and the analytic one) and the flags
  that lower it.
  """
  said = (str(error).strip().splitlines() or [""])[0][:200]
  analytic = cost_report.analytic_bytes_per_device(run)
  if memory is not None:
    estimate = (
        f"the compiled train step needs {cost_report.human_bytes(memory.total)}"
        f" per device (XLA; the analytic estimate is "
        f"{cost_report.human_bytes(analytic)})"
    )
  else:
    estimate = (
        f"the analytic estimate is {cost_report.human_bytes(analytic)} per "
        "device (--dry_run also prints XLA's figure for the compiled step)"
    )
  remedies = cost_report.memory_remedies(
      run,
      "; fsdp, expert and tensor split the weights, data, fsdp and expert "
      "the batch",
  )
  return OutOfMemoryError(
      f"out of device memory {when} ({said}); {estimate}. {remedies}"
  )


def non_finite_message(
    run: run_config.RunConfig,
    step: int,
    loss: float,
    newest_checkpoint: str | None,
) -> str:
  """The one line of a `NonFiniteError` at `step` of `run` whose loss is
  `loss`; it names `newest_checkpoint` (a path, or None) to resume from."""
  if math.isfinite(loss):
    what = (
        f"the update made the parameters or optimiser state non-finite "
        f"(the loss, {loss:.4g}, was finite)"
    )
  else:
    what = f"the loss is {loss}"
  resume = (
      f"--resume continues from {os.path.basename(newest_checkpoint)}"
      if newest_checkpoint
      else "no checkpoint was saved yet"
  )
  return (
      f"step {step}: {what}; the run stopped, keeping and saving nothing "
      f"of this step. Lower --learning_rate (now {run.learning_rate:g})"
      f" or raise --warmup_steps (now {run.warmup_steps}); {resume}."
  )
