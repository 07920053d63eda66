"""The traffic counters of bench/ep/train_traffic.py against arithmetic.

* `collective_bytes` / `collective_ops` on jitted collectives whose result
  sizes are known from their shapes;
* `exchange_rows` against a per-copy loop, `ragged_traffic` on a hand-made
  routing matrix;
* the benchmark's shortcut: one layer's step compiled and multiplied by the
  layers gives the all-to-all bytes of the layers compiled together.

Needs 8 devices (set here when this module is the first to import jax; the
Bazel target sets them itself).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=8"
  )

# pylint: disable=g-import-not-at-top,g-bad-import-order
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from bench.ep import collective_traffic
from bench.ep import train_traffic
import moe_core
from moe_core import parallel

P = jax.sharding.PartitionSpec


def _compiled(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


class HloCountTest(absltest.TestCase):

  def test_all_to_all_result_bytes_match_the_shape(self):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    rows, width = 12, 5  # Per device: 4 blocks of 3 rows.

    def exchange(a):
      return jax.lax.all_to_all(a, "x", 0, 0, tiled=True)

    fn = jax.shard_map(exchange, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = jnp.zeros((4 * rows, width), jnp.float32)
    hlo = _compiled(fn, x)
    # One all-to-all whose per-device result is [rows, width] float32.
    self.assertEqual(
        collective_traffic.collective_bytes(hlo)["all-to-all"],
        (rows * width * 4, rows * width),
    )
    self.assertEqual(collective_traffic.collective_ops(hlo)["all-to-all"], 1)

  def test_counts_every_collective_of_its_kind(self):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))

    def two_exchanges_and_a_gather(a):
      b = jax.lax.all_to_all(a, "x", 0, 0, tiled=True)
      c = jax.lax.all_to_all(jnp.sin(b), "x", 0, 0, tiled=True)
      return c, jax.lax.all_gather(a[:1], "x", tiled=True)

    fn = jax.shard_map(
        two_exchanges_and_a_gather,
        mesh=mesh,
        in_specs=P("x"),
        out_specs=(P("x"), P("x")),
    )
    x = jnp.zeros((2 * 6, 3), jnp.int32)
    hlo = _compiled(fn, x)
    counted = collective_traffic.collective_bytes(hlo)
    self.assertEqual(collective_traffic.collective_ops(hlo)["all-to-all"], 2)
    self.assertEqual(counted["all-to-all"][1], 2 * 6 * 3)
    # The gather's result: one row from each of the 2 devices, int32.
    self.assertEqual(counted["all-gather"], (2 * 3 * 4, 2 * 3))


class RoutingCountTest(absltest.TestCase):

  def test_exchange_rows_match_a_loop_over_copies(self):
    groups, ep, per_device, top_k, experts = 2, 4, 5, 3, 8
    rng = np.random.default_rng(0)
    ids = rng.integers(0, experts, (groups * ep * per_device, top_k))
    want = np.zeros((groups, ep, ep), int)
    for token, chosen in enumerate(ids):
      shard = token // per_device
      for expert in chosen:
        want[shard // ep, shard % ep, expert // (experts // ep)] += 1
    got = collective_traffic.exchange_rows(
        ids, ep=ep, experts_per_device=experts // ep, groups=groups
    )
    np.testing.assert_array_equal(got, want)

  def test_exchange_rows_rejects_a_token_count_that_does_not_split(self):
    with self.assertRaisesRegex(ValueError, "groups\\*ep=8.*got 6"):
      collective_traffic.exchange_rows(
          np.zeros((6, 2), int), ep=4, experts_per_device=2, groups=2
      )

  def test_ragged_traffic_of_a_two_device_routing(self):
    # Device 0 keeps 5 copies and sends 2; device 1 sends 3 and keeps 4.
    rows = np.array([[[5, 2], [3, 4]]])
    got = collective_traffic.ragged_traffic(rows, row_bytes=10)
    # Each device sends its own off-device copies and returns the others'
    # outputs: 2 + 3 rows either way. The busiest direction carries 3 rows
    # in each phase. Device 0's experts receive 5 + 3 rows.
    self.assertEqual(
        got,
        {
            "mean_sent_bytes": 50.0,
            "max_sent_bytes": 50.0,
            "busiest_link_bytes": 60.0,
            "max_received_rows": 8,
        },
    )


class StepShortcutTest(absltest.TestCase):

  def test_layers_compiled_together_move_layers_times_one_layer(self):
    cfg = moe_core.MoEConfig(
        num_experts=8, top_k=2, hidden_size=16, expert_ffn_size=8
    )
    model = train_traffic.TrafficModel(
        name="test", moe=cfg, moe_layers=2, batch_size=4, seq_len=16
    )
    mesh = train_traffic.make_mesh("data=2,expert=4")
    one = collective_traffic.collective_bytes(
        train_traffic.step_hlo(model, mesh)
    )["all-to-all"]

    def two_layer_loss(layers, x):
      for params in layers:
        y, _ = moe_core.moe_layer(
            params, x, cfg, backend="xla", mesh=mesh, data_axes=("data",)
        )
        x = x + y
      return jnp.mean(jnp.square(x.astype(jnp.float32)))

    keys = jax.random.split(jax.random.key(0), 2)
    layers = [
        parallel.shard_params(moe_core.init_params(k, cfg), cfg, mesh)
        for k in keys
    ]
    x = jax.device_put(
        jnp.ones((model.tokens, cfg.hidden_size), jnp.bfloat16),
        parallel.NamedSharding(mesh, P(("data", "expert"))),
    )
    hlo = _compiled(
        jax.value_and_grad(two_layer_loss, argnums=(0, 1)), layers, x
    )
    both = collective_traffic.collective_bytes(hlo)["all-to-all"]
    self.assertEqual(both, tuple(2 * n for n in one))
    # Each layer's step: 4 exchanges (dispatch, combine, their transposes)
    # of a padded [ep, slots, D] buffer, slots = T_l * min(K, E / ep).
    t_l, ep = model.tokens // 8, 4
    slots = t_l * min(cfg.top_k, cfg.num_experts // ep)
    self.assertEqual(one[1], 4 * ep * slots * cfg.hidden_size)


if __name__ == "__main__":
  absltest.main()
