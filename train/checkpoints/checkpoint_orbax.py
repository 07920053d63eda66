"""Orbax as the checkpoints use it: items, handlers, leaves, quiet logging.

A checkpoint is one Orbax composite of two items (`handlers`): the state's
leaves under `checkpoint_dirs.ARRAYS`, keyed by position (`leaf_key`), and
meta.json under `checkpoint_dirs.META_ITEM`. A template leaf with a
sharding is restored as a jax.Array with that sharding, whatever mesh saved
it, and one without as numpy (`restore_target`). `quiet_orbax` keeps
Orbax's per-save INFO lines and its tracebacks of a failed background save
off the log: `Checkpointer` reports such a save in one line.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_meta


def leaf_key(i: int) -> str:
  """The key of the state's `i`-th leaf (flattening order) in its item."""
  return f"leaf_{i:05d}"


def restore_target(leaf):
  """What Orbax restores a template leaf as: its sharding, or numpy."""
  sharding = getattr(leaf, "sharding", None)
  shape, dtype = tuple(np.shape(leaf)), checkpoint_meta.leaf_dtype(leaf)
  if sharding is None:
    return np.zeros(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def handlers() -> ocp.handlers.CompositeCheckpointHandler:
  """The handler of a checkpoint's two items, for an Orbax checkpointer."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
    registry.add(
        checkpoint_dirs.ARRAYS, args, ocp.handlers.StandardCheckpointHandler
    )
  meta_handler = ocp.handlers.JsonCheckpointHandler(
      filename=checkpoint_dirs.META_FILE
  )
  for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
    registry.add(checkpoint_dirs.META_ITEM, args, meta_handler)
  return ocp.handlers.CompositeCheckpointHandler(handler_registry=registry)


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


def quiet_orbax() -> None:
  """Installs `_HideOrbaxInfo` on absl's logger, once however often called."""
  absl_logger = logging.getLogger("absl")
  if not any(isinstance(f, _HideOrbaxInfo) for f in absl_logger.filters):
    absl_logger.addFilter(_HideOrbaxInfo())
