"""A failed checkpoint save, told in one line: its cause, the space needed.

A failed save (a full disk, most often) raises `CheckpointSaveError`, one
line naming the step, the directory, the bytes the checkpoint needs and
what is left to resume from (`what_is_intact`): `Checkpointer.save`
(`checkpoint.py`) refuses at once when the directory's filesystem has
less free space (`free_bytes`) than one uncompressed copy of the state
(`bytes_to_write`); a write that fails later, in Orbax's background thread,
is raised by the next `poll` (the trainer polls after every step), `wait`,
`save` or `close`, its cause read from the exception (`is_disk_full`,
`first_line`) rather than from Orbax's tracebacks. The checkpoints saved
before it are left as they were: old ones are pruned only after a new one
lands.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import jax
import numpy as np

from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_meta
from train.parallel import distributed


class CheckpointSaveError(checkpoint_meta.CheckpointError):
  """A checkpoint that could not be written (a full disk, most often).

  Attributes:
    step: the step whose save failed.
    directory: where it was being written.
    needed: the bytes it needs on this process (uncompressed), or None.
  """

  def __init__(self, message: str, *, step: int, directory: str, needed):
    super().__init__(message)
    self.step = step
    self.directory = directory
    self.needed = needed


# What Orbax, tensorstore and the filesystem raise for a save that failed
# (tensorstore's write errors are ValueErrors); anything else is a bug,
# and keeps its traceback.
SAVE_FAILURES = (OSError, ValueError, RuntimeError)


def free_bytes(directory: str) -> int:
  """Bytes an unprivileged writer may still put on `directory`'s filesystem.

  `Checkpointer.save` checks this against the bytes a checkpoint needs
  before it writes anything. Tests replace this function (mock.patch) to
  stage a full disk.
  """
  return shutil.disk_usage(directory).free


def bytes_to_write(leaves: list, meta: dict) -> int:
  """Uncompressed bytes this process writes for one checkpoint.

  Each process writes one copy of each shard it holds (replica 0);
  process 0 also writes the host (numpy) leaves and meta.json.
  """
  main = distributed.is_main_process()
  total = len(json.dumps(meta)) if main else 0
  for leaf in leaves:
    if isinstance(leaf, jax.Array):
      total += sum(
          shard.data.nbytes
          for shard in leaf.addressable_shards
          if shard.replica_id == 0
      )
    elif main:
      total += np.asarray(leaf).nbytes
  return total


def human_bytes(n: float) -> str:
  """`n` bytes as a message gives them: "19.9 MiB"."""
  for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB")):
    if n >= scale:
      return f"{n / scale:.3g} {suffix}"
  return f"{n / 2**10:.3g} KiB" if n >= 2**10 else f"{n:.0f} B"


# errno of a full filesystem or quota, also as tensorstore spells it in its
# messages ("No space left on device [os_error_code='28']").
_FULL = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = tuple(os.strerror(e) for e in _FULL) + tuple(
    f"os_error_code='{e}'" for e in _FULL
)


def is_disk_full(error: BaseException) -> bool:
  """Whether `error` (or one it was raised from) says the disk is full."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _FULL:
      return True
    if any(text in str(error) for text in _FULL_TEXT):
      return True
    error = error.__cause__ or error.__context__
  return False


def first_line(error: BaseException, limit: int = 300) -> str:
  """`error`'s type and the first line of its message, for a one-line
  report."""
  # Tensorstore appends its whole JSON spec: the head says what failed.
  text = str(error).split(" [tensorstore_spec", 1)[0]
  text = (text.strip().splitlines() or [""])[0]
  return f"{type(error).__name__}: {text[:limit]}"


def what_is_intact(directory: str) -> str:
  """What is left to resume from, and how to go on: the end of a save
  failure's message."""
  ours = [
      p
      for _, p in checkpoint_dirs.list_checkpoints(directory)
      if checkpoint_dirs.is_ours(p)
  ]
  if not ours:
    return (
        "No earlier checkpoint was saved. Free space there and run again, "
        "or pass another --output_dir."
    )
  return (
      "The checkpoints saved before it are intact (newest: "
      f"{os.path.basename(ours[-1])}). Free space there and rerun with "
      "--resume, or start again with another --output_dir."
  )
