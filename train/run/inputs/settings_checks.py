"""The checks of a run's settings that `train.main` makes as it parses its
flags: each a plain function of the values, raising ValueError with the one
line the program prints (`train_flags.py` registers them with absl, whose
error that line becomes).

They check the settings against what they name: the mesh's syntax and the
model's experts, the model's depth, the batch's split, the uniform layers
a scan needs, a compile target's devices, a quantised recipe's experts, a
named backend's recipes, dtypes and platforms, and every path a run
writes (--output_dir's outputs, --dry_run_json, --data). Each parameter is
named as its flag.
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from moe_core import aot
from moe_core import precision as moe_precision
from moe_core import registry
from train.models import scan_model
from train.parallel import mesh as mesh_lib
from train.presets import catalog
from train.run.inputs import run_config


def mesh_sizes(spec) -> dict[str, int]:
  """--mesh as {axis: size}, or a ValueError naming the flag."""
  if not isinstance(spec, str):
    raise ValueError(
        f"--mesh must be a string like 'data=2,expert=4', got {spec!r}."
    )
  try:
    sizes = mesh_lib.parse(spec)
  except ValueError as e:
    message = str(e)
    if "--mesh" not in message:
      message = f"--mesh={spec!r}: {message}"
    raise ValueError(message) from e
  # parse() lets a later entry overwrite an earlier one; a repeated axis is
  # a typo, not a choice.
  axes = [item.partition("=")[0].strip() for item in spec.split(",")]
  repeated = sorted({a for a in axes if a and axes.count(a) > 1})
  if repeated:
    raise ValueError(
        f"--mesh must give each axis at most once, got {repeated} more "
        f"than once in {spec!r}."
    )
  return sizes


def check_mesh_splits_experts(*, mesh, model) -> None:
  """The expert axis divides the experts of --model (with --dry_run too).

  The device count is checked when the mesh is built (JAX's devices are not
  known at parse time), the batch split with the run (mesh.check_run).
  """
  sizes = mesh_sizes(mesh)
  if model not in catalog.PRESETS:
    raise ValueError(
        f"--model must be one of {sorted(catalog.PRESETS)}, got {model!r}."
    )
  moe = catalog.get_preset(model).model.moe
  expert = sizes[mesh_lib.EXPERT_AXIS]
  if expert > 1 and moe is None:
    raise ValueError(
        f"--mesh expert={expert} splits experts, but --model="
        f"{model} is dense; use data or fsdp instead."
    )
  if moe is not None and moe.num_experts % expert:
    raise ValueError(
        f"--mesh expert size must divide the {moe.num_experts} experts of "
        f"--model={model}, got expert={expert}."
    )


def check_layers_scan(*, scan_layers, model) -> None:
  """--scan_layers needs uniform layer stacks (Llama 4's interleaved MoE and
  NoPE layers and Qwen3-Next's hybrid stack are not): refused, naming
  --noscan_layers."""
  if scan_layers and model in catalog.PRESETS:
    try:
      scan_model.check_scannable(catalog.get_preset(model).model)
    except ValueError as e:
      raise ValueError(f"--model={model}: {e}") from e


def check_target(*, target, topology, dry_run, mesh) -> None:
  """--target and --topology come together, with --dry_run, and the
  topology's devices are the mesh's devices."""
  if target is None and topology is None:
    return
  if target is None:
    raise ValueError(
        f"--topology={topology} needs --target (one of {sorted(aot.TARGETS)})"
        " to say which GPUs or TPUs to compile for."
    )
  shape = "AxB[xC][/S]" if aot.is_tpu(target) else "SxHxG"
  example = (
      aot.TPU_TARGETS[target].topologies[1].partition(":")[2]
      if aot.is_tpu(target)
      else "1x1x8"
  )
  if topology is None:
    raise ValueError(
        f"--target={target} needs --topology={shape} (e.g. {example}) to "
        "say how many devices."
    )
  if not dry_run:
    raise ValueError(
        f"--target={target} --topology={topology} compiles for devices that "
        "are not here: it needs --dry_run."
    )
  try:
    count = aot.num_devices(target, topology)
  except ValueError as e:
    raise ValueError(f"--{e}") from e
  sizes = mesh_sizes(mesh)
  if count != mesh_lib.num_devices(sizes):
    raise ValueError(
        f"--topology={topology} has {count} {target} devices, but --mesh="
        f"{mesh} multiplies to {mesh_lib.num_devices(sizes)}; give "
        "a mesh whose sizes multiply to the topology's devices."
    )


def check_precision_has_experts(*, precision, model) -> None:
  """A quantised recipe needs routed experts: --model must have MoE blocks."""
  if precision == moe_precision.UNQUANTIZED or model not in catalog.PRESETS:
    return  # An unknown --model is the mesh check's line.
  if catalog.get_preset(model).model.moe is None:
    raise ValueError(
        f"--precision must be {moe_precision.UNQUANTIZED} for --model={model}, "
        "which is dense (no "
        f"routed experts' GEMMs to quantise), got {precision!r}."
    )


def check_output_dir(path) -> None:
  """A directory, or a path whose missing folders can be made (not made here).

  Creating it waits for the run (or for --dry_run --target's JSON).
  """
  if not isinstance(path, str) or not path:
    raise ValueError(f"--output_dir must be a directory path, got {path!r}.")
  _check_can_make("--output_dir", path, "a directory or a new path under one")


def _check_can_make(flag: str, path: str, wanted: str) -> None:
  """The nearest existing folder of `path` (itself, or an ancestor) is a
  writable directory, so that the run can make what is missing."""
  existing = os.path.abspath(path)  # The path itself, or its nearest ancestor.
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(
        f"{flag} must be {wanted}, got {path!r}, but {existing!r} exists and "
        "is not a directory."
    )
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(
        f"{flag} must be writable, got {path!r}, but {existing!r} is "
        "not writable."
    )


# What a training run writes in --output_dir: name -> (a directory?, with
# --plot only?). The output lock (.dropless_train.lock) checks itself.
RUN_OUTPUTS = {
    "checkpoints": (True, False),
    "metrics.jsonl": (False, False),
    "summary.json": (False, False),
    "training.png": (False, True),
}


def check_output_paths(
    *, output_dir, dry_run, plot, target, topology, dry_run_json
) -> None:
  """Every path the run will write can be written, before it starts.

  A training run writes RUN_OUTPUTS in --output_dir: each must be absent
  or of its kind (a checkpoints directory that is a file would lose the
  run's work at its last save). --dry_run --target writes one JSON file,
  --dry_run_json or one in --output_dir: not a directory, in a folder that
  can be made. --dry_run_json is refused without --dry_run --target, which
  alone write it. `check_output_dir` and `check_target` check the flags
  themselves.
  """
  if not isinstance(output_dir, str) or not output_dir:
    return  # check_output_dir's line.
  if dry_run_json is not None and not (dry_run and target and topology):
    raise ValueError(
        f"--dry_run_json={dry_run_json} is written only by --dry_run "
        "--target=... --topology=...; give them, or drop --dry_run_json."
    )
  if dry_run:
    if not (target and topology):
      return  # Writes nothing.
    flag, path = "--dry_run_json", dry_run_json
    if path is None:
      flag = "--output_dir"
      path = os.path.join(output_dir, f"dry_run_{target}_{topology}.json")
    if not path or os.path.isdir(path):
      raise ValueError(
          f"{flag} must name a JSON file to write, not a directory, got "
          f"{path!r}."
      )
    _check_can_make(flag, path, "a new file or one in a directory")
    return
  for name, (directory, plot_only) in RUN_OUTPUTS.items():
    path = os.path.join(output_dir, name)
    if (plot_only and not plot) or not os.path.lexists(path):
      continue
    if os.path.isdir(path) != directory:
      kind = "directory" if directory else "file"
      raise ValueError(
          f"--output_dir must be a directory whose {name!r} is absent or a "
          f"{kind} (the run writes its {name} there), got {output_dir!r}, "
          f"where {path!r} is "
          + ("a directory." if os.path.isdir(path) else "not a directory.")
      )


def check_model_shape(*, model, num_layers, precision) -> None:
  """--num_layers leaves room for --model's first dense layers and one MoE
  layer; --precision applies to it (`run_config.preset_model`)."""
  if model not in catalog.PRESETS:
    return  # check_mesh_splits_experts' line.
  try:
    run_config.preset_model(catalog.get_preset(model), precision, num_layers)
  except ValueError as e:
    raise ValueError(f"--{e} (--model={model})") from e


def check_batch_split(
    *, model, batch_size, seq_len, microbatches, ep_chunks, mesh, dry_run
) -> None:
  """--batch_size splits into --microbatches equal parts and, for a run,
  each over the data-parallel devices of --mesh (`mesh_lib.check_run`;
  --dry_run reports a mesh that does not split the batch instead), whose
  tokens on a device split into --ep_chunks under expert parallelism."""
  if model not in catalog.PRESETS:
    return  # check_mesh_splits_experts' line.
  preset = catalog.get_preset(model)
  batch_size = batch_size or preset.train.batch_size
  if batch_size % microbatches:
    raise ValueError(
        f"--microbatches={microbatches} must divide --batch_size="
        f"{batch_size} (each step's batch splits into equal microbatches)."
    )
  if dry_run:
    return
  sizes = mesh_sizes(mesh)
  mesh_lib.check_run(sizes, preset.model, batch_size, microbatches)
  seq_len = seq_len or preset.train.seq_len
  tokens = batch_size // microbatches // mesh_lib.batch_shards(sizes) * seq_len
  if sizes[mesh_lib.EXPERT_AXIS] > 1 and tokens % ep_chunks:
    raise ValueError(
        f"--ep_chunks must divide the {tokens} tokens a device holds per "
        f"microbatch (--batch_size={batch_size} x --seq_len={seq_len} / "
        f"--microbatches={microbatches} / {mesh_lib.batch_shards(sizes)} "
        f"data-parallel devices of --mesh={mesh}), got {ep_chunks}."
    )


def check_backend(
    *, moe_backend, model, target, precision, compute_dtype
) -> None:
  """A named --moe_backend can be imported, compiles for --target's
  platform (a GPU or TPU; the platforms of its "auto" orders), and runs
  --precision and --compute_dtype (its `precisions` and `dtypes`).

  Whether it runs on the devices here is asked once JAX has them
  (`trainer.Trainer`): that needs the devices, which parsing must not start.
  """
  if moe_backend == "auto" or moe_backend not in registry.registered_backends():
    return  # auto falls through; an unknown name is --moe_backend's line.
  if model in catalog.PRESETS and catalog.get_preset(model).model.moe is None:
    return  # A dense model calls no MoE backend.
  try:
    cls = registry.backend_class(moe_backend)
  except ImportError as e:
    raise ValueError(f"--moe_backend={moe_backend} cannot run here: {e}") from e
  if target:
    platform = "tpu" if aot.is_tpu(target) else "gpu"
    order = registry.AUTO_ORDER[platform]
    elsewhere = any(moe_backend in o for o in registry.AUTO_ORDER.values())
    if moe_backend not in order and elsewhere:
      raise ValueError(
          f"--moe_backend={moe_backend} does not compile for --target={target}"
          f" ({platform.upper()}s); use auto or one of {list(order)}."
      )
  if cls is None:
    return
  recipe = moe_precision.check_recipe(precision)
  if recipe not in cls.precisions:
    raise ValueError(
        f"--precision must be one of {list(cls.precisions)} with "
        f"--moe_backend={moe_backend}, got {precision!r}; --moe_backend=auto "
        "or xla runs every recipe."
    )
  dtypes = [jnp.dtype(d).name for d in cls.dtypes or ()]
  if dtypes and compute_dtype not in dtypes:
    raise ValueError(
        f"--compute_dtype must be one of {dtypes} with --moe_backend="
        f"{moe_backend}, got {compute_dtype!r}."
    )


def check_data(path) -> None:
  """None or '' (the embedded corpus), or a readable file."""
  if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
    raise ValueError(f"--data must name a readable file, got {path!r}.")
