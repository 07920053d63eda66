"""Tests of the exchanges: the emulated collective, zeroed padding, bounded
buffers and their overflow, and the ragged exchange's CUDA lowering.

Needs 8 devices (the root conftest.py, or Bazel's `devices = 8`).
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import parallel
from moe_core.parallel import exchange as exchange_lib
from moe_core.testing import cuda_export
from moe_core.testing import expert_parallel

P = jax.sharding.PartitionSpec


# Primitives that wait for every device of their axes (jax 0.10 to 0.12).
_COLLECTIVES = (
    "all_to_all",
    "ragged_all_to_all",
    "psum",
    "all_gather",
    "ppermute",
    "reduce_scatter",
    "pmax",
    "pmin",
)


def _sub_jaxprs(eqn):
  """The jaxprs in an equation's parameters (open), in order."""
  found = []
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        found.append(item.jaxpr)
      elif isinstance(item, jax.extend.core.Jaxpr):
        found.append(item)
  return found


def overlapping_collectives(jaxpr, callback="pure_callback"):
  """Collectives that may run beside the host callback.

  Walks the program (nested jaxprs included) and tracks, for every value,
  the collectives and callbacks it depends on. A collective is ordered
  with the callback when the callback's operands depend on it, or it on
  the callback; any other may run at the same time on some device.

  Args:
    jaxpr: a ClosedJaxpr with exactly one `callback` equation.

  Returns:
    the names of the collectives ordered neither way (a list).
  """
  names = []  # Event id -> primitive name.
  operands_of = {}  # Event id -> the events its operands depend on.

  def walk(jaxpr, in_deps):
    deps = dict(zip(jaxpr.invars, in_deps))
    for var in jaxpr.constvars:
      deps[var] = frozenset()

    for eqn in jaxpr.eqns:
      ins = [
          frozenset()
          if isinstance(a, jax.extend.core.Literal)
          else deps.get(a, frozenset())
          for a in eqn.invars
      ]
      subs = _sub_jaxprs(eqn)
      name = eqn.primitive.name
      if any(name.startswith(c) for c in _COLLECTIVES) or name == callback:
        event = len(names)
        names.append(name)
        operands_of[event] = frozenset().union(*ins)
        outs = [operands_of[event] | {event}] * len(eqn.outvars)
      elif (
          len(subs) == 1
          and len(subs[0].invars) == len(ins)
          and len(subs[0].outvars) == len(eqn.outvars)
      ):
        outs = walk(subs[0], ins)  # A call: operands map one to one.
      elif subs:
        # Loops and branches: every output may depend on every operand and
        # on everything inside.
        everything = frozenset().union(*ins)
        for sub in subs:
          inner = walk(sub, [everything] * len(sub.invars))
          everything = everything.union(*inner)
        outs = [everything] * len(eqn.outvars)
      else:
        outs = [frozenset().union(*ins)] * len(eqn.outvars)
      deps.update(zip(eqn.outvars, outs))
    return [
        frozenset()
        if isinstance(v, jax.extend.core.Literal)
        else deps.get(v, frozenset())
        for v in jaxpr.outvars
    ]

  walk(jaxpr.jaxpr, [frozenset()] * len(jaxpr.jaxpr.invars))
  checks = [e for e, n in enumerate(names) if n == callback]
  if len(checks) != 1:
    raise AssertionError(f"expected one {callback}, found {len(checks)}")
  (check,) = checks
  return [
      name
      for event, name in enumerate(names)
      if name != callback
      and event not in operands_of[check]
      and check not in operands_of[event]
  ]


class EmulatedRaggedAllToAllTest(expert_parallel.DevicesTestCase):

  def test_matches_the_jax_docstring_example(self):
    # The example of jax.lax.ragged_all_to_all's docstring (axis size 2).
    mesh = expert_parallel.mesh((2,), ("i",))
    args = dict(
        operand=[[1, 2, 2], [3, 4, 0]],
        output=[[0] * 4, [0] * 4],
        input_offsets=[[0, 1], [0, 1]],
        send_sizes=[[1, 2], [1, 1]],
        output_offsets=[[0, 0], [1, 2]],
        recv_sizes=[[1, 1], [2, 1]],
    )
    args = {k: jnp.asarray(v, jnp.int32).reshape(-1) for k, v in args.items()}

    def body(*args):  # The six arrays of `args`, in that order.
      return parallel.emulated_ragged_all_to_all(*args, axis_name="i")

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False
        )
    )
    got = f(*args.values())
    np.testing.assert_array_equal(
        np.asarray(got).reshape(2, 4), [[1, 3, 0, 0], [2, 2, 4, 0]]
    )


class PlatformGuardTest(absltest.TestCase):
  """`exchange.refuse_other_platforms`: an identity, refused at lowering."""

  def setUp(self):
    super().setUp()
    self.ragged = parallel.get_exchange("ragged")

  def guarded(self, rows):
    return exchange_lib.refuse_other_platforms(rows, self.ragged)

  def test_exchanges_that_run_everywhere_add_nothing(self):
    rows = jnp.ones((3, 2))
    for name in ("padded", "ragged_emulated"):
      exchange = parallel.get_exchange(name)
      self.assertIs(exchange_lib.refuse_other_platforms(rows, exchange), rows)

  def test_refused_when_lowered_for_the_cpu_through_transformations(self):
    if jax.devices()[0].platform != "cpu":
      self.skipTest("refuses this machine's CPU devices")

    def loss(rows):
      return jnp.sum(jax.vmap(self.guarded)(rows) ** 2)

    rows = jnp.arange(6.0).reshape(2, 3)
    message = r"^exchange 'ragged' cannot run on platform 'cpu'"
    for name, fn in (
        ("jit", jax.jit(loss)),
        ("grad", jax.jit(jax.grad(loss))),
        ("eager", self.guarded),
    ):
      with (
          self.subTest(name),
          self.assertRaisesRegex(NotImplementedError, message),
      ):
        jax.jit(fn).lower(rows) if name != "eager" else fn(rows)
    # Traced but not lowered, or lowered where the exchange runs: fine.
    self.assertEqual(jax.eval_shape(jax.grad(loss), rows).shape, (2, 3))
    for platform in ("cuda", "rocm", "tpu"):
      with self.subTest(platform):
        exported = jax.export.export(
            jax.jit(jax.grad(loss)), platforms=[platform]
        )(rows)
        self.assertNotIn("platform_guard", exported.mlir_module())


class ExchangeTest(expert_parallel.LayerTestCase):
  """Each exchange's buffers, bounds and lowering, through the layer."""

  @parameterized.named_parameters(
      ("padded", "padded"), ("ragged", "ragged_emulated")
  )
  def test_dispatched_rows_past_the_groups_are_zero(self, exchange):
    """The receive rows no peer fills come out as zeros, not buffer garbage.

    Drop-free buffers hold the worst case, so every device has such rows.
    (jnp.zeros and jnp.empty are both zeros on the CPU;
    test_ragged_exchange_lowers_for_gpu rules out uninitialised buffers.)
    """
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 32, seed=8)
    x = x + jnp.sign(x)  # Every real entry is non-zero; routing as random.
    mesh = expert_parallel.mesh((8,), ("expert",))

    def body(params, x):
      aux = parallel.route(x, params["router"], cfg, token_axes=("expert",))
      d = parallel.dispatch(
          x, aux.expert_ids, cfg, expert_axis="expert", exchange=exchange
      )
      return d.rows[None], d.group_sizes[None]

    rows, sizes = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(parallel.param_specs(cfg), P("expert")),
            out_specs=(P("expert"), P("expert")),
            check_vma=False,
        )
    )(params, x)
    rows, sizes = np.asarray(rows), np.asarray(sizes)  # [8, R, D], [8, E_l]
    for device in range(expert_parallel.DEVICES):
      used = int(sizes[device].sum())
      with self.subTest(device=device):
        self.assertLess(used, rows.shape[1], "no rows past the groups")
        self.assertTrue(np.all(rows[device, :used] != 0))
        np.testing.assert_array_equal(rows[device, used:], 0.0)

  @parameterized.named_parameters(
      ("padded", "padded"), ("ragged", "ragged_emulated")
  )
  def test_bounded_buffer_drops_are_counted_and_zeroed(self, exchange):
    # Every token picks expert 3 (device 3 of 8): with buffer_factor=2 the
    # bound is 2x the average, far below what device 3 receives.
    cfg = expert_parallel.cfg(top_k=1)
    num_tokens, ep, factor = 32, 8, 2.0
    params, x = expert_parallel.inputs(cfg, num_tokens, seed=6, hot_expert=3)
    y, aux, _ = self.run_layer(
        cfg,
        params,
        x,
        mesh=expert_parallel.mesh((ep,), ("expert",)),
        data_axes=(),
        ep_options=parallel.EPOptions(
            exchange=exchange, buffer_factor=factor, overflow="drop"
        ),
    )
    y0, aux0, _ = self.run_layer(cfg, params, x)
    # Expected drops from the documented bound, computed here from the
    # single-device routing: each source's copies to one device in (expert,
    # token) order; padded keeps the first ceil(f*T_l*K/ep) per source and
    # destination, ragged the first ceil(f*T_l*K) rows per destination with
    # sources stacked in device order.
    local_tokens = num_tokens // ep
    ids = np.asarray(aux0.expert_ids)[:, 0]
    dest = ids // (cfg.num_experts // ep)
    kept = np.zeros(num_tokens, bool)
    if exchange == "padded":
      slots = math.ceil(factor * local_tokens * cfg.top_k / ep)
      for src in range(ep):
        mine = np.arange(src * local_tokens, (src + 1) * local_tokens)
        for j in range(ep):
          to_j = sorted(mine[dest[mine] == j], key=lambda t: (ids[t], t))
          kept[to_j[:slots]] = True
    else:
      rows = math.ceil(factor * local_tokens * cfg.top_k)
      for j in range(ep):
        to_j = [t for t in range(num_tokens) if dest[t] == j]  # Source order.
        to_j = sorted(to_j, key=lambda t: (t // local_tokens, ids[t], t))
        kept[to_j[:rows]] = True
    self.assertGreater(int(np.sum(~kept)), 0, "the case must overflow")
    self.assertEqual(int(aux.dropped_tokens), int(np.sum(~kept)))
    np.testing.assert_array_equal(np.asarray(aux.kept)[:, 0], kept)
    self.assertMatches(
        np.asarray(y)[kept], np.asarray(y0)[kept], "y of kept tokens"
    )
    np.testing.assert_array_equal(np.asarray(y)[~kept], 0.0)
    np.testing.assert_array_equal(np.asarray(aux.combine_weights)[~kept], 0.0)

  def test_bounded_buffer_overflow_raises_by_default(self):
    cfg = expert_parallel.cfg(top_k=1)
    params, x = expert_parallel.inputs(cfg, 32, seed=6, hot_expert=3)
    # All 32 copies go to device 3; each of the 8 sources may send it
    # ceil(2 * 4 tokens * 1 / 8) = 1 of its 4, so 8 * 3 = 24 do not fit.
    for grads in (False, True):  # The check must survive differentiation.
      with (
          self.subTest(grads=grads),
          self.assertRaisesRegex(
              Exception,
              r"expert-parallel receive buffer overflow: 24 token "
              r"copies did not fit",
          ),
      ):
        y, _, g = self.run_layer(
            cfg,
            params,
            x,
            grads=grads,
            mesh=expert_parallel.mesh((8,), ("expert",)),
            data_axes=(),
            ep_options=parallel.EPOptions(buffer_factor=2.0),
        )
        jax.block_until_ready((y, g))
    # With room for all 4 copies per source (ceil(8 * 4 / 8) = 4 slots), the
    # same bounded layer runs and matches one device.
    got = self.run_layer(
        cfg,
        params,
        x,
        mesh=expert_parallel.mesh((8,), ("expert",)),
        data_axes=(),
        ep_options=parallel.EPOptions(buffer_factor=8.0),
    )
    self.assertLayerMatches(got, self.run_layer(cfg, params, x))

  @parameterized.named_parameters(
      ("padded", "padded"), ("ragged", "ragged_emulated")
  )
  def test_overflow_check_overlaps_no_collective(self, exchange):
    # Every device raises from the check; one that raises while a peer
    # waits for it in a collective hangs that peer, and XLA:CPU aborts the
    # process (a rendezvous timeout). So each collective of the layer must
    # come before the check or after it, forward and in the gradient, with
    # the statistics' psums (data axis) and two chunks of exchanges. (Under
    # jax.jvp the tangents' own collectives are not ordered with the check:
    # docs/expert_parallel.md.)
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 32, seed=6, hot_expert=3)
    mesh = expert_parallel.mesh((2, 4), ("data", "expert"))

    def layer(params, x):
      return moe_core.moe_layer(
          params,
          x,
          cfg,
          backend=expert_parallel.BACKEND,
          mesh=mesh,
          data_axes=("data",),
          ep_options=parallel.EPOptions(
              exchange=exchange, buffer_factor=2.0, num_chunks=2
          ),
      )

    def loss(params, x):
      y, aux = layer(params, x)
      return jnp.sum(y) + aux.load_balancing_loss + aux.router_z_loss

    programs = {
        "forward": (layer, (params, x)),
        "grad": (jax.grad(loss, argnums=(0, 1)), (params, x)),
    }
    for name, (fn, args) in programs.items():
      with self.subTest(name):
        jaxpr = jax.make_jaxpr(fn)(*args)
        self.assertEqual(overlapping_collectives(jaxpr), [])

  def test_overlap_finder_sees_an_unordered_collective(self):
    # The finder itself: a psum beside the callback is reported, one that
    # feeds it or follows it is not.
    mesh = expert_parallel.mesh((8,), ("i",))

    def body(a):
      check = lambda v: jax.pure_callback(
          lambda v: np.zeros((), np.float32),
          jax.ShapeDtypeStruct((), jnp.float32),
          v,
      )
      before = jax.lax.psum(a, "i")
      zero = check(before.sum())
      after = jax.lax.all_gather(a * zero, "i")
      beside = jax.lax.all_to_all(a, "i", 0, 0, tiled=True)
      return after.sum() + beside.sum() + zero

    f = jax.shard_map(
        body, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False
    )
    jaxpr = jax.make_jaxpr(f)(jnp.ones(64, jnp.float32))
    self.assertEqual(overlapping_collectives(jaxpr), ["all_to_all"])

  def test_ragged_exchange_lowers_for_gpu(self):
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 32, seed=7)
    mesh = expert_parallel.mesh((8,), ("expert",))

    def loss(params, x):
      y, _ = moe_core.moe_layer(
          params,
          x,
          cfg,
          backend=expert_parallel.BACKEND,
          mesh=mesh,
          data_axes=(),
          ep_options=parallel.EPOptions(exchange="ragged"),
      )
      return jnp.sum(y)

    # No abstract GPU device: the shard_map's concrete mesh must match the
    # context mesh, and this program has no Pallas kernel that needs one.
    exported = cuda_export.export_for_cuda(
        jax.grad(loss, argnums=(0, 1)),
        params,
        x,
        disabled_custom_calls=("ragged_all_to_all",),
        device_kind=None,
    )
    # Forward dispatch and combine, and their transposes in the backward;
    # nothing else. In particular no AllocateBuffer, which is what
    # jnp.empty lowers to on GPU since jax 0.11 (uninitialised memory):
    # ragged_all_to_all leaves the rows it does not write as the output
    # buffer had them, and dispatch relies on those being zeros.
    self.assertEqual(
        cuda_export.custom_calls(exported.mlir_module()),
        ["ragged_all_to_all"] * 4,
    )


if __name__ == "__main__":
  absltest.main()
