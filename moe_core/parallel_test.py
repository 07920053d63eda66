"""Tests of moe_core.parallel: buffers, overflow, chunks, meshes, errors.

Needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8
(set here too when this module is the first to import jax). The conformance
EP suite (conformance/ep_suite.py) checks every backend on the standard
cases; this file checks the options and the error paths, with "xla".
"""

import itertools
import math
import os
import subprocess
import sys

if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=8"
  )

# pylint: disable=g-import-not-at-top,g-bad-import-order
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import parallel
from moe_core import xla_flags
from moe_core.testing import cuda_export

P = jax.sharding.PartitionSpec

_DEVICES = 8
_BACKEND = "xla"


def _cfg(**changes):
  base = dict(num_experts=8, top_k=2, hidden_size=16, expert_ffn_size=24)
  base.update(changes)
  return moe_core.MoEConfig(**base)


def _inputs(cfg, num_tokens, seed=0, hot_expert=None):
  """params and x [num_tokens, D] in float32 from a fixed numpy seed.

  hot_expert: every token's best expert (router row 0 is huge for it and
  feature 0 is positive for every token).
  """
  rng = np.random.default_rng(seed)
  params = {}
  for name, shape in moe_core.param_shapes(cfg).items():
    scale = 0.1 if name == "correction_bias" else shape[-2] ** -0.5
    params[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
  x = rng.standard_normal((num_tokens, cfg.hidden_size)).astype(np.float32)
  if hot_expert is not None:
    x[:, 0] = 1.0 + np.abs(x[:, 0])
    params["router"][0, hot_expert] = 40.0
  return {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x)


def _mesh(shape, names):
  return jax.sharding.Mesh(
      np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names
  )


def _max_rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = np.max(np.abs(want))
  return float(np.max(np.abs(got - want)) / (scale if scale else 1.0))


class _DevicesTestCase(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if jax.device_count() < _DEVICES:
      self.skipTest(
          f"needs {_DEVICES} devices, found {jax.device_count()}: set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={_DEVICES} "
          "before jax is imported."
      )


class BufferBoundTest(parameterized.TestCase):

  @parameterized.product(num_experts=[4, 6, 8], ep=[1, 2], top_k=[1, 2, 3])
  def test_safe_slots_is_the_most_one_token_can_send_a_device(
      self, num_experts, ep, top_k
  ):
    if num_experts % ep or top_k > num_experts:
      self.skipTest("not a valid layout")
    local = num_experts // ep
    # Every set of K distinct experts a token could choose; count those on
    # device 0 (experts [0, local)), the same for every device by symmetry.
    most = max(
        sum(e < local for e in chosen)
        for chosen in itertools.combinations(range(num_experts), top_k)
    )
    for tokens in (1, 5):
      self.assertEqual(
          parallel.safe_slots_per_peer(tokens, top_k, local), tokens * most
      )

  def test_bounded_buffers_never_exceed_the_safe_ones(self):
    for factor in (0.25, 1.0, 1.5, 100.0):
      slots, rows = parallel.buffer_sizes(12, 3, 16, 4, factor)
      safe_slots, safe_rows = parallel.buffer_sizes(12, 3, 16, 4, None)
      self.assertLessEqual(slots, safe_slots)
      self.assertLessEqual(rows, safe_rows)
      self.assertGreaterEqual(
          slots, math.ceil(min(factor * 12 * 3 / 4, safe_slots))
      )
    self.assertEqual(
        parallel.buffer_sizes(12, 3, 16, 4, 100.0),
        parallel.buffer_sizes(12, 3, 16, 4, None),
    )


class EmulatedRaggedAllToAllTest(_DevicesTestCase):

  def test_matches_the_jax_docstring_example(self):
    # The example of jax.lax.ragged_all_to_all's docstring (axis size 2).
    mesh = _mesh((2,), ("i",))
    args = dict(
        operand=[[1, 2, 2], [3, 4, 0]],
        output=[[0] * 4, [0] * 4],
        input_offsets=[[0, 1], [0, 1]],
        send_sizes=[[1, 2], [1, 1]],
        output_offsets=[[0, 0], [1, 2]],
        recv_sizes=[[1, 1], [2, 1]],
    )
    args = {k: jnp.asarray(v, jnp.int32).reshape(-1) for k, v in args.items()}

    def body(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
    ):
      return parallel.emulated_ragged_all_to_all(
          operand,
          output,
          input_offsets,
          send_sizes,
          output_offsets,
          recv_sizes,
          axis_name="i",
      )

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False
        )
    )
    got = f(*args.values())
    np.testing.assert_array_equal(
        np.asarray(got).reshape(2, 4), [[1, 3, 0, 0], [2, 2, 4, 0]]
    )


class ExpertParallelLayerTest(_DevicesTestCase):

  def _single(self, cfg, params, x, grads=False):
    return self._run(cfg, params, x, grads=grads)

  def _run(self, cfg, params, x, grads=False, **kwargs):
    cotangent = jnp.asarray(
        np.random.default_rng(9).standard_normal(x.shape).astype(np.float32)
    )

    def loss(params, x):
      y, aux = moe_core.moe_layer(params, x, cfg, backend=_BACKEND, **kwargs)
      return (
          jnp.sum(y.astype(jnp.float32) * cotangent)
          + aux.load_balancing_loss
          + 0.1 * aux.router_z_loss
      ), (y, aux)

    if not grads:
      return jax.jit(lambda p, x: loss(p, x)[1])(params, x) + (None,)
    (_, (y, aux)), g = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    )(params, x)
    return y, aux, g

  def assertMatches(self, got, want, what, tol=1e-5):
    err = _max_rel_err(got, want)
    self.assertLessEqual(
        err,
        tol,
        f"{what}: max error {err} (relative to " "the largest expected value)",
    )

  def assertLayerMatches(self, got, want):
    y, aux, grads = got
    y0, aux0, grads0 = want
    self.assertMatches(y, y0, "y")
    np.testing.assert_array_equal(aux.expert_ids, aux0.expert_ids)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux0.tokens_per_expert)
    for name in ("load_balancing_loss", "router_z_loss", "combine_weights"):
      self.assertMatches(getattr(aux, name), getattr(aux0, name), name)
    self.assertEqual(int(aux.dropped_tokens), 0)
    if grads0 is not None:
      for (name, g), g0 in zip(grads[0].items(), grads0[0].values()):
        self.assertMatches(g, g0, f"d {name}", 5e-5)
      self.assertMatches(grads[1], grads0[1], "d x", 5e-5)

  def test_chunks_match_single_device_with_gradients(self):
    cfg = _cfg(shared_ffn_size=8)
    params, x = _inputs(cfg, 32, seed=1)
    got = self._run(
        cfg,
        params,
        x,
        grads=True,
        mesh=_mesh((2, 4), ("data", "expert")),
        ep_options=parallel.EPOptions(num_chunks=2),
    )
    self.assertLayerMatches(got, self._single(cfg, params, x, grads=True))

  def test_ragged_layout_with_k_above_local_experts_matches(self):
    # E_l = 1 < K = 3: a token sends at most one copy to a device.
    cfg = _cfg(top_k=3, score_func="sigmoid", norm_topk_prob=True)
    params, x = _inputs(cfg, 16, seed=2)
    got = self._run(
        cfg,
        params,
        x,
        grads=True,
        mesh=_mesh((8,), ("expert",)),
        data_axes=(),
        ep_options=parallel.EPOptions(exchange="ragged_emulated"),
    )
    self.assertLayerMatches(got, self._single(cfg, params, x, grads=True))

  def test_unnamed_mesh_axis_replicates(self):
    cfg = _cfg()
    params, x = _inputs(cfg, 16, seed=3)
    got = self._run(
        cfg, params, x, mesh=_mesh((2, 4), ("model", "expert")), data_axes=()
    )
    self.assertLayerMatches(got, self._single(cfg, params, x))

  def test_explicit_axis_mesh(self):
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:
      self.skipTest(
          "this jax has no explicit mesh axes (jax.sharding." "AxisType)."
      )
    cfg = _cfg()
    params, x = _inputs(cfg, 32, seed=4)
    mesh = jax.make_mesh(
        (2, 4), ("data", "expert"), axis_types=(axis_type.Explicit,) * 2
    )
    x3 = x.reshape(4, 8, cfg.hidden_size)
    want = self._single(cfg, params, x3)
    # x unsharded, and x split over the data axis only.
    for x_in in (
        x3,
        jax.device_put(x3, jax.sharding.NamedSharding(mesh, P("data"))),
    ):
      y, aux, _ = self._run(cfg, params, x_in, mesh=mesh)
      self.assertEqual(y.shape, x3.shape)
      self.assertLayerMatches((y, aux, None), want)

  def test_stages_compose_inside_a_user_shard_map(self):
    cfg = _cfg()
    params, x = _inputs(cfg, 32, seed=5)
    mesh = _mesh((8,), ("expert",))
    backend = moe_core.get_backend(_BACKEND)

    def body(params, x):
      aux = parallel.route(x, params["router"], cfg, token_axes=("expert",))
      d = parallel.dispatch(x, aux.expert_ids, cfg, expert_axis="expert")
      out = backend.expert_ffn(d.rows, d.group_sizes, params, cfg)
      y = parallel.combine(out, d, aux.combine_weights, expert_axis="expert")
      return y, aux.load_balancing_loss

    specs = parallel.param_specs(cfg)
    y, loss = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, P("expert")),
            out_specs=(P("expert"), P()),
            check_vma=False,
        )
    )(params, x)
    y0, aux0, _ = self._single(cfg, params, x)
    self.assertMatches(y, y0, "y")
    self.assertMatches(loss, aux0.load_balancing_loss, "load_balancing_loss")

  @parameterized.named_parameters(
      ("padded", "padded"), ("ragged", "ragged_emulated")
  )
  def test_dispatched_rows_past_the_groups_are_zero(self, exchange):
    """The receive rows no peer fills come out as zeros, not buffer garbage.

    Drop-free buffers hold the worst case, so every device has such rows.
    (jnp.zeros and jnp.empty are both zeros on the CPU;
    test_ragged_exchange_lowers_for_gpu rules out uninitialised buffers.)
    """
    cfg = _cfg()
    params, x = _inputs(cfg, 32, seed=8)
    x = x + jnp.sign(x)  # Every real entry is non-zero; routing as random.
    mesh = _mesh((8,), ("expert",))

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
    for device in range(_DEVICES):
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
    cfg = _cfg(top_k=1)
    num_tokens, ep, factor = 32, 8, 2.0
    params, x = _inputs(cfg, num_tokens, seed=6, hot_expert=3)
    y, aux, _ = self._run(
        cfg,
        params,
        x,
        mesh=_mesh((ep,), ("expert",)),
        data_axes=(),
        ep_options=parallel.EPOptions(
            exchange=exchange, buffer_factor=factor, overflow="drop"
        ),
    )
    y0, aux0, _ = self._single(cfg, params, x)
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
    cfg = _cfg(top_k=1)
    params, x = _inputs(cfg, 32, seed=6, hot_expert=3)
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
        y, _, g = self._run(
            cfg,
            params,
            x,
            grads=grads,
            mesh=_mesh((8,), ("expert",)),
            data_axes=(),
            ep_options=parallel.EPOptions(buffer_factor=2.0),
        )
        jax.block_until_ready((y, g))
    # With room for all 4 copies per source (ceil(8 * 4 / 8) = 4 slots), the
    # same bounded layer runs and matches one device.
    got = self._run(
        cfg,
        params,
        x,
        mesh=_mesh((8,), ("expert",)),
        data_axes=(),
        ep_options=parallel.EPOptions(buffer_factor=8.0),
    )
    self.assertLayerMatches(got, self._single(cfg, params, x))

  def test_ragged_exchange_lowers_for_gpu(self):
    cfg = _cfg()
    params, x = _inputs(cfg, 32, seed=7)
    mesh = _mesh((8,), ("expert",))

    def loss(params, x):
      y, _ = moe_core.moe_layer(
          params,
          x,
          cfg,
          backend=_BACKEND,
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


class ErrorTest(_DevicesTestCase):

  def test_ep_options_without_mesh(self):
    cfg = _cfg()
    params, x = _inputs(cfg, 8)
    with self.assertRaisesRegex(ValueError, "ep_options needs a mesh"):
      moe_core.moe_layer(params, x, cfg, ep_options=parallel.EPOptions())

  def test_mesh_errors_name_the_argument(self):
    cfg = _cfg()
    params, x = _inputs(cfg, 8)
    mesh = _mesh((2, 4), ("data", "expert"))
    cases = [
        (
            dict(expert_axis="experts"),
            ValueError,
            r"expert_axis='experts' is not an axis of the mesh; mesh axes are "
            r"\('data', 'expert'\)",
        ),
        (
            dict(data_axes=("batch",)),
            ValueError,
            r"data_axes=\('batch',\) names axes \['batch'\] the mesh lacks",
        ),
        (
            dict(data_axes="data"),
            TypeError,
            r"data_axes must be a sequence of axis names, got the string",
        ),
        (
            dict(data_axes=("expert",)),
            ValueError,
            r"data_axes must be distinct and exclude expert_axis",
        ),
    ]
    for kwargs, error, message in cases:
      with self.subTest(str(kwargs)), self.assertRaisesRegex(error, message):
        moe_core.moe_layer(params, x, cfg, mesh=mesh, **kwargs)

  def test_experts_must_divide_over_the_expert_axis(self):
    cfg = _cfg(num_experts=6)
    params, x = _inputs(cfg, 8)
    with self.assertRaisesRegex(
        ValueError,
        r"num_experts=6 must be divisible by the expert axis "
        r"size, got mesh.shape\['expert'\]=4",
    ):
      moe_core.moe_layer(params, x, cfg, mesh=_mesh((2, 4), ("data", "expert")))

  def test_tokens_must_split_evenly(self):
    cfg = _cfg()
    params, x = _inputs(cfg, 12)
    with self.assertRaisesRegex(
        ValueError,
        r"the 12 tokens of x \(shape \(12, 16\)\) must split "
        r"evenly over the 8 devices of axes \('data', 'expert'\)",
    ):
      moe_core.moe_layer(params, x, cfg, mesh=_mesh((2, 4), ("data", "expert")))

  def test_capacity_configs_are_not_supported(self):
    cfg = _cfg(capacity_factor=1.0)
    params, x = _inputs(cfg, 8)
    with self.assertRaisesRegex(
        NotImplementedError,
        r"dropless configs only \(capacity_factor="
        r"None\), got capacity_factor=1.0",
    ):
      moe_core.moe_layer(
          params, x, cfg, mesh=_mesh((8,), ("expert",)), data_axes=()
      )

  def test_options_are_validated(self):
    cases = [
        (dict(exchange="nccl"), r"exchange must be one of .*got 'nccl'"),
        (dict(overflow="ignore"), r"overflow must be one of .*got 'ignore'"),
        (
            dict(buffer_factor=0),
            r"buffer_factor must be None \(drop-free\) "
            r"or a finite number > 0, got 0",
        ),
        (dict(num_chunks=0), r"num_chunks must be a positive int, got 0"),
    ]
    for kwargs, message in cases:
      with (
          self.subTest(str(kwargs)),
          self.assertRaisesRegex(ValueError, message),
      ):
        parallel.EPOptions(**kwargs)


class XlaFlagsTest(absltest.TestCase):

  def _start_jax(self, flags: str):
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import jax.numpy as jnp; print(float((jnp.ones(3) * 2).sum()))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

  def test_this_jaxlib_accepts_every_flag(self):
    # XLA parses every GPU flag on any platform and aborts on unknown ones.
    done = self._start_jax(xla_flags.format_flags(xla_flags.gpu_ep_flags()))
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertEqual(done.stdout.strip(), "6.0")

  def test_an_unknown_flag_is_rejected(self):
    # The control for the test above: the check does catch a bad flag.
    done = self._start_jax("--xla_gpu_no_such_flag_for_moe=true")
    self.assertNotEqual(done.returncode, 0)
    self.assertIn("Unknown flag", done.stderr)

  def test_merge_keeps_flags_the_user_set(self):
    env = {
        "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false "
        "--xla_dump_to=/tmp/d"
    }
    merged = xla_flags.apply_gpu_ep_flags(environ=env)
    self.assertEqual(merged, env["XLA_FLAGS"])
    parts = merged.split()
    self.assertIn("--xla_gpu_enable_latency_hiding_scheduler=false", parts)
    self.assertNotIn("--xla_gpu_enable_latency_hiding_scheduler=true", parts)
    self.assertIn("--xla_dump_to=/tmp/d", parts)
    names = [p.split("=")[0] for p in parts]
    self.assertLen(set(names), len(names))
    for flag in xla_flags.gpu_ep_flags():
      self.assertIn(f"--{flag.name}", names)

  def test_every_flag_is_explained(self):
    text = xla_flags.explain()
    for flag in xla_flags.gpu_ep_flags():
      self.assertIn(f"--{flag.name}={flag.value}", text)
      self.assertGreater(len(flag.why), 30)


if __name__ == "__main__":
  absltest.main()
