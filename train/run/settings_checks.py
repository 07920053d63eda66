"""The checks of a run's settings that `train.main` makes as it parses its
flags: each a plain function of the values, raising ValueError with the one
line the program prints (`train_flags.py` registers them with absl, whose
error that line becomes).

They check the settings against what they name: the mesh's syntax and the
model's experts, the uniform layers a scan needs, a compile target's
devices, a quantised recipe's experts, and the paths of --output_dir and
--data. Each parameter is named as its flag.
"""

from __future__ import annotations

import os

from moe_core import aot
from moe_core import precision as moe_precision
from train.presets import catalog
from train.models import scan_model
from train.parallel import mesh as mesh_lib


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
  existing = os.path.abspath(path)  # The path itself, or its nearest ancestor.
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(
        f"--output_dir must be a directory or a new path under one, got "
        f"{path!r}, but {existing!r} exists and is not a directory."
    )
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(
        f"--output_dir must be writable, got {path!r}, but {existing!r} is "
        "not writable."
    )


def check_data(path) -> None:
  """None or '' (the embedded corpus), or a readable file."""
  if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
    raise ValueError(f"--data must name a readable file, got {path!r}.")
