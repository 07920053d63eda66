"""moe_core.zero_experts through moe_layer: chosen, they add x or nothing."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core.testing import routing_cases


class ZeroExpertTest(parameterized.TestCase):
  """Zero experts through moe_layer: chosen, they add x (or nothing)."""

  @parameterized.parameters("identity", "zero")
  def test_tokens_choosing_only_zero_experts(self, output):
    cfg = routing_cases.small_cfg(
        num_experts=4, top_k=2, num_zero_experts=2, zero_expert_output=output
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    self.assertEqual(params["router"].shape, (routing_cases.D, 6))
    x, _, _ = routing_cases.inputs(cfg, seed=19)
    # Token t < 12 prefers the zero experts 4 and 5, the rest expert 0, 1.
    prefer = np.zeros((routing_cases.T, 6), np.float32)
    prefer[:12, 4:] = 1.0
    prefer[12:, :2] = 1.0
    x = jnp.concatenate([x[:, :10], jnp.asarray(prefer)], axis=1)
    router = np.zeros((routing_cases.D, 6), np.float32)
    router[10:, :] = 50.0 * np.eye(6)
    params["router"] = jnp.asarray(router)
    y, aux = moe_core.moe_layer(params, x, cfg, backend="xla")
    np.testing.assert_array_equal(aux.expert_ids[:12] >= 4, True)
    np.testing.assert_array_equal(aux.expert_ids[12:] < 4, True)
    self.assertEqual(int(aux.tokens_per_expert[4:].sum()), 24)
    self.assertEqual(int(aux.kept.sum()), routing_cases.T * 2)
    total = np.asarray(aux.combine_weights[:12]).sum(-1, keepdims=True)
    want = total * np.asarray(x[:12]) if output == "identity" else 0.0
    np.testing.assert_allclose(y[:12], want, rtol=1e-6, atol=0)
    # The others went through their FFN experts, as without zero experts.
    plain = cfg.replace(num_zero_experts=0)
    plain_params = dict(params, router=params["router"][:, :4])
    y_plain, _ = moe_core.moe_layer(plain_params, x[12:], plain, "xla")
    np.testing.assert_allclose(y[12:], y_plain, rtol=1e-6)

  def test_refuses_capacity_and_groups(self):
    for field, value in (("capacity_factor", 1.0), ("n_group", 2)):
      with self.subTest(field):
        with self.assertRaisesRegex(
            ValueError, f"num_zero_experts > 0 needs.*{field}"
        ):
          routing_cases.small_cfg(num_zero_experts=2, **{field: value})


if __name__ == "__main__":
  absltest.main()
