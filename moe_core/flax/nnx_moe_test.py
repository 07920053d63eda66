"""The Flax modules compute exactly what moe_core.moe_layer computes."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import errors as flax_errors
from flax import nnx

import moe_core
from moe_core import flax as moe_flax
from moe_core import params as params_lib

# DeepSeek-V3 routing (bias, groups, scaling) plus a gated shared expert, so
# every parameter of the layout is exercised.
CFG = moe_core.MoEConfig(
    num_experts=8,
    top_k=2,
    hidden_size=16,
    expert_ffn_size=24,
    score_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    correction_bias=True,
    n_group=4,
    topk_group=2,
    group_score="sum_top2",
    shared_ffn_size=16,
    shared_expert_gate=True,
)


def _tokens(dtype, shape=(3, 5, 16)):
  return jax.random.normal(jax.random.key(7), shape, jnp.float32).astype(dtype)


class NnxMoETest(parameterized.TestCase):

  def test_owns_the_library_layout(self):
    layer = moe_flax.MoE(CFG, rngs=nnx.Rngs(0))
    shapes = {k: tuple(v.shape) for k, v in layer.params_dict().items()}
    self.assertEqual(shapes, moe_core.param_shapes(CFG))
    self.assertIsInstance(layer.correction_bias, moe_flax.CorrectionBias)
    self.assertEqual(layer.correction_bias[...].dtype, jnp.float32)
    trainable = nnx.state(layer, nnx.Param)
    self.assertNotIn("correction_bias", trainable)

  @parameterized.parameters("float32", "bfloat16")
  def test_output_equals_moe_layer(self, dtype):
    layer = moe_flax.MoE(CFG, backend="xla", rngs=nnx.Rngs(0))
    # A non-zero bias, so it visibly takes part in routing.
    moe_flax.set_value(layer.correction_bias, jnp.linspace(-0.3, 0.3, 8))
    x = _tokens(dtype)
    y, aux = layer(x)
    y_ref, aux_ref = moe_core.moe_layer(
        layer.params_dict(), x, CFG, backend="xla"
    )
    self.assertEqual(y.dtype, jnp.dtype(dtype))
    np.testing.assert_array_equal(
        np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    )
    np.testing.assert_array_equal(aux.expert_ids, aux_ref.expert_ids)

  def test_on_a_mesh_equals_one_device(self):
    # Experts split over expert=4, tokens over data=2 x expert=4: the same
    # parameters give the one-device result (float32: only sums reorder).
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert")
    )
    layer = moe_flax.MoE(CFG, backend="xla", rngs=nnx.Rngs(0))
    on_mesh = moe_flax.MoE(CFG, backend="xla", rngs=nnx.Rngs(0), mesh=mesh)
    x = _tokens(jnp.float32, shape=(4, 8, 16))
    y, aux = layer(x)
    y_mesh, aux_mesh = on_mesh(x)
    np.testing.assert_allclose(y_mesh, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        aux_mesh.tokens_per_expert, aux.tokens_per_expert
    )

  def test_matches_reference_backend(self):
    layer = moe_flax.MoE(CFG, backend="xla", rngs=nnx.Rngs(1))
    x = _tokens(jnp.float32)
    y, _ = layer(x)
    y_ref, _ = moe_core.moe_layer(
        layer.params_dict(), x, CFG, backend="reference"
    )
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)

  def test_gradients_equal_moe_layer_and_skip_bias(self):
    layer = moe_flax.MoE(CFG, backend="xla", rngs=nnx.Rngs(2))
    x = _tokens(jnp.float32)

    def module_loss(m):
      return jnp.sum(m(x)[0] ** 2)

    grads = nnx.grad(module_loss)(layer)  # Differentiates nnx.Param only.
    params = layer.params_dict()
    ref = jax.grad(
        lambda p: jnp.sum(moe_core.moe_layer(p, x, CFG, backend="xla")[0] ** 2)
    )(params)
    self.assertNotIn("correction_bias", grads)
    np.testing.assert_array_equal(ref["correction_bias"], 0.0)
    for name in moe_core.param_shapes(CFG):
      if name == "correction_bias":
        continue
      with self.subTest(name):
        np.testing.assert_allclose(
            grads[name][...], ref[name], rtol=1e-5, atol=1e-6
        )

  def test_bias_update_follows_the_rule(self):
    layer = moe_flax.MoE(CFG, rngs=nnx.Rngs(3))
    load = jnp.array([9, 1, 4, 4, 0, 12, 2, 0], jnp.int32)
    layer.update_correction_bias(load, 0.25)
    # mean load 4: above -> -rate, below -> +rate, equal -> 0.
    want = 0.25 * np.array([-1, 1, 0, 0, 1, -1, 1, 1], np.float32)
    np.testing.assert_array_equal(layer.correction_bias[...], want)
    self.assertEqual(layer.correction_bias[...].dtype, jnp.float32)

  def test_hash_routing_takes_token_ids_and_keeps_the_table_untrained(self):
    # DeepSeek-V4's hash layers: experts from a table indexed by token id.
    cfg = CFG.replace(
        correction_bias=False,
        n_group=1,
        topk_group=1,
        group_score="max",
        hash_vocab_size=11,
    )
    layer = moe_flax.MoE(cfg, backend="xla", rngs=nnx.Rngs(0))
    self.assertIsInstance(layer.hash_table, moe_flax.HashTable)
    # Routing state, like the bias: kept apart from what the optimiser sees.
    self.assertIsInstance(layer.hash_table, moe_flax.CorrectionBias)
    self.assertNotIn("hash_table", nnx.state(layer, nnx.Param))
    x = _tokens("float32")
    token_ids = jnp.arange(15, dtype=jnp.int32).reshape(3, 5) % 11
    y, aux = layer(x, token_ids=token_ids)
    y_ref, _ = moe_core.moe_layer(
        layer.params_dict(), x, cfg, backend="xla", token_ids=token_ids
    )
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    table = np.asarray(layer.hash_table[...])
    np.testing.assert_array_equal(
        np.sort(np.asarray(aux.expert_ids), axis=-1),
        np.sort(table[np.asarray(token_ids).reshape(-1)], axis=-1),
    )
    with self.assertRaisesRegex(ValueError, "token_ids"):
      layer(x)

  def test_update_without_bias_is_a_noop(self):
    cfg = CFG.replace(correction_bias=False)
    layer = moe_flax.MoE(cfg, rngs=nnx.Rngs(3))
    layer.update_correction_bias(jnp.ones(8, jnp.int32), 0.1)
    self.assertFalse(hasattr(layer, "correction_bias"))


class LinenMoETest(absltest.TestCase):

  def test_linen_equals_moe_layer_with_the_same_params(self):
    module = moe_flax.LinenMoE(CFG, backend="xla")
    x = _tokens(jnp.float32)
    variables = module.init(jax.random.key(0), x)
    params = dict(variables["params"])
    params["correction_bias"] = variables["moe_state"]["correction_bias"]
    self.assertEqual(
        {k: tuple(v.shape) for k, v in params.items()},
        moe_core.param_shapes(CFG),
    )
    y, _ = module.apply(variables, x)
    y_ref, _ = moe_core.moe_layer(params, x, CFG, backend="xla")
    np.testing.assert_array_equal(y, y_ref)

  def test_linen_hash_routing_keeps_the_table_in_moe_state(self):
    # As the nnx module: token_ids in, the int32 table routing state (not a
    # trainable float param, on which init used to fail).
    cfg = CFG.replace(
        correction_bias=False,
        n_group=1,
        topk_group=1,
        group_score="max",
        hash_vocab_size=11,
    )
    module = moe_flax.LinenMoE(cfg, backend="xla")
    x = _tokens(jnp.float32)
    token_ids = jnp.arange(15, dtype=jnp.int32).reshape(3, 5) % 11
    variables = module.init(jax.random.key(0), x, token_ids)
    self.assertNotIn("hash_table", variables["params"])
    table = variables["moe_state"]["hash_table"]
    self.assertEqual(table.dtype, jnp.int32)
    (y, _), updated = module.apply(
        variables, x, token_ids, update_bias_rate=0.5, mutable=["moe_state"]
    )
    np.testing.assert_array_equal(updated["moe_state"]["hash_table"], table)
    params = dict(variables["params"], hash_table=table)
    y_ref, _ = moe_core.moe_layer(
        params, x, cfg, backend="xla", token_ids=token_ids
    )
    np.testing.assert_array_equal(y, y_ref)
    with self.assertRaisesRegex(ValueError, "token_ids must be given"):
      module.apply(variables, x)

  def test_linen_starts_router_biases_at_0_and_scales_at_1(self):
    cfg = CFG.replace(
        router_bias=True,
        router_input_norm=True,
        expert_input_norm=True,
        expert_output_scale=True,
        output_bias=True,
        output_norm=True,
        expert_latent_size=8,
        latent_norm=True,
        post_expert_norm=True,
        latent_bias=True,
        shared_ffn_size=8,
        shared_expert_bias=True,
    )
    variables = moe_flax.LinenMoE(cfg).init(
        jax.random.key(0), _tokens(jnp.float32)
    )
    for name, start in params_lib.CONSTANT_INIT.items():
      np.testing.assert_array_equal(variables["params"][name], start)
    layer = moe_flax.MoE(cfg, rngs=nnx.Rngs(0))
    for name, start in params_lib.CONSTANT_INIT.items():
      np.testing.assert_array_equal(getattr(layer, name)[...], start)

  def test_linen_updates_bias_when_mutable(self):
    module = moe_flax.LinenMoE(CFG, backend="xla")
    x = _tokens(jnp.float32)
    variables = module.init(jax.random.key(0), x)
    (_, aux), updated = module.apply(
        variables, x, update_bias_rate=0.5, mutable=["moe_state"]
    )
    want = moe_core.update_correction_bias(
        jnp.zeros(8, jnp.float32), aux.tokens_per_expert, 0.5
    )
    np.testing.assert_array_equal(updated["moe_state"]["correction_bias"], want)

  def test_linen_bias_update_without_mutable_state_raises(self):
    # Before: apply returned as if it had stepped the bias, and nothing
    # changed. Linen raises for any write to an immutable collection.
    module = moe_flax.LinenMoE(CFG, backend="xla")
    x = _tokens(jnp.float32)
    variables = module.init(jax.random.key(0), x)
    for mutable in (False, ["params"]):
      with (
          self.subTest(mutable=mutable),
          self.assertRaisesRegex(
              flax_errors.ModifyScopeVariableError,
              r"^LinenMoE: update_bias_rate=0.1 steps the correction bias "
              r'in collection "moe_state", which this apply\(\) holds '
              r'immutable: pass mutable=\["moe_state"\]',
          ),
      ):
        module.apply(variables, x, update_bias_rate=0.1, mutable=mutable)
    self.assertIsInstance(
        moe_flax.ImmutableBiasError(0.1), flax_errors.ModifyScopeVariableError
    )
    # Without update_bias_rate, or with mutable state, no error.
    module.apply(variables, x)
    module.apply(variables, x, update_bias_rate=0.1, mutable=True)

  def test_linen_on_a_mesh_equals_one_device(self):
    # As the nnx module's test: experts split over expert=4, tokens over
    # data=2 x expert=4; the same variables give the one-device result.
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert")
    )
    module = moe_flax.LinenMoE(CFG, backend="xla")
    on_mesh = moe_flax.LinenMoE(
        CFG,
        backend="xla",
        mesh=mesh,
        expert_axis="expert",
        data_axes=("data",),
    )
    x = _tokens(jnp.float32, shape=(4, 8, 16))
    variables = module.init(jax.random.key(0), x)
    mesh_variables = on_mesh.init(jax.random.key(0), x)
    for a, b in zip(
        jax.tree.leaves(variables), jax.tree.leaves(mesh_variables)
    ):
      np.testing.assert_array_equal(a, b)
    (y, aux), state = module.apply(
        variables, x, update_bias_rate=0.5, mutable=["moe_state"]
    )
    (y_mesh, aux_mesh), mesh_state = on_mesh.apply(
        variables, x, update_bias_rate=0.5, mutable=["moe_state"]
    )
    np.testing.assert_allclose(y_mesh, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        aux_mesh.tokens_per_expert, aux.tokens_per_expert
    )
    np.testing.assert_array_equal(
        mesh_state["moe_state"]["correction_bias"],
        state["moe_state"]["correction_bias"],
    )


if __name__ == "__main__":
  absltest.main()
