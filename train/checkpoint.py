"""Atomic, verified checkpoints of a training state pytree.

Layout of one checkpoint, `<dir>/step_00000300/`:

    arrays.npz   every leaf of the state, as raw bytes (any dtype, bf16 too)
    meta.json    step, data position, run fingerprint, one entry per leaf
                 (tree path, shape, dtype) and the sha256 of arrays.npz

A checkpoint is written into a hidden temporary directory and renamed into
place, so a crash mid-save leaves the previous checkpoints intact and never a
half-written `step_*`. Restoring checks the hash (corruption), the
fingerprint (a different model or data setup) and every leaf's path, shape
and dtype against the state the caller built; any difference raises
`CheckpointError` naming it. Nothing falls back to a fresh start.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid

import jax
import numpy as np

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")
ARRAYS = "arrays.npz"
META = "meta.json"


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored: corrupt, partial or mismatched."""


def step_dir(directory: str, step: int) -> str:
  return os.path.join(directory, f"step_{step:08d}")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
  """(step, path) of every complete checkpoint in `directory`, oldest first."""
  if not os.path.isdir(directory):
    return []
  found = []
  for name in os.listdir(directory):
    match = _STEP_DIR.match(name)
    if match:
      found.append((int(match.group(1)), os.path.join(directory, name)))
  return sorted(found)


def latest(directory: str) -> str | None:
  found = list_checkpoints(directory)
  return found[-1][1] if found else None


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _fsync_dir(path: str) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _leaves(tree):
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in with_path]
  return paths, [leaf for _, leaf in with_path], treedef


def save(
    directory: str,
    step: int,
    state,
    *,
    fingerprint: dict,
    extra: dict | None = None,
    keep: int | None = None,
) -> str:
  """Writes `state` (a pytree of arrays) as checkpoint `step`, atomically.

  Args:
    directory: the checkpoint directory (created if needed).
    step: the number of optimiser steps `state` has taken.
    state: the pytree to save.
    fingerprint: JSON-able description of the run that restoring must match.
    extra: JSON-able data restored as is (data position, history, ...).
    keep: if set, delete all but the newest `keep` checkpoints afterwards.

  Returns:
    The checkpoint's path.
  """
  os.makedirs(directory, exist_ok=True)
  paths, leaves, _ = _leaves(state)
  host = [np.asarray(jax.device_get(leaf)) for leaf in leaves]
  final = step_dir(directory, step)
  tmp = os.path.join(
      directory, f".tmp-step_{step:08d}-{os.getpid()}-{uuid.uuid4().hex}"
  )
  os.makedirs(tmp)
  try:
    arrays_path = os.path.join(tmp, ARRAYS)
    with open(arrays_path, "wb") as f:
      # Raw bytes: numpy has no native bfloat16, and a byte view
      # round-trips any dtype exactly.
      np.savez(
          f,
          **{
              f"leaf_{i}": np.ascontiguousarray(a).reshape(-1).view(np.uint8)
              for i, a in enumerate(host)
          },
      )
      f.flush()
      os.fsync(f.fileno())
    meta = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "fingerprint": fingerprint,
        "leaves": [
            {"path": p, "shape": list(a.shape), "dtype": a.dtype.name}
            for p, a in zip(paths, host)
        ],
        "sha256": _sha256(arrays_path),
        "extra": extra or {},
    }
    with open(os.path.join(tmp, META), "w") as f:
      json.dump(meta, f)
      f.flush()
      os.fsync(f.fileno())
    replaced = None
    if os.path.exists(final):
      # Move the old copy aside rather than delete it first: a crash between
      # the two renames leaves it whole (rename it back to restore it).
      replaced = tmp + ".replaced"
      os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(directory)
    if replaced:
      shutil.rmtree(replaced, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if keep:
    for _, old in list_checkpoints(directory)[:-keep]:
      shutil.rmtree(old, ignore_errors=True)
  return final


def read_meta(path: str) -> dict:
  """meta.json of checkpoint `path`, or CheckpointError if unreadable."""
  meta_path = os.path.join(path, META)
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except FileNotFoundError as e:
    raise CheckpointError(
        f"checkpoint {path!r} is incomplete or corrupt: {META} is missing."
    ) from e
  except (OSError, ValueError) as e:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {META} is not valid JSON ({e})."
    ) from e
  for key in ("format_version", "step", "fingerprint", "leaves", "sha256"):
    if key not in meta:
      raise CheckpointError(
          f"checkpoint {path!r} is corrupt: {META} lacks " f"{key!r}."
      )
  if meta["format_version"] != FORMAT_VERSION:
    raise CheckpointError(
        f"checkpoint {path!r} has format version {meta['format_version']}; "
        f"this program reads version {FORMAT_VERSION}."
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


def restore(path: str, template, *, fingerprint: dict):
  """Loads checkpoint `path` into the structure of `template`.

  Args:
    path: a `step_*` checkpoint directory.
    template: a pytree with the structure, shapes and dtypes expected (its
      values are not used).
    fingerprint: must equal the one the checkpoint was saved with.

  Returns:
    (state, meta): the restored pytree (numpy leaves) and meta.json.

  Raises:
    CheckpointError: corrupt, incomplete or mismatched checkpoint; the
      message names the file, field or leaf at fault.
  """
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint {path!r} does not exist.")
  meta = read_meta(path)
  arrays_path = os.path.join(path, ARRAYS)
  if not os.path.isfile(arrays_path):
    raise CheckpointError(
        f"checkpoint {path!r} is incomplete: {ARRAYS} is " "missing."
    )
  digest = _sha256(arrays_path)
  if digest != meta["sha256"]:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: sha256 of {ARRAYS} is {digest}, "
        f"{META} recorded {meta['sha256']}."
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
  saved = meta["leaves"]
  if [s["path"] for s in saved] != paths:
    missing = sorted(set(paths) - {s["path"] for s in saved})
    unexpected = sorted({s["path"] for s in saved} - set(paths))
    raise CheckpointError(
        f"checkpoint {path!r} holds a different state structure: missing "
        f"{missing[:5]}, unexpected {unexpected[:5]} (showing up to 5)."
    )
  restored = []
  try:
    with np.load(arrays_path) as npz:
      for i, (leaf_path, leaf, entry) in enumerate(zip(paths, leaves, saved)):
        shape = tuple(np.shape(leaf))
        dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        if tuple(entry["shape"]) != shape or entry["dtype"] != dtype.name:
          raise CheckpointError(
              f"checkpoint {path!r}: leaf {leaf_path} must be {dtype.name}"
              f"{list(shape)}, got {entry['dtype']}{entry['shape']}."
          )
        raw = npz[f"leaf_{i}"]
        restored.append(raw.view(dtype).reshape(shape))
  except CheckpointError:
    raise
  except Exception as e:  # A damaged zip raises many kinds of errors.
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: cannot read {ARRAYS} ({e})."
    ) from e
  return jax.tree_util.tree_unflatten(treedef, restored), meta
