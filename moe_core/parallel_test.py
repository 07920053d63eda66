"""Tests of moe_core.parallel's layer: chunks, meshes, stages, errors.

Needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8
(set here too when this module is the first to import jax). The conformance
EP suite (conformance/ep_suite.py) checks every backend on the standard
cases; this file checks the layer's options and error paths with "xla".
Elsewhere: parallel/options_test.py (options and buffer sizes, no devices),
parallel/exchange_test.py (the exchanges, bounded buffers, CUDA lowering),
xla_flags_test.py (the GPU XLA flags).
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
from absl.testing import parameterized
import jax

import moe_core
from moe_core import parallel
from moe_core.testing import expert_parallel

P = jax.sharding.PartitionSpec


class ExpertParallelLayerTest(expert_parallel.LayerTestCase):

  def test_chunks_match_single_device_with_gradients(self):
    cfg = expert_parallel.cfg(shared_ffn_size=8)
    params, x = expert_parallel.inputs(cfg, 32, seed=1)
    got = self.run_layer(
        cfg,
        params,
        x,
        grads=True,
        mesh=expert_parallel.mesh((2, 4), ("data", "expert")),
        ep_options=parallel.EPOptions(num_chunks=2),
    )
    self.assertLayerMatches(got, self.run_layer(cfg, params, x, grads=True))

  def test_ragged_layout_with_k_above_local_experts_matches(self):
    # E_l = 1 < K = 3: a token sends at most one copy to a device.
    cfg = expert_parallel.cfg(
        top_k=3, score_func="sigmoid", norm_topk_prob=True
    )
    params, x = expert_parallel.inputs(cfg, 16, seed=2)
    got = self.run_layer(
        cfg,
        params,
        x,
        grads=True,
        mesh=expert_parallel.mesh((8,), ("expert",)),
        data_axes=(),
        ep_options=parallel.EPOptions(exchange="ragged_emulated"),
    )
    self.assertLayerMatches(got, self.run_layer(cfg, params, x, grads=True))

  def test_unnamed_mesh_axis_replicates(self):
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 16, seed=3)
    got = self.run_layer(
        cfg,
        params,
        x,
        mesh=expert_parallel.mesh((2, 4), ("model", "expert")),
        data_axes=(),
    )
    self.assertLayerMatches(got, self.run_layer(cfg, params, x))

  def test_explicit_axis_mesh(self):
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:
      self.skipTest(
          "this jax has no explicit mesh axes (jax.sharding." "AxisType)."
      )
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 32, seed=4)
    mesh = jax.make_mesh(
        (2, 4), ("data", "expert"), axis_types=(axis_type.Explicit,) * 2
    )
    x3 = x.reshape(4, 8, cfg.hidden_size)
    want = self.run_layer(cfg, params, x3)
    # x unsharded, and x split over the data axis only.
    for x_in in (
        x3,
        jax.device_put(x3, jax.sharding.NamedSharding(mesh, P("data"))),
    ):
      y, aux, _ = self.run_layer(cfg, params, x_in, mesh=mesh)
      self.assertEqual(y.shape, x3.shape)
      self.assertLayerMatches((y, aux, None), want)

  def test_stages_compose_inside_a_user_shard_map(self):
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 32, seed=5)
    mesh = expert_parallel.mesh((8,), ("expert",))
    backend = moe_core.get_backend(expert_parallel.BACKEND)

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
    y0, aux0, _ = self.run_layer(cfg, params, x)
    self.assertMatches(y, y0, "y")
    self.assertMatches(loss, aux0.load_balancing_loss, "load_balancing_loss")


class ErrorTest(expert_parallel.DevicesTestCase):

  def test_ep_options_without_mesh(self):
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 8)
    with self.assertRaisesRegex(ValueError, "ep_options needs a mesh"):
      moe_core.moe_layer(params, x, cfg, ep_options=parallel.EPOptions())

  def test_mesh_errors_name_the_argument(self):
    cfg = expert_parallel.cfg()
    params, x = expert_parallel.inputs(cfg, 8)
    mesh = expert_parallel.mesh((2, 4), ("data", "expert"))
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

  @parameterized.named_parameters(
      (
          "experts_must_divide_over_the_expert_axis",
          dict(num_experts=6),
          8,
          r"num_experts=6 must be divisible by the expert axis "
          r"size, got mesh.shape\['expert'\]=4",
      ),
      (
          "tokens_must_split_evenly",
          {},
          12,
          r"the 12 tokens of x \(shape \(12, 16\)\) must split "
          r"evenly over the 8 devices of axes \('data', 'expert'\)",
      ),
  )
  def test_layout_error(self, changes, num_tokens, message):
    cfg = expert_parallel.cfg(**changes)
    params, x = expert_parallel.inputs(cfg, num_tokens)
    mesh = expert_parallel.mesh((2, 4), ("data", "expert"))
    with self.assertRaisesRegex(ValueError, message):
      moe_core.moe_layer(params, x, cfg, mesh=mesh)

  def test_capacity_configs_are_not_supported(self):
    cfg = expert_parallel.cfg(capacity_factor=1.0)
    params, x = expert_parallel.inputs(cfg, 8)
    with self.assertRaisesRegex(
        NotImplementedError,
        r"dropless configs only \(capacity_factor="
        r"None\), got capacity_factor=1.0",
    ):
      moe_core.moe_layer(
          params,
          x,
          cfg,
          mesh=expert_parallel.mesh((8,), ("expert",)),
          data_axes=(),
      )


if __name__ == "__main__":
  absltest.main()
