"""All-to-all bytes of one expert-parallel training step, against the ideal.

For the `tiny_dsv3` preset and `mid_dsv3` (a mid-size DeepSeek-V3-shaped
model defined here) on each --mesh, per device and training step: the
padded exchange's bytes measured in the compiled HLO of one MoE layer's
forward and backward (times the MoE layers), the ideal from the routing
(the token copies that leave their device), and the ragged exchange's
mean, busiest device and busiest link, as ratios over the ideal; one run
on 8 simulated CPU devices (this module sets XLA_FLAGS unless it already
gives a device count), no timings (docs/benchmarks.md,
"bench/ep/train_traffic.py"). Usage:
    python -m bench.ep.train_traffic [--models tiny_dsv3,mid_dsv3] \
        [--mesh data=2,expert=4 --mesh expert=8] [--out PATH]
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=8"
  )

# pylint: disable=g-import-not-at-top,g-bad-import-order
import dataclasses

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bench.ep import collective_traffic
from bench.harness import json_report
from bench.harness import text_table
import moe_core
from moe_core import parallel
from train import platforms
from train import presets
from train.presets import sizing

DTYPE = jnp.bfloat16
EXPERT_AXIS = "expert"
DATA_AXIS = "data"
# Forward and backward of dispatch and of combine: four exchanges a layer.
EXCHANGES_PER_LAYER = 4


@dataclasses.dataclass(frozen=True)
class TrafficModel:
  """The MoE part of a model: its block, its MoE layers, tokens a step."""

  name: str
  moe: moe_core.MoEConfig
  moe_layers: int
  batch_size: int
  seq_len: int

  @property
  def tokens(self) -> int:
    return self.batch_size * self.seq_len


def _preset_model(name: str) -> TrafficModel:
  preset = presets.get_preset(name)
  return TrafficModel(
      name=name,
      moe=preset.model.moe,
      moe_layers=preset.model.num_moe_layers,
      batch_size=preset.train.batch_size,
      seq_len=preset.train.seq_len,
  )


# No preset is mid-sized: DeepSeek-V3's block at D=1024 with a quarter of
# its experts, the same top-8 and group-limited routing.
MID_DSV3 = TrafficModel(
    name="mid_dsv3",
    moe=presets.deepseek_v3_moe(
        1024,
        num_experts=64,
        top_k=8,
        expert_ffn_size=512,
        n_group=8,
        topk_group=4,
    ),
    moe_layers=8,
    batch_size=32,
    seq_len=512,
)

MODELS = {
    "tiny_dsv3": lambda: _preset_model("tiny_dsv3"),
    "mid_dsv3": lambda: MID_DSV3,
}

_MODELS = flags.DEFINE_list("models", list(MODELS), "Models to measure.")
_MESHES = flags.DEFINE_multi_string(
    "mesh",
    ["data=2,expert=4", "expert=8"],
    "Meshes as AXIS=SIZE,... over the data and expert axes (as train.main's "
    "--mesh); repeat the flag for more.",
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the parameters and tokens.")
# `bazel run` starts in the runfiles and names the workspace in this variable.
_WORKSPACE = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..")
)
_OUT = flags.DEFINE_string(
    "out",
    os.path.join(_WORKSPACE, "bench", "results", "train_traffic.json"),
    "Where to write the JSON.",
)


def make_mesh(spec: str) -> jax.sharding.Mesh:
  """A ("data", "expert") mesh from 'data=2,expert=4' (data 1 if unnamed)."""
  sizes = sizing.parse_mesh(spec)
  others = {a: n for a, n in sizes.items() if a not in (DATA_AXIS, EXPERT_AXIS)}
  if any(n > 1 for n in others.values()):
    raise ValueError(
        f"--mesh may only split the {DATA_AXIS} and {EXPERT_AXIS} axes, got "
        f"{spec!r}."
    )
  shape = (sizes[DATA_AXIS], sizes[EXPERT_AXIS])
  needed = shape[0] * shape[1]
  if needed > jax.device_count():
    raise ValueError(
        f"--mesh {spec!r} needs {needed} devices, found {jax.device_count()}."
    )
  devices = np.array(jax.devices()[:needed]).reshape(shape)
  return jax.sharding.Mesh(devices, (DATA_AXIS, EXPERT_AXIS))


def step_hlo(model: TrafficModel, mesh: jax.sharding.Mesh) -> str:
  """Compiled HLO of one MoE layer's forward + backward on `mesh`.

  Compiled from shapes and shardings only (nothing is allocated): params
  placed as `parallel.shard_params` places them, x [T, D] split over
  data x expert. The gradient is taken for the params and x (a layer's
  input gradient feeds the layers below it).
  """
  cfg = model.moe
  specs = parallel.param_specs(cfg, EXPERT_AXIS)
  params = {
      name: jax.ShapeDtypeStruct(
          shape,
          jnp.float32,
          sharding=parallel.NamedSharding(mesh, specs[name]),
      )
      for name, shape in moe_core.param_shapes(cfg).items()
  }
  x = jax.ShapeDtypeStruct(
      (model.tokens, cfg.hidden_size),
      DTYPE,
      sharding=parallel.NamedSharding(
          mesh, parallel.P((DATA_AXIS, EXPERT_AXIS))
      ),
  )

  def loss(params, x):
    y, _ = moe_core.moe_layer(
        params,
        x,
        cfg,
        backend="xla",
        mesh=mesh,
        data_axes=(DATA_AXIS,),
        expert_axis=EXPERT_AXIS,
    )
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  return step.lower(params, x).compile().as_text()


def layer_routing(model: TrafficModel, seed: int) -> list[np.ndarray]:
  """[T, K] expert ids of each MoE layer, routed on one device.

  Layer l's tokens are random normal and its router comes from
  `moe_core.init_params` (the correction bias starts at zero); jit keeps
  only the router of the init, so the expert weights are never drawn.
  """
  cfg = model.moe

  @jax.jit
  def route(key):
    init_key, x_key = jax.random.split(key)
    params = moe_core.init_params(init_key, cfg)
    x = jax.random.normal(x_key, (model.tokens, cfg.hidden_size), DTYPE)
    aux = moe_core.route(
        x, params["router"], cfg, params.get("correction_bias")
    )
    return aux.expert_ids

  base = jax.random.key(seed)
  return [
      np.asarray(route(jax.random.fold_in(base, layer)))
      for layer in range(model.moe_layers)
  ]


def measure(model: TrafficModel, spec: str, routing: list[np.ndarray]) -> dict:
  """The step's traffic for `model` on the mesh `spec`; see the module doc."""
  cfg = model.moe
  mesh = make_mesh(spec)
  groups, ep = mesh.shape[DATA_AXIS], mesh.shape[EXPERT_AXIS]
  devices = groups * ep
  t_l = model.tokens // devices
  row = cfg.hidden_size * jnp.dtype(DTYPE).itemsize
  layers = model.moe_layers

  hlo = step_hlo(model, mesh)
  coll = collective_traffic.collective_bytes(hlo)
  ops = collective_traffic.collective_ops(hlo)
  exchanges = [coll.get(k, (0, 0)) for k in ("all-to-all", "ragged-all-to-all")]
  a2a_bytes = sum(nbytes for nbytes, _ in exchanges)
  a2a_elements = sum(elements for _, elements in exchanges)
  leaves = (ep - 1) / ep
  padded = layers * a2a_elements * jnp.dtype(DTYPE).itemsize * leaves
  padded_cpu = layers * a2a_bytes * leaves

  per_layer_rows = [
      collective_traffic.exchange_rows(
          ids,
          ep=ep,
          experts_per_device=cfg.num_experts // ep,
          groups=groups,
      )
      for ids in routing
  ]
  per_layer = [
      collective_traffic.ragged_traffic(r, row) for r in per_layer_rows
  ]
  # ragged_traffic counts a forward's dispatch + combine; the backward
  # moves the same rows the other way.
  fwd_bwd = 2
  ideal = fwd_bwd * sum(t["mean_sent_bytes"] for t in per_layer)
  # A device's step total is linear in the rows: sum the layers first.
  step_max = collective_traffic.ragged_traffic(sum(per_layer_rows), row)
  ragged_max = fwd_bwd * step_max["max_sent_bytes"]
  busiest = fwd_bwd * sum(t["busiest_link_bytes"] for t in per_layer)
  uniform = layers * EXCHANGES_PER_LAYER * t_l * cfg.top_k * row * leaves
  slots, buffer_rows = parallel.buffer_sizes(
      t_l, cfg.top_k, cfg.num_experts, ep, None
  )
  max_received = max(t["max_received_rows"] for t in per_layer)
  return {
      "model": model.name,
      "mesh": spec,
      "data": groups,
      "ep": ep,
      "moe_layers": layers,
      "tokens_per_step": model.tokens,
      "tokens_per_device": t_l,
      "hidden_size": cfg.hidden_size,
      "num_experts": cfg.num_experts,
      "top_k": cfg.top_k,
      "dtype": jnp.dtype(DTYPE).name,
      "all_to_all_ops_per_layer": ops.get("all-to-all", 0),
      "ragged_all_to_all_ops_per_layer": ops.get("ragged-all-to-all", 0),
      "ideal_bytes": ideal,
      "uniform_routing_bytes": uniform,
      "uniform_routing_over_ideal": uniform / ideal,
      "padded_bytes": padded,
      "padded_over_ideal": padded / ideal,
      "padded_bytes_as_compiled_on_cpu": padded_cpu,
      "padded_cpu_over_ideal": padded_cpu / ideal,
      # ragged_all_to_all sends exactly the rows that leave: the ideal.
      "ragged_mean_sent_bytes": ideal,
      "ragged_mean_sent_over_ideal": 1.0,
      "ragged_max_sent_bytes": ragged_max,
      "ragged_max_sent_over_ideal": ragged_max / ideal,
      "ragged_busiest_link_over_ideal": busiest / ideal,
      "other_collectives_bytes_as_compiled": {
          k: layers * v[0]
          for k, v in coll.items()
          if k not in ("all-to-all", "ragged-all-to-all")
      },
      "padded_slots_per_peer": slots,
      "padded_buffer_bytes": ep * slots * row,
      "receive_buffer_rows": buffer_rows,
      "receive_buffer_bytes": buffer_rows * row,
      "receive_buffer_over_average": buffer_rows / (t_l * cfg.top_k),
      "max_rows_received": max_received,
  }


COLUMNS = (
    text_table.Column("model", 9, align="<"),
    text_table.Column("mesh", 15, align="<"),
    text_table.Column("tokens", 6, "d"),
    text_table.Column("ideal MiB", 9, ".1f"),
    text_table.Column("uniform/ideal", 13, ".2f"),
    text_table.Column("padded/ideal", 12, ".2f"),
    text_table.Column("padded cpu/ideal", 16, ".2f"),
    text_table.Column("ragged max/ideal", 16, ".2f"),
    text_table.Column("busiest/ideal", 13, ".2f"),
    text_table.Column("recv buf MiB", 12, ".1f"),
)


def _row(r: dict) -> list:
  return [
      r["model"],
      r["mesh"],
      r["tokens_per_step"],
      r["ideal_bytes"] / 2**20,
      r["uniform_routing_over_ideal"],
      r["padded_over_ideal"],
      r["padded_cpu_over_ideal"],
      r["ragged_max_sent_over_ideal"],
      r["ragged_busiest_link_over_ideal"],
      r["receive_buffer_bytes"] / 2**20,
  ]


def main(argv):
  del argv
  unknown = [m for m in _MODELS.value if m not in MODELS]
  if unknown:
    raise app.UsageError(
        f"--models must name models of {sorted(MODELS)}, got {unknown}."
    )
  results = []
  print(text_table.heading(COLUMNS))
  for name in _MODELS.value:
    model = MODELS[name]()
    routing = layer_routing(model, _SEED.value)
    for spec in _MESHES.value:
      r = measure(model, spec, routing)
      results.append(r)
      print(text_table.row(COLUMNS, _row(r)), flush=True)
  print(
      "Bytes per device and training step (forward + backward, every MoE "
      "layer); ideal = the copies that leave their device; 1 = ideal."
  )
  json_report.save(
      _OUT.value,
      {
          "jax": jax.__version__,
          "platform": jax.default_backend(),
          "devices": jax.device_count(),
          "seed": _SEED.value,
          "note": (
              "bytes per device and training step (forward + backward of "
              "every MoE layer); all-to-all bytes counted in one layer's "
              "compiled step, times moe_layers"
          ),
          "results": results,
      },
  )


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
