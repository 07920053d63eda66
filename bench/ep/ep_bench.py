"""Bytes an expert-parallel layer moves per device, against the ideal.

For each ep in --ep and each routing (even, skewed), per device and layer:
the padded all_to_all fallback's bytes read from the compiled HLO, the
ragged exchange's from the routing (mean, busiest device and link), and
the ideal of a perfectly even router, as ratios over the ideal, with the
drop-free receive buffer and the compiled schedule's overlap; one run, no
timings (docs/expert_parallel.md, "Bytes moved"). Usage:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python -m bench.ep.ep_bench [--tokens_per_device 256] [--out PATH]
"""

from __future__ import annotations

import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bench.ep import collective_traffic
from bench.harness import json_report
import moe_core
from moe_core import parallel
from train import platforms

_TOKENS = flags.DEFINE_integer("tokens_per_device", 256, "T_l.")
_EP = flags.DEFINE_list("ep", ["2", "4", "8"], "Expert-parallel sizes.")
_OUT = flags.DEFINE_string(
    "out",
    os.path.join(os.path.dirname(__file__), "..", "results", "ep_bench.json"),
    "Where to write the JSON.",
)

# DeepSeek-V3's routing shape (E=256 would make XLA:CPU compile slowly;
# what matters here is K and E/ep), with a small D.
CONFIG = moe_core.MoEConfig(
    num_experts=64,
    top_k=8,
    hidden_size=256,
    expert_ffn_size=128,
    score_func="sigmoid",
    norm_topk_prob=True,
)
DTYPE = jnp.bfloat16


def schedule(hlo: str) -> list[str]:
  """The compiled entry's collectives and expert loops, in program order."""
  entry = hlo[hlo.index("ENTRY") :]
  events = []
  for line in entry.splitlines():
    if " all-to-all(" in line:
      events.append("all-to-all")
    elif " while(" in line:
      events.append("compute(while)")
    elif " all-gather(" in line:
      events.append("all-gather")
  return events


def _inputs(ep: int, skewed: bool):
  cfg = CONFIG
  rng = np.random.default_rng(0)
  params = {}
  for name, shape in moe_core.param_shapes(cfg).items():
    params[name] = (shape[-2] ** -0.5 * rng.standard_normal(shape)).astype(
        np.float32
    )
  x = rng.standard_normal((ep * _TOKENS.value, cfg.hidden_size)).astype(
      np.float32
  )
  if skewed:  # Every token's first choice is expert 0 (on device 0).
    x[:, 0] = 1.0 + np.abs(x[:, 0])
    params["router"][0, 0] = 40.0
  return (
      {k: jnp.asarray(v, DTYPE) for k, v in params.items()},
      jnp.asarray(x, DTYPE),
  )


def ragged_bytes(expert_ids: np.ndarray, ep: int) -> dict[str, float]:
  """Off-device bytes of ragged dispatch + combine, from the routing.

  See `collective_traffic.ragged_traffic`: the mean and most bytes a device
  sends, the busiest link direction, the most rows a device receives.
  """
  cfg = CONFIG
  rows = collective_traffic.exchange_rows(
      expert_ids, ep=ep, experts_per_device=cfg.num_experts // ep
  )
  row = cfg.hidden_size * jnp.dtype(DTYPE).itemsize
  return collective_traffic.ragged_traffic(rows, row)


def run(ep: int, skewed: bool) -> dict:
  cfg = CONFIG
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:ep]), ("expert",))
  params, x = _inputs(ep, skewed)
  t_l = _TOKENS.value
  row = cfg.hidden_size * jnp.dtype(DTYPE).itemsize
  ideal = 2 * t_l * cfg.top_k * row * (ep - 1) / ep

  def layer(params, x, chunks=1):
    return moe_core.moe_layer(
        params,
        x,
        cfg,
        backend="xla",
        mesh=mesh,
        data_axes=(),
        ep_options=parallel.EPOptions(exchange="padded", num_chunks=chunks),
    )

  compiled = jax.jit(layer).lower(params, x).compile().as_text()
  coll = collective_traffic.collective_bytes(compiled)
  a2a_bytes, a2a_elements = coll.get("all-to-all", (0, 0))
  # XLA:CPU runs bf16 collectives in f32 (it converts around them); a GPU
  # moves the activation dtype. Report both.
  padded = a2a_elements * jnp.dtype(DTYPE).itemsize * (ep - 1) / ep
  padded_cpu = a2a_bytes * (ep - 1) / ep
  _, aux = jax.jit(layer)(params, x)
  ragged = ragged_bytes(np.asarray(aux.expert_ids), ep)
  slots, rows = parallel.buffer_sizes(t_l, cfg.top_k, cfg.num_experts, ep, None)
  result = {
      "ep": ep,
      "routing": "skewed" if skewed else "even",
      "tokens_per_device": t_l,
      "top_k": cfg.top_k,
      "num_experts": cfg.num_experts,
      "hidden_size": cfg.hidden_size,
      "dtype": jnp.dtype(DTYPE).name,
      "ideal_bytes": ideal,
      "padded_bytes": padded,
      "padded_over_ideal": padded / ideal,
      "padded_bytes_as_compiled_on_cpu": padded_cpu,
      "padded_cpu_over_ideal": padded_cpu / ideal,
      "padded_count_exchange_bytes": coll.get("all-gather", (0, 0))[0],
      "ragged_mean_sent_bytes": ragged["mean_sent_bytes"],
      "ragged_mean_sent_over_ideal": ragged["mean_sent_bytes"] / ideal,
      "ragged_max_sent_over_ideal": ragged["max_sent_bytes"] / ideal,
      "ragged_busiest_link_over_ideal": ragged["busiest_link_bytes"] / ideal,
      "receive_buffer_rows": rows,
      "receive_buffer_over_average": rows / (t_l * cfg.top_k),
      "receive_buffer_bytes": rows * row,
      "max_rows_received": ragged["max_received_rows"],
      "padded_slots_per_peer": slots,
  }
  if not skewed:
    chunked = (
        jax.jit(lambda p, x: layer(p, x, chunks=2))
        .lower(params, x)
        .compile()
        .as_text()
    )
    result["cpu_schedule_num_chunks_2"] = schedule(chunked)
  return result


def main(argv):
  del argv
  eps = [int(e) for e in _EP.value]
  if jax.device_count() < max(eps):
    raise app.UsageError(
        f"needs {max(eps)} devices, found {jax.device_count()}: set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={max(eps)}."
    )
  results = []
  for ep in eps:
    for skewed in (False, True):
      r = run(ep, skewed)
      results.append(r)
      print(
          f"ep={ep} {r['routing']:6s} padded/ideal="
          f"{r['padded_over_ideal']:.2f} ragged mean/ideal="
          f"{r['ragged_mean_sent_over_ideal']:.2f} ragged busiest link/"
          f"ideal={r['ragged_busiest_link_over_ideal']:.2f} receive buffer/"
          f"average={r['receive_buffer_over_average']:.1f} "
          f"({r['receive_buffer_bytes'] / 2**20:.1f} MiB)"
      )
      if "cpu_schedule_num_chunks_2" in r:
        print(
            "  compiled CPU schedule, num_chunks=2: "
            + " -> ".join(r["cpu_schedule_num_chunks_2"])
        )
  json_report.save(
      _OUT.value,
      {
          "jax": jax.__version__,
          "platform": jax.default_backend(),
          "results": results,
      },
  )


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
