"""Where checkpoints live in a run's directory, which are ours, and cleanup.

A checkpoint is the directory `<dir>/step_00000300/`, written by Orbax: in
it `state/` holds every leaf of the state as a tensorstore array (each
process writes the shards it holds) and `meta/meta.json` the step, data
position, run fingerprint and one entry per leaf (`checkpoint_meta.py`),
written by process 0. Orbax writes a checkpoint into
`step_00000300.orbax-checkpoint-tmp` and renames it into place once every
process has finished, so a crash mid-save leaves the previous checkpoints
intact and never a half-written `step_*`. What a killed save or deletion
leaves behind (Orbax's temporary directory, this package's hidden ones) is
never listed, and `remove_leftovers` deletes it or puts it back. Only
directories this program wrote are ever deleted (pruned, replaced, or
cleared by `remove_checkpoints`): a `step_*` is recognised by its meta.json
(`is_ours`); anything else in the directory is left alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid

STEP_DIR = re.compile(r"^step_(\d{8})$")  # A checkpoint's name.
ARRAYS = "state"  # The Orbax item holding the arrays.
META_ITEM = "meta"  # The Orbax item holding meta.json.
META_FILE = "meta.json"
META = os.path.join(META_ITEM, META_FILE)  # Relative to a checkpoint.
OLD_META = "meta.json"  # Format 1 kept it at the top, beside arrays.npz.
# meta.json's mark of this program, which `is_ours` looks for. Checkpoints
# written before it existed are recognised by their format_version and step.
# The text is part of the format: older checkpoints carry it as it is.
WRITER = "dropless train/checkpoint.py"
WRITER_KEY = "writer"

# Names of what an interrupted save or deletion leaves in the directory.
ORBAX_TEMPORARY = ".orbax-checkpoint-tmp"  # Orbax 0.12: step_*<this>[-ts].
_DELETING = ".deleting-"  # `remove_checkpoint`: a checkpoint being deleted.
# `Checkpointer.save`: the old copy of a step saved again.
REPLACED = re.compile(r"^\.replaced-(step_\d{8})-[0-9a-f]+$")


def step_dir(directory: str, step: int) -> str:
  """The path of the checkpoint of `step` in `directory`."""
  return os.path.join(directory, f"step_{step:08d}")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
  """(step, path) of every finalised checkpoint in `directory`, oldest first.

  Only directories named `step_<8 digits>` are listed: Orbax gives that
  name to a save by its last act, a rename. Unfinished saves
  (`step_*.orbax-checkpoint-tmp`) and the hidden directories named here are
  not; whether a listed one is whole, `restore` checks.
  """
  if not os.path.isdir(directory):
    return []
  found = []
  for name in os.listdir(directory):
    match = STEP_DIR.match(name)
    path = os.path.join(directory, name)
    if match and os.path.isdir(path):
      found.append((int(match.group(1)), path))
  return sorted(found)


def latest(directory: str) -> str | None:
  """The path of the newest checkpoint in `directory`, or None."""
  found = list_checkpoints(directory)
  return found[-1][1] if found else None


def remove_leftovers(directory: str) -> list[str]:
  """Clears what killed saves left in `directory`; returns what it did.

  Deletes Orbax's unfinished saves and half-deleted checkpoints. An old
  copy that a save of the same step moved aside (see `Checkpointer.save`)
  is put back if the new one never landed, else deleted. Call it on one
  process, while no save is running.

  Returns:
    One line per directory removed or put back, for the run's log.
  """
  if not os.path.isdir(directory):
    return []
  done = []
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    replaced = REPLACED.match(name)
    if replaced and not os.path.exists(os.path.join(directory, replaced[1])):
      os.rename(path, os.path.join(directory, replaced[1]))
      done.append(
          f"put back {replaced[1]} from {name}: a save of the same step "
          "was interrupted"
      )
    elif replaced or name.startswith(_DELETING) or ORBAX_TEMPORARY in name:
      shutil.rmtree(path, ignore_errors=True)
      done.append(f"removed {name}, left by an interrupted save or deletion")
  return done


def is_ours(path: str) -> bool:
  """Whether `path`, a `step_*` directory, is a checkpoint this program wrote.

  Its meta.json says so: it carries `WRITER`, or (checkpoints written
  before the mark) an int format_version and the step of the directory's
  name. Nothing is verified beyond that; `restore` verifies.
  """
  name = os.path.basename(os.path.normpath(path))
  match = STEP_DIR.match(name)
  if match is None:
    return False
  for meta_file in (META, OLD_META):
    try:
      with open(os.path.join(path, meta_file)) as f:
        meta = json.load(f)
    except (OSError, ValueError):
      continue
    if not isinstance(meta, dict):
      continue
    if meta.get(WRITER_KEY) == WRITER:
      return True
    version = meta.get("format_version")
    if isinstance(version, int) and meta.get("step") == int(match[1]):
      return True
  return False


def foreign_step_dirs(directory: str) -> list[str]:
  """Names of the `step_*` directories in `directory` not written here.

  A fresh run refuses to start beside them: its own saves could meet
  their names.
  """
  return [
      os.path.basename(path)
      for _, path in list_checkpoints(directory)
      if not is_ours(path)
  ]


def remove_checkpoints(directory: str) -> list[str]:
  """Deletes the checkpoints in `directory` that this program wrote.

  Each is renamed out of sight first, so a crash midway leaves every
  `step_*` whole. Other files and directories stay, `step_*` ones that
  `is_ours` does not recognise too.

  Returns:
    The names of the checkpoints removed.
  """
  removed = []
  for _, path in list_checkpoints(directory):
    if is_ours(path):
      remove_checkpoint(path)
      removed.append(os.path.basename(path))
  return removed


def remove_checkpoint(path: str) -> None:
  """Deletes a checkpoint: renamed out of sight first, so a crash midway
  never leaves a half-deleted `step_*` that looks complete."""
  hidden = os.path.join(
      os.path.dirname(path),
      f"{_DELETING}{os.path.basename(path)}-{uuid.uuid4().hex}",
  )
  try:
    os.rename(path, hidden)
  except FileNotFoundError:
    return
  shutil.rmtree(hidden, ignore_errors=True)
