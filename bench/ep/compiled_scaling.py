"""Step time and tokens/s per GPU modelled from compiled training steps.

Reads `train.main --dry_run --target --topology` records (the real step
compiled for those GPUs) for their per-device matmul FLOPs (plus the
routed experts' GEMMs hidden in custom kernels, counted from the model)
and all-to-all bytes, and models compute, exchange, serial and overlapped
step time with `scaling_model.CLUSTERS`' rates; a model, not a measurement
(docs/benchmarks.md, "bench/ep/compiled_scaling.py"). Usage:
    python -m bench.ep.compiled_scaling bench/results/dry_run/*.json \
        [--gpu h100]
"""

from __future__ import annotations

import json
import math
import sys

from absl import app
from absl import flags

from bench.ep import scaling_model
from train import platforms
from train.parallel import mesh as mesh_lib
from train.presets import sizing
from train.run.inputs import run_config

# --gpu (which cluster's rates) is scaling_model's flag.
FLAGS = flags.FLAGS

# Megatron-Core's DeepSeek-V3 on 1,024 H100s (TP2 PP8 VP4 EP64, forced
# balanced routing; Megatron-Bridge's performance summary).
MEGATRON_TOKENS_PER_GPU = 1297
MEGATRON_TFLOPS_PER_GPU = 338


def kernel_expert_flops(run, tokens: float) -> float:
  """Routed experts' GEMM FLOPs per device and step (inside kernels), for
  `tokens` a device per step of `run` (a `RunConfig`)."""
  moe = run.model.moe
  passes = 3 + (1 if run.remat == "full" else 0)
  per_token = moe.top_k * 3 * run.model.hidden_size * moe.expert_ffn_size
  return tokens * run.model.num_moe_layers * per_token * 2 * passes


def model_step(record: dict, cluster: scaling_model.Cluster) -> dict:
  """The modelled step of one compiled record (seconds, tokens/s/GPU)."""
  run = run_config.run_config_from_preset(
      record["model"], num_layers=record["num_layers"], remat=record["remat"]
  )
  sizes = mesh_lib.parse(record["mesh"])
  devices = math.prod(sizes.values())
  ep = sizes["expert"]
  tokens = record["batch_size"] * record["seq_len"] / devices
  flops = record["figures"]["flops"]["compiled"]
  if record["moe_backend"] in ("mosaic_gpu", "pallas", "triton", "te"):
    flops += kernel_expert_flops(run, tokens)
  compute = flops / (cluster.gemm_tflops_bf16 * 1e12)
  sent = record["figures"]["all_to_all"]["compiled"]
  per_node = scaling_model.GPUS_PER_NODE
  nvlink = sent * (min(ep, per_node) - 1) / ep / (cluster.nvlink_gbps * 1e9)
  ib = sent * max(ep - per_node, 0) / ep / (cluster.ib_gbps * 1e9)
  exchange = max(nvlink, ib)
  serial = compute + exchange
  overlap = max(compute / (1 - cluster.sm_fraction_for_comm), exchange)
  overlap = min(overlap, serial)
  model_flops = (
      sizing.flops_per_token(run.model, record["seq_len"])["train"] * tokens
  )
  return {
      "devices": devices,
      "tokens": tokens,
      "compute_s": compute,
      "exchange_s": exchange,
      "serial_s": serial,
      "overlap_s": overlap,
      "tokens_per_gpu_serial": tokens / serial,
      "tokens_per_gpu_overlap": tokens / overlap,
      "model_tflops_overlap": model_flops / overlap / 1e12,
  }


def main(argv):
  cluster = scaling_model.CLUSTERS[FLAGS.gpu]
  print(
      f"{cluster.name}: GEMMs at {cluster.gemm_tflops_bf16:.0f} TFLOP/s, "
      f"NVLink {cluster.nvlink_gbps:.0f} GB/s, IB {cluster.ib_gbps:.0f} "
      f"GB/s; Megatron-Core: {MEGATRON_TOKENS_PER_GPU} tokens/s and "
      f"{MEGATRON_TFLOPS_PER_GPU} TFLOP/s per GPU on 1,024 H100s"
  )
  print(
      "| record | GPUs | tokens/GPU/step | compute s | all-to-all s | "
      "serial s | overlap s | tokens/s/GPU serial | overlap | vs Megatron "
      "| model TFLOP/s/GPU |"
  )
  print("|---" * 11 + "|")
  for path in argv[1:]:
    with open(path) as f:
      record = json.load(f)
    m = model_step(record, cluster)
    # Megatron's figure is DeepSeek-V3's: no comparison for other models.
    versus = (
        f"{m['tokens_per_gpu_overlap'] / MEGATRON_TOKENS_PER_GPU:.2f}x"
        if record["model"] == "deepseek_v3"
        else "-"
    )
    print(
        f"| {path.rsplit('/', 1)[-1]} | {m['devices']} | {m['tokens']:,.0f} "
        f"| {m['compute_s']:.1f} | {m['exchange_s']:.1f} | "
        f"{m['serial_s']:.1f} | {m['overlap_s']:.1f} | "
        f"{m['tokens_per_gpu_serial']:,.0f} | "
        f"{m['tokens_per_gpu_overlap']:,.0f} | "
        f"{versus} | "
        f"{m['model_tflops_overlap']:.0f} |"
    )
  return 0


if __name__ == "__main__":
  platforms.set_default_platforms()
  sys.exit(app.run(main))
