"""A checkpoint's meta.json: what it records, and its checks on a restore.

meta.json (`checkpoint_dirs.META`, written by process 0) holds the step,
the data position and history (`extra`), the run fingerprint, one entry per
leaf (tree path, shape, dtype, checksum: tensorstore keeps no checksum, so
`checkpoint.py` records one per leaf, see `checksum.py`), and a
checksum of each of these fields. `read_meta` verifies every field against
its checksum and the step against the name of the directory; a restore
also checks the fingerprint (a different model or data setup) and every
leaf's path, shape and dtype against the state the caller built. Any
difference raises `CheckpointError` naming it: nothing falls back to a
fresh start.
"""

from __future__ import annotations

import json
import os

import numpy as np

from train.checkpoints import checkpoint_dirs
from train.checkpoints import checksum

# Version 3 added the checksums of meta.json's fields. Version 2 is refused:
# without them its step, data position and history cannot be verified, and
# a resume from an edited or damaged meta.json would go unnoticed.
FORMAT_VERSION = 3
_META_KEYS = ("format_version", "step", "fingerprint", "leaves", "extra")
_META_CHECKSUMS = "field_checksums"  # {field: checksum of its JSON}.
_LEAF_KEYS = frozenset(("path", "shape", "dtype", "checksum"))
_META = checkpoint_dirs.META  # Named in the messages below.


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored: corrupt, partial or mismatched."""


def leaf_dtype(leaf) -> np.dtype:
  """The dtype of a state leaf: an array, a ShapeDtypeStruct or a scalar."""
  dtype = getattr(leaf, "dtype", None)
  return np.dtype(np.asarray(leaf).dtype if dtype is None else dtype)


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


def new_meta(
    step: int, fingerprint: dict, paths: list[str], leaves: list, extra
) -> dict:
  """meta.json of a checkpoint of `leaves` (at tree `paths`), checksums and
  all; `extra` is JSON-able data restored as is, or None."""
  return _with_field_checksums(
      {
          "format_version": FORMAT_VERSION,
          checkpoint_dirs.WRITER_KEY: checkpoint_dirs.WRITER,
          "step": int(step),
          "fingerprint": fingerprint,
          "leaves": [
              {
                  "path": p,
                  "shape": list(np.shape(x)),
                  "dtype": leaf_dtype(x).name,
                  "checksum": c,
              }
              for p, x, c in zip(paths, leaves, checksum.checksums(leaves))
          ],
          "extra": extra or {},
      }
  )


def _load_meta_json(path: str) -> dict:
  """meta.json of checkpoint `path` as a dict, unchecked."""
  meta_path = os.path.join(path, _META)
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except FileNotFoundError as e:
    if os.path.isfile(os.path.join(path, checkpoint_dirs.OLD_META)):
      raise CheckpointError(
          f"checkpoint {path!r} has format version 1 (arrays.npz); this "
          f"program reads version {FORMAT_VERSION}."
      ) from e
    raise CheckpointError(
        f"checkpoint {path!r} is incomplete or corrupt: {_META} is missing."
    ) from e
  except (OSError, ValueError) as e:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {_META} is not valid JSON ({e})."
    ) from e
  if not isinstance(meta, dict):
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {_META} holds a "
        f"{type(meta).__name__}, expected an object."
    )
  return meta


def _check_field_checksums(path: str, meta: dict) -> None:
  recorded = meta.get(_META_CHECKSUMS)
  if not isinstance(recorded, dict):
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {_META} lacks {_META_CHECKSUMS!r}."
    )
  fields = set(meta) - {_META_CHECKSUMS}
  if set(recorded) != fields:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt or was edited: {_META} has the "
        f"fields {sorted(fields)}, its checksums cover {sorted(recorded)}."
    )
  for key in sorted(fields):
    found = _field_checksum(meta[key])
    if found != recorded[key]:
      raise CheckpointError(
          f"checkpoint {path!r} is corrupt or was edited: {_META} field "
          f"{key!r} has checksum {found}, the checkpoint recorded "
          f"{recorded[key]}."
      )


def _check_step(path: str, meta: dict) -> None:
  """The recorded step must be the one the directory is named after."""
  step = meta["step"]
  if not isinstance(step, int) or isinstance(step, bool) or step < 0:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {_META} records step {step!r}, "
        "expected an int >= 0."
    )
  name = os.path.basename(os.path.normpath(path))
  match = checkpoint_dirs.STEP_DIR.match(name)
  if match is None or int(match[1]) != step:
    raise CheckpointError(
        f"checkpoint {path!r}: {_META} records step {step}, but the "
        f"directory is named {name!r}; expected "
        f"{checkpoint_dirs.step_dir('', step)!r}."
    )


def read_meta(path: str) -> dict:
  """meta.json of checkpoint `path`, verified; or CheckpointError.

  Every field must match its recorded checksum, and the step the name of
  the directory (`step_<8 digits>`).
  """
  meta = _load_meta_json(path)
  if "format_version" not in meta:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt: {_META} lacks 'format_version'."
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
          f"checkpoint {path!r} is corrupt: {_META} lacks {key!r}."
      )
  _check_step(path, meta)
  for i, entry in enumerate(meta["leaves"]):
    if not isinstance(entry, dict) or not _LEAF_KEYS <= set(entry):
      raise CheckpointError(
          f"checkpoint {path!r} is corrupt: {_META} leaf entry {i} must "
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


def check_fingerprint(path: str, meta: dict, fingerprint: dict) -> None:
  """Raises unless meta.json's fingerprint is `fingerprint` (this run's)."""
  diffs = _fingerprint_diff(meta["fingerprint"], fingerprint)
  if diffs:
    raise CheckpointError(
        f"checkpoint {path!r} was saved by a different run configuration; "
        "resume with the same settings or start a new --output_dir: "
        + "; ".join(diffs)
        + "."
    )


def check_layout(path: str, meta: dict, paths: list[str], leaves: list):
  """Raises unless meta.json's leaves have these tree paths, shapes and
  dtypes (those of the restore's template)."""
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
    shape, dtype = tuple(np.shape(leaf)), leaf_dtype(leaf)
    if tuple(entry["shape"]) != shape or entry["dtype"] != dtype.name:
      raise CheckpointError(
          f"checkpoint {path!r}: leaf {leaf_path} must be {dtype.name}"
          f"{list(shape)}, got {entry['dtype']}{entry['shape']}."
      )
