r"""Trains a small MoE language model with a chosen dropless backend.

    python -m train.main                        # tiny_dsv3 on the CPU, ~3 min
    python -m train.main --moe_backend=reference --steps=20
    python -m train.main --precision=mxfp8      # expert GEMMs in MXFP8
    python -m train.main --model=deepseek_v3 --dry_run --mesh=fsdp=4,expert=64
    python -m train.main --model=mixtral_8x7b --dry_run --target=h100 \
        --topology=1x1x8 --mesh=fsdp=8   # the real step, compiled for GPUs
    python -m train.main --resume               # continue the last run
    python -m train.main --mesh=data=2,expert=4 # 8 devices (simulated on CPU)
    tools/launch_local.sh 2 --mesh=data=2,expert=4   # 2 processes x 4 devices

Writes to --output_dir: metrics.jsonl (every step), checkpoints/,
training.png (loss curves and an expert-load heat map) and summary.json.
One run at a time per --output_dir: a second is refused (a lock file in
it, .dropless_train.lock, names the holder).

A fault ends the program with one line on stderr, "error: ...", and exit
status 1: a bad flag, a busy --output_dir, a checkpoint that does not
match or cannot be written, a non-finite loss, the device's memory. An
interruption (Ctrl-C, SIGTERM) before the last step checkpoints and exits
130; after it, the run finishes as usual.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

from absl import app
from absl import flags
import jax
import numpy as np

import moe_core
from moe_core import aot
import moe_core.flags  # Defines --moe_backend.
from moe_core import remat as moe_remat
from train import checkpoint
from train import cost_report
from train import data as data_lib
from train import distributed
from train import dry_run_target
from train import mesh as mesh_lib
from train import presets
from train import report
from train import run_config
from train import sizing
from train import step_log
from train import trainer

_MODEL = flags.DEFINE_enum(
    "model", presets.DEFAULT_PRESET, list(presets.PRESETS), "Model preset."
)
_STEPS = flags.DEFINE_integer(
    "steps", None, "Optimiser steps, >= 1 (preset default if unset)."
)
_BATCH = flags.DEFINE_integer(
    "batch_size", None, "Sequences per step, >= 1 (preset default if unset)."
)
_MICROBATCHES = flags.DEFINE_integer(
    "microbatches",
    1,
    "Gradient accumulation: each step's batch runs as this many equal "
    "microbatches, one after the other, their gradients summed (>= 1; it "
    "and the data-parallel size of --mesh must divide --batch_size).",
)
_OPT_STATE_DTYPE = flags.DEFINE_enum(
    "opt_state_dtype",
    "float32",
    list(run_config.OPT_STATE_DTYPES),
    "The dtype AdamW's moments are stored in: bfloat16 halves them (as "
    "DeepSeek-V3 trained), updated in float32 either way.",
)
_NUM_LAYERS = flags.DEFINE_integer(
    "num_layers",
    None,
    "The preset model at this depth (blocks), full width, its first dense "
    "layers kept: e.g. --model=deepseek_v3 --num_layers=5 --dry_run "
    "compiles the real mesh's step in a fraction of the time (preset depth "
    "if unset).",
)
_EP_CHUNKS = flags.DEFINE_integer(
    "ep_chunks",
    1,
    "Expert parallelism: exchange each device's tokens of an MoE layer in "
    "this many chunks (>= 1, dividing the tokens a device holds per "
    "microbatch). The drop-free receive buffer is sized for the worst case, "
    "every peer's tokens sent to one device; chunks shrink it by this "
    "factor, and the scheduler may overlap one chunk's exchange with "
    "another's expert GEMMs.",
)
_SEQ = flags.DEFINE_integer(
    "seq_len",
    None,
    "Tokens (bytes) per sequence, >= 1 (preset default if unset).",
)
_LR = flags.DEFINE_float(
    "learning_rate", None, "Peak AdamW learning rate, > 0 (preset default)."
)
_WARMUP = flags.DEFINE_integer(
    "warmup_steps", None, "Linear warmup steps, >= 0 (preset default)."
)
_WD = flags.DEFINE_float(
    "weight_decay", None, "AdamW weight decay, >= 0 (preset default)."
)
_CLIP = flags.DEFINE_float(
    "grad_clip", None, "Global gradient-norm clip, > 0 (preset default)."
)
_BIAS_RATE = flags.DEFINE_float(
    "bias_update_rate",
    None,
    "Step of the aux-loss-free correction-bias rule (sigmoid presets), "
    ">= 0 (preset default).",
)
_AUX = flags.DEFINE_float(
    "aux_loss_weight",
    None,
    "Weight of the load-balancing loss, >= 0 (preset default).",
)
_Z = flags.DEFINE_float(
    "z_loss_weight", None, "Weight of the router z-loss, >= 0 (preset default)."
)
_SEED = flags.DEFINE_integer(
    "seed", 0, "Initialisation and data-order seed, in [0, 2**63 - 1]."
)
_DATA = flags.DEFINE_string(
    "data",
    None,
    "A text file to train on (bytes); default: the embedded "
    "pydoc_data corpus that ships with Python.",
)
_OUT = flags.DEFINE_string(
    "output_dir",
    "/tmp/dropless_train",
    "Where metrics, checkpoints and plots go: a directory, or a path where "
    "one can be created.",
)
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every",
    50,
    "Held-out evaluation interval in steps, >= 1 (the last step is always "
    "evaluated).",
)
_EVAL_BATCHES = flags.DEFINE_integer(
    "eval_batches", 8, "Held-out batches per evaluation, >= 1."
)
_CKPT_EVERY = flags.DEFINE_integer(
    "checkpoint_every",
    100,
    "Checkpoint interval in steps, >= 0 (0: only at the end and on "
    "interrupt).",
)
_KEEP = flags.DEFINE_integer(
    "keep_checkpoints", 2, "Checkpoints kept, newest first, >= 0 (0: all)."
)
_LOG_EVERY = flags.DEFINE_integer(
    "log_every", 25, "Print a log line every N steps, N >= 1."
)
_RESUME = flags.DEFINE_bool(
    "resume",
    False,
    "Continue from the newest checkpoint in --output_dir "
    "(an error if there is none or it does not match this run).",
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Print parameter counts, FLOPs per token and memory per device for "
    "--mesh (an analytic estimate and, for models this program trains, "
    "XLA's figure for the compiled train step), and exit without "
    "allocating the model.",
)
_TARGET = flags.DEFINE_enum(
    "target",
    None,
    sorted(aot.TARGETS),
    "With --dry_run and --topology: compile the real train step for these "
    "GPUs (they need not be here; moe_core.aot) and report its memory, "
    "FLOPs and all-to-all bytes per device beside the analytic estimate.",
)
_TOPOLOGY = flags.DEFINE_string(
    "topology",
    None,
    "With --target: the GPUs as 'SxHxG' (slices x hosts x GPUs per host, "
    "e.g. 1x128x8); their count must be the product of --mesh.",
)
_DRY_RUN_JSON = flags.DEFINE_string(
    "dry_run_json",
    None,
    "Where --dry_run --target writes its figures as JSON (default: "
    "--output_dir/dry_run_<target>_<topology>.json).",
)
_MESH = flags.DEFINE_string(
    "mesh",
    "data=1",
    "Device mesh to train on (and for --dry_run estimates), e.g. "
    "'data=2,expert=4': axes data, fsdp, expert, tensor (see train/mesh.py), "
    "each at most once; expert must divide the model's experts; the sizes "
    "multiply to the device count of all processes.",
)
_REMAT = flags.DEFINE_enum(
    "remat",
    "none",
    list(moe_remat.POLICIES),
    "Activation rematerialisation policy per block (see moe_core/remat.py).",
)
_SCAN_LAYERS = flags.DEFINE_bool(
    "scan_layers",
    True,
    "Run the layers under a scan (one compiled layer per stack: compile "
    "time does not grow with depth; parameters stacked per layer); "
    "--noscan_layers unrolls them.",
)
_DTYPE = flags.DEFINE_enum(
    "compute_dtype",
    "bfloat16",
    ["bfloat16", "float32"],
    "Activation dtype; parameters stay float32.",
)
# What each --precision recipe does to the routed experts' GEMMs (both
# operands of every forward GEMM; moe_core/precision.py has the details).
PRECISION_RECIPES = {
    "bf16": "no quantisation: the GEMMs run in --compute_dtype",
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
_PRECISION = flags.DEFINE_enum(
    "precision",
    "bf16",
    list(moe_core.config.PRECISIONS),
    "Recipe of the routed experts' GEMMs: "
    + "; ".join(f"{k}: {v}" for k, v in PRECISION_RECIPES.items())
    + ". Routing stays float32; the shared expert, attention and dense "
    "layers run in --compute_dtype. An all-dense --model takes only bf16.",
)
_PROGRESS = flags.DEFINE_bool(
    "progress", True, "Show a progress bar on a terminal."
)
_PLOT = flags.DEFINE_bool("plot", True, "Write training.png at the end.")

# --- Flag checks --------------------------------------------------------------
# absl runs these as it parses the command line: a bad value ends the program
# with one line per bad flag (and exit status 1) before JAX sets up a device
# or compiles anything. Setting a flag in code (flagsaver) runs them too.

# The largest seed nnx.Rngs and jax.random.key accept (a C long).
_MAX_SEED = 2**63 - 1

# (flag, smallest value, largest value or None): the integer flags.
_INT_RANGES = (
    (_STEPS, 1, None),
    (_BATCH, 1, None),
    (_MICROBATCHES, 1, None),
    (_EP_CHUNKS, 1, None),
    (_NUM_LAYERS, 1, None),
    # The sampler reads seq_len + 1 bytes: one next-byte target per input.
    (_SEQ, 1, None),
    (_WARMUP, 0, None),
    (_SEED, 0, _MAX_SEED),
    (_EVAL_EVERY, 1, None),
    (_EVAL_BATCHES, 1, None),
    (_CKPT_EVERY, 0, None),
    (_KEEP, 0, None),
    (_LOG_EVERY, 1, None),
)

# (flag, whether 0 is allowed): the float flags, all finite and not negative.
_FLOAT_ZERO_ALLOWED = (
    (_LR, False),
    (_WD, True),
    (_CLIP, False),
    (_BIAS_RATE, True),
    (_AUX, True),
    (_Z, True),
)


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


def _register_number_checks() -> None:
  for holder, low, high in _INT_RANGES:
    _register_int_check(holder, low, high)
  for holder, zero_ok in _FLOAT_ZERO_ALLOWED:
    _register_float_check(holder, zero_ok)


_register_number_checks()


def _mesh_sizes(spec) -> dict[str, int]:
  """--mesh as {axis: size}, or a flags.ValidationError naming the flag."""
  if not isinstance(spec, str):
    raise flags.ValidationError(
        f"--mesh must be a string like 'data=2,expert=4', got {spec!r}."
    )
  try:
    sizes = mesh_lib.parse(spec)
  except ValueError as e:
    message = str(e)
    if "--mesh" not in message:
      message = f"--mesh={spec!r}: {message}"
    raise flags.ValidationError(message) from e
  # parse() lets a later entry overwrite an earlier one; a repeated axis is
  # a typo, not a choice.
  axes = [item.partition("=")[0].strip() for item in spec.split(",")]
  repeated = sorted({a for a in axes if a and axes.count(a) > 1})
  if repeated:
    raise flags.ValidationError(
        f"--mesh must give each axis at most once, got {repeated} more "
        f"than once in {spec!r}."
    )
  return sizes


@flags.validator("mesh")
def _check_mesh_syntax(spec) -> bool:
  _mesh_sizes(spec)
  return True


@flags.multi_flags_validator(("mesh", "model"))
def _check_mesh_splits_experts(values: dict) -> bool:
  """The expert axis divides the experts of --model (with --dry_run too).

  The device count is checked when the mesh is built (JAX's devices are not
  known at parse time), the batch split with the run (mesh.check_run).
  """
  sizes = _mesh_sizes(values["mesh"])
  if values["model"] not in presets.PRESETS:
    raise flags.ValidationError(
        f"--model must be one of {sorted(presets.PRESETS)}, got "
        f"{values['model']!r}."
    )
  moe = presets.get_preset(values["model"]).model.moe
  expert = sizes[mesh_lib.EXPERT_AXIS]
  if expert > 1 and moe is None:
    raise flags.ValidationError(
        f"--mesh expert={expert} splits experts, but --model="
        f"{values['model']} is dense; use data or fsdp instead."
    )
  if moe is not None and moe.num_experts % expert:
    raise flags.ValidationError(
        f"--mesh expert size must divide the {moe.num_experts} experts of "
        f"--model={values['model']}, got expert={expert}."
    )
  return True


@flags.multi_flags_validator(("target", "topology", "dry_run", "mesh"))
def _check_target(values: dict) -> bool:
  """--target and --topology come together, with --dry_run, and the
  topology's GPUs are the mesh's devices."""
  target, topology = values["target"], values["topology"]
  if target is None and topology is None:
    return True
  if target is None:
    raise flags.ValidationError(
        f"--topology={topology} needs --target (one of {sorted(aot.TARGETS)})"
        " to say which GPUs to compile for."
    )
  if topology is None:
    raise flags.ValidationError(
        f"--target={target} needs --topology=SxHxG (slices x hosts x GPUs "
        "per host, e.g. 1x1x8) to say how many GPUs."
    )
  if not values["dry_run"]:
    raise flags.ValidationError(
        f"--target={target} --topology={topology} compiles for GPUs that "
        "are not here: it needs --dry_run."
    )
  try:
    slices, hosts, gpus = aot.parse_topology(topology)
  except ValueError as e:
    raise flags.ValidationError(f"--{e}") from e
  sizes = _mesh_sizes(values["mesh"])
  if slices * hosts * gpus != mesh_lib.num_devices(sizes):
    raise flags.ValidationError(
        f"--topology={topology} has {slices * hosts * gpus} GPUs, but --mesh="
        f"{values['mesh']} multiplies to {mesh_lib.num_devices(sizes)}; give "
        "a mesh whose sizes multiply to the topology's GPUs."
    )
  return True


@flags.multi_flags_validator(("precision", "model"))
def _check_precision_has_experts(values: dict) -> bool:
  """A quantised recipe needs routed experts: --model must have MoE blocks."""
  precision, model = values["precision"], values["model"]
  if precision == "bf16" or model not in presets.PRESETS:
    return True  # An unknown --model is the mesh check's line.
  if presets.get_preset(model).model.moe is None:
    raise flags.ValidationError(
        f"--precision must be bf16 for --model={model}, which is dense (no "
        f"routed experts' GEMMs to quantise), got {precision!r}."
    )
  return True


@flags.validator("output_dir")
def _check_output_dir(path) -> bool:
  """A directory, or a path whose missing folders can be made (not made here).

  Creating it waits for the run (or for --dry_run --target's JSON).
  """
  if not isinstance(path, str) or not path:
    raise flags.ValidationError(
        f"--output_dir must be a directory path, got {path!r}."
    )
  existing = os.path.abspath(path)  # The path itself, or its nearest ancestor.
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise flags.ValidationError(
        f"--output_dir must be a directory or a new path under one, got "
        f"{path!r}, but {existing!r} exists and is not a directory."
    )
  if not os.access(existing, os.W_OK | os.X_OK):
    raise flags.ValidationError(
        f"--output_dir must be writable, got {path!r}, but {existing!r} is "
        "not writable."
    )
  return True


@flags.validator("data")
def _check_data(path) -> bool:
  """None or '' (the embedded corpus), or a readable file."""
  if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
    raise flags.ValidationError(
        f"--data must name a readable file, got {path!r}."
    )
  return True


def _run_config() -> run_config.RunConfig:
  return run_config.run_config_from_preset(
      _MODEL.value,
      steps=_STEPS.value,
      batch_size=_BATCH.value,
      seq_len=_SEQ.value,
      learning_rate=_LR.value,
      warmup_steps=_WARMUP.value,
      weight_decay=_WD.value,
      grad_clip=_CLIP.value,
      bias_update_rate=_BIAS_RATE.value,
      aux_loss_weight=_AUX.value,
      z_loss_weight=_Z.value,
      seed=_SEED.value,
      backend=moe_core.flags.MOE_BACKEND.value,
      remat=_REMAT.value,
      scan_layers=_SCAN_LAYERS.value,
      microbatches=_MICROBATCHES.value,
      ep_chunks=_EP_CHUNKS.value,
      opt_state_dtype=_OPT_STATE_DTYPE.value,
      num_layers=_NUM_LAYERS.value,
      compute_dtype=_DTYPE.value,
      data=_DATA.value,
      output_dir=_OUT.value,
      eval_every=_EVAL_EVERY.value,
      eval_batches=_EVAL_BATCHES.value,
      checkpoint_every=_CKPT_EVERY.value,
      keep_checkpoints=_KEEP.value,
      log_every=_LOG_EVERY.value,
      resume=_RESUME.value,
      progress=_PROGRESS.value,
      plot=_PLOT.value,
      mesh=mesh_lib.canonical(mesh_lib.parse(_MESH.value)),
      precision=_PRECISION.value,
  )


def dry_run(out=None, *, compile_step: bool = True) -> str:
  """Prints the counts for the chosen preset; allocates no arrays.

  Args:
    out: where to print (default: sys.stdout).
    compile_step: also compile the train step (abstractly, on the devices
      of --mesh, simulated on a CPU) and print XLA's memory figures for it
      beside the analytic estimate: the very step a run compiles, so the
      figure is what the run allocates for it; about as long as a run's
      first step.
  """
  preset = presets.get_preset(_MODEL.value)
  full_depth = preset.model.num_layers
  preset = dataclasses.replace(
      preset,
      model=run_config.preset_model(
          preset, _PRECISION.value, _NUM_LAYERS.value
      ),
  )
  text = cost_report.describe(
      preset,
      mesh=sizing.parse_mesh(_MESH.value),
      batch_size=_BATCH.value or preset.train.batch_size,
      seq_len=_SEQ.value or preset.train.seq_len,
      remat=_REMAT.value,
      moment_bytes=run_config.MOMENT_BYTES[_OPT_STATE_DTYPE.value],
      microbatches=_MICROBATCHES.value,
      published_layers=full_depth,
  )
  if compile_step and not _TARGET.value:
    text += f"\n    {_compiled_memory()}"
  if preset.model.moe is not None:
    text += f"\n{_precision_line(_PRECISION.value)}"
  print(text, file=out or sys.stdout, flush=True)
  if _TARGET.value:
    text += "\n" + _target_dry_run(out or sys.stdout)
  return text


def _target_dry_run(out) -> str:
  """Compiles the run's step for --target x --topology, prints and writes
  its figures; the printed text.

  Raises:
    app.UsageError: the run does not split over the mesh, the GPUs cannot
      be described here, or the step does not fit (one line).
  """
  run = dry_run_target.resolve_backend(_run_config())
  path = _DRY_RUN_JSON.value or dry_run_target.default_json_path(
      run.output_dir, _TARGET.value, _TOPOLOGY.value
  )
  try:
    record, _, _ = dry_run_target.compile_for(
        run, _TARGET.value, _TOPOLOGY.value
    )
  except (ValueError, RuntimeError) as e:
    # A run that does not split over --mesh; no CUDA plugin to describe
    # the GPUs with.
    raise app.UsageError(str(e)) from e
  text = dry_run_target.describe(record)
  dry_run_target.write_json(record, path)
  text += f"\n  wrote {path}"
  print(text, file=out, flush=True)
  try:
    dry_run_target.check_fits(record, run)
  except dry_run_target.TargetDoesNotFitError as e:
    raise app.UsageError(str(e)) from e
  return text


def _compiled_memory() -> str:
  """The --dry_run line with XLA's memory figures of the train step."""
  try:
    run = _run_config()
    mesh_lib.simulate_cpu_devices(mesh_lib.parse(run.mesh), 1)
    memory = trainer.compiled_step_memory(run)
  except ValueError as e:  # The mesh does not fit the devices.
    return f"compiled train step: not compiled: {e}"
  if memory is None:
    return (
        "compiled train step: XLA gives no memory figures on "
        f"{jax.devices()[0].platform}"
    )
  analytic = cost_report.analytic_bytes_per_device(run)
  return cost_report.compiled_memory_line(memory, analytic)


def _precision_line(precision: str) -> str:
  """The --dry_run line that says how the routed experts' GEMMs compute."""
  return (
      f"  routed experts' GEMMs: --precision={precision} "
      f"({PRECISION_RECIPES[precision]}); routing float32"
  )


def _start_devices(run: run_config.RunConfig, out) -> None:
  """Joins the other processes (if any) and sets up the devices for --mesh.

  Runs before anything initialises JAX's backends.
  """
  spec = distributed.spec_from_flags()
  note = mesh_lib.simulate_cpu_devices(
      mesh_lib.parse(run.mesh), spec.num_processes if spec else 1
  )
  distributed.initialize(spec)
  if note and distributed.is_main_process():
    print(note, file=out, flush=True)


def train(out=None) -> dict:
  """Runs training as the flags say and writes the report files.

  Prints to `out` (default: sys.stdout).

  In a multi-process run every process trains; only process 0 (which holds
  --output_dir's lock) prints and writes the metrics, plot and summary
  (checkpoints are written by all). Ctrl-C and SIGTERM are deferred from
  the first step to the end of the report (see
  `trainer.Trainer.deferring_signals`).

  Raises:
    app.UsageError: a flag the run cannot use, a busy --output_dir, or a
      checkpoint that does not match the run.
    trainer.TrainingFault: a non-finite loss or state, out of memory.
    checkpoint.CheckpointSaveError: a checkpoint could not be written.
  """
  out = out or sys.stdout
  try:
    run = _run_config()
    _start_devices(run, out)
    run, tr, out = _set_up(run, out)
  except ValueError as e:
    # A flag the run cannot use, or a checkpoint that does not match it:
    # one line naming the flag, not a traceback.
    raise app.UsageError(str(e)) from e
  except RuntimeError as e:
    if not trainer.is_out_of_memory(e):
      raise
    raise trainer.out_of_memory_error(
        run, e, when="placing the model on the devices"
    ) from e
  try:
    with tr.deferring_signals():
      summary = tr.fit(handle_signals=True)
      return _report(run, tr, summary, out)
  except step_log.MetricsLogError as e:
    raise app.UsageError(str(e)) from e
  finally:
    tr.close()


def _set_up(run: run_config.RunConfig, out):
  """(run, Trainer, output stream), resumed or fresh as the flags say."""
  if not distributed.is_main_process():
    run = dataclasses.replace(run, progress=False, plot=False)
    out = open(os.devnull, "w")  # pylint: disable=consider-using-with
  corpus = data_lib.load(run.data)
  entropy = data_lib.unigram_entropy(
      np.concatenate([corpus.train, corpus.held_out])
  )
  print(
      f"data {corpus.name}: {len(corpus.train):,} train bytes, "
      f"{len(corpus.held_out):,} held-out bytes; unigram byte entropy "
      f"{entropy:.4f} nats/byte ({entropy / 0.6931471805599453:.3f} "
      "bits), the loss to beat",
      file=out,
  )
  tr = trainer.Trainer(run, corpus, out=out)
  counts = sizing.param_counts(run.model)
  print(
      f"model {run.model.name}: {counts.total:,} parameters "
      f"({counts.active:,} active per token); backend {tr.backend_name}; "
      f"{run.steps} steps of {run.batch_size}x{run.seq_len} tokens"
      + (f" in {run.microbatches} microbatches" if run.microbatches > 1 else "")
      + f"; layers {'scanned' if run.scan_layers else 'unrolled'}; "
      f"remat={run.remat}; compute {run.compute_dtype}, params float32, "
      f"expert GEMMs {run.precision}; "
      f"mesh {mesh_lib.describe(tr.sizes)} over {jax.device_count()} "
      f"{jax.devices()[0].platform} device(s) in {jax.process_count()} "
      "process(es)",
      file=out,
      flush=True,
  )
  tr.prepare_output_dir()
  return run, tr, out


def _report(run: run_config.RunConfig, tr, summary: dict, out) -> dict:
  """Writes the plot and summary.json (process 0) and prints the summary."""
  if run.plot and tr.history["step"]:
    summary["plot"] = report.plot(
        os.path.join(run.output_dir, "training.png"),
        tr.history,
        summary,
        [i for i in range(run.model.num_layers) if run.model.is_moe_layer(i)],
    )
  summary_path = os.path.join(run.output_dir, "summary.json")
  if distributed.is_main_process():
    report.write_summary(summary_path, summary)
  held = summary["final_held_out_loss"]
  print("\nsummary:", file=out)
  if held is not None:
    print(
        f"  held-out loss {held:.4f} nats/byte vs unigram entropy "
        f"{summary['unigram_entropy']:.4f} "
        f"({held / summary['unigram_entropy']:.0%} of it)",
        file=out,
    )
  print(
      f"  final train loss {summary['final_train_loss']:.4f}; median "
      f"{summary['tokens_per_s_median']:,.0f} tokens/s "
      f"({summary['tokens_per_s_per_device_median']:,.0f} per device on "
      f"{summary['mesh']}, {summary['num_processes']} process(es)) with "
      "backend "
      f"{summary['backend']}, expert GEMMs {summary['precision']}; max "
      "dropped fraction "
      f"{summary['max_dropped_fraction']:.3g}; wall "
      f"{summary['wall_seconds']:.0f} s",
      file=out,
  )
  print(
      f"  wrote {summary_path}"
      + (f", {summary['plot']}" if "plot" in summary else "")
      + (f", {summary['checkpoint']}" if summary["checkpoint"] else ""),
      file=out,
      flush=True,
  )
  return summary


# Exit status of a run interrupted before its last step (128 + SIGINT, as a
# shell reports a Ctrl-C).
INTERRUPTED_EXIT_CODE = 130
# What ends the program with one line (`_exit_with`) instead of a traceback.
_FAULTS = (
    app.UsageError,
    trainer.TrainingFault,
    checkpoint.CheckpointError,
)


def _exit_with(error: BaseException) -> None:
  """Ends the program with `error`'s message as one line on stderr, status 1.

  absl would print the module's docstring and every flag's help (about 95
  lines) before a UsageError's message; `--help` still lists the flags.
  """
  sys.stdout.flush()
  message = " ".join(str(error).split("\n"))
  sys.stderr.write(f"error: {message}\n")
  sys.stderr.flush()
  sys.exit(getattr(error, "exitcode", None) or 1)


def main(argv):
  try:
    if len(argv) > 1:
      raise app.UsageError(
          f"unexpected arguments {argv[1:]}: this program takes only flags, "
          "--name=value (--help lists them)."
      )
    if _DRY_RUN.value:
      dry_run()
      return
    summary = train()
  except _FAULTS as e:
    _exit_with(e)
  distributed.shutdown()
  if summary["interrupted"]:
    sys.exit(INTERRUPTED_EXIT_CODE)


if __name__ == "__main__":
  app.run(main)
