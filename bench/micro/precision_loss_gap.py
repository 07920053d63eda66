r"""Held-out loss and step time of low-precision expert GEMMs against
unquantised ones.

Trains the default preset of `train.main` (tiny_dsv3) once per recipe of
--recipes, from the same seed on the same batches, steps interleaved, and
reports per recipe the final held-out loss, its gap to the unquantized
recipe's against the goal (at most +1% for the fp8 recipes and mxfp8) and
the step time over unquantized's; prints a table and writes JSON to --out
(docs/benchmarks.md, "bench/micro/precision_loss_gap.py"). Usage:
    python -m bench.micro.precision_loss_gap              # ~14 min on 2 cores
    python -m bench.micro.precision_loss_gap --steps=2 \
        --recipes=unquantized,mxfp8 \
        --out=/tmp/gap.json                         # proves the script runs
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform as platform_lib
import statistics
import time

from absl import app
from absl import flags
import jax
import numpy as np

import moe_core
from moe_core import precision as moe_precision
import moe_core.flags  # Defines --moe_backend.
from bench.harness import json_report
from bench.harness import flag_checks
from bench.harness import text_table
from bench.harness import timing
from train import platforms
from train import presets
from train.run.inputs import data as data_lib
from train.run.inputs import run_config
from train.run.training import trainer

_BASELINE = moe_precision.UNQUANTIZED
# The JSON keys that compare a recipe with the baseline. Records written
# before the recipe was renamed say "bf16" where these say "unquantized".
_GAP_KEY = f"gap_vs_{_BASELINE}_percent"
_TIME_KEY = timing.ratio_key("step", _BASELINE)
_DIFF_KEY = f"max_step_loss_diff_vs_{_BASELINE}"
_SAME_KEY = f"same_losses_as_{_BASELINE}"
# Steps left out of the step times: the first ones compile.
_SKIP = 2
# The largest gap of the held-out loss over the unquantized recipe's each
# recipe aims for, as a fraction of that loss; None: the gap is stated, not
# bounded.
GOALS = {
    "fp8_tensor": 0.01,
    "fp8_block": 0.01,
    "mxfp8": 0.01,
    "nvfp4": None,
}

_STEPS = flags.DEFINE_integer(
    "steps",
    200,
    "Training steps per recipe, >= 1 (200: the preset's own run).",
)
_RECIPES = flags.DEFINE_list(
    "recipes",
    list(moe_precision.RECIPES),
    "Expert-GEMM recipes to train, each once; unquantized, the baseline, is "
    "added if missing.",
)
_SEED = flags.DEFINE_integer(
    "seed", 0, "Initialisation and data-order seed of every run, >= 0."
)
_OUT = flags.DEFINE_string(
    "out",
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "..",
        "results",
        "precision_loss_gap.json",
    ),
    "Where the JSON goes.",
)


@flags.validator("steps")
def _check_steps(value) -> bool:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise flags.ValidationError(f"--steps must be an int >= 1, got {value!r}.")
  return True


@flags.validator("seed")
def _check_seed(value) -> bool:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise flags.ValidationError(f"--seed must be an int >= 0, got {value!r}.")
  return True


@flags.validator("recipes")
def _check_recipes(names) -> bool:
  return flag_checks.check_distinct_names(
      "recipes", names, moe_precision.RECIPES
  )


def recipes_with_baseline(names: list[str]) -> list[str]:
  """`names` with the baseline (unquantized) first: every gap and time
  ratio is against it."""
  return [_BASELINE] + [n for n in names if n != _BASELINE]


@dataclasses.dataclass
class _Run:
  """One recipe's trainer and what it measured so far."""

  trainer: trainer.Trainer | None
  losses: list[float] = dataclasses.field(default_factory=list)
  seconds: list[float] = dataclasses.field(default_factory=list)
  not_implemented: str | None = None


def _start(recipe: str, steps: int, seed: int, corpus) -> _Run:
  """A trainer of the default preset with `recipe`, or why there is none."""
  run = run_config.run_config_from_preset(
      presets.DEFAULT_PRESET,
      steps=steps,
      seed=seed,
      backend=moe_core.flags.MOE_BACKEND.value,
      precision=recipe,
      output_dir="/tmp/dropless_precision_loss_gap",  # Never written.
      checkpoint_every=0,
      progress=False,
      plot=False,
  )
  try:
    return _Run(trainer.Trainer(run, corpus, out=None))
  except NotImplementedError as e:
    return _Run(None, not_implemented=str(e))


def _step(state: _Run, batch) -> None:
  """One training step of a recipe; a NotImplementedError ends its run."""
  start = time.perf_counter()
  try:
    metrics = state.trainer.train_step(batch)
  except NotImplementedError as e:
    state.trainer, state.not_implemented = None, str(e)
    return
  state.seconds.append(time.perf_counter() - start)
  state.losses.append(float(metrics["loss"]))


def train_all(recipes: list[str], steps: int, seed: int) -> dict[str, dict]:
  """Trains every recipe in turn, step by step; {recipe: raw results}.

  Each raw result has "losses" (train loss per step), "seconds" (per step),
  "held_out_loss" (None if the run did not finish), "backend" and
  "not_implemented" (the backend's message, or None).
  """
  corpus = data_lib.load()
  runs = {r: _start(r, steps, seed, corpus) for r in recipes}
  for _ in range(steps):
    for state in runs.values():
      if state.trainer is not None:
        # Every run's sampler starts from `seed`: the same batch for all.
        _step(state, state.trainer.sampler.next())
  return {
      recipe: {
          "losses": state.losses,
          "seconds": state.seconds,
          "held_out_loss": (
              None if state.trainer is None else state.trainer.evaluate()
          ),
          "backend": (
              None if state.trainer is None else state.trainer.backend_name
          ),
          "not_implemented": state.not_implemented,
      }
      for recipe, state in runs.items()
  }


def _median_step_seconds(seconds: list[float]) -> float | None:
  """Median step time without the first steps (they compile)."""
  timed = seconds[min(_SKIP, len(seconds) - 1) :]
  return statistics.median(timed) if timed else None


def _gap(loss: float | None, base: float | None) -> float | None:
  """(loss - base) / base, the relative gap; None if either is missing."""
  if loss is None or base is None:
    return None
  return (loss - base) / base


def _goal(recipe: str) -> str:
  if recipe == _BASELINE:
    return "baseline"
  bound = GOALS[recipe]
  return "stated" if bound is None else f"<= +{bound:.0%}"


def _goal_met(recipe: str, gap: float | None) -> bool | None:
  """Whether the gap meets the recipe's goal; None for the baseline or no
  result.

  A stated goal (nvfp4) is met once the gap is measured. A lower loss than
  the baseline's (a negative gap) meets a bound.
  """
  if recipe == _BASELINE or gap is None:
    return None
  bound = GOALS[recipe]
  return True if bound is None else gap <= bound


def summarize(raw: dict[str, dict]) -> list[dict]:
  """One JSON row per recipe: loss, gap, goal, step time over the
  baseline's."""
  base = raw[_BASELINE]
  base_seconds = _median_step_seconds(base["seconds"])
  rows = []
  for recipe, r in raw.items():
    gap = _gap(r["held_out_loss"], base["held_out_loss"])
    seconds = _median_step_seconds(r["seconds"])
    finished = r["held_out_loss"] is not None
    same_as_baseline = (
        recipe != _BASELINE
        and finished
        and r["losses"] == base["losses"]
        and r["held_out_loss"] == base["held_out_loss"]
    )
    rows.append(
        {
            "recipe": recipe,
            "backend": r["backend"],
            "not_implemented": r["not_implemented"],
            "final_train_loss": r["losses"][-1] if finished else None,
            "final_held_out_loss": r["held_out_loss"],
            _GAP_KEY: None if gap is None else 100 * gap,
            "goal": _goal(recipe),
            # Losses equal to the baseline's say nothing about the recipe.
            "goal_met": None if same_as_baseline else _goal_met(recipe, gap),
            "step_seconds_median": seconds,
            _TIME_KEY: timing.time_over(seconds, base_seconds),
            _DIFF_KEY: _max_loss_diff(r, base),
            _SAME_KEY: same_as_baseline,
            "train_losses": r["losses"],
        }
    )
  return rows


def _max_loss_diff(run: dict, base: dict) -> float | None:
  """Largest |train loss - the baseline's| over the steps both took."""
  n = min(len(run["losses"]), len(base["losses"]))
  if not n:
    return None
  diff = np.asarray(run["losses"][:n]) - np.asarray(base["losses"][:n])
  return float(np.abs(diff).max())


_COLUMNS = (
    text_table.Column("recipe", 11, align="<"),
    text_table.Column("held-out", 8, ".4f"),
    text_table.Column("gap %", 7, ".2f"),
    text_table.Column("goal", 8),
    text_table.Column("met", 4),
    text_table.Column("s/step", 7, ".3f"),
    text_table.Column("time/unq", 9, ".2f"),
    text_table.Column("note", 0, align="<"),
)


def _note(row: dict) -> str:
  if row["not_implemented"] is not None:
    return f"NotImplementedError: {row['not_implemented']}"
  if row[_SAME_KEY]:
    return "losses equal unquantized's bit for bit: GEMMs not quantised?"
  return ""


def _met_text(met: bool | None) -> str | None:
  return None if met is None else ("yes" if met else "NO")


def print_table(rows: list[dict]) -> None:
  text_table.print_table(
      _COLUMNS,
      rows,
      lambda r: [
          r["recipe"],
          r["final_held_out_loss"],
          r[_GAP_KEY],
          r["goal"],
          _met_text(r["goal_met"]),
          r["step_seconds_median"],
          r[_TIME_KEY],
          _note(r),
      ],
      "gap %: (held-out loss - unquantized's) / unquantized's; 'time/unq': "
      "median step time / unquantized's in this run (< 1 is faster).",
  )


def _write_json(path: str, rows: list[dict], steps: int, seed: int) -> None:
  preset = presets.get_preset(presets.DEFAULT_PRESET)
  json_report.save(
      path,
      {
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "jax": jax.__version__,
          "platform": jax.default_backend(),
          "device": jax.devices()[0].device_kind,
          "host": platform_lib.node(),
          "cpu_count": os.cpu_count(),
          "model": preset.model.name,
          "moe_backend": moe_core.flags.MOE_BACKEND.value,
          "steps": steps,
          "seed": seed,
          "batch_size": preset.train.batch_size,
          "seq_len": preset.train.seq_len,
          "timing_skips_first_steps": _SKIP,
          "goals": GOALS,
          "results": rows,
      },
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  recipes = recipes_with_baseline(_RECIPES.value)
  steps, seed = _STEPS.value, _SEED.value
  preset = presets.get_preset(presets.DEFAULT_PRESET)
  print(
      f"jax {jax.__version__} on {jax.default_backend()}; "
      f"{preset.model.name}, {steps} steps of {preset.train.batch_size}x"
      f"{preset.train.seq_len} tokens, seed {seed}, --moe_backend="
      f"{moe_core.flags.MOE_BACKEND.value}; recipes {', '.join(recipes)}",
      flush=True,
  )
  rows = summarize(train_all(recipes, steps, seed))
  print_table(rows)
  _write_json(_OUT.value, rows, steps, seed)


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
