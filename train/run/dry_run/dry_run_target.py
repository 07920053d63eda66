"""`--dry_run --target=h100|v5p --topology=...`: the real step, compiled.

The run's train step (model, optimiser, microbatches, remat, scan, the
mesh, the MoE backend's kernels and expert-parallel exchange) is built on
a `moe_core.aot` topology's devices (`step_builder`) and compiled by XLA's
GPU or TPU compiler for that target, on any host; `report` gives, per
device, its memory against the target's usable HBM, matmul FLOPs, bytes
accessed and all-to-all bytes, each beside the analytic estimate
(`train.presets.sizing`) and their ratio, and `check_fits` refuses a step that
does not fit. XLA's TPU compiler itself refuses a step over the HBM: that
is the same one-line refusal, with the compiler's figures.
"""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np

from moe_core import aot
from train.parallel import mesh as mesh_lib
from train.presets import sizing
from train.run.dry_run import memory_check
from train.run.inputs import run_config
from train.run.reporting import cost_report
from train.run.step import step_builder

_GIB = 2**30
# The collectives of the expert-parallel exchange.
EXCHANGES = ("all-to-all", "ragged-all-to-all")


class TargetDoesNotFitError(memory_check.StepDoesNotFitError):
  """The step's compiled peak exceeds the target's usable memory."""


def tree_bytes_per_device(tree) -> int:
  """Bytes one device holds of a tree of sharded jax.ShapeDtypeStructs.

  Each leaf counts its shard (`sharding.shard_shape`); a replicated leaf
  counts whole. Every device of these shardings holds equal shards.
  """
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.shape
    if leaf.sharding is not None:
      shape = leaf.sharding.shard_shape(shape)
    total += int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize
  return total


def analytic_all_to_all_bytes(run: run_config.RunConfig) -> float:
  """The analytic exchange per step, in bytes a device sends.

  Each MoE layer sends every token's top_k rows of width hidden (in the
  compute dtype) to their experts and back: twice forward, twice backward
  (the transposes), twice more when --remat=full recomputes the forward.
  A device's tokens: batch x seq_len / (data x fsdp x expert).
  """
  moe = run.model.moe
  sizes = mesh_lib.parse(run.mesh)
  if moe is None or sizes[mesh_lib.EXPERT_AXIS] == 1:
    return 0.0
  tokens = run.batch_size * run.seq_len / mesh_lib.batch_shards(sizes)
  row = run.model.hidden_size * np.dtype(run.compute_dtype).itemsize
  exchanges = 4 + (2 if run.remat == "full" else 0)
  return exchanges * run.model.num_moe_layers * tokens * moe.top_k * row


def analytic(run: run_config.RunConfig) -> dict[str, float | None]:
  """The analytic figure of each reported quantity, per device.

  FLOPs are 6 x active parameters + attention per token (`sizing`);
  --remat=full recomputes the forward, which the compiled count includes
  (about 4/3 of this figure) and this one does not.
  """
  sizes = sizing.parse_mesh(run.mesh)
  mem = cost_report.run_memory_per_device(run)
  devices = math.prod(sizes.values())
  tokens = run.batch_size * run.seq_len
  train_flops = sizing.flops_per_token(run.model, run.seq_len)["train"]
  return {
      "params": mem["weights"],
      "optimizer": mem["optimizer"],
      "gradients": mem["gradients"],
      # The compiled step's gradients are temporaries (neither arguments
      # nor outputs), beside the activations saved for the backward.
      "temporaries": mem["gradients"] + mem["activations"],
      "peak": cost_report.device_bytes(mem),
      "flops": train_flops * tokens / devices,
      "bytes_accessed": None,  # No analytic model of it.
      "all_to_all": analytic_all_to_all_bytes(run),
  }


def _figure(compiled: float, estimate: float | None) -> dict:
  """{compiled, analytic, ratio (compiled / analytic)}; ratio None if 0."""
  ratio = compiled / estimate if estimate else None
  return {"compiled": compiled, "analytic": estimate, "ratio": ratio}


def report(
    run: run_config.RunConfig,
    step: step_builder.TrainStep,
    program: aot.CompiledProgram,
) -> dict:
  """The figures of a compiled step, per device, as the JSON records them.

  Each beside the analytic estimate (`analytic`) and their ratio:

      params, optimizer, gradients   bytes of the state's trees, from their
                                     shardings (gradients: the params'
                                     shapes, dtypes and shardings)
      temporaries, peak              XLA's memory_analysis (peak: arguments
                                     + outputs not aliased + temporaries +
                                     code), against the target's usable HBM
      flops                          matmul FLOPs per step: every dot and
                                     GEMM call of the compiled module, times
                                     the trip counts of its loops
                                     (`aot.per_step_matmul_flops`); custom
                                     kernels (Pallas, Mosaic GPU and TPU) are
                                     opaque, and their launches are counted
                                     instead
      bytes_accessed                 XLA's cost analysis of the compiled
                                     module (each loop body once)
      all_to_all                     all-to-all and ragged-all-to-all
                                     operand bytes per step, loops counted
                                     (`aot.per_step_collective_bytes`): the
                                     expert-parallel exchange, and any
                                     resharding XLA does with all-to-alls
                                     (the analytic figure is the exchange)
  """
  params = tree_bytes_per_device(step.state["params"])
  text = program.hlo_text
  per_step = aot.per_step_collective_bytes(text)
  matmuls = aot.per_step_matmul_flops(text)
  compiled = {
      "params": params,
      "optimizer": tree_bytes_per_device(step.state["opt_state"]),
      # The gradients have the params' shapes, dtypes and shardings.
      "gradients": params,
      "temporaries": program.temp_bytes,
      "peak": program.peak_bytes,
      "flops": matmuls.flops,
      "bytes_accessed": program.bytes_accessed,
      "all_to_all": sum(per_step.bytes.get(op, 0) for op in EXCHANGES),
  }
  estimate = analytic(run)
  return {
      "model": run.model.name,
      "num_layers": run.model.num_layers,
      "target": program.target,
      "topology": program.topology,
      "mesh": run.mesh,
      "moe_backend": run.backend,
      "batch_size": run.batch_size,
      "seq_len": run.seq_len,
      "microbatches": run.microbatches,
      "ep_chunks": run.ep_chunks,
      "opt_state_dtype": run.opt_state_dtype,
      "remat": run.remat,
      "scan_layers": run.scan_layers,
      "precision": run.precision,
      "compile_seconds": program.compile_seconds,
      "hbm_bytes": program.hbm_bytes,
      "usable_bytes": program.usable_bytes,
      "fits": program.fits,
      "figures": {k: _figure(v, estimate[k]) for k, v in compiled.items()},
      "memory_analysis": {
          "argument_bytes": program.argument_bytes,
          "output_bytes": program.output_bytes,
          "alias_bytes": program.alias_bytes,
          "temp_bytes": program.temp_bytes,
          "code_bytes": program.code_bytes,
      },
      # XLA's own cost analysis counts a loop body once, so under
      # --scan_layers it falls short of the step (0.07x for mixtral_8x7b on
      # 8 H100s): kept for reference, not as "flops".
      "xla_cost_analysis_flops": program.flops,
      "kernel_launches_per_step": matmuls.kernel_launches,
      "matmuls_in_unknown_loops": matmuls.unknown_loops,
      "collective_bytes_per_step": per_step.bytes,
      "collectives_in_unknown_loops": per_step.unknown_loops,
      "collective_bytes_per_instruction": program.collective_bytes,
      "custom_calls": program.custom_calls,
  }


def compile_for(
    run: run_config.RunConfig, target: str, topology: str
) -> tuple[dict, step_builder.TrainStep, aot.CompiledProgram]:
  """(report, step, compiled program) of `run`'s step on the topology.

  Raises:
    ValueError: the mesh does not cover the topology, or the run does not
      split over the mesh.
    TargetDoesNotFitError: XLA's TPU compiler found the step over the HBM.
  """
  topo = aot.named_topology(f"{target}:{topology}")
  mesh = mesh_lib.build(mesh_lib.parse(run.mesh), devices=topo.devices)
  step = step_builder.build(run, mesh)
  try:
    program = aot.compile(
        step.fn,
        step.state,
        step.batch,
        topology=topo,
        mesh=mesh,
        name=f"{run.model.name} train step",
        **step.jit_kwargs,
    )
  except aot.HbmOomError as e:
    raise TargetDoesNotFitError(
        _does_not_fit(
            run,
            target,
            topology,
            e.required_bytes,
            e.available_bytes or topo.target.usable_bytes,
        )
        + f" ({e})"
    ) from e
  return report(run, step, program), step, program


# --- Words -------------------------------------------------------------------

_BYTE_ROWS = (
    ("params", "parameters (f32)"),
    ("optimizer", "optimiser state"),
    ("gradients", "gradients"),
    ("temporaries", "temporaries (vs gradients + activations)"),
    ("peak", "peak"),
)


def _versus(figure: dict, fmt) -> str:
  """ "<compiled>  (analytic <estimate>, 1.23x)"."""
  if figure["analytic"] is None:
    return f"{fmt(figure['compiled'])}  (no analytic estimate)"
  ratio = "n/a" if figure["ratio"] is None else f"{figure['ratio']:.2f}x"
  return (
      f"{fmt(figure['compiled'])}  (analytic {fmt(figure['analytic'])}, "
      f"compiled/analytic {ratio})"
  )


def describe(record: dict) -> str:
  """The report in lines, per device."""
  figures = record["figures"]
  lines = [
      f"compiled for {record['target']} {record['topology']} in "
      f"{record['compile_seconds']:.1f} s: --model={record['model']} "
      f"({record.get('num_layers', '?')} layers) "
      f"--mesh={record['mesh']} --moe_backend={record['moe_backend']}, "
      f"batch {record['batch_size']} x {record['seq_len']} in "
      f"{record['microbatches']} microbatch(es), "
      f"{record.get('ep_chunks', 1)} EP chunk(s), remat={record['remat']}, "
      f"layers {'scanned' if record['scan_layers'] else 'unrolled'}",
      "  per device:",
  ]
  for key, label in _BYTE_ROWS:
    lines.append(
        f"    {label}: {_versus(figures[key], cost_report.human_bytes)}"
    )
  peak = cost_report.human_bytes(figures["peak"]["compiled"])
  usable = cost_report.human_bytes(record["usable_bytes"])
  lines += [
      f"    peak vs usable HBM: {peak} of {usable} usable "
      f"({cost_report.human_bytes(record['hbm_bytes'])} HBM): "
      + ("fits" if record["fits"] else "DOES NOT FIT"),
      "    matmul FLOPs per step (loops counted"
      + _kernels_note(record["kernel_launches_per_step"])
      + f"): {_versus(figures['flops'], cost_report.human)}",
      "    bytes accessed per step: "
      f"{_versus(figures['bytes_accessed'], cost_report.human_bytes)}",
      "    all-to-all per step (all-to-all + ragged-all-to-all, sent): "
      f"{_versus(figures['all_to_all'], cost_report.human_bytes)}",
  ]
  return "\n".join(lines)


def _kernels_note(launches: dict[str, int]) -> str:
  """ ", not inside N custom-call launches": custom kernels hide FLOPs."""
  count = sum(launches.values())
  return f"; not inside {count:,} custom-call launches" if count else ""


def check_fits(record: dict, run: run_config.RunConfig) -> None:
  """Raises TargetDoesNotFitError (one line) if the peak exceeds usable HBM."""
  if record["fits"]:
    return
  raise TargetDoesNotFitError(
      _does_not_fit(
          run,
          record["target"],
          record["topology"],
          record["figures"]["peak"]["compiled"],
          record["usable_bytes"],
      )
  )


def _does_not_fit(run, target, topology, peak, usable) -> str:
  """The one-line refusal: the figures, then the flags that lower them."""
  remat = "" if run.remat == "full" else f", --remat=full (now {run.remat})"
  if peak is None:
    head = f"over the {usable / _GIB:.1f} GiB usable on {target}"
  else:
    head = (
        f"peak {peak / _GIB:.1f} GiB per device > {usable / _GIB:.1f} GiB "
        f"usable on {target} by {(peak - usable) / _GIB:.1f} GiB"
    )
  return (
      f"{head}: --model={run.model.name} does not fit on --topology="
      f"{topology} with --mesh={run.mesh}; lower it with "
      f"--batch_size (now {run.batch_size}), --microbatches (now "
      f"{run.microbatches}), --seq_len (now {run.seq_len}){remat}, or more "
      "devices (--topology and --mesh)."
  )


def default_json_path(output_dir: str, target: str, topology: str) -> str:
  """Where the JSON goes without --dry_run_json: in --output_dir."""
  return os.path.join(output_dir, f"dry_run_{target}_{topology}.json")


def write_json(record: dict, path: str) -> None:
  """Writes `record` to `path` (its folders made), whole or not at all."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  temp = f"{path}.tmp"
  try:
    with open(temp, "w", encoding="utf-8") as f:
      json.dump(record, f, indent=2, sort_keys=True)
      f.write("\n")
    os.replace(temp, path)
  except OSError:
    if os.path.isfile(temp):  # No stray <path>.tmp beside what failed.
      os.remove(temp)
    raise
