"""Tests of the NCCL-EP exchange ("te_nccl_ep") on a CPU.

NCCL-EP runs only on NVIDIA GPUs (SM90+, NVLink, a communicator made by
`nccl_ep.bootstrap`), so here:
  * everywhere: its registration and options; its buffer layout (capacity,
    admit, return_slot, the communicator's sizes) against hand-computed
    values; and the layer with NCCL-EP's dispatch replaced by a JAX stand-in
    that delivers rows in another order with NaN padding (what NCCL-EP may
    do), which must equal the ragged exchange bit for bit: the tags, not
    NCCL-EP's order, place every row;
  * with Transformer Engine installed (tools/setup_te.sh): the errors
    without a communicator or with one of other sizes; the methods traced
    inside `jax.shard_map` over 8 devices; and `jax.export` for CUDA of a
    layer using the exchange, forward and gradients, with TE's EP custom
    calls and their operand shapes and dtypes. The communicator is faked
    for tracing (TE's EP config set, its handle size made up): NCCL cannot
    start on a CPU. Without TE those tests skip with the reason (and fail
    under DROPLESS_EXPECT_TE=1, as tools/test_te.sh sets).

Needs 8 devices (the root conftest.py, or Bazel's `devices = 8`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import sys
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.te import _te
from backends.te import nccl_ep
from backends.testing.te_required import require_te
from moe_core import parallel
from moe_core.parallel import exchange as exchange_lib
from moe_core.testing import expert_parallel

P = jax.sharding.PartitionSpec
_NAME = "te_nccl_ep"
# The made-up size of NCCL-EP's routing state when no communicator exists
# (NCCL-EP reports the real one only after it starts).
_HANDLE_BYTES = 4096
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


class ShuffledDispatchExchange(nccl_ep.NcclEpExchange):
  """The exchange with NCCL-EP's dispatch emulated by an all_gather.

  Rows reach their device in the reverse of (source, row) order, and the
  receive buffer's rows past them are NaN with tag 0: an order and padding
  NCCL-EP is free to produce. No communicator is needed, and it runs on
  every platform.
  """

  platforms = None

  def _check_communicator(self, need, hidden):
    del need, hidden  # Nothing to check: no NCCL here.

  @staticmethod
  def _dispatch(rows, dest, tags, recv_rows, axis_name):
    me = jax.lax.axis_index(axis_name)
    all_rows = jax.lax.all_gather(rows, axis_name)  # [ep, N, D]
    ep, n, d = all_rows.shape
    all_rows = all_rows.reshape(ep * n, d)
    all_dest = jax.lax.all_gather(dest, axis_name).reshape(-1)
    all_tags = jax.lax.all_gather(tags, axis_name).reshape(-1)
    mine = all_dest == me
    # Rows for this device first, latest source and row first.
    order = jnp.argsort(jnp.where(mine, -jnp.arange(ep * n), ep * n))
    order = jnp.pad(order, (0, max(0, recv_rows - ep * n)))[:recv_rows]
    padding = (jnp.arange(recv_rows) >= jnp.sum(mine))[:, None]
    received = jnp.where(padding, jnp.nan, all_rows[order])
    got_tags = jnp.where(
        padding[:, 0], 0.0, all_tags[order].astype(jnp.float32)
    )
    return received.astype(rows.dtype), got_tags


@contextlib.contextmanager
def _shuffled_dispatch():
  """Makes the layer's "te_nccl_ep" a `ShuffledDispatchExchange`."""
  real = exchange_lib.get_exchange
  shuffled = ShuffledDispatchExchange()

  def get_exchange(name):
    return shuffled if name == _NAME else real(name)

  with mock.patch.object(exchange_lib, "get_exchange", get_exchange):
    yield


@contextlib.contextmanager
def _pretend_bootstrapped(sizes: nccl_ep.CommunicatorSizes, hidden: int):
  """TE's EP config as `nccl_ep.bootstrap` would leave it, with no NCCL.

  For tracing and `jax.export` only: TE's EP primitives read the config and
  NCCL-EP's handle size while tracing; NCCL cannot start on a CPU, so the
  config is set directly and the handle size is `_HANDLE_BYTES`.
  """
  ep_ops = importlib.import_module("transformer_engine.jax.cpp_extensions.ep")
  extension = sys.modules["transformer_engine_jax"]
  ep = sizes.num_experts
  ep_ops.set_ep_config(
      ep_ops.EpConfig(
          world_size=ep,
          rank=0,
          ep_size=ep,
          num_ep_groups=1,
          num_experts=sizes.num_experts,
          num_local_experts=1,
          max_tokens_per_rank=sizes.max_tokens_per_rank,
          recv_capacity_per_rank=sizes.recv_capacity_per_rank,
          hidden_dim=hidden,
      )
  )
  try:
    with mock.patch.object(
        extension, "ep_handle_mem_size", lambda top_k, alignment: _HANDLE_BYTES
    ):
      yield
  finally:
    ep_ops.reset_ep_config()


def _bf16_inputs(cfg, num_tokens, **kwargs):
  params, x = expert_parallel.inputs(cfg, num_tokens, **kwargs)
  return jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params, x))


class RegistrationTest(absltest.TestCase):

  def test_chosen_by_name_never_by_auto(self):
    # Registered by the package (`backends.te`), not named by the core.
    self.assertIn(_NAME, parallel.exchange_names())
    self.assertNotIn(_NAME, parallel.EXCHANGES)
    self.assertEqual(parallel.EPOptions(exchange=_NAME).exchange, _NAME)
    for platform in ("cpu", "gpu", "cuda", "rocm", "tpu"):
      self.assertNotEqual(
          parallel.resolve_exchange("auto", platform), _NAME, platform
      )
    self.assertEqual(parallel.resolve_exchange(_NAME, "cuda"), _NAME)
    found = parallel.get_exchange(_NAME)
    self.assertIsInstance(found, nccl_ep.NcclEpExchange)
    self.assertIsInstance(found, parallel.Exchange)
    self.assertEqual(found.name, _NAME)

  def test_choosing_it_imports_no_transformer_engine(self):
    # In a fresh process: TE may be imported by other tests of this one.
    code = (
        "import sys\n"
        "import backends.te\n"
        "from moe_core import parallel\n"
        f"parallel.EPOptions(exchange={_NAME!r})\n"
        f"parallel.get_exchange({_NAME!r})\n"
        "print(sorted(m for m in sys.modules "
        "if m.startswith('transformer_engine')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=_REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        check=True,
    )
    self.assertEqual(out.stdout.strip().splitlines()[-1], "[]", out.stderr)


class LayoutTest(absltest.TestCase):
  """The buffer layout, pure jnp and Python, against hand-computed values."""

  def setUp(self):
    super().setUp()
    self.exchange = nccl_ep.NcclEpExchange()

  def test_capacity_is_the_ragged_receive_rows(self):
    # T_l=12, K=3, E=16 over ep=4: E_l=4, a device receives at most
    # 4 sources * 12 tokens * min(3, 4) = 144 rows; f=0.5 bounds that to
    # ceil(0.5 * 12 * 3) = 18.
    self.assertEqual(self.exchange.capacity(12, 3, 16, 4, None), 144)
    self.assertEqual(self.exchange.capacity(12, 3, 16, 4, 0.5), 18)
    self.assertEqual(self.exchange.describe_capacity(18), "18 receive rows")

  def test_admit_stacks_sources_in_device_order(self):
    # wanted[src, dst]; 4 receive rows: device 0 gets source 0's 2 rows,
    # then 2 of source 1's 3; device 1 gets source 0's one.
    wanted = jnp.array([[2, 1], [3, 0]], jnp.int32)
    fits, first = self.exchange.admit(wanted, 4)
    np.testing.assert_array_equal(fits, [[2, 1], [2, 0]])
    np.testing.assert_array_equal(first, [[0, 0], [2, 1]])

  def test_results_return_to_the_send_order(self):
    copy = jnp.arange(5, dtype=jnp.int32)
    dest = jnp.array([0, 0, 1, 1, 1], jnp.int32)
    slot = jnp.array([0, 1, 0, 1, 2], jnp.int32)
    np.testing.assert_array_equal(
        self.exchange.return_slot(copy, dest, slot, 4), copy
    )

  def test_communicator_sizes(self):
    # Drop-free: 36 copies sent, 144 receive rows: both dispatches fit
    # 144 rows sent and 256 received (144 rounded up to 128s).
    self.assertEqual(
        nccl_ep.communicator_sizes(12, 3, 16, 4, None),
        nccl_ep.CommunicatorSizes(4, 144, 256),
    )
    # Bounded to 18 receive rows: the 36 copies are the most either way.
    self.assertEqual(
        nccl_ep.communicator_sizes(12, 3, 16, 4, 0.5),
        nccl_ep.CommunicatorSizes(4, 36, 128),
    )


class ShuffledLayerTest(expert_parallel.LayerTestCase):
  """The layer, NCCL-EP's dispatch emulated (`ShuffledDispatchExchange`)."""

  def _both(self, cfg, params, x, mesh, **options):
    """(te_nccl_ep's, ragged_emulated's) `run_layer` results."""
    results = []
    for name in (_NAME, "ragged_emulated"):
      with _shuffled_dispatch():
        results.append(
            self.run_layer(
                cfg,
                params,
                x,
                grads=True,
                mesh=mesh,
                data_axes=("data",) if "data" in mesh.axis_names else (),
                ep_options=parallel.EPOptions(exchange=name, **options),
            )
        )
    return results

  def assertIdentical(self, got, want):
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(want),
        jax.tree.leaves(got),
        jax.tree.leaves(want),
    ):
      np.testing.assert_array_equal(
          np.asarray(g, np.float32),
          np.asarray(w, np.float32),
          jax.tree_util.keystr(path[0]),
      )

  @parameterized.named_parameters(
      ("ep8", (8,), ("expert",)), ("data2_ep4", (2, 4), ("data", "expert"))
  )
  def test_matches_the_ragged_exchange_bit_for_bit(self, shape, names):
    cfg = expert_parallel.cfg()
    params, x = _bf16_inputs(cfg, 64, seed=3)
    got, want = self._both(cfg, params, x, expert_parallel.mesh(shape, names))
    self.assertIdentical(got, want)

  def test_bounded_buffer_drops_as_the_ragged_exchange(self):
    # Every token's best expert is 3: with buffer_factor=2 device 1 (experts
    # 2, 3) cannot take them all, so copies are dropped (routed to -1).
    cfg = expert_parallel.cfg(top_k=1)
    params, x = _bf16_inputs(cfg, 32, seed=6, hot_expert=3)
    got, want = self._both(
        cfg,
        params,
        x,
        expert_parallel.mesh((4,), ("expert",)),
        buffer_factor=2.0,
        overflow="drop",
    )
    self.assertGreater(int(want[1].dropped_tokens), 0, "the case must drop")
    self.assertIdentical(got, want)

  def test_other_dtypes_raise_naming_the_dtype(self):
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 64, seed=3)  # float32.
    with (
        _shuffled_dispatch(),
        self.assertRaisesRegex(
            NotImplementedError,
            r"exchange 'te_nccl_ep' moves bfloat16 rows only .*got float32",
        ),
    ):
      self.run_layer(
          cfg,
          params,
          x,
          mesh=expert_parallel.mesh((8,), ("expert",)),
          data_axes=(),
          ep_options=parallel.EPOptions(exchange=_NAME),
      )


class PlatformTest(expert_parallel.DevicesTestCase):
  """Off NVIDIA GPUs the exchange is refused first, naming the platform."""

  def test_refused_at_trace_time_naming_the_platform(self):
    platform = jax.devices()[0].platform
    if platform == "gpu":
      self.skipTest("NCCL-EP may run on this GPU")
    cfg = expert_parallel.cfg()
    mesh = expert_parallel.mesh((8,), ("expert",))
    message = (
        f"exchange 'te_nccl_ep' cannot run on platform '{platform}': it "
        "needs Transformer Engine's NCCL-EP kernels .* On "
        f"'{platform}' use exchange='auto'"
    )
    # Before: float32 rows were blamed ("moves bfloat16 rows only ... use
    # exchange='ragged'"), bfloat16 ones the missing communicator or TE.
    for dtype in (jnp.float32, jnp.bfloat16):
      params, x = expert_parallel.inputs(cfg, 64, seed=3)
      params, x = jax.tree.map(
          lambda a, dtype=dtype: a.astype(dtype), (params, x)
      )

      def layer(params, x):
        return moe_core.moe_layer(
            params,
            x,
            cfg,
            backend="auto",
            mesh=mesh,
            data_axes=(),
            ep_options=parallel.EPOptions(exchange=_NAME),
        )

      for name, fn in (("eager", layer), ("traced", jax.jit(layer))):
        with (
            self.subTest(dtype=jnp.dtype(dtype).name, call=name),
            self.assertRaisesRegex(NotImplementedError, f"^{message}"),
        ):
          jax.eval_shape(fn, params, x) if name == "traced" else fn(params, x)

  def test_lowering_for_another_platform_is_refused(self):
    # Traceable (as when a test traces for CUDA on a CPU host with a made-up
    # communicator; here NCCL-EP's dispatch is emulated) but lowered for
    # the CPU: refused at lowering, before XLA compiles.
    if jax.devices()[0].platform != "cpu":
      self.skipTest("lowers for this machine's CPU devices")
    cfg = expert_parallel.cfg()
    params, x = _bf16_inputs(cfg, 64, seed=3)
    mesh = expert_parallel.mesh((8,), ("expert",))

    class TracedAnywhere(ShuffledDispatchExchange):
      platforms = nccl_ep.NcclEpExchange.platforms

      def check_platform(self, platform):
        del platform  # The communicator's waiver.

    def get_exchange(name):
      return TracedAnywhere() if name == _NAME else real(name)

    def loss(params, x):
      y, _ = moe_core.moe_layer(
          params,
          x,
          cfg,
          backend="xla",
          mesh=mesh,
          data_axes=(),
          ep_options=parallel.EPOptions(exchange=_NAME),
      )
      return jnp.sum(y.astype(jnp.float32))

    real = exchange_lib.get_exchange
    with (
        mock.patch.object(exchange_lib, "get_exchange", get_exchange),
        self.assertRaisesRegex(
            NotImplementedError,
            r"^exchange 'te_nccl_ep' cannot run on platform 'cpu'",
        ),
    ):
      jax.jit(loss).lower(params, x)


class TransformerEngineTest(expert_parallel.DevicesTestCase):
  """What needs TE: its EP primitives traced and lowered for CUDA."""

  def setUp(self):
    super().setUp()
    require_te(self)
    self.cfg = expert_parallel.cfg()  # E=8, K=2, D=16.
    self.num_tokens = 64  # 8 per device: M = 16 copies, R = 64 rows.
    self.mesh = expert_parallel.mesh((8,), ("expert",))
    self.sizes = nccl_ep.communicator_sizes(8, 2, 8, 8, None)

  def _layer_loss(self, backend="xla"):
    def loss(params, x):
      y, _ = moe_core.moe_layer(
          params,
          x,
          self.cfg,
          backend=backend,
          mesh=self.mesh,
          data_axes=(),
          ep_options=parallel.EPOptions(exchange=_NAME),
      )
      return jnp.sum(y.astype(jnp.float32))

    return loss

  def _abstract_inputs(self):
    params, x = _bf16_inputs(self.cfg, self.num_tokens)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
        (
            params,
            x,
        ),
    )

  def test_tracing_without_a_communicator_says_to_bootstrap(self):
    # As on a GPU, where the platform is not what is missing.
    with (
        mock.patch.object(nccl_ep.NcclEpExchange, "platforms", None),
        self.assertRaisesRegex(
            NotImplementedError,
            r"needs NCCL-EP's communicator, which is created outside jit: call "
            r"backends.te.nccl_ep.bootstrap",
        ),
    ):
      jax.eval_shape(self._layer_loss(), *self._abstract_inputs())

  def test_a_communicator_of_other_sizes_is_refused(self):
    other = nccl_ep.CommunicatorSizes(8, 64, 256)
    with (
        _pretend_bootstrapped(other, self.cfg.hidden_size),
        self.assertRaisesRegex(
            ValueError,
            r"created for .*recv_capacity_per_rank=256; this layer needs "
            r".*recv_capacity_per_rank=128",
        ),
    ):
      jax.eval_shape(self._layer_loss(), *self._abstract_inputs())

  def test_methods_trace_in_shard_map(self):
    exchange = nccl_ep.NcclEpExchange()
    cfg = self.cfg

    def body(params, x):
      aux = parallel.route(x, params["router"], cfg, token_axes=("expert",))
      d = parallel.dispatch(
          x, aux.expert_ids, cfg, expert_axis="expert", exchange=_NAME
      )
      back = exchange.send_back(d.rows, d.layout, 16, "expert")
      return d.rows[None], back[None]

    params, x = self._abstract_inputs()
    with _pretend_bootstrapped(self.sizes, cfg.hidden_size):
      rows, back = jax.eval_shape(
          jax.shard_map(
              body,
              mesh=self.mesh,
              in_specs=(parallel.param_specs(cfg), P("expert")),
              out_specs=(P("expert"), P("expert")),
              check_vma=False,
          ),
          params,
          x,
      )
    # Per device: 64 receive rows from `send`, 16 copies from `send_back`.
    self.assertEqual(rows.shape, (8, 64, 16))
    self.assertEqual(back.shape, (8, 16, 16))
    self.assertEqual(rows.dtype, jnp.bfloat16)
    self.assertEqual(back.dtype, jnp.bfloat16)

  @parameterized.parameters("xla", "te")
  def test_layer_lowers_to_nccl_ep_for_cuda(self, backend):
    if backend not in moe_core.registered_backends():
      self.skipTest(f"backend {backend!r} is not registered here")
    loss = self._layer_loss(backend)
    with (
        _pretend_bootstrapped(self.sizes, self.cfg.hidden_size),
        _te.compute_capability(90),
    ):
      exported = {
          "fwd": jax.export.export(
              jax.jit(loss),
              platforms=["cuda"],
              disabled_checks=_disabled_checks(),
          )(*self._abstract_inputs()),
          "grad": jax.export.export(
              jax.jit(jax.grad(loss, argnums=(0, 1))),
              platforms=["cuda"],
              disabled_checks=_disabled_checks(),
          )(*self._abstract_inputs()),
      }
    # Per device: M = 16 copies out, R = 64 rows back; NCCL-EP's receive
    # buffer is 128 rows (64 rounded up to 128) in both directions.
    hm = f"tensor<1x{_HANDLE_BYTES}xui8>"
    send = [
        ("te_ep_prepare_ffi", ["tensor<16x1xi32>"]),
        (
            "te_ep_dispatch_ffi",
            [hm, "tensor<16x1xi32>", "tensor<16x16xbf16>", "tensor<16x1xf32>"],
        ),
    ]
    send_back = [
        ("te_ep_prepare_ffi", ["tensor<64x1xi32>"]),
        (
            "te_ep_dispatch_ffi",
            [hm, "tensor<64x1xi32>", "tensor<64x16xbf16>", "tensor<64x1xf32>"],
        ),
    ]
    backward = [
        # send_back's transpose first: 128 received rows back to 64.
        (
            "te_ep_dispatch_bwd_ffi",
            [hm, "tensor<1x128x16xbf16>", "tensor<1x128xf32>"],
        ),
        (
            "te_ep_dispatch_bwd_ffi",
            [hm, "tensor<1x128x16xbf16>", "tensor<1x128xf32>"],
        ),
    ]
    want = {"fwd": send + send_back, "grad": send + send_back + backward}
    for mode, exp in exported.items():
      with self.subTest(mode):
        calls = _ep_calls(exp.mlir_module())
        self.assertEqual([(t, ops) for t, ops, _ in calls], want[mode])
        for target, _, results in calls:
          if target == "te_ep_dispatch_ffi":
            self.assertEqual(
                results, ["tensor<1x128x16xbf16>", "tensor<1x128xf32>"]
            )

  def test_forward_mode_lowers_to_a_second_dispatch(self):
    # jvp: each dispatch's tangent is NCCL-EP's dispatch of the tangent rows
    # on the same routing state (no second prepare, no dispatch backward);
    # a Hessian runs dispatch backward too. Both serialise.
    loss = self._layer_loss("te")
    params, x = _bf16_inputs(self.cfg, self.num_tokens)

    def jvp(params, x):
      tangents = jax.tree.map(jnp.ones_like, (params, x))
      return jax.jvp(loss, (params, x), tangents)

    def hessian(v):
      return jax.hessian(lambda v: loss(params, x * v[0].astype(x.dtype)))(v)

    with (
        _pretend_bootstrapped(self.sizes, self.cfg.hidden_size),
        _te.compute_capability(90),
    ):
      exported = {
          name: jax.export.export(
              jax.jit(fn),
              platforms=["cuda"],
              disabled_checks=_disabled_checks(),
          )(*args)
          for name, fn, args in (
              ("jvp", jvp, self._abstract_inputs()),
              ("hessian", hessian, (jnp.ones((1,), jnp.float32),)),
          )
      }
    hm = f"tensor<1x{_HANDLE_BYTES}xui8>"
    jvp_calls = [
        (t, ops) for t, ops, _ in _ep_calls(exported["jvp"].mlir_module())
    ]
    # send and send_back: one prepare each, two dispatches on its handle.
    for rows in (16, 64):
      idx, data = f"tensor<{rows}x1xi32>", f"tensor<{rows}x16xbf16>"
      dispatch = (
          "te_ep_dispatch_ffi",
          [hm, idx, data, f"tensor<{rows}x1xf32>"],
      )
      with self.subTest(rows=rows):
        self.assertEqual(jvp_calls.count(("te_ep_prepare_ffi", [idx])), 1)
        self.assertEqual(jvp_calls.count(dispatch), 2)
    self.assertNotIn("te_ep_dispatch_bwd_ffi", [t for t, _ in jvp_calls])
    hessian_targets = {
        t for t, _, _ in _ep_calls(exported["hessian"].mlir_module())
    }
    self.assertEqual(
        hessian_targets,
        {"te_ep_prepare_ffi", "te_ep_dispatch_ffi", "te_ep_dispatch_bwd_ffi"},
    )
    for name, exp in exported.items():
      with self.subTest(f"{name} serialises"):
        restored = jax.export.deserialize(exp.serialize())
        self.assertEqual(restored.mlir_module(), exp.mlir_module())


def _disabled_checks():
  return [
      jax.export.DisabledSafetyCheck.custom_call(t)
      for t in _te.custom_call_targets()
  ]


def _ep_calls(module_text):
  """[(target, operand types, result types)] of TE's EP custom calls."""
  calls = []
  for line in module_text.splitlines():
    found = re.search(
        r"custom_call @(te_ep_\w+)\(.*:\s*\((.*?)\)\s*->\s*(.*?)\s*loc", line
    )
    if found:
      target, operands, results = found.groups()
      results = results.strip("()")
      calls.append((target, _types(operands), _types(results)))
  return calls


def _types(text):
  return re.findall(r"tensor<[^>]*>", text)


if __name__ == "__main__":
  absltest.main()
