"""What a preset costs, in words: the `--dry_run` report of train.main."""

from __future__ import annotations

import math

from train.presets import published
from train.presets import rows
from train.presets import sizing
from train.run.inputs import run_config


def human(n: float, unit: str = "") -> str:
  """1.234e9 -> '1.23G'."""
  for scale, suffix in (
      (1e15, "P"),
      (1e12, "T"),
      (1e9, "G"),
      (1e6, "M"),
      (1e3, "k"),
  ):
    if abs(n) >= scale:
      return f"{n / scale:.3g}{suffix}{unit}"
  return f"{n:.3g}{unit}"


def human_bytes(n: float) -> str:
  for scale, suffix in (
      (2**40, "TiB"),
      (2**30, "GiB"),
      (2**20, "MiB"),
      (2**10, "KiB"),
  ):
    if abs(n) >= scale:
      return f"{n / scale:.3g} {suffix}"
  return f"{n:.0f} B"


# What the analytic estimate counts on a device (the rest is on the host).
_DEVICE_MEMORY = ("weights", "gradients", "optimizer", "activations")


def moment_bytes(run) -> int:
  """Bytes of each AdamW moment of a `RunConfig` (--opt_state_dtype)."""
  return run_config.MOMENT_BYTES[run.opt_state_dtype]


def run_memory_per_device(run) -> dict[str, float]:
  """`sizing.memory_per_device` for a `RunConfig`: its model, mesh, one
  microbatch of its batch, remat policy and moment dtype."""
  return sizing.memory_per_device(
      run.model,
      sizing.parse_mesh(run.mesh),
      run.batch_size // run.microbatches,
      run.seq_len,
      run.remat,
      moment_bytes(run),
  )


def device_bytes(mem: dict[str, float]) -> float:
  """What of `sizing.memory_per_device`'s figures lives on a device."""
  return sum(mem[k] for k in _DEVICE_MEMORY)


def analytic_bytes_per_device(run) -> float:
  """The analytic estimate of a `RunConfig`'s step, bytes per device."""
  return device_bytes(run_memory_per_device(run))


def memory_remedies(run, mesh_note: str = "") -> str:
  """The sentence that ends an out-of-memory error: the flags that lower
  a `RunConfig`'s memory per device, each with its value ("Lower it with
  --batch_size (now 16), ... or more devices on --mesh (now data=1)."),
  `mesh_note` added inside --mesh's parenthesis; --remat=full only where
  the run does not already use it."""
  remat = "" if run.remat == "full" else f", --remat=full (now {run.remat})"
  return (
      f"Lower it with --batch_size (now {run.batch_size}), --microbatches "
      f"(now {run.microbatches}), --seq_len (now {run.seq_len}){remat}, or "
      f"more devices on --mesh (now {run.mesh}{mesh_note})."
  )


def compiled_memory_line(memory, analytic: float) -> str:
  """One line: XLA's figures for the compiled train step beside the
  analytic estimate.

  Args:
    memory: a `steps.StepMemory` (bytes per device).
    analytic: `analytic_bytes_per_device` for the same flags.
  """
  return (
      f"compiled train step (XLA memory_analysis): {human_bytes(memory.total)}"
      f" per device = arguments {human_bytes(memory.arguments)} + outputs "
      f"{human_bytes(memory.outputs)} - aliased {human_bytes(memory.aliased)}"
      f" + temporaries {human_bytes(memory.temporaries)} + code "
      f"{human_bytes(memory.code)}; analytic estimate "
      f"{human_bytes(analytic)} (XLA's is {memory.total / analytic:.2f}x it)"
  )


def describe(
    preset: rows.Preset,
    *,
    mesh: dict[str, int],
    batch_size: int,
    seq_len: int,
    remat: str,
    moment_bytes: int = 4,
    microbatches: int = 1,
    published_layers: int | None = None,
) -> str:
  """The `--dry_run` report: counts, FLOPs per token and memory per device.

  Args:
    preset: the preset, its model as the run builds it (precision, depth).
    mesh, batch_size, seq_len, remat: the run's.
    moment_bytes: bytes of each AdamW moment (2 for --opt_state_dtype=
      bfloat16).
    microbatches: the batch is computed in this many parts, one at a time:
      the activations are one microbatch's (`run_memory_per_device`).
    published_layers: the depth the published counts are for; at another
      depth (--num_layers) they are named as the full model's, not
      compared. None: the model's own.
  """
  cfg = preset.model
  c = sizing.param_counts(cfg)
  fl = sizing.flops_per_token(cfg, seq_len)
  mem = sizing.memory_per_device(
      cfg, mesh, batch_size // microbatches, seq_len, remat, moment_bytes
  )
  devices = math.prod(mesh.values())
  total_bytes = device_bytes(mem)
  lines = [
      f"model {cfg.name}: {preset.description}",
      f"  layers {cfg.num_layers} ({cfg.num_dense_layers} dense, "
      f"{cfg.num_moe_layers} MoE), hidden {cfg.hidden_size}, "
      f"attention {cfg.attention}, vocab {cfg.vocab_size}",
  ]
  if cfg.moe:
    m = cfg.moe
    lines.append(
        f"  experts {m.num_experts} (top-{m.top_k}, ffn {m.expert_ffn_size}"
        f", shared ffn {m.shared_ffn_size}), router {m.score_func}"
    )
  lines += [
      f"  parameters: total {c.total:,} ({human(c.total)}), active per token"
      f" {c.active:,} ({human(c.active)}); without the input embedding "
      f"{human(c.active_without_embedding)}",
      f"    embedding {human(c.embedding)}, head {human(c.head)}, attention "
      f"{human(c.attention)}, dense MLP {human(c.dense_mlp)}, MoE "
      f"{human(c.moe)} (active {human(c.moe_active)})",
  ]
  if cfg.name in published.PUBLISHED:
    pub = published.PUBLISHED[cfg.name]
    full_depth = published_layers in (None, cfg.num_layers)
    lines.append(
        (
            "  published"
            if full_depth
            else f"  published, for all {published_layers} layers (not this "
            f"{cfg.num_layers}-layer model)"
        )
        + f": {human(pub.total)} total, {human(pub.active)} active "
        f"({'with' if pub.active_counts_embedding else 'without'} the input "
        f"embedding{'' if pub.active_counts_head else ' and the head'}); "
        f"source: {pub.source}"
    )
  lines += [
      f"  FLOPs per token at seq_len {seq_len}: forward "
      f"{human(fl['forward'])}, training {human(fl['train'])} (6 x active "
      f"matmul params + attention; remat recompute not included)",
      f"  per device, mesh {mesh} ({devices} devices), global batch "
      f"{batch_size} x {seq_len} tokens"
      + (
          f" in {microbatches} microbatches (activations of one, "
          f"{batch_size // microbatches} rows)"
          if microbatches > 1
          else ""
      )
      + f", remat={remat}:",
      f"    weights (f32) {human_bytes(mem['weights'])}, gradients "
      f"{human_bytes(mem['gradients'])}, AdamW state "
      f"{human_bytes(mem['optimizer'])}, activations "
      f"{human_bytes(mem['activations'])}"
      + (
          f" (+{human_bytes(mem['activations_offloaded_to_host'])} on host)"
          if mem["activations_offloaded_to_host"]
          else ""
      ),
      f"    total {human_bytes(total_bytes)} (analytic estimate)",
  ]
  return "\n".join(lines)
