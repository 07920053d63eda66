"""A paper model of DeepSeek-V3 training with expert parallelism on N GPUs.

Per MoE layer and GPU, compute time from the layer's training FLOPs and a
stated GEMM rate and all-to-all time from the bytes sent over NVLink and
InfiniBand, without and with overlap; scaling efficiency is tokens/s per
GPU against one node, for a serial, a chunked and a fully overlapped
schedule (docs/benchmarks.md, "bench/ep/scaling_model.py"). Every input is a
named constant below with its source; docs/scaling.md discusses the
results. Nothing here is measured on a GPU. Usage:
    python -m bench.ep.scaling_model [--gpu h100] [--markdown]
"""

from __future__ import annotations

import dataclasses

from absl import app
from absl import flags

from train import platforms
from train import presets

_GPU = flags.DEFINE_enum(
    "gpu", "h100", ["h100", "h800", "b200"], "Link bandwidths of which cluster."
)
_MARKDOWN = flags.DEFINE_bool("markdown", False, "Print markdown tables.")

GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Model:
  """A DeepSeek-V3-like model's sizes (`deepseek_v3`: the preset's)."""

  hidden: int  # D
  expert_ffn: int  # F, routed and shared experts alike.
  num_experts: int  # E
  top_k: int  # K
  shared_experts: int
  heads: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_dim: int
  qk_rope_dim: int
  v_dim: int
  seq_len: int = 4096
  node_limit: int = 4  # A token's experts lie on at most 4 nodes (M = 4).

  def attention_params(self) -> int:
    """MLA projection weights of one layer (about 187M)."""
    qk = self.qk_nope_dim + self.qk_rope_dim
    return (
        self.hidden * self.q_lora_rank
        + self.q_lora_rank * self.heads * qk
        + self.hidden * (self.kv_lora_rank + self.qk_rope_dim)
        + self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_dim)
        + self.heads * self.v_dim * self.hidden
    )

  def expert_params_per_token(self) -> int:
    """Routed (K) and shared expert weights each token multiplies."""
    return (
        (self.top_k + self.shared_experts) * 3 * self.hidden * self.expert_ffn
    )

  def train_flops_per_token(self) -> float:
    """Forward + backward (3x forward) FLOPs of one MoE layer per token."""
    matmul = 2 * (self.attention_params() + self.expert_params_per_token())
    # Causal attention scores: each token attends to seq_len / 2 on average.
    context = self.seq_len / 2
    scores = (
        2
        * self.heads
        * context
        * (self.qk_nope_dim + self.qk_rope_dim + self.v_dim)
    )
    return 3 * (matmul + scores)


def deepseek_v3() -> Model:
  """DeepSeek-V3's sizes, from its preset (the Hugging Face config.json)."""
  cfg = presets.get_preset("deepseek_v3").model
  moe = cfg.moe
  return Model(
      hidden=cfg.hidden_size,
      expert_ffn=moe.expert_ffn_size,
      num_experts=moe.num_experts,
      top_k=moe.top_k,
      shared_experts=moe.shared_ffn_size // moe.expert_ffn_size,
      heads=cfg.num_heads,
      q_lora_rank=cfg.q_lora_rank,
      kv_lora_rank=cfg.kv_lora_rank,
      qk_nope_dim=cfg.qk_nope_head_dim,
      qk_rope_dim=cfg.qk_rope_head_dim,
      v_dim=cfg.v_head_dim,
  )


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Achieved rates per GPU (one direction for links)."""

  name: str
  gemm_tflops_bf16: float
  gemm_tflops_fp8: float
  nvlink_gbps: float
  ib_gbps: float
  sm_fraction_for_comm: float  # Compute slowdown while comm kernels run.
  latency_us_nvlink: float = 15.0
  latency_us_ib: float = 40.0


CLUSTERS = {
    # H100 SXM: 989 dense BF16 TFLOP/s, 1979 FP8 (NVIDIA H100 datasheet); we
    # assume 45% of peak for the layer's GEMMs, as tokamax's H100 grouped
    # GEMMs reach 390-470 TFLOP/s on DeepSeek-V3 shapes (openxla/tokamax,
    # ragged_dot autotuning data). NVLink 4: 900 GB/s both directions, 450
    # GB/s each way; an all-to-all is assumed to reach 80% (360 GB/s).
    # InfiniBand NDR 400 Gb/s = 50 GB/s per GPU; DeepEP measured 43-58 GB/s
    # bottleneck bandwidth on CX7 (DeepEP docs/legacy.md): 45 GB/s.
    "h100": Cluster("H100 SXM, NDR IB", 445.0, 890.0, 360.0, 45.0, 20 / 132),
    # H800 (DeepSeek's cluster): same compute; NVLink 160 GB/s and IB 50 GB/s
    # (DeepSeek-V3 report, section 3.2.2); DeepEP measured 153-158 GB/s on
    # NVLink (docs/legacy.md); 20 of 132 SMs drive both links (report 3.2.2).
    "h800": Cluster("H800, CX7 IB", 445.0, 890.0, 155.0, 45.0, 20 / 132),
    # B200: 2,250 dense BF16 TFLOP/s, 4,500 FP8 (NVIDIA DGX B200 datasheet),
    # taken at the same 45%; NVLink 5: 1,800 GB/s both directions, 80% of
    # 900 each way; ConnectX-8 800 Gb/s = 100 GB/s per GPU, taken at 90%; 20
    # of its 148 SMs for communication. Assumptions, not measurements.
    "b200": Cluster("B200, CX8 IB", 1012.0, 2025.0, 720.0, 90.0, 20 / 148),
}


@dataclasses.dataclass(frozen=True)
class Scheme:
  """How the all-to-alls are done."""

  name: str
  dispatch_bytes: float  # Per element, forward dispatch.
  other_bytes: float  # Per element: combine, and both backward exchanges.
  node_dedup: bool  # One IB copy per (token, remote node), NVLink fan-out.
  fp8_gemm: bool


SCHEMES = (
    # What moe_core.parallel does: one row per (token, expert) copy, in the
    # activation dtype (BF16) both ways, forward and backward.
    Scheme("dropless (per copy, BF16)", 2.0, 2.0, False, False),
    # DeepSeek-V3 / DeepEP: FP8 dispatch (+1/128 float32 scales), BF16
    # combine, one IB transfer per remote node, FP8 GEMMs.
    Scheme("DeepEP-style (node dedup, FP8)", 1.0 + 4 / 128, 2.0, True, True),
)


def remote_copies(
    ep: int, model: Model, node_dedup: bool
) -> tuple[float, float]:
  """(NVLink, IB) transfers per token per exchange, with even routing.

  Copies go to the K chosen experts' devices, uniform over the ep devices
  of the EP group. With node dedup, a token crosses IB once per remote node
  among the (at most node_limit) nodes of its experts and fans out over
  NVLink there.
  """
  k = model.top_k
  node = min(ep, GPUS_PER_NODE)
  nodes = ep // node
  same_node = k * (node - 1) / ep
  other_nodes = k * (ep - node) / ep
  if not node_dedup or nodes == 1:
    return same_node, other_nodes
  chosen = min(model.node_limit, nodes)  # Nodes each token's experts use.
  ib = chosen * (nodes - 1) / nodes  # Remote ones among them.
  # The K copies then spread over the chosen nodes by NVLink: the copies on
  # a remote node leave its receiving GPU for its other GPUs, plus this
  # node's own fan-out.
  nvlink = k * (node - 1) / node
  return nvlink, ib


def layer_times(
    n_gpus: int,
    ep_max: int,
    cluster: Cluster,
    scheme: Scheme,
    tokens: int,
    chunks: int,
    model: Model | None = None,
) -> dict:
  """The layer's times on `n_gpus` (`model`: DeepSeek-V3 by default)."""
  model = model or deepseek_v3()
  ep = min(n_gpus, ep_max)
  rate = (
      cluster.gemm_tflops_fp8 if scheme.fp8_gemm else cluster.gemm_tflops_bf16
  ) * 1e12
  compute = tokens * model.train_flops_per_token() / rate
  nvl, ib = remote_copies(ep, model, scheme.node_dedup)
  row = model.hidden
  # Four exchanges per layer and step: dispatch and combine forward, and
  # their transposes backward (combine-like, dispatch-like), BF16 there.
  per_elem = scheme.dispatch_bytes + 3 * scheme.other_bytes
  nvl_bytes = tokens * nvl * row * per_elem
  ib_bytes = tokens * ib * row * per_elem
  latency = 4 * (
      (cluster.latency_us_ib if ib else cluster.latency_us_nvlink) * 1e-6
  )
  comm = (
      max(
          nvl_bytes / (cluster.nvlink_gbps * 1e9),
          ib_bytes / (cluster.ib_gbps * 1e9),
      )
      + latency
  )
  serial = compute + comm
  # Overlap: comm kernels take SMs, so compute slows; with c chunks the
  # pipeline still exposes about 1/c of the shorter side.
  # A scheduler that loses by overlapping would not overlap: min(serial).
  slowed = compute / (1 - cluster.sm_fraction_for_comm)
  chunked = min(serial, max(slowed, comm) + min(slowed, comm) / chunks)
  # Full overlap (DualPipe: one micro-batch's exchange under another's
  # compute, forward and backward interleaved): only the longer side shows.
  full = min(serial, max(slowed, comm))
  return {
      "n_gpus": n_gpus,
      "ep": ep,
      "compute_ms": compute * 1e3,
      "comm_ms": comm * 1e3,
      "ib_MB": ib_bytes / 1e6,
      "nvlink_MB": nvl_bytes / 1e6,
      "serial_ms": serial * 1e3,
      "chunked_ms": chunked * 1e3,
      "full_overlap_ms": full * 1e3,
  }


def table(
    cluster: Cluster,
    scheme: Scheme,
    ep_max: int,
    tokens: int = 4096,
    chunks: int = 4,
    sizes=(8, 16, 32, 64, 128, 256, 512, 1024),
) -> list[dict]:
  rows = [
      layer_times(n, ep_max, cluster, scheme, tokens, chunks) for n in sizes
  ]
  base = rows[0]
  for r in rows:
    for mode in ("serial", "chunked", "full_overlap"):
      # Scaling efficiency: tokens/s per GPU against one node (N = 8).
      r[f"eff_{mode}"] = base[f"{mode}_ms"] / r[f"{mode}_ms"]
    # The fraction of the layer time that is compute at full speed.
    r["compute_share_full_overlap"] = r["compute_ms"] / r["full_overlap_ms"]
  return rows


def _print(rows, markdown):
  cols = (
      "n_gpus",
      "ep",
      "compute_ms",
      "comm_ms",
      "ib_MB",
      "eff_serial",
      "eff_chunked",
      "eff_full_overlap",
      "compute_share_full_overlap",
  )
  if markdown:
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
  for r in rows:
    vals = [
        f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols
    ]
    print(
        ("| " + " | ".join(vals) + " |")
        if markdown
        else "  ".join(f"{c}={v}" for c, v in zip(cols, vals))
    )


def main(argv):
  del argv
  cluster = CLUSTERS[_GPU.value]
  model = deepseek_v3()
  print(
      f"{cluster.name}; one MoE layer, T=4096 tokens per GPU; "
      f"{model.train_flops_per_token() / 1e9:.2f} GFLOP per token "
      "(forward + backward)"
  )
  for scheme in SCHEMES:
    for ep_max in (64, 256):
      print(f"\n{scheme.name}, EP = min(N, {ep_max}); chunked = 4 chunks")
      _print(table(cluster, scheme, ep_max), _MARKDOWN.value)
  print(
      "\neff_<schedule>: scaling efficiency, tokens/s per GPU at N over "
      "that at N = 8, i.e. (N = 8 layer time) / (layer time): higher is "
      "better, unlike the other benchmarks' time/baseline ratios. "
      "compute_share_full_overlap: compute time / full-overlap layer time."
  )


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
