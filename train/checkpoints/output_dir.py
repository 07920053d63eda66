"""A run's --output_dir: taking it on every process, readying its checkpoints.

Process 0 holds the directory's lock (`output_lock.py`) and every
process learns whether it did, so that all stop together or none does.
Before the first step the checkpoint directory is readied: what killed
saves left behind is deleted, and then a resumed run finds its newest
checkpoint, a fresh one deletes this program's old ones.
"""

from __future__ import annotations

from typing import Callable

from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_meta
from train.checkpoints import output_lock
from train.parallel import distributed


def take(output_dir: str, is_main: bool) -> output_lock.OutputDirLock | None:
  """Process 0 (`is_main`) takes `output_dir`'s lock, which it returns
  (the other processes get None) once every process knows it did.

  Raises:
    output_lock.OutputDirBusyError: another run holds it (process 0's
      message names the holder); on the other processes, one line
      saying that process 0 could not take it.
  """
  lock, error = None, None
  if is_main:
    try:
      lock = output_lock.OutputDirLock(output_dir).acquire()
    except (output_lock.OutputDirBusyError, OSError) as e:
      error = e
  # All processes stop together, or none does.
  if not distributed.all_true(error is None):
    if error is not None:
      raise error
    raise output_lock.OutputDirBusyError(
        f"--output_dir={output_dir!r}: process 0 of this run "
        "could not take the directory's lock; its output says why."
    )
  return lock


def prepare_checkpoints(
    checkpoint_dir: str,
    *,
    resume: bool,
    is_main: bool,
    say: Callable[[str], None],
) -> str | None:
  """Readies `checkpoint_dir`; returns the checkpoint to `resume` from.

  First deletes what killed saves left behind (process 0), saying so
  (`say`). A fresh run deletes only the `step_*` checkpoints this program
  wrote (`checkpoint_dirs.is_ours`), and returns None; it refuses to start
  beside `step_*` directories of any other origin, whose names its saves
  could meet.

  Raises:
    checkpoint_meta.CheckpointError: nothing to resume, or foreign
      `step_*` directories in the way of a fresh run.
  """
  if is_main:
    for line in checkpoint_dirs.remove_leftovers(checkpoint_dir):
      say(f"{checkpoint_dir}: {line}")
  # No process may list the checkpoints before the leftovers are gone.
  distributed.barrier("dropless_checkpoint_leftovers")
  found = checkpoint_dirs.list_checkpoints(checkpoint_dir)
  if resume:
    if not found:
      raise checkpoint_meta.CheckpointError(
          f"--resume: no checkpoint in {checkpoint_dir!r}; run without "
          "--resume to start a new run."
      )
    return found[-1][1]
  if found:
    foreign = checkpoint_dirs.foreign_step_dirs(checkpoint_dir)
    if foreign:
      raise checkpoint_meta.CheckpointError(
          f"{checkpoint_dir!r} holds {foreign[:5]} (showing up to 5), "
          "which this program did not write (no meta.json of its own); a "
          "fresh run deletes only its own checkpoints, and its saves could "
          "meet these names: move them out, or pass another --output_dir."
      )
    say(
        f"starting fresh: removing {len(found)} checkpoint(s) of a "
        f"previous run in {checkpoint_dir} (pass --resume to "
        "continue it instead)"
    )
    if is_main:
      checkpoint_dirs.remove_checkpoints(checkpoint_dir)
    # No process may look for checkpoints until they are gone.
    distributed.barrier("dropless_fresh_output_dir")
  return None
