"""Atomic, verified, sharded checkpoints of a training state pytree (Orbax).

Layout of one checkpoint, `<dir>/step_00000300/`, written by Orbax:

    state/           every leaf of the state as a tensorstore array; each
                     process writes the shards it holds
    meta/meta.json   step, data position, run fingerprint and one entry per
                     leaf (tree path, shape, dtype, checksum), and a
                     checksum of each of these fields; written by process 0

Orbax writes a checkpoint into `step_00000300.orbax-checkpoint-tmp` and
renames it into place once every process has finished, so a crash mid-save
leaves the previous checkpoints intact and never a half-written `step_*`.
What a killed save leaves behind (Orbax's temporary directory, this
module's hidden ones) is never listed, and `remove_leftovers` deletes it.
Saving may be asynchronous: `Checkpointer.save` returns once the arrays are
copied off the devices, and `wait()` blocks until they are on disk.

Tensorstore keeps no checksum, so `save` records one per leaf, computed on
the devices from the global array (see `checksums`): it does not depend on
the sharding or the number of processes, and `restore` recomputes it on
the arrays it read, whatever mesh they were restored onto. Every field of
meta.json has a checksum too, and its step must be the one the directory
is named after. Restoring also checks the fingerprint (a different model
or data setup) and every leaf's path, shape and dtype against the state
the caller built; any difference raises `CheckpointError` naming it.
Nothing falls back to a fresh start.

A failed save (a full disk, most often) raises `CheckpointSaveError`, one
line naming the step, the directory and the bytes the checkpoint needs:
`save` refuses at once when the directory's filesystem has less free space
than one uncompressed copy of the state; a write that fails later, in
Orbax's background thread, is raised by the next `poll` (the trainer polls
after every step), `wait`, `save` or `close`. The checkpoints saved before
it are left as they were: old ones are pruned only after a new one lands.

Only directories this module wrote are ever deleted (pruned, replaced, or
cleared by `remove_checkpoints`): a `step_*` is recognised by its
meta.json (`is_ours`); anything else in the directory is left alone.

Every process calls `save`, `restore`, `wait`, `poll` and `close`
together, as Orbax expects; more than one process needs `jax.distributed`.
"""

from __future__ import annotations

import errno
import functools
import itertools
import json
import logging
import os
import re
import shutil
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp

from train import checksum
from train import distributed

# Version 3 added the checksums of meta.json's fields. Version 2 is refused:
# without them its step, data position and history cannot be verified, and
# a resume from an edited or damaged meta.json would go unnoticed.
FORMAT_VERSION = 3
_STEP_DIR = re.compile(r"^step_(\d{8})$")
ARRAYS = "state"  # The Orbax item holding the arrays.
_META_ITEM = "meta"  # The Orbax item holding meta.json.
_META_FILE = "meta.json"
META = os.path.join(_META_ITEM, _META_FILE)  # Relative to a checkpoint.
_OLD_META = "meta.json"  # Format 1 kept it at the top, beside arrays.npz.
_META_KEYS = ("format_version", "step", "fingerprint", "leaves", "extra")
# meta.json's mark of this program, which `is_ours` looks for. Checkpoints
# written before it existed are recognised by their format_version and step.
WRITER = "dropless train/checkpoint.py"
_WRITER_KEY = "writer"
_META_CHECKSUMS = "field_checksums"  # {field: checksum of its JSON}.
_LEAF_KEYS = frozenset(("path", "shape", "dtype", "checksum"))


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored: corrupt, partial or mismatched."""


class CheckpointSaveError(CheckpointError):
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


class _HideOrbaxInfo(logging.Filter):
  """Drops Orbax's INFO and DEBUG records (several lines per save), and the
  tracebacks it logs for a failed background save.

  Orbax logs through absl, whose records all go to the "absl" logger; this
  filter keeps everyone else's records and Orbax's warnings and errors, but
  those that carry a traceback: Orbax logs a failed write once per thread
  it passed through (hundreds of lines), then hands the exception to
  `wait`, which `Checkpointer` turns into one `CheckpointSaveError` line.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f"{os.sep}orbax{os.sep}" in record.pathname
    if not from_orbax:
      return True
    if record.levelno >= logging.ERROR and record.exc_info:
      return False
    return record.levelno >= logging.WARNING


def _quiet_orbax() -> None:
  absl_logger = logging.getLogger("absl")
  if not any(isinstance(f, _HideOrbaxInfo) for f in absl_logger.filters):
    absl_logger.addFilter(_HideOrbaxInfo())


_quiet_orbax()


def step_dir(directory: str, step: int) -> str:
  return os.path.join(directory, f"step_{step:08d}")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
  """(step, path) of every finalised checkpoint in `directory`, oldest first.

  Only directories named `step_<8 digits>` are listed: Orbax gives that
  name to a save by its last act, a rename. Unfinished saves
  (`step_*.orbax-checkpoint-tmp`) and this module's hidden directories are
  not; whether a listed one is whole, `restore` checks.
  """
  if not os.path.isdir(directory):
    return []
  found = []
  for name in os.listdir(directory):
    match = _STEP_DIR.match(name)
    path = os.path.join(directory, name)
    if match and os.path.isdir(path):
      found.append((int(match.group(1)), path))
  return sorted(found)


def latest(directory: str) -> str | None:
  found = list_checkpoints(directory)
  return found[-1][1] if found else None


# Names of what an interrupted save or deletion leaves in the directory.
_ORBAX_TEMPORARY = ".orbax-checkpoint-tmp"  # Orbax 0.12: step_*<this>[-ts].
_DELETING = ".deleting-"  # `_remove`: a checkpoint being deleted.
_REPLACED = re.compile(r"^\.replaced-(step_\d{8})-[0-9a-f]+$")  # `save`.


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
    replaced = _REPLACED.match(name)
    if replaced and not os.path.exists(os.path.join(directory, replaced[1])):
      os.rename(path, os.path.join(directory, replaced[1]))
      done.append(
          f"put back {replaced[1]} from {name}: a save of the same step "
          "was interrupted"
      )
    elif replaced or name.startswith(_DELETING) or _ORBAX_TEMPORARY in name:
      shutil.rmtree(path, ignore_errors=True)
      done.append(f"removed {name}, left by an interrupted save or deletion")
  return done


def is_ours(path: str) -> bool:
  """Whether `path`, a `step_*` directory, is a checkpoint this module wrote.

  Its meta.json says so: it carries `WRITER`, or (checkpoints written
  before the mark) an int format_version and the step of the directory's
  name. Nothing is verified beyond that; `restore` verifies.
  """
  name = os.path.basename(os.path.normpath(path))
  match = _STEP_DIR.match(name)
  if match is None:
    return False
  for meta_file in (META, _OLD_META):
    try:
      with open(os.path.join(path, meta_file)) as f:
        meta = json.load(f)
    except (OSError, ValueError):
      continue
    if not isinstance(meta, dict):
      continue
    if meta.get(_WRITER_KEY) == WRITER:
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
  """Deletes the checkpoints in `directory` that this module wrote.

  Each is renamed out of sight first, so a crash midway leaves every
  `step_*` whole. Other files and directories stay, `step_*` ones that
  `is_ours` does not recognise too.

  Returns:
    The names of the checkpoints removed.
  """
  removed = []
  for _, path in list_checkpoints(directory):
    if is_ours(path):
      _remove(path)
      removed.append(os.path.basename(path))
  return removed


# --- Reading ------------------------------------------------------------------


def _leaves(tree):
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in with_path]
  return paths, [leaf for _, leaf in with_path], treedef


def _leaf_key(i: int) -> str:
  return f"leaf_{i:05d}"


def _field_checksum(value) -> int:
  """The checksum of one meta.json field: of its canonical JSON text."""
  text = json.dumps(value, sort_keys=True, separators=(",", ":"))
  return checksum.of_bytes(text.encode())


def _with_field_checksums(meta: dict) -> dict:
  """`meta` as JSON will read it back, plus the checksums of its fields."""
  # The round trip turns tuples into lists and keys into strings first, so
  # that the checksums are those of what a reader will find.
  meta = json.loads(json.dumps(meta))
  meta[_META_CHECKSUMS] = {k: _field_checksum(v) for k, v in meta.items()}
  return meta


def _load_meta_json(path: str) -> dict:
  """meta.json of checkpoint `path` as a dict, unchecked."""
  meta_path = os.path.join(path, META)
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except FileNotFoundError as e:
    if os.path.isfile(os.path.join(path, _OLD_META)):
      raise CheckpointError(
          f"checkpoint {path!r} has format version 1 (arrays.npz); this "
          f"program reads version {FORMAT_VERSION}."
      ) from e
    raise CheckpointError(
        f"checkpoint {path!r} is incomplete or corrupt: {META} is missing."
    ) from e
  except (OSError, ValueError) as e:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {META} is not valid JSON ({e})."
    ) from e
  if not isinstance(meta, dict):
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {META} holds a "
        f"{type(meta).__name__}, expected an object."
    )
  return meta


def _check_field_checksums(path: str, meta: dict) -> None:
  recorded = meta.get(_META_CHECKSUMS)
  if not isinstance(recorded, dict):
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {META} lacks {_META_CHECKSUMS!r}."
    )
  fields = set(meta) - {_META_CHECKSUMS}
  if set(recorded) != fields:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt or was edited: {META} has the "
        f"fields {sorted(fields)}, its checksums cover {sorted(recorded)}."
    )
  for key in sorted(fields):
    found = _field_checksum(meta[key])
    if found != recorded[key]:
      raise CheckpointError(
          f"checkpoint {path!r} is corrupt or was edited: {META} field "
          f"{key!r} has checksum {found}, the checkpoint recorded "
          f"{recorded[key]}."
      )


def _check_step(path: str, meta: dict) -> None:
  """The recorded step must be the one the directory is named after."""
  step = meta["step"]
  if not isinstance(step, int) or isinstance(step, bool) or step < 0:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {META} records step {step!r}, "
        "expected an int >= 0."
    )
  name = os.path.basename(os.path.normpath(path))
  match = _STEP_DIR.match(name)
  if match is None or int(match[1]) != step:
    raise CheckpointError(
        f"checkpoint {path!r}: {META} records step {step}, but the "
        f"directory is named {name!r}; expected {step_dir('', step)!r}."
    )


def read_meta(path: str) -> dict:
  """meta.json of checkpoint `path`, verified; or CheckpointError.

  Every field must match its recorded checksum, and the step the name of
  the directory (`step_<8 digits>`).
  """
  meta = _load_meta_json(path)
  if "format_version" not in meta:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {META} lacks 'format_version'."
    )
  version = meta["format_version"]
  if version != FORMAT_VERSION:
    why = " (its meta.json has no checksums)" if version == 2 else ""
    raise CheckpointError(
        f"checkpoint {path!r} has format version {version}{why}; this "
        f"program reads version {FORMAT_VERSION}. Resume it with the "
        "program that wrote it, or start a new --output_dir."
    )
  _check_field_checksums(path, meta)
  for key in _META_KEYS:
    if key not in meta:
      raise CheckpointError(
          f"checkpoint {path!r} is corrupt: {META} lacks {key!r}."
      )
  _check_step(path, meta)
  for i, entry in enumerate(meta["leaves"]):
    if not isinstance(entry, dict) or not _LEAF_KEYS <= set(entry):
      raise CheckpointError(
          f"checkpoint {path!r} is corrupt: {META} leaf entry {i} must "
          f"have {sorted(_LEAF_KEYS)}, got {entry!r}."
      )
  return meta


def _fingerprint_diff(saved: dict, expected: dict, prefix="") -> list[str]:
  diffs = []
  for key in sorted(set(saved) | set(expected)):
    a, b = saved.get(key, "<absent>"), expected.get(key, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
      diffs += _fingerprint_diff(a, b, f"{prefix}{key}.")
    elif a != b:
      diffs.append(f"{prefix}{key}: checkpoint has {a!r}, this run has {b!r}")
  return diffs


def _restore_target(leaf):
  """What Orbax restores a template leaf as: its sharding, or numpy."""
  sharding = getattr(leaf, "sharding", None)
  shape, dtype = tuple(np.shape(leaf)), _dtype(leaf)
  if sharding is None:
    return np.zeros(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _dtype(leaf) -> np.dtype:
  dtype = getattr(leaf, "dtype", None)
  return np.dtype(np.asarray(leaf).dtype if dtype is None else dtype)


def _check_layout(path: str, meta: dict, paths: list[str], leaves: list):
  saved = meta["leaves"]
  saved_paths = [s["path"] for s in saved]
  if saved_paths != paths:
    missing = sorted(set(paths) - set(saved_paths))
    unexpected = sorted(set(saved_paths) - set(paths))
    raise CheckpointError(
        f"checkpoint {path!r} holds a different state structure: missing "
        f"{missing[:5]}, unexpected {unexpected[:5]} (showing up to 5)."
    )
  for leaf_path, leaf, entry in zip(paths, leaves, saved):
    shape, dtype = tuple(np.shape(leaf)), _dtype(leaf)
    if tuple(entry["shape"]) != shape or entry["dtype"] != dtype.name:
      raise CheckpointError(
          f"checkpoint {path!r}: leaf {leaf_path} must be {dtype.name}"
          f"{list(shape)}, got {entry['dtype']}{entry['shape']}."
      )


def _read(orbax_checkpointer, path: str, template, fingerprint: dict):
  """Checks and loads checkpoint `path`; see `restore`."""
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint {path!r} does not exist.")
  meta = read_meta(path)
  if not os.path.isdir(os.path.join(path, ARRAYS)):
    raise CheckpointError(
        f"checkpoint {path!r} is incomplete: {ARRAYS}/ is missing."
    )
  diffs = _fingerprint_diff(meta["fingerprint"], fingerprint)
  if diffs:
    raise CheckpointError(
        f"checkpoint {path!r} was saved by a different run configuration; "
        "resume with the same settings or start a new --output_dir: "
        + "; ".join(diffs)
        + "."
    )
  paths, leaves, treedef = _leaves(template)
  _check_layout(path, meta, paths, leaves)
  target = {_leaf_key(i): _restore_target(x) for i, x in enumerate(leaves)}
  try:
    loaded = orbax_checkpointer.restore(
        path,
        args=ocp.args.Composite(**{ARRAYS: ocp.args.StandardRestore(target)}),
    )[ARRAYS]
    restored = [loaded[_leaf_key(i)] for i in range(len(leaves))]
  except Exception as e:  # Tensorstore and Orbax raise many kinds.
    # Tensorstore appends its whole JSON spec: the head says what failed.
    reason = str(e).split(" [tensorstore_spec", 1)[0][:300]
    raise CheckpointError(
        f"checkpoint {path!r} is incomplete or corrupt: cannot read "
        f"{ARRAYS}/ ({type(e).__name__}: {reason})."
    ) from e
  for leaf_path, found, entry in zip(
      paths, checksum.checksums(restored), meta["leaves"]
  ):
    if found != entry["checksum"]:
      raise CheckpointError(
          f"checkpoint {path!r} is corrupt: leaf {leaf_path} has checksum "
          f"{found}, the checkpoint recorded {entry['checksum']}."
      )
  return jax.tree_util.tree_unflatten(treedef, restored), meta


# --- Writing ------------------------------------------------------------------


def free_bytes(directory: str) -> int:
  """Bytes an unprivileged writer may still put on `directory`'s filesystem.

  `Checkpointer.save` checks this against the bytes a checkpoint needs
  before it writes anything. Tests replace this function (mock.patch) to
  stage a full disk.
  """
  return shutil.disk_usage(directory).free


def _bytes_to_write(leaves: list, meta: dict) -> int:
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


def _human_bytes(n: float) -> str:
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


def _is_disk_full(error: BaseException) -> bool:
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


def _first_line(error: BaseException, limit: int = 300) -> str:
  # Tensorstore appends its whole JSON spec: the head says what failed.
  text = str(error).split(" [tensorstore_spec", 1)[0]
  text = (text.strip().splitlines() or [""])[0]
  return f"{type(error).__name__}: {text[:limit]}"


# What Orbax, tensorstore and the filesystem raise for a save that failed
# (tensorstore's write errors are ValueErrors); anything else is a bug,
# and keeps its traceback.
_SAVE_FAILURES = (OSError, ValueError, RuntimeError)


def _handlers() -> ocp.handlers.CompositeCheckpointHandler:
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
    registry.add(ARRAYS, args, ocp.handlers.StandardCheckpointHandler)
  meta_handler = ocp.handlers.JsonCheckpointHandler(filename=_META_FILE)
  for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
    registry.add(_META_ITEM, args, meta_handler)
  return ocp.handlers.CompositeCheckpointHandler(handler_registry=registry)


def _remove(path: str) -> None:
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


class Checkpointer:
  """Saves and restores the checkpoints of one run, in `directory`.

  Every process of the run holds one and calls each method together.
  Call `wait()` before reading the checkpoint directory (listing, resuming)
  and `close()` before exiting: with `async_save`, `save` returns while the
  bytes are still being written.
  """

  def __init__(
      self,
      directory: str,
      *,
      fingerprint: dict,
      keep: int | None = None,
      async_save: bool = True,
  ):
    """Creates the checkpointer; Orbax's writer threads start here.

    Args:
      directory: holds the `step_*` checkpoints; created if needed.
      fingerprint: JSON-able description of the run; restoring a checkpoint
        saved with another one is refused, naming the differences.
      keep: if >= 1, only the newest `keep` checkpoints survive each save;
        None or 0 keeps them all.
      async_save: write in a background thread (see `wait`).
    """
    if keep is not None and keep < 0:
      raise ValueError(f"keep: expected None or an int >= 0, got {keep!r}.")
    self.directory = directory
    self.fingerprint = fingerprint
    self.keep = keep
    self.async_save = async_save
    kind = ocp.AsyncCheckpointer if async_save else ocp.Checkpointer
    self._orbax = kind(_handlers())
    self._unfinished = False  # A save whose bookkeeping `wait` still owes.
    self._pending: tuple[int, int] = (-1, 0)  # (step, bytes) of that save.
    self._replaced: list[str] = []  # Older copies of re-saved steps.
    self._barriers = itertools.count()

  def _sync(self, what: str) -> None:
    """All processes meet here (Orbax's barrier; free with one process)."""
    ocp.multihost.sync_global_processes(
        f"dropless_checkpoint:{what}:{next(self._barriers)}"
    )

  def save(self, step: int, state, extra: dict | None = None) -> str:
    """Starts writing `state` (a pytree of arrays) as checkpoint `step`.

    Waits for the previous save first. Returns the checkpoint's path once
    the arrays are copied off the devices (async) or on disk (sync); the
    caller may then update or donate `state`.

    Args:
      step: the number of optimiser steps `state` has taken.
      state: the pytree to save: global jax.Arrays, sharded or not, or
        numpy arrays.
      extra: JSON-able data restored as is (data position, history, ...).
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
      raise TypeError(f"step: expected an int, got {step!r}.")
    if step < 0:
      raise ValueError(f"step: expected an int >= 0, got {step}.")
    self.wait()
    paths, leaves, _ = _leaves(state)
    # Numpy leaves are copied: an async save reads them later.
    leaves = [
        x if isinstance(x, jax.Array) else np.array(x, copy=True)
        for x in leaves
    ]
    meta = _with_field_checksums(
        {
            "format_version": FORMAT_VERSION,
            _WRITER_KEY: WRITER,
            "step": int(step),
            "fingerprint": self.fingerprint,
            "leaves": [
                {
                    "path": p,
                    "shape": list(np.shape(x)),
                    "dtype": _dtype(x).name,
                    "checksum": c,
                }
                for p, x, c in zip(paths, leaves, checksum.checksums(leaves))
            ],
            "extra": extra or {},
        }
    )
    final = step_dir(self.directory, step)
    if distributed.is_main_process():
      os.makedirs(self.directory, exist_ok=True)
    self._sync("directory")
    self._check_space(step, _bytes_to_write(leaves, meta))
    # Barriers around the rename: every process must see the same answer
    # here, and none may reach Orbax's own "exists" check before it.
    resaving = os.path.exists(final)
    if resaving and not is_ours(final):
      raise CheckpointError(
          f"cannot save the checkpoint of step {step}: {final!r} exists and "
          "was not written by this program (its meta.json is not one of "
          "ours); move it out of --output_dir."
      )
    self._sync("checked")
    if resaving and distributed.is_main_process():
      # Move the old copy aside rather than delete it first, so that a
      # crash before the new one lands leaves it whole.
      aside = os.path.join(
          self.directory, f".replaced-step_{step:08d}-{uuid.uuid4().hex}"
      )
      os.rename(final, aside)
      self._replaced.append(aside)
    self._sync("replaced")
    self._unfinished = True
    try:
      self._orbax.save(
          final,
          args=ocp.args.Composite(
              **{
                  ARRAYS: ocp.args.StandardSave(
                      {_leaf_key(i): x for i, x in enumerate(leaves)}
                  ),
                  _META_ITEM: ocp.args.JsonSave(meta),
              }
          ),
      )
    except _SAVE_FAILURES as e:
      self._failed(e)
    if not self.async_save:
      self.wait()
    return final

  def _check_space(self, step: int, needed: int) -> None:
    """Refuses the save of `step` before it writes a byte, if the disk of
    any process lacks `needed` (its uncompressed bytes) free."""
    self._pending = (step, needed)
    free = free_bytes(self.directory)
    if distributed.all_true(free >= needed):
      return
    if free >= needed:
      where = (
          "another process of the run lacks the space for its shards there "
          "(its output says how much)"
      )
    else:
      where = (
          f"it needs about {_human_bytes(needed)} ({needed:,} bytes, one "
          "uncompressed copy of the state, written before older checkpoints "
          f"are pruned) and the filesystem has {_human_bytes(free)} free"
      )
    raise CheckpointSaveError(
        f"cannot save the checkpoint of step {step} in {self.directory!r}: "
        f"{where}. {self._intact()}",
        step=step,
        directory=self.directory,
        needed=needed,
    )

  def _intact(self) -> str:
    """What is left to resume from, and how to go on: the end of a save
    failure's message."""
    ours = [p for _, p in list_checkpoints(self.directory) if is_ours(p)]
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

  def _failed(self, error: BaseException):
    """Raises CheckpointSaveError for the save in flight, which raised
    `error`, after putting the directory back as it was before it."""
    step, needed = self._pending
    self._unfinished = False
    try:
      if isinstance(self._orbax, ocp.AsyncCheckpointer):
        self._orbax.wait_until_finished()  # Joins its thread; raised once.
    except Exception:  # pylint: disable=broad-except
      pass  # `error` is the one to report.
    if distributed.is_main_process():
      self._undo(step)
    self._replaced = []
    if _is_disk_full(error):
      free = free_bytes(self.directory)
      reason = (
          f"no space left on device; it needs about {_human_bytes(needed)} "
          f"({needed:,} bytes uncompressed) and {_human_bytes(free)} are "
          "free now"
      )
    else:
      reason = _first_line(error)
    raise CheckpointSaveError(
        f"the checkpoint of step {step} could not be written to "
        f"{self.directory!r}: {reason}. {self._intact()}",
        step=step,
        directory=self.directory,
        needed=needed,
    ) from error

  def _undo(self, step: int) -> None:
    """Deletes what the failed save of `step` wrote and puts back the copy
    it moved aside: the directory holds what it held before the save."""
    if not os.path.isdir(self.directory):
      return
    prefix = os.path.basename(step_dir(self.directory, step))
    for name in os.listdir(self.directory):
      if name.startswith(prefix) and _ORBAX_TEMPORARY in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    for aside in self._replaced:
      name = _REPLACED.match(os.path.basename(aside))[1]
      final = os.path.join(self.directory, name)
      if not os.path.exists(final):
        os.rename(aside, final)

  def wait(self) -> None:
    """Blocks until the last save is on disk, then prunes old ones.

    Raises:
      CheckpointSaveError: that save failed (see `poll`).
    """
    try:
      if isinstance(self._orbax, ocp.AsyncCheckpointer):
        self._orbax.wait_until_finished()
    except _SAVE_FAILURES as e:
      if not self._unfinished:
        raise
      self._failed(e)
    if not self._unfinished:
      return
    self._unfinished = False
    if distributed.is_main_process():
      for aside in self._replaced:
        shutil.rmtree(aside, ignore_errors=True)
      if self.keep:
        ours = [p for _, p in list_checkpoints(self.directory) if is_ours(p)]
        for old in ours[: -self.keep]:
          _remove(old)
    self._replaced = []
    self._sync("pruned")

  def poll(self) -> None:
    """Raises if the save in flight has already failed; never waits for it.

    Orbax writes in a background thread, whose error otherwise waits for
    the next `wait`: the trainer polls after every step, so a failed save
    stops the run at once rather than at the next checkpoint.

    Raises:
      CheckpointSaveError: the save failed; one line naming its step, the
        directory and the bytes it needs. The directory then holds what it
        held before that save.
    """
    if not self._unfinished or not isinstance(
        self._orbax, ocp.AsyncCheckpointer
    ):
      return
    try:
      self._orbax.check_for_errors()
    except _SAVE_FAILURES as e:
      self._failed(e)

  def restore(self, path: str, target, *, fingerprint: dict | None = None):
    """Loads checkpoint `path` into the structure of `target`.

    Args:
      path: a `step_*` checkpoint directory.
      target: a pytree with the structure, shapes and dtypes expected. Its
        leaves are jax.ShapeDtypeStructs or arrays (values unused): a leaf
        with a `.sharding` is restored as a jax.Array with that sharding
        (any mesh, whatever mesh saved it); one without (numpy) as numpy.
      fingerprint: the fingerprint to check, if not the checkpointer's.

    Returns:
      (state, meta): the restored pytree and meta.json ("step", "extra",
      "fingerprint", "leaves").

    Raises:
      CheckpointError: corrupt, incomplete or mismatched checkpoint; the
        message names the file, field or leaf at fault.
    """
    self.wait()
    if fingerprint is None:
      fingerprint = self.fingerprint
    return _read(self._orbax, path, target, fingerprint)

  def close(self) -> None:
    """Finishes the last save and releases Orbax's threads."""
    try:
      self.wait()
    finally:
      self._orbax.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


# --- One-call forms (synchronous) ---------------------------------------------


def save(
    directory: str,
    step: int,
    state,
    *,
    fingerprint: dict,
    extra: dict | None = None,
    keep: int | None = None,
) -> str:
  """Writes `state` as checkpoint `step` and waits until it is on disk.

  See `Checkpointer.save`; `keep` prunes all but the newest `keep`.

  Returns:
    The checkpoint's path.
  """
  with Checkpointer(
      directory, fingerprint=fingerprint, keep=keep, async_save=False
  ) as checkpointer:
    return checkpointer.save(step, state, extra)


@functools.cache
def _reader() -> ocp.Checkpointer:
  return ocp.Checkpointer(_handlers())


def restore(path: str, template, *, fingerprint: dict):
  """Loads checkpoint `path` into the structure of `template`.

  See `Checkpointer.restore`; `fingerprint` must equal the one the
  checkpoint was saved with.
  """
  return _read(_reader(), path, template, fingerprint)
