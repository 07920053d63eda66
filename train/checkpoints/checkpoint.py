"""Sharded, async, verified checkpoints of a training state pytree (Orbax).

`Checkpointer` saves the checkpoints of one run into a directory and
restores them (`save` and `restore` are its synchronous one-call forms);
the directory's layout and cleanup are `checkpoint_dirs.py`'s, the
checks of meta.json `checkpoint_meta.py`'s. Saving may be
asynchronous: `Checkpointer.save` returns once the arrays are copied off
the devices, and `wait()` blocks until they are on disk. Tensorstore keeps
no checksum, so `save` records one per leaf, computed on the devices from
the global array (`checksum.py`): it does not depend on the sharding
or the number of processes, and `restore` recomputes it on the arrays it
read, whatever mesh they were restored onto; any difference raises
`CheckpointError`. A failed save (a full disk, most often) raises
`CheckpointSaveError` (`checkpoint_failures.py`) and leaves the
checkpoints saved before it as they were: old ones are pruned only after a
new one lands. Every process calls `save`, `restore`, `wait`, `poll` and
`close` together, as Orbax expects; more than one process needs
`jax.distributed`. About 400 lines because `Checkpointer`'s save, poll,
wait, prune and undo share one state machine (a save in flight).
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp

from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_failures
from train.checkpoints import checkpoint_meta
from train.checkpoints import checkpoint_orbax
from train.checkpoints import checksum
from train.parallel import distributed

# Orbax's INFO lines and failure tracebacks stay off the log from the
# moment checkpoints may be used.
checkpoint_orbax.quiet_orbax()


def _leaves(tree):
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in with_path]
  return paths, [leaf for _, leaf in with_path], treedef


def _read(orbax_checkpointer, path: str, template, fingerprint: dict):
  """Checks and loads checkpoint `path`; see `restore`."""
  if not os.path.isdir(path):
    raise checkpoint_meta.CheckpointError(
        f"checkpoint {path!r} does not exist."
    )
  meta = checkpoint_meta.read_meta(path)
  if not os.path.isdir(os.path.join(path, checkpoint_dirs.ARRAYS)):
    raise checkpoint_meta.CheckpointError(
        f"checkpoint {path!r} is incomplete: {checkpoint_dirs.ARRAYS}/ is "
        "missing."
    )
  checkpoint_meta.check_fingerprint(path, meta, fingerprint)
  paths, leaves, treedef = _leaves(template)
  checkpoint_meta.check_layout(path, meta, paths, leaves)
  target = {
      checkpoint_orbax.leaf_key(i): checkpoint_orbax.restore_target(x)
      for i, x in enumerate(leaves)
  }
  try:
    loaded = orbax_checkpointer.restore(
        path,
        args=ocp.args.Composite(
            **{checkpoint_dirs.ARRAYS: ocp.args.StandardRestore(target)}
        ),
    )[checkpoint_dirs.ARRAYS]
    restored = [
        loaded[checkpoint_orbax.leaf_key(i)] for i in range(len(leaves))
    ]
  except Exception as e:  # Tensorstore and Orbax raise many kinds.
    # Tensorstore appends its whole JSON spec: the head says what failed.
    reason = str(e).split(" [tensorstore_spec", 1)[0][:300]
    raise checkpoint_meta.CheckpointError(
        f"checkpoint {path!r} is incomplete or corrupt: cannot read "
        f"{checkpoint_dirs.ARRAYS}/ ({type(e).__name__}: {reason})."
    ) from e
  for leaf_path, found, entry in zip(
      paths, checksum.checksums(restored), meta["leaves"]
  ):
    if found != entry["checksum"]:
      raise checkpoint_meta.CheckpointError(
          f"checkpoint {path!r} is corrupt: leaf {leaf_path} has checksum "
          f"{found}, the checkpoint recorded {entry['checksum']}."
      )
  return jax.tree_util.tree_unflatten(treedef, restored), meta


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
    self._orbax = kind(checkpoint_orbax.handlers())
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
    meta = checkpoint_meta.new_meta(
        step, self.fingerprint, paths, leaves, extra
    )
    final = checkpoint_dirs.step_dir(self.directory, step)
    if distributed.is_main_process():
      os.makedirs(self.directory, exist_ok=True)
    self._sync("directory")
    self._check_space(step, checkpoint_failures.bytes_to_write(leaves, meta))
    # Barriers around the rename: every process must see the same answer
    # here, and none may reach Orbax's own "exists" check before it.
    resaving = os.path.exists(final)
    if resaving and not checkpoint_dirs.is_ours(final):
      raise checkpoint_meta.CheckpointError(
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
                  checkpoint_dirs.ARRAYS: ocp.args.StandardSave(
                      {
                          checkpoint_orbax.leaf_key(i): x
                          for i, x in enumerate(leaves)
                      }
                  ),
                  checkpoint_dirs.META_ITEM: ocp.args.JsonSave(meta),
              }
          ),
      )
    except checkpoint_failures.SAVE_FAILURES as e:
      self._failed(e)
    if not self.async_save:
      self.wait()
    return final

  def _check_space(self, step: int, needed: int) -> None:
    """Refuses the save of `step` before it writes a byte, if the disk of
    any process lacks `needed` (its uncompressed bytes) free."""
    self._pending = (step, needed)
    free = checkpoint_failures.free_bytes(self.directory)
    if distributed.all_true(free >= needed):
      return
    if free >= needed:
      where = (
          "another process of the run lacks the space for its shards there "
          "(its output says how much)"
      )
    else:
      human = checkpoint_failures.human_bytes
      where = (
          f"it needs about {human(needed)} ({needed:,} bytes, one "
          "uncompressed copy of the state, written before older checkpoints "
          f"are pruned) and the filesystem has {human(free)} free"
      )
    raise self._save_error(
        step,
        needed,
        f"cannot save the checkpoint of step {step} in {self.directory!r}: "
        f"{where}",
    )

  def _save_error(
      self, step: int, needed: int, what: str
  ) -> checkpoint_failures.CheckpointSaveError:
    """The error of the save of `step` (`needed` bytes): `what` went wrong,
    then what of the directory is still intact."""
    intact = checkpoint_failures.what_is_intact(self.directory)
    return checkpoint_failures.CheckpointSaveError(
        f"{what}. {intact}", step=step, directory=self.directory, needed=needed
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
    if checkpoint_failures.is_disk_full(error):
      free = checkpoint_failures.free_bytes(self.directory)
      human = checkpoint_failures.human_bytes
      reason = (
          f"no space left on device; it needs about {human(needed)} "
          f"({needed:,} bytes uncompressed) and {human(free)} are "
          "free now"
      )
    else:
      reason = checkpoint_failures.first_line(error)
    raise self._save_error(
        step,
        needed,
        f"the checkpoint of step {step} could not be written to "
        f"{self.directory!r}: {reason}",
    ) from error

  def _undo(self, step: int) -> None:
    """Deletes what the failed save of `step` wrote and puts back the copy
    it moved aside: the directory holds what it held before the save."""
    if not os.path.isdir(self.directory):
      return
    prefix = os.path.basename(checkpoint_dirs.step_dir(self.directory, step))
    for name in os.listdir(self.directory):
      if name.startswith(prefix) and checkpoint_dirs.ORBAX_TEMPORARY in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    for aside in self._replaced:
      name = checkpoint_dirs.REPLACED.match(os.path.basename(aside))[1]
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
    except checkpoint_failures.SAVE_FAILURES as e:
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
        ours = [
            p
            for _, p in checkpoint_dirs.list_checkpoints(self.directory)
            if checkpoint_dirs.is_ours(p)
        ]
        for old in ours[: -self.keep]:
          checkpoint_dirs.remove_checkpoint(old)
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
    except checkpoint_failures.SAVE_FAILURES as e:
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
  return ocp.Checkpointer(checkpoint_orbax.handlers())


def restore(path: str, template, *, fingerprint: dict):
  """Loads checkpoint `path` into the structure of `template`.

  See `Checkpointer.restore`; `fingerprint` must equal the one the
  checkpoint was saved with.
  """
  return _read(_reader(), path, template, fingerprint)
