r"""Grouped-GEMM forward time of each low-precision recipe against the
unquantized GEMM.

Times `grouped_gemm(..., precision=recipe)` of each backend in --backends
for every recipe of `moe_precision.RECIPES`, as a ratio over the same
backend's unquantized time in the same run, with each recipe's largest
error against the unquantized output; a recipe a backend cannot run is
reported, not fatal. Prints a table and writes
bench/results/precision_gemm_<platform>_<date>.json (docs/benchmarks.md,
"bench/micro/precision_gemm_bench.py"). Usage:
    python -m bench.micro.precision_gemm_bench [--backends=xla,reference] \
        [--quick]
"""

from __future__ import annotations

import inspect
import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import precision as moe_precision
from bench.harness import json_report
from bench.harness import flag_checks
from bench.harness import text_table
from bench.harness import timing
from bench.workloads import gemm_workloads
from train import platforms

_BASELINE = moe_precision.UNQUANTIZED
# Records written before the recipe was renamed say "bf16" in these keys.
_ERROR_KEY = f"max_error_vs_{_BASELINE}"

_QUICK = flags.DEFINE_bool(
    "quick", False, "One timed call per measurement: proves the script runs."
)
_ROWS = flags.DEFINE_integer("rows", 4096, "M: dispatched rows (T * top_k).")
_CONTRACT = flags.DEFINE_integer("contract", 1024, "K: the contraction size.")
_OUTPUT = flags.DEFINE_integer("output", 512, "N: the output size.")
_EXPERTS = flags.DEFINE_integer("experts", 8, "E: experts (groups).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per measurement.")
_BACKENDS = flags.DEFINE_list(
    "backends", ["xla", "reference"], "Registered backends to time."
)
_RECIPES = flags.DEFINE_list(
    "recipes",
    list(moe_precision.RECIPES),
    "Recipes to time; unquantized, the baseline, is added if missing.",
)
_OUT_DIR = flags.DEFINE_string(
    "out_dir",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results"),
    "Where the JSON goes.",
)


def _require_positive_int(holder: flags.FlagHolder) -> None:
  """--name must be an int >= 1."""

  def check(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise flags.ValidationError(
          f"--{holder.name} must be an int >= 1, got {value!r}."
      )
    return True

  flags.register_validator(holder, check)


for _holder in (_ROWS, _CONTRACT, _OUTPUT, _EXPERTS, _REPEATS):
  _require_positive_int(_holder)


@flags.validator("backends")
def _check_backends(names) -> bool:
  return flag_checks.check_distinct_names(
      "backends", names, moe_core.registered_backends()
  )


@flags.validator("recipes")
def _check_recipes(names) -> bool:
  return flag_checks.check_distinct_names(
      "recipes", names, moe_precision.RECIPES
  )


def _takes_precision(backend) -> bool:
  """Whether the backend's grouped_gemm has the `precision` argument yet."""
  return "precision" in inspect.signature(backend.grouped_gemm).parameters


def gemm_program(backend, recipe: str):
  """Jitted f(rows, weights, group_sizes) -> [M, N] for one recipe.

  The baseline calls grouped_gemm without `precision` (its default), so it
  runs on a backend that predates the argument.
  """
  if recipe == _BASELINE:
    return jax.jit(backend.grouped_gemm)
  return jax.jit(
      lambda rows, weights, sizes: backend.grouped_gemm(
          rows, weights, sizes, precision=recipe
      )
  )


def _relative_error(got: jax.Array, want: jax.Array) -> float:
  """max |got - want| / max |want|, in float32."""
  got = jnp.asarray(got, jnp.float32)
  want = jnp.asarray(want, jnp.float32)
  scale = jnp.maximum(jnp.abs(want).max(), jnp.finfo(jnp.float32).tiny)
  return float(jnp.abs(got - want).max() / scale)


def measure(backend, recipe: str, args: tuple, repeats: int) -> dict:
  """{"fwd_s", "output", "not_implemented"} of one backend and recipe."""
  if recipe != _BASELINE and not _takes_precision(backend):
    return {
        "fwd_s": None,
        "output": None,
        "not_implemented": "grouped_gemm has no precision argument yet",
    }
  program = gemm_program(backend, recipe)
  try:
    output = jax.block_until_ready(program(*args))
    seconds = timing.median_seconds(program, args, repeats)
  except NotImplementedError as e:
    return {"fwd_s": None, "output": None, "not_implemented": str(e)}
  return {"fwd_s": seconds, "output": output, "not_implemented": None}


def _operands(m: int, k: int, n: int, e: int) -> tuple:
  """bfloat16 rows [M, K], weights [E, K, N] (unit-scale outputs), sizes."""
  k_rows, k_w = jax.random.split(jax.random.key(0))
  rows = jax.random.normal(k_rows, (m, k), jnp.float32).astype(jnp.bfloat16)
  weights = jax.random.normal(k_w, (e, k, n), jnp.float32) / np.sqrt(k)
  sizes = gemm_workloads.skewed_group_sizes("even", m, e)
  return rows, weights.astype(jnp.bfloat16), jnp.asarray(sizes)


def run_backend(name: str, recipes: list[str], args: tuple, repeats: int):
  """One JSON row per recipe of backend `name`, the baseline (unquantized)
  first."""
  backend = moe_core.get_backend(name)
  measured = {r: measure(backend, r, args, repeats) for r in recipes}
  base = measured[_BASELINE]
  rows = []
  for recipe, r in measured.items():
    error = None
    if r["output"] is not None and base["output"] is not None:
      error = _relative_error(r["output"], base["output"])
    rows.append(
        {
            "backend": name,
            "recipe": recipe,
            "fwd_ms": None if r["fwd_s"] is None else 1e3 * r["fwd_s"],
            timing.ratio_key("fwd", _BASELINE): timing.time_over(
                r["fwd_s"], base["fwd_s"]
            ),
            _ERROR_KEY: error,
            "not_implemented": r["not_implemented"],
        }
    )
  return rows


_COLUMNS = (
    text_table.Column("backend", 10, align="<"),
    text_table.Column("recipe", 11, align="<"),
    text_table.Column("fwd ms", 9, ".2f"),
    text_table.Column("time/unq", 9, ".2f"),
    text_table.Column("err/unq", 9, ".2e"),
    text_table.Column("note", 0, align="<"),
)


def _note(row: dict) -> str:
  if row["not_implemented"] is not None:
    return f"not implemented: {row['not_implemented']}"
  if row["recipe"] != _BASELINE and row[_ERROR_KEY] == 0:
    return "output equals unquantized's: not quantised?"
  return ""


def print_table(rows: list[dict]) -> None:
  text_table.print_table(
      _COLUMNS,
      rows,
      lambda r: [
          r["backend"],
          r["recipe"],
          r["fwd_ms"],
          r[timing.ratio_key("fwd", _BASELINE)],
          r[_ERROR_KEY],
          _note(r),
      ],
      "'time/unq': forward time / the same backend's unquantized time in "
      "this run (< 1 is faster); 'err/unq': max |output - unquantized "
      "output| / max |unquantized output|.",
  )


def _available(names: list[str]) -> list[str]:
  kept = []
  for name in names:
    ok, why = moe_core.registry.availability(name)
    if ok:
      kept.append(name)
    else:
      print(f"skipping {name}: {why}")
  return kept


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  repeats = 1 if _QUICK.value else _REPEATS.value
  m, k, n, e = _ROWS.value, _CONTRACT.value, _OUTPUT.value, _EXPERTS.value
  recipes = [_BASELINE] + [r for r in _RECIPES.value if r != _BASELINE]
  print(
      f"jax {jax.__version__} on {jax.default_backend()} "
      f"({jax.devices()[0].device_kind}); M={m} K={k} N={n} E={e} bfloat16, "
      f"repeats={repeats}",
      flush=True,
  )
  args = _operands(m, k, n, e)
  results = []
  for name in _available(_BACKENDS.value):
    results += run_backend(name, recipes, args, repeats)
  print_table(results)

  json_report.save_run(
      _OUT_DIR.value,
      "precision_gemm",
      {
          "quick": _QUICK.value,
          "repeats": repeats,
          "shape": {"rows": m, "contract": k, "output": n, "experts": e},
          "dtype": "bfloat16",
          "results": results,
      },
  )


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
