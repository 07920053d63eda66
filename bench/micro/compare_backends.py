r"""Trains the same model with several backends, step by step, and compares.

Every backend starts from the same initialisation and sees the same
batches, one step of each in turn (so that a change of machine load hits
all of them alike). Prints each backend's median step time and tokens/s,
its speed relative to the first backend, and the largest per-step loss
difference from the first backend. Usage:
    python -m bench.micro.compare_backends --backends=reference,xla --steps=20
"""

from __future__ import annotations

import dataclasses
import time

from absl import app
from absl import flags
import numpy as np

import moe_core
from bench.harness import flag_checks
from train.presets import catalog
from train.run.inputs import run_config
from train.run.training import trainer
from train import platforms

_SKIP = 2  # Steps left out of the timing: the first ones compile.

_BACKENDS = flags.DEFINE_list(
    "backends",
    ["reference", "xla"],
    "Backends to compare, each once; the first is the baseline.",
)
_MODEL = flags.DEFINE_enum(
    "model", catalog.DEFAULT_PRESET, list(catalog.PRESETS), "Model preset."
)
_STEPS = flags.DEFINE_integer(
    "steps",
    20,
    f"Steps per backend, > {_SKIP}: the first {_SKIP} compile and are not "
    "timed.",
)
_BATCH = flags.DEFINE_integer(
    "batch_size", None, "Sequences per step, >= 1 (preset default if unset)."
)
_SEQ = flags.DEFINE_integer(
    "seq_len", None, "Tokens per sequence, >= 1 (preset default if unset)."
)
_DTYPE = flags.DEFINE_enum(
    "compute_dtype", "bfloat16", ["bfloat16", "float32"], "Activation dtype."
)


def _require_int_at_least(holder: flags.FlagHolder, low: int) -> None:
  """--name must be an int >= low (or None where None is the default)."""

  def check(value) -> bool:
    if value is None and holder.default is None:
      return True  # The preset's value.
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise flags.ValidationError(
          f"--{holder.name} must be an int >= {low}, got {value!r}."
      )
    return True

  flags.register_validator(holder, check)


# At least one step is timed after the _SKIP that compile.
_require_int_at_least(_STEPS, _SKIP + 1)
_require_int_at_least(_BATCH, 1)
_require_int_at_least(_SEQ, 1)


@flags.validator("backends")
def _check_backends(names) -> bool:
  valid = ["auto"] + moe_core.registered_backends()
  return flag_checks.check_distinct_names("backends", names, valid)


def compare(backends, steps, **overrides) -> dict:
  """{backend: {"losses", "seconds"}} for `steps` interleaved steps."""
  base = run_config.run_config_from_preset(
      _MODEL.value,
      steps=steps,
      output_dir="/tmp/dropless_compare",
      checkpoint_every=0,
      **overrides,
  )
  trainers = {
      b: trainer.Trainer(dataclasses.replace(base, backend=b), out=None)
      for b in backends
  }
  results = {b: {"losses": [], "seconds": []} for b in backends}
  for _ in range(steps):
    for name, tr in trainers.items():
      batch = tr.sampler.next()
      start = time.perf_counter()
      metrics = tr.train_step(batch)
      results[name]["seconds"].append(time.perf_counter() - start)
      results[name]["losses"].append(float(metrics["loss"]))
  return results


def main(argv):
  del argv
  backends = _BACKENDS.value
  results = compare(
      backends,
      _STEPS.value,
      batch_size=_BATCH.value,
      seq_len=_SEQ.value,
      compute_dtype=_DTYPE.value,
  )
  preset = catalog.get_preset(_MODEL.value)
  tokens = (_BATCH.value or preset.train.batch_size) * (
      _SEQ.value or preset.train.seq_len
  )
  baseline = backends[0]
  base_time = np.median(results[baseline]["seconds"][_SKIP:])
  base_loss = np.asarray(results[baseline]["losses"])
  print(
      f"{_MODEL.value}, {tokens} tokens/step, {_DTYPE.value}, "
      f"{_STEPS.value} steps (timing skips the first {_SKIP})"
  )
  for name in backends:
    seconds = np.median(results[name]["seconds"][_SKIP:])
    losses = np.asarray(results[name]["losses"])
    print(
        f"  {name:10s} {seconds * 1e3:8.1f} ms/step {tokens / seconds:9,.0f}"
        f" tok/s  x{base_time / seconds:.2f} vs {baseline}; max |loss - "
        f"{baseline}| {np.abs(losses - base_loss).max():.4f}; losses "
        f"{' '.join(f'{x:.3f}' for x in losses[:5])} ..."
    )


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
