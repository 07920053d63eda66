"""Every flag of `python -m train.main`, its parse-time check, and the
RunConfig the flags make (`run_config_from_flags`). The checks of the
numbers are here; those of the settings against the model, the mesh, the
compile target and the paths are `train/run/inputs/settings_checks.py`'s.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from absl import flags
from absl import logging

import moe_core
from moe_core import aot
import moe_core.flags  # Defines --moe_backend.
from moe_core import precision as moe_precision
from moe_core import remat as moe_remat
from train.parallel import mesh as mesh_lib
from train.presets import catalog
from train.run.inputs import run_config
from train.run.inputs import settings_checks

# --- Flag checks --------------------------------------------------------------
# Registered with the flags below. absl runs them as it parses the command
# line: a bad value ends the program with one line per bad flag (and exit
# status 1) before JAX sets up a device or compiles anything. Setting a flag
# in code (flagsaver) runs them too.

# The largest seed nnx.Rngs and jax.random.key accept (a C long).
_MAX_SEED = 2**63 - 1


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value) -> bool:
  return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _register_int_check(
    holder: flags.FlagHolder, low: int, high: int | None
) -> None:
  """--name must be an int in [low, high]; None where None is the default."""
  expected = f">= {low}" if high is None else f"in [{low}, {high}]"

  def check(value) -> bool:
    if value is None and holder.default is None:
      return True  # The preset's value.
    if not _is_int(value) or value < low or (high is not None and value > high):
      raise flags.ValidationError(
          f"--{holder.name} must be an int {expected}, got {value!r}."
      )
    return True

  flags.register_validator(holder, check)


def _register_float_check(holder: flags.FlagHolder, zero_ok: bool) -> None:
  """--name must be finite and > 0 (>= 0 if zero_ok); None if the default."""
  expected = ">= 0" if zero_ok else "> 0"

  def check(value) -> bool:
    if value is None and holder.default is None:
      return True  # The preset's value.
    # absl's float parser takes "nan" and "inf": refuse them here.
    if (
        not _is_finite_number(value)
        or value < 0
        or (value == 0 and not zero_ok)
    ):
      raise flags.ValidationError(
          f"--{holder.name} must be a finite number {expected}, got {value!r}."
      )
    return True

  flags.register_validator(holder, check)


def _preset_int(name: str, what: str, *, low: int) -> flags.FlagHolder:
  """--name, an int >= low that replaces the preset's value of the same
  name; unset (None, the default), the preset's value stands."""
  holder = flags.DEFINE_integer(
      name, None, f"{what}, >= {low} (preset default if unset)."
  )
  _register_int_check(holder, low, None)
  return holder


def _preset_float(name: str, what: str, *, zero_ok: bool) -> flags.FlagHolder:
  """--name, a finite number > 0 (>= 0 if zero_ok) that replaces the
  preset's value of the same name; unset (None), the preset's value."""
  bound = ">= 0" if zero_ok else "> 0"
  holder = flags.DEFINE_float(
      name, None, f"{what}, {bound} (preset default if unset)."
  )
  _register_float_check(holder, zero_ok)
  return holder


MODEL = flags.DEFINE_enum(
    "model", catalog.DEFAULT_PRESET, list(catalog.PRESETS), "Model preset."
)
STEPS = _preset_int("steps", "Optimiser steps", low=1)
BATCH_SIZE = _preset_int("batch_size", "Sequences per step", low=1)
MICROBATCHES = flags.DEFINE_integer(
    "microbatches",
    1,
    "Gradient accumulation: each step's batch runs as this many equal "
    "microbatches, one after the other, their gradients summed (>= 1; it "
    "and the data-parallel size of --mesh must divide --batch_size).",
)
OPT_STATE_DTYPE = flags.DEFINE_enum(
    "opt_state_dtype",
    "float32",
    list(run_config.OPT_STATE_DTYPES),
    "The dtype AdamW's moments are stored in: bfloat16 halves them (as "
    "DeepSeek-V3 trained), updated in float32 either way.",
)
NUM_LAYERS = flags.DEFINE_integer(
    "num_layers",
    None,
    "The preset model at this depth (blocks), full width, its first dense "
    "layers kept: e.g. --model=deepseek_v3 --num_layers=5 --dry_run "
    "compiles the real mesh's step in a fraction of the time (preset depth "
    "if unset).",
)
EP_CHUNKS = flags.DEFINE_integer(
    "ep_chunks",
    1,
    "Expert parallelism: exchange each device's tokens of an MoE layer in "
    "this many chunks (>= 1, dividing the tokens a device holds per "
    "microbatch). The drop-free receive buffer is sized for the worst case, "
    "every peer's tokens sent to one device; chunks shrink it by this "
    "factor, and the scheduler may overlap one chunk's exchange with "
    "another's expert GEMMs.",
)
# The sampler reads seq_len + 1 bytes: one next-byte target per input.
SEQ_LEN = _preset_int("seq_len", "Tokens (bytes) per sequence", low=1)
LEARNING_RATE = _preset_float(
    "learning_rate", "Peak AdamW learning rate", zero_ok=False
)
WARMUP_STEPS = _preset_int("warmup_steps", "Linear warmup steps", low=0)
WEIGHT_DECAY = _preset_float("weight_decay", "AdamW weight decay", zero_ok=True)
GRAD_CLIP = _preset_float(
    "grad_clip", "Global gradient-norm clip", zero_ok=False
)
BIAS_UPDATE_RATE = _preset_float(
    "bias_update_rate",
    "Step of the aux-loss-free correction-bias rule (sigmoid presets)",
    zero_ok=True,
)
AUX_LOSS_WEIGHT = _preset_float(
    "aux_loss_weight", "Weight of the load-balancing loss", zero_ok=True
)
Z_LOSS_WEIGHT = _preset_float(
    "z_loss_weight", "Weight of the router z-loss", zero_ok=True
)
SEED = flags.DEFINE_integer(
    "seed", 0, "Initialisation and data-order seed, in [0, 2**63 - 1]."
)
DATA = flags.DEFINE_string(
    "data",
    None,
    "A text file to train on (bytes); default: the embedded "
    "pydoc_data corpus that ships with Python.",
)
OUTPUT_DIR = flags.DEFINE_string(
    "output_dir",
    "/tmp/dropless_train",
    "Where metrics, checkpoints and plots go: a directory, or a path where "
    "one can be created.",
)
EVAL_EVERY = flags.DEFINE_integer(
    "eval_every",
    50,
    "Held-out evaluation interval in steps, >= 1 (the last step is always "
    "evaluated).",
)
EVAL_BATCHES = flags.DEFINE_integer(
    "eval_batches", 8, "Held-out batches per evaluation, >= 1."
)
CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every",
    100,
    "Checkpoint interval in steps, >= 0 (0: only at the end and on "
    "interrupt).",
)
KEEP_CHECKPOINTS = flags.DEFINE_integer(
    "keep_checkpoints", 2, "Checkpoints kept, newest first, >= 0 (0: all)."
)
LOG_EVERY = flags.DEFINE_integer(
    "log_every", 25, "Print a log line every N steps, N >= 1."
)
RESUME = flags.DEFINE_bool(
    "resume",
    False,
    "Continue from the newest checkpoint in --output_dir "
    "(an error if there is none or it does not match this run).",
)
DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Print parameter counts, FLOPs per token and memory per device for "
    "--mesh (an analytic estimate and, for models this program trains, "
    "XLA's figure for the compiled train step), and exit without "
    "allocating the model.",
)
TARGET = flags.DEFINE_enum(
    "target",
    None,
    sorted(aot.TARGETS),
    "With --dry_run and --topology: compile the real train step for these "
    "GPUs or TPUs (they need not be here; moe_core.aot) and report its "
    "memory, FLOPs and all-to-all bytes per device beside the analytic "
    "estimate.",
)
TOPOLOGY = flags.DEFINE_string(
    "topology",
    None,
    "With --target: GPUs as 'SxHxG' (slices x hosts x GPUs per host, e.g. "
    "1x128x8), TPUs as their chip grid and '/S' slices (v5e, v6e: '16x16'; "
    "v5p, tpu7x: '8x16x16', '4x4x4/2'); their devices must be the product "
    "of --mesh.",
)
DRY_RUN_JSON = flags.DEFINE_string(
    "dry_run_json",
    None,
    "Where --dry_run --target writes its figures as JSON (default: "
    "--output_dir/dry_run_<target>_<topology>.json).",
)
MESH = flags.DEFINE_string(
    "mesh",
    "data=1",
    "Device mesh to train on (and for --dry_run estimates), e.g. "
    "'data=2,expert=4': axes data, fsdp, expert, tensor (see "
    "train/parallel/mesh.py), "
    "each at most once; expert must divide the model's experts; the sizes "
    "multiply to the device count of all processes.",
)
REMAT = flags.DEFINE_enum(
    "remat",
    "none",
    list(moe_remat.POLICIES),
    "Activation rematerialisation policy per block (see moe_core/remat.py).",
)
SCAN_LAYERS = flags.DEFINE_bool(
    "scan_layers",
    True,
    "Run the layers under a scan (one compiled layer per stack: compile "
    "time does not grow with depth; parameters stacked per layer); "
    "--noscan_layers unrolls them.",
)
COMPUTE_DTYPE = flags.DEFINE_enum(
    "compute_dtype",
    "bfloat16",
    ["bfloat16", "float32"],
    "Activation dtype; parameters stay float32.",
)
# What each --precision recipe does to the routed experts' GEMMs (both
# operands of every forward GEMM; moe_core/precision.py has the details).
PRECISION_RECIPES = {
    moe_precision.UNQUANTIZED: (
        "no quantisation: the GEMMs run in --compute_dtype"
    ),
    "fp8_tensor": "E4M3 with one float32 scale per tensor",
    "fp8_block": (
        "E4M3 with float32 scales per 1x128 activation tile and per 128x128 "
        "weight block, as DeepSeek-V3"
    ),
    "mxfp8": "E4M3 with one power-of-two (E8M0) scale per 32 elements",
    "nvfp4": (
        "E2M1 with one E4M3 scale per 16 elements and a float32 scale per "
        "tensor"
    ),
}


class _RecipeParser(flags.EnumParser):
  """One of `moe_core.precision.RECIPES`; a deprecated alias ("bf16") parses
  to the recipe it names, with the library's DeprecationWarning logged.

  Logged, not only warned: Python hides a DeprecationWarning raised outside
  __main__, so a command line with the old name would convert silently.
  """

  def parse(self, argument):
    if argument in moe_precision.DEPRECATED_ALIASES:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        recipe = moe_precision.check_recipe(argument)
      for warning in caught:
        logging.warning("--%s", warning.message)
        warnings.warn_explicit(
            warning.message, warning.category, warning.filename, warning.lineno
        )
      return recipe
    return super().parse(argument)


class _RecipeFlag(flags.EnumFlag):
  """An enum flag of the recipes whose parser also takes the deprecated
  aliases; the help's <...|...> lists the canonical names only."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.parser = _RecipeParser(self.parser.enum_values)


PRECISION = flags.DEFINE_flag(
    _RecipeFlag(
        "precision",
        moe_precision.UNQUANTIZED,
        "Recipe of the routed experts' GEMMs: "
        + "; ".join(f"{k}: {v}" for k, v in PRECISION_RECIPES.items())
        + ". Routing stays float32; the shared expert, attention and dense "
        "layers run in --compute_dtype. An all-dense --model takes only "
        f"{moe_precision.UNQUANTIZED}. Deprecated: "
        + ", ".join(
            f"{old} (the same as {new})"
            for old, new in moe_precision.DEPRECATED_ALIASES.items()
        )
        + ".",
        list(moe_precision.RECIPES),
    )
)
PROGRESS = flags.DEFINE_bool(
    "progress", True, "Show a progress bar on a terminal."
)
PLOT = flags.DEFINE_bool("plot", True, "Write training.png at the end.")
PROFILE_DIR = flags.DEFINE_string(
    "profile_dir",
    "",
    "Write a jax.profiler trace (with a Perfetto trace beside it) of three "
    "steps after the warm-up (steps 6-8) into this directory.",
)

# (flag, smallest value, largest value or None): the integer flags that
# are not preset values (those check themselves, `_preset_int`).
_INT_RANGES = (
    (MICROBATCHES, 1, None),
    (EP_CHUNKS, 1, None),
    (NUM_LAYERS, 1, None),
    (SEED, 0, _MAX_SEED),
    (EVAL_EVERY, 1, None),
    (EVAL_BATCHES, 1, None),
    (CHECKPOINT_EVERY, 0, None),
    (KEEP_CHECKPOINTS, 0, None),
    (LOG_EVERY, 1, None),
)


def _register_int_checks() -> None:
  for holder, low, high in _INT_RANGES:
    _register_int_check(holder, low, high)


_register_int_checks()


def _validator(check):
  """`check` (a `settings_checks` function) as an absl validator of one
  flag: its ValueError becomes the flag's one-line error."""

  def validate(value) -> bool:
    try:
      check(value)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from e
    return True

  return validate


def _multi_validator(check):
  """As `_validator`, for a check of several flags, given by name."""

  def validate(values: dict) -> bool:
    try:
      check(**values)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from e
    return True

  return validate


_check_layers_scan = _multi_validator(settings_checks.check_layers_scan)
flags.register_validator("mesh", _validator(settings_checks.mesh_sizes))
flags.register_multi_flags_validator(
    ("mesh", "model"),
    _multi_validator(settings_checks.check_mesh_splits_experts),
)
flags.register_multi_flags_validator(
    ("scan_layers", "model"), _check_layers_scan
)
flags.register_multi_flags_validator(
    ("target", "topology", "dry_run", "mesh"),
    _multi_validator(settings_checks.check_target),
)
flags.register_multi_flags_validator(
    ("precision", "model"),
    _multi_validator(settings_checks.check_precision_has_experts),
)
flags.register_validator(
    "output_dir", _validator(settings_checks.check_output_dir)
)
flags.register_validator("data", _validator(settings_checks.check_data))
# The settings against each other. Registered last: absl skips a validator
# whose flags an earlier one refused, so each bad flag gets one line.
flags.register_multi_flags_validator(
    ("model", "num_layers", "precision"),
    _multi_validator(settings_checks.check_model_shape),
)
flags.register_multi_flags_validator(
    (
        "model",
        "batch_size",
        "seq_len",
        "microbatches",
        "ep_chunks",
        "mesh",
        "dry_run",
    ),
    _multi_validator(settings_checks.check_batch_split),
)
flags.register_multi_flags_validator(
    ("moe_backend", "model", "target", "precision", "compute_dtype"),
    _multi_validator(settings_checks.check_backend),
)
flags.register_multi_flags_validator(
    ("output_dir", "dry_run", "plot", "target", "topology", "dry_run_json"),
    _multi_validator(settings_checks.check_output_paths),
)


# RunConfig's fields that no flag of the same name sets: --model picks the
# preset, --moe_backend sets backend, and --mesh is canonicalised.
_NOT_SAME_NAME = ("model", "backend", "mesh")
# The flags passed to run_config_from_preset under their own names: every
# other RunConfig field, generated from the dataclass (a field without its
# flag fails flags_test), and the two that shape the preset's model.
SAME_NAME = tuple(
    f.name
    for f in dataclasses.fields(run_config.RunConfig)
    if f.name not in _NOT_SAME_NAME
) + ("precision", "num_layers")


def run_config_from_flags() -> run_config.RunConfig:
  """The RunConfig the parsed flags describe (the preset's values where a
  flag is unset)."""
  return run_config.run_config_from_preset(
      MODEL.value,
      backend=moe_core.flags.MOE_BACKEND.value,
      mesh=mesh_lib.canonical(mesh_lib.parse(MESH.value)),
      **{name: flags.FLAGS[name].value for name in SAME_NAME},
  )
