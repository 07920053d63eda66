"""Resuming a run from its checkpoint: what the checkpoint must match.

A checkpoint records the run's fingerprint (`RunConfig.fingerprint`: the
shapes of the state, the text's name and SHA-256) and the soft settings
(`SOFT_SETTINGS`), which a run may be resumed with changed (with a note).
`restore` reads a checkpoint into the run's shardings and refuses one
that holds NaN or Inf, lacks the data position, or whose optimiser step
counters disagree with its meta.json.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np

from moe_core import precision as moe_precision
from train.checkpoints import checkpoint
from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_meta
from train.run.inputs import data as data_lib
from train.run.inputs import run_config

# Settings a run may be resumed with changed (with a note): they change
# the trajectory but not the shapes of the state.
SOFT_SETTINGS = (
    "steps",
    "learning_rate",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "bias_update_rate",
    "aux_loss_weight",
    "z_loss_weight",
    "backend",
    "remat",
)


def soft_settings(run: run_config.RunConfig) -> dict:
  """{name: value} of `run`'s `SOFT_SETTINGS` (a checkpoint records them)."""
  return {k: getattr(run, k) for k in SOFT_SETTINGS}


def note_changed_settings(
    run: run_config.RunConfig, saved: dict, say: Callable[[str], None]
) -> None:
  """Says (`say`) which of `run`'s soft settings differ from the `saved`
  ones of the checkpoint it resumes from."""
  changed = {
      k: (saved[k], v)
      for k, v in soft_settings(run).items()
      if k in saved and saved[k] != v
  }
  if changed:
    say(
        f"note: resuming with changed settings {changed} "
        "(checkpoint value, now); the run will not match an "
        "uninterrupted one."
    )


def resume_fingerprint(
    path: str,
    fingerprint: dict,
    corpus: data_lib.Corpus,
    run: run_config.RunConfig,
    say: Callable[[str], None],
) -> dict:
  """The fingerprint checkpoint `path` must match (`fingerprint`, the
  run's, less what `path` does not record and with the recipe under the
  deprecated name `path` records it by, if so), after checking that the
  text has the contents it was trained on.

  Raises:
    checkpoint_meta.CheckpointError: the same --data path (or the embedded
      corpus) with other contents than when `path` was saved.
  """
  saved = checkpoint_meta.read_meta(path)["fingerprint"]
  _match_recipe_alias(saved, fingerprint)
  if "data_sha256" not in saved:
    # Saved before the digest was recorded: only the name can be checked.
    del fingerprint["data_sha256"]
    say(
        f"note: {os.path.basename(path)} records no digest of its text; "
        "whether the contents of --data changed since cannot be checked."
    )
  elif (
      saved.get("data") == corpus.name and saved["data_sha256"] != corpus.sha256
  ):
    what = (
        f"--data={corpus.name!r}"
        if run.data
        else f"the embedded corpus {corpus.name!r} (another Python "
        "version ships other text)"
    )
    raise checkpoint_meta.CheckpointError(
        f"{what} changed since checkpoint {path!r} was saved: its SHA-256 "
        f"was {saved['data_sha256'][:16]}..., now "
        f"{corpus.sha256[:16]}...; --resume needs the text the run "
        "trained on: put it back, or start a new run (without --resume, or "
        "in another --output_dir)."
    )
  return fingerprint


def _match_recipe_alias(saved: dict, fingerprint: dict) -> None:
  """Gives `fingerprint` the saved recipe name where `saved` records this
  run's recipe by a deprecated alias ("bf16", the name "unquantized" had):
  the same recipe, so the checkpoint resumes. Later checkpoints of the run
  record the canonical name."""
  saved_moe = saved.get("model", {}).get("moe")
  moe = fingerprint.get("model", {}).get("moe")
  if not isinstance(saved_moe, dict) or not isinstance(moe, dict):
    return
  old = saved_moe.get("precision")
  if moe_precision.DEPRECATED_ALIASES.get(old) == moe.get("precision"):
    moe["precision"] = old


def restore(
    checkpointer: checkpoint.Checkpointer,
    path: str,
    abstract_state: Any,
    *,
    fingerprint: dict,
    non_finite_leaves: Callable[[Any], list[str]],
) -> tuple[Any, dict]:
  """(state, meta) of checkpoint `path`, read into `abstract_state`'s
  shardings (each process reads its devices' shards), once checked.

  Raises:
    checkpoint_meta.CheckpointError: `path` does not match `fingerprint`,
      holds NaN or Inf (`non_finite_leaves` of the state names them),
      lacks the data position, or its optimiser step counters disagree
      with its meta.json.
  """
  # The abstract state is the template: each leaf's sharding says where
  # its shards go, and each process reads just its devices' shards. No
  # initial state is computed to be overwritten.
  template = _on_default_device(abstract_state)
  state, meta = checkpointer.restore(path, template, fingerprint=fingerprint)
  bad = non_finite_leaves(state)
  if bad:
    raise checkpoint_meta.CheckpointError(
        f"checkpoint {path!r} holds NaN or Inf values ({len(bad)} leaves, "
        f"first {bad[0]}): it was saved after the run diverged. Move it "
        "out of the checkpoint directory to resume from the one before, "
        "or start afresh."
    )
  if "data" not in meta.get("extra", {}):
    raise checkpoint_meta.CheckpointError(
        f"checkpoint {path!r} lacks the data position; cannot resume "
        "exactly."
    )
  counts = _optimizer_step_counts(state["opt_state"])
  if any(count != meta["step"] for count in counts.values()):
    raise checkpoint_meta.CheckpointError(
        f"checkpoint {path!r}: {checkpoint_dirs.META} records step "
        f"{meta['step']}, but the step counters of the optimiser state in "
        f"{checkpoint_dirs.ARRAYS}/ say {counts}."
    )
  return state, meta


def _on_default_device(tree):
  """Abstract leaves without a sharding, placed on the default device (a
  restore target: each leaf says where it goes)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(
      lambda x: x
      if x.sharding is not None
      else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      tree,
  )


def _optimizer_step_counts(opt_state) -> dict[str, int]:
  """{tree path: value} of the optax state's step counters ("count")."""
  counts = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if getattr(path[-1], "name", None) == "count":
      # Replicated: every process holds the whole scalar.
      local = leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf
      counts[jax.tree_util.keystr(path)] = int(np.asarray(local))
  return counts
