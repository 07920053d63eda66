"""moe_core.router_weights: finite weights where the chosen scores underflow."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import router_weights
from moe_core import routing
from moe_core.testing import routing_cases


class ExtremeLogitsTest(parameterized.TestCase):
  """Finite logits give finite weights, probabilities and losses
  (docs/api.md, "Guarantees"): where the scores underflow to 0 the
  renormalisation is computed from their logs (`router_weights.renormalise`)."""

  def assertCounted(self, aux, cfg, num_tokens):
    self.assertEqual(int(aux.invalid_assignments), 0)
    self.assertEqual(
        int(aux.kept.sum()) + int(aux.dropped_tokens),
        num_tokens * cfg.top_k,
        "kept + dropped + invalid != T*K",
    )

  def assertAllFinite(self, aux):
    for name in (
        "router_probs",
        "combine_weights",
        "load_balancing_loss",
        "router_z_loss",
    ):
      value = np.asarray(getattr(aux, name))
      self.assertTrue(np.all(np.isfinite(value)), f"aux.{name} = {value}")

  @parameterized.named_parameters(
      ("epsilon_0", 0.0),
      ("epsilon_1e-20", 1e-20),
      ("epsilon_1e-6", 1e-6),
  )
  def test_sigmoid_scores_that_all_underflow(self, epsilon):
    # sigmoid(l) is 0 in float32 for l below about -104: the plain
    # w / (sum(w) + 0) was 0/0 = NaN with the token still counted as kept.
    cfg = routing_cases.small_cfg(
        score_func="sigmoid", norm_topk_prob=True, norm_epsilon=epsilon
    )
    logits = np.array(
        [
            [-200.0, -201.0, -300.0, -300.0, -300.0, -300.0, -300.0, -300.0],
            -1e4 - np.arange(8.0),
            -105.0 - np.arange(8.0),
        ],
        np.float32,
    )
    aux = routing_cases.route_logits(logits, cfg)
    self.assertAllFinite(aux)
    self.assertCounted(aux, cfg, 3)
    # The weights are the exact ratios of the (underflowed) scores: for
    # l << 0, log sigmoid(l) = l, a softmax over the chosen logits.
    chosen = np.take_along_axis(
        logits.astype(np.float64), np.asarray(aux.expert_ids), -1
    )
    ratios = np.exp(chosen - chosen.max(-1, keepdims=True))
    ratios /= ratios.sum(-1, keepdims=True)
    if epsilon == 0:
      np.testing.assert_allclose(aux.combine_weights, ratios, rtol=1e-6)
    else:
      # w / (sum + epsilon) with sum < 1e-44: the weights shrink towards 0.
      np.testing.assert_array_less(np.asarray(aux.combine_weights), 1e-20)
    # The load-balancing probabilities are the normalised scores too.
    np.testing.assert_allclose(aux.router_probs.sum(-1), 1.0, rtol=1e-6)

  def test_softmax_scores_a_bias_chose_over_the_best(self):
    # The bias makes the experts whose probability underflows to 0 win:
    # their renormalised weights were 0/0.
    cfg = routing_cases.small_cfg(
        score_func="softmax", correction_bias=True, norm_topk_prob=True
    )
    logits = np.full((2, 8), -1e4, np.float32)
    logits[:, 0] = 1e4
    logits[1, 1:] -= np.arange(7.0)
    bias = jnp.zeros(8).at[0].set(-5.0)
    aux = routing_cases.route_logits(logits, cfg, bias)
    self.assertAllFinite(aux)
    self.assertCounted(aux, cfg, 2)
    self.assertFalse(np.any(np.asarray(aux.expert_ids) == 0))
    # Token 0: a tie among the chosen; token 1: logits 1 apart.
    np.testing.assert_allclose(aux.combine_weights[0], [0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(
        aux.combine_weights[1],
        [1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))],
        rtol=1e-6,
    )

  @parameterized.named_parameters(
      ("softmax", dict()),
      ("softmax_bias", dict(correction_bias=True)),
      ("sigmoid", dict(score_func="sigmoid")),
      ("sigmoid_bias", dict(score_func="sigmoid", correction_bias=True)),
      (
          "deepseek_v3_groups",
          dict(
              num_experts=16,
              top_k=4,
              n_group=4,
              topk_group=2,
              group_score="sum_top2",
              score_func="sigmoid",
              correction_bias=True,
              routed_scaling_factor=2.5,
          ),
      ),
      (
          "groups_max_softmax_bias",
          dict(
              num_experts=16,
              top_k=3,
              n_group=4,
              topk_group=2,
              group_score="max",
              correction_bias=True,
          ),
      ),
  )
  def test_extreme_finite_logits_and_gradients_are_finite(self, fields):
    for norm, epsilon in ((False, 0.0), (True, 0.0), (True, 1e-20)):
      cfg = routing_cases.small_cfg(
          norm_topk_prob=norm, norm_epsilon=epsilon, **fields
      )
      e = cfg.num_experts
      cfg = cfg.replace(hidden_size=e)  # x = the logits, router = I.
      rng = np.random.default_rng(0)
      one_hot = np.full(e, -1e4)
      one_hot[e // 2] = 1e4
      logits = np.stack(
          [
              np.full(e, -1e4),  # All equal, all underflowing.
              -1e4 + rng.standard_normal(e),
              -110.0 - rng.uniform(0, 5, e),  # Just past sigmoid's underflow.
              np.full(e, 1e4),  # All saturate: sigmoid 1, softmax 1/E.
              one_hot,
              1e4 * np.sign(rng.standard_normal(e)),
              np.zeros(e),
              1e-30 * rng.standard_normal(e),
          ]
      ).astype(np.float32)
      bias = None
      if cfg.correction_bias:
        # Large enough to overrule the scores in [0, 1] everywhere.
        bias = jnp.asarray(3.0 * rng.standard_normal(e), jnp.float32)

      def loss(x, router, cfg=cfg, bias=bias):
        aux = routing.route(x, router, cfg, bias)
        return (
            jnp.sum(aux.combine_weights * jnp.arange(cfg.top_k))
            + aux.load_balancing_loss
            + 1e-9 * aux.router_z_loss,
            aux,
        )

      x = jnp.asarray(logits)
      router = jnp.eye(e, dtype=jnp.float32)
      (_, aux), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(
          x, router
      )
      with self.subTest(norm_topk_prob=norm, norm_epsilon=epsilon):
        self.assertAllFinite(aux)
        self.assertCounted(aux, cfg, len(logits))
        for g in grads:
          self.assertTrue(np.all(np.isfinite(g)), f"gradient {g}")
        if norm and epsilon == 0:
          np.testing.assert_allclose(
              aux.combine_weights.sum(-1) / cfg.routed_scaling_factor,
              1.0,
              rtol=1e-6,
          )


class RenormaliseTest(parameterized.TestCase):

  @parameterized.parameters(0.0, 1e-20, 0.5)
  def test_equals_the_quotient_where_it_is_defined(self, epsilon):
    rng = np.random.default_rng(1)
    w = rng.uniform(1e-3, 1.0, (16, 4))
    got = router_weights.renormalise(
        jnp.asarray(np.log(w), jnp.float32),
        math.log(epsilon) if epsilon else None,
    )
    np.testing.assert_allclose(
        got, w / (w.sum(-1, keepdims=True) + epsilon), rtol=2e-6
    )

  def test_underflowing_scores_keep_their_ratios(self):
    # exp(-1e4) is 0 even in float64; the logs are not.
    logs = np.asarray([[-1e4, -1e4 - math.log(3.0)]], np.float32)
    got = router_weights.renormalise(jnp.asarray(logs))
    gap = float(logs[0, 0]) - float(logs[0, 1])  # log 3, to float32's ulp.
    np.testing.assert_allclose(
        got, [[1 / (1 + math.exp(-gap)), 1 / (1 + math.exp(gap))]], rtol=1e-6
    )
    got = router_weights.renormalise(
        jnp.asarray([[-1e4, -1e4]]), log_epsilon=math.log(1e-20)
    )
    np.testing.assert_array_equal(got, [[0.0, 0.0]])


if __name__ == "__main__":
  absltest.main()
