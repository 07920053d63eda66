"""moe_core.score_functions against their formulas, and routes that use them."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import routing
from moe_core import score_functions
from moe_core.testing import routing_cases


class ScoreFunctionTest(parameterized.TestCase):
  """Each score function against its formula; choices against a top-k."""

  @parameterized.named_parameters(
      ("softmax", "softmax", lambda l: np.exp(l) / np.exp(l).sum(-1)[:, None]),
      ("sigmoid", "sigmoid", lambda l: 1 / (1 + np.exp(-l))),
      ("sqrtsoftplus", "sqrtsoftplus", lambda l: np.sqrt(np.log1p(np.exp(l)))),
  )
  def test_scores_match_formula(self, name, formula):
    fn = score_functions.SCORE_FUNCTIONS[name]
    logits = np.linspace(-20.0, 20.0, 41).reshape(1, -1)
    got = np.asarray(fn.scores(jnp.asarray(logits, jnp.float32)))
    np.testing.assert_allclose(got, formula(logits), rtol=2e-6, atol=1e-30)
    log_got = np.asarray(fn.log_scores(jnp.asarray(logits, jnp.float32)))
    np.testing.assert_allclose(log_got, np.log(formula(logits)), atol=2e-5)

  def test_log_sqrt_softplus_is_finite_where_the_score_underflows(self):
    logits = jnp.asarray([-1e4, -200.0, -104.0, -31.0, -29.0], jnp.float32)
    grad = jax.grad(lambda l: score_functions.log_sqrt_softplus(l).sum())(
        logits
    )
    self.assertTrue(np.all(np.isfinite(np.asarray(grad))))
    # log(sqrt(log1p(e^l))) = l / 2 to float32 for l << 0.
    np.testing.assert_allclose(
        np.asarray(score_functions.log_sqrt_softplus(logits)),
        0.5 * np.asarray(logits, np.float64),
        rtol=1e-6,
    )

  @parameterized.parameters(("sqrtsoftplus", False), ("sqrtsoftplus", True))
  def test_sqrtsoftplus_route_is_top_k_of_logits(self, name, norm):
    cfg = routing_cases.small_cfg(top_k=3, score_func=name, norm_topk_prob=norm)
    x, router, _ = routing_cases.inputs(cfg, seed=11)
    aux = routing.route(x, router, cfg)
    logits = routing_cases.float64_logits(cfg, seed=11)
    ids = routing_cases.plain_top_k(logits, 3)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    w = np.sqrt(np.log1p(np.exp(np.take_along_axis(logits, ids, axis=-1))))
    if norm:
      w = w / w.sum(-1, keepdims=True)
    np.testing.assert_allclose(aux.combine_weights, w, rtol=1e-5)
    scores = np.sqrt(np.log1p(np.exp(logits)))
    np.testing.assert_allclose(
        aux.router_probs, scores / scores.sum(-1, keepdims=True), rtol=1e-5
    )

  @parameterized.parameters(0.0, 0.01, 0.3, 10.0)
  def test_sparsemixer_matches_phi_two_steps(self, epsilon):
    cfg = routing_cases.small_cfg(
        score_func="sparsemixer", sparsemixer_epsilon=epsilon
    )
    x, router, _ = routing_cases.inputs(cfg, seed=12)
    aux = routing.route(x, router, cfg)
    logits = routing_cases.float64_logits(cfg, seed=12)
    ids = routing_cases.plain_top_k(logits, 2)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    # Phi-MoE's eval-mode sparsemixer, transcribed: step 1 masks experts
    # far below the best, step 2 also masks the first choice.
    want = np.zeros((routing_cases.T, 2))
    for t, row in enumerate(logits):
      masked = row.copy()
      for step in range(2):
        m = masked.max()
        far = (m - row) / np.maximum(np.abs(row), m) > 2 * epsilon
        gates = np.where(far, -np.inf, masked)
        gates = np.exp(gates - gates.max())
        want[t, step] = gates[ids[t, step]] / gates.sum()
        masked[ids[t, step]] = -np.inf
    np.testing.assert_allclose(aux.combine_weights, want, rtol=1e-5)
    if epsilon == 0.0:  # Only the chosen expert is within 0 of itself.
      np.testing.assert_allclose(aux.combine_weights, 1.0)
    if epsilon == 10.0:  # Everyone is near: plain softmaxes.
      p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
      np.testing.assert_allclose(
          aux.combine_weights[:, 0],
          np.take_along_axis(p, ids[:, :1], axis=-1)[:, 0],
          rtol=1e-5,
      )

  def test_sparsemixer_refuses_what_it_would_ignore(self):
    for field, value in (
        ("norm_topk_prob", True),
        ("correction_bias", True),
        ("n_group", 2),
    ):
      with self.subTest(field):
        with self.assertRaisesRegex(
            ValueError, f"score_func='sparsemixer'.*takes no {field}"
        ):
          routing_cases.small_cfg(score_func="sparsemixer", **{field: value})


if __name__ == "__main__":
  absltest.main()
