r"""Trains a small MoE language model with a chosen dropless backend.

Writes metrics.jsonl, checkpoints/, training.png and summary.json to
--output_dir, one run at a time per directory; a fault ends it with one
"error: ..." line and exit status 1, an interruption before the last step
checkpoints and exits 130 (docs/training.md: outputs, the output lock,
faults). Usage:
    python -m train.main                        # tiny_dsv3 on the CPU, ~3 min
    python -m train.main --moe_backend=reference --steps=20
    python -m train.main --precision=mxfp8      # expert GEMMs in MXFP8
    python -m train.main --model=deepseek_v3 --dry_run --mesh=fsdp=4,expert=64
    python -m train.main --model=mixtral_8x7b --dry_run --target=h100 \
        --topology=1x1x8 --mesh=fsdp=8   # the real step, compiled for GPUs
    python -m train.main --model=mixtral_8x7b --dry_run --target=v5p \
        --topology=2x2x2 --mesh=fsdp=8   # and for TPUs
    python -m train.main --resume               # continue the last run
    python -m train.main --mesh=data=2,expert=4 # 8 devices (simulated on CPU)
    tools/launch_local.sh 2 --mesh=data=2,expert=4   # 2 processes x 4 devices
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

from absl import app
from absl import flags
import jax
import numpy as np

import moe_core.flags
from train.presets import catalog
from train import platforms
from train import train_flags
from train.checkpoints import checkpoint_meta
from train.checkpoints import output_lock
from train.parallel import distributed
from train.parallel import mesh as mesh_lib
from train.parallel import process_spec
from train.presets import sizing
from train.run.dry_run import dry_run_target
from train.run.inputs import data as data_lib
from train.run.inputs import run_config
from train.run.reporting import cost_report
from train.run.reporting import report
from train.run.reporting import step_log
from train.run.step import step_builder
from train.run.training import trainer
from train.run.training import training_faults

# --help lists the program's flags, defined in train_flags (and
# --moe_backend, in moe_core.flags), as its own.
flags.adopt_module_key_flags(train_flags)
flags.adopt_module_key_flags(moe_core.flags)


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
  preset = catalog.get_preset(train_flags.MODEL.value)
  full_depth = preset.model.num_layers
  preset = dataclasses.replace(
      preset,
      model=run_config.preset_model(
          preset, train_flags.PRECISION.value, train_flags.NUM_LAYERS.value
      ),
  )
  text = cost_report.describe(
      preset,
      mesh=sizing.parse_mesh(train_flags.MESH.value),
      batch_size=train_flags.BATCH_SIZE.value or preset.train.batch_size,
      seq_len=train_flags.SEQ_LEN.value or preset.train.seq_len,
      remat=train_flags.REMAT.value,
      moment_bytes=run_config.MOMENT_BYTES[train_flags.OPT_STATE_DTYPE.value],
      microbatches=train_flags.MICROBATCHES.value,
      published_layers=full_depth,
  )
  if compile_step and not train_flags.TARGET.value:
    text += f"\n    {_compiled_memory()}"
  if preset.model.moe is not None:
    text += f"\n{_precision_line(train_flags.PRECISION.value)}"
  print(text, file=out or sys.stdout, flush=True)
  if train_flags.TARGET.value:
    text += "\n" + _target_dry_run(out or sys.stdout)
  return text


def _target_dry_run(out) -> str:
  """Compiles the run's step for --target x --topology, prints and writes
  its figures; the printed text.

  Raises:
    app.UsageError: the run does not split over the mesh, the chips cannot
      be described here, or the step does not fit (one line).
  """
  # --moe_backend=auto orders the backends by the target's platform, as
  # every lowering for it does (moe_core.registry.auto_order).
  run = train_flags.run_config_from_flags()
  path = train_flags.DRY_RUN_JSON.value or dry_run_target.default_json_path(
      run.output_dir, train_flags.TARGET.value, train_flags.TOPOLOGY.value
  )
  try:
    record, _, _ = dry_run_target.compile_for(
        run, train_flags.TARGET.value, train_flags.TOPOLOGY.value
    )
  except dry_run_target.TargetDoesNotFitError as e:
    # XLA's TPU compiler refuses a step over the HBM: no figures to write.
    raise app.UsageError(str(e)) from e
  except (ValueError, RuntimeError, NotImplementedError) as e:
    # A run that does not split over --mesh; no CUDA plugin or libtpu to
    # describe the chips with; a backend that cannot compile this step.
    raise app.UsageError(str(e)) from e
  except ImportError as e:
    # A backend whose package (Transformer Engine) is imported as it traces.
    raise app.UsageError(
        f"--moe_backend={run.backend} cannot compile here: {e}"
    ) from e
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
    run = train_flags.run_config_from_flags()
    mesh_lib.simulate_cpu_devices(mesh_lib.parse(run.mesh), 1)
    memory = step_builder.compiled_step_memory(run)
  except (ValueError, NotImplementedError, ImportError) as e:
    # The mesh does not fit the devices; the backend cannot run the step,
    # or its package is not installed.
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
      f"({train_flags.PRECISION_RECIPES[precision]}); routing float32"
  )


def _start_devices(run: run_config.RunConfig, out) -> None:
  """Joins the other processes (if any) and sets up the devices for --mesh.

  Runs before anything initialises JAX's backends.
  """
  spec = process_spec.spec_from_flags()
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
    training_faults.TrainingFault: a non-finite loss or state, out of memory.
    checkpoint_failures.CheckpointSaveError: a checkpoint could not be written.
  """
  out = out or sys.stdout
  try:
    run = train_flags.run_config_from_flags()
    _start_devices(run, out)
    run, tr, out = _set_up(run, out)
  except (ValueError, NotImplementedError) as e:
    # A flag the run cannot use, a checkpoint that does not match it, or a
    # backend that cannot run its step (valid, not supported there): one
    # line naming the flag, not a traceback.
    raise app.UsageError(str(e)) from e
  except RuntimeError as e:
    if not training_faults.is_out_of_memory(e):
      raise
    raise training_faults.out_of_memory_error(
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
  # No matplotlib (a bare accelerator host): the run's results stand, the
  # figure is skipped with one line below.
  plot_skipped = run.plot and report.plot_unavailable()
  if run.plot and tr.history["step"] and not plot_skipped:
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
  if summary.get("mfu_median") is not None:
    print(
        f"  median MFU {summary['mfu_median']:.1%} of "
        f"{summary['peak_flops_per_device'] / 1e12:,.1f} TFLOP/s bf16 per "
        "device",
        file=out,
    )
  if plot_skipped:
    print(f"  {plot_skipped}", file=out)
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
    training_faults.TrainingFault,
    checkpoint_meta.CheckpointError,
    # An OSError at --output_dir's lock: its message names the directory,
    # the lock file and the cause.
    output_lock.OutputDirLockError,
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


# absl's prefix of a validator's refusal: "flag --name=value: " or "flags
# a=1, b=2: " before the validator's own message, which names its flag.
_VALIDATOR_PREFIX = re.compile(r"^flags? .*?: (?=--)", re.DOTALL)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parse, a refused flag ending the program as `_exit_with` does:
  one line, the validator's message, without absl's "FATAL Flags parsing
  error", its list of the flags involved and its pointer to --helpshort."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _exit_with(app.UsageError(_VALIDATOR_PREFIX.sub("", str(e))))
    raise  # Not reached: _exit_with exits.


def main(argv):
  try:
    if len(argv) > 1:
      raise app.UsageError(
          f"unexpected arguments {argv[1:]}: this program takes only flags, "
          "--name=value (--help lists them)."
      )
    if train_flags.DRY_RUN.value:
      dry_run()
      return
    summary = train()
  except _FAULTS as e:
    _exit_with(e)
  distributed.shutdown()
  if summary["interrupted"]:
    sys.exit(INTERRUPTED_EXIT_CODE)


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main, flags_parser=_parse_flags)
