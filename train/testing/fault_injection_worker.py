r"""A tiny training run that SIGKILLs itself at a chosen point, for
fault_injection_test.py.

Trains small_runs.SMALL_DSV3 (batch 2 in 2 microbatches, 16 tokens, layers
scanned, a checkpoint every step, the newest 2 kept) into DIR, as `python
-m train.main` would; with --resume it resumes from the newest checkpoint,
then restores the older one too, so that a damaged checkpoint cannot hide
behind a good one. --kill sends SIGKILL at one point (`PHASES`) of a save
or of the metrics log; a run that finishes writes --final (its state's
leaves, in tree order, and its loss history). Usage:
    python train/testing/fault_injection_worker.py --output_dir=DIR \
        --steps=12 [--resume] [--kill=PHASE:STEP[:SECONDS]] [--final=FILE.npz]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

# Run as a script: the workspace root, one level up, must be importable.
# The workspace root: this file is train/<package>/<name>.py.
_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

# pylint: disable=g-import-not-at-top
import jax  # noqa: E402
import numpy as np  # noqa: E402

from train import platforms  # noqa: E402
from train.checkpoints import checkpoint  # noqa: E402
from train.checkpoints import checkpoint_dirs  # noqa: E402
from train.checkpoints import checkpoint_meta  # noqa: E402
from train.run.reporting import step_log  # noqa: E402
from train.run.training import trainer  # noqa: E402
from train.testing import small_runs  # noqa: E402

# pylint: enable=g-import-not-at-top

# A checkpoint the run cannot use ends it with this code after a line
#   REFUSED CheckpointError: <message>
REFUSED_EXIT_CODE = 3
# A run that ends without reaching its kill point (a timer is waited for:
# it fires).
MISSED_EXIT_CODE = 4
# Where --kill=PHASE:STEP[:SECONDS] sends SIGKILL (STEP: the step saved or
# logged):
#   timer      SECONDS after the save of STEP begins, wherever that lands
#   item       before Orbax renames the first written item of the save of
#              STEP (state/) into place
#   finalize   before Orbax renames the save of STEP into place
#   committed  right after that rename, before pruning
#   prune      right after the first old checkpoint is renamed for
#              deletion (STEP unused)
#   replaced   right after a re-save of STEP moved the old copy aside
#   log        halfway through writing the metrics record of STEP
#   trim       before the trimmed metrics log of a resume replaces the old
PHASES = (
    "timer",
    "item",
    "finalize",
    "committed",
    "prune",
    "replaced",
    "log",
    "trim",
)


def _run_config(output_dir: str, steps: int, resume: bool):
  """The run every worker of a test trains (the same but for `resume`)."""
  return small_runs.small_run(
      output_dir,
      steps=steps,
      batch_size=2,
      seq_len=16,
      checkpoint_every=1,
      keep_checkpoints=2,
      eval_batches=1,
      resume=resume,
      # The program as it runs at scale: layers scanned (the default) and
      # gradients accumulated over microbatches.
      scan_layers=True,
      microbatches=2,
  )


def _die() -> None:
  os.kill(os.getpid(), signal.SIGKILL)


def _orbax_temporary(step: int) -> str:
  """Where Orbax writes the save of `step` before renaming it into place."""
  return f"step_{step:08d}.orbax-checkpoint-tmp"


class _KillSwitch:
  """Patches the calls that mark each phase so that PHASE's kills us."""

  def __init__(self, phase: str, step: int, seconds: float):
    self.phase, self.step, self.seconds = phase, step, seconds
    self.timer = None

  def arm(self, metrics_path: str) -> None:
    """Patches the calls of this process; `metrics_path` is the run's log."""
    real_rename, real_replace = os.rename, os.replace
    real_save = checkpoint.Checkpointer.save
    real_append = step_log.MetricsLog.append

    def rename(src, dst, *args, **kwargs):
      src_name, dst_name = os.path.basename(src), os.path.basename(dst)
      parent = os.path.basename(os.path.dirname(src))
      ours = _orbax_temporary(self.step)
      if (self.phase == "item" and parent == ours) or (
          self.phase == "finalize" and src_name == ours
      ):
        _die()
      result = real_rename(src, dst, *args, **kwargs)
      if (
          (self.phase == "committed" and src_name == ours)
          or (self.phase == "prune" and dst_name.startswith(".deleting-"))
          or (
              self.phase == "replaced"
              and dst_name.startswith(f".replaced-step_{self.step:08d}")
          )
      ):
        _die()
      return result

    def replace(src, dst, *args, **kwargs):
      if self.phase == "trim" and os.path.basename(src).startswith(
          ".metrics.jsonl."
      ):
        _die()
      return real_replace(src, dst, *args, **kwargs)

    def save(checkpointer, step, state, extra=None):
      if self.phase == "timer" and step == self.step and self.timer is None:
        self.timer = threading.Timer(self.seconds, _die)
        self.timer.start()
      return real_save(checkpointer, step, state, extra)

    def append(log, record):
      if self.phase == "log" and record["step"] == self.step:
        line = (json.dumps(record) + "\n").encode()
        with open(metrics_path, "ab") as f:
          f.write(line[: len(line) // 2])
        _die()
      real_append(log, record)

    os.rename, os.replace = rename, replace
    checkpoint.Checkpointer.save = save
    step_log.MetricsLog.append = append

  def finish(self) -> None:
    """The run ended: a pending timer still fires; any other phase missed."""
    if self.timer is not None:
      self.timer.join()
    print(f"KILL POINT NOT REACHED {self.phase}:{self.step}", flush=True)
    sys.exit(MISSED_EXIT_CODE)


def _parse_kill(text: str) -> _KillSwitch:
  parts = text.split(":")
  if parts[0] not in PHASES or len(parts) not in (2, 3):
    raise ValueError(
        f"--kill: expected PHASE:STEP[:SECONDS] with PHASE in {PHASES}, "
        f"got {text!r}."
    )
  seconds = float(parts[2]) if len(parts) == 3 else 0.0
  return _KillSwitch(parts[0], int(parts[1]), seconds)


def _restore_older_checkpoints(tr: trainer.Trainer) -> None:
  """Restores (verifies) all checkpoints but the newest, which resumed."""
  for _, path in checkpoint_dirs.list_checkpoints(tr.checkpoint_dir)[:-1]:
    tr.checkpointer.restore(path, tr.state)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      description="A tiny training run that SIGKILLs itself at a chosen point."
  )
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--resume", action="store_true")
  parser.add_argument("--kill", type=_parse_kill, default=None)
  parser.add_argument("--final", default=None)
  args = parser.parse_args(argv)

  run = _run_config(args.output_dir, args.steps, args.resume)
  tr = trainer.Trainer(run, small_runs.corpus(), out=sys.stdout)
  if args.kill is not None:
    args.kill.arm(os.path.join(args.output_dir, "metrics.jsonl"))
  try:
    tr.prepare_output_dir()
    if args.resume:
      _restore_older_checkpoints(tr)
  except checkpoint_meta.CheckpointError as e:
    print(f"REFUSED {type(e).__name__}: {e}", flush=True)
    sys.exit(REFUSED_EXIT_CODE)
  tr.fit()
  tr.close()
  if args.kill is not None:
    args.kill.finish()
  if args.final:
    leaves = [np.asarray(x) for x in jax.tree.leaves(tr.state)]
    np.savez(
        args.final,
        *leaves,
        history_loss=np.asarray(tr.history["loss"], np.float64),
    )
  print("DONE", flush=True)


if __name__ == "__main__":
  platforms.set_default_platforms()
  main(sys.argv[1:])
