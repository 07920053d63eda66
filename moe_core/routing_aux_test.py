"""moe_core.routing_aux: capacity, counts and losses against numpy loops."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np

from moe_core import routing
from moe_core import routing_aux
from moe_core.testing import routing_cases


class CapacityTest(parameterized.TestCase):

  @parameterized.parameters((1, 1), (2, 3), (3, 2), (4, 5))
  def test_keep_mask_matches_gshard_loop(self, top_k, capacity):
    rng = np.random.default_rng(top_k * 10 + capacity)
    # Distinct experts per token, skewed toward low ids so slots overflow.
    ids = np.stack(
        [
            rng.choice(
                6, top_k, replace=False, p=[0.4, 0.2, 0.15, 0.1, 0.1, 0.05]
            )
            for _ in range(20)
        ]
    ).astype(np.int32)
    kept = routing_aux.capacity_keep_mask(jnp.asarray(ids), 6, capacity)
    np.testing.assert_array_equal(
        kept, routing_cases.keep_mask(ids, 6, capacity)
    )

  def test_first_choices_beat_earlier_tokens_second_choices(self):
    ids = jnp.asarray([[0, 1], [1, 0]], jnp.int32)
    kept = routing_aux.capacity_keep_mask(ids, 2, capacity=1)
    # Both first choices fit; both second choices find their expert full.
    np.testing.assert_array_equal(kept, [[True, False], [True, False]])

  def test_route_with_capacity_drops_and_counts(self):
    cfg = routing_cases.small_cfg(top_k=2, capacity_factor=0.5)
    x, router, _ = routing_cases.inputs(cfg, seed=3)
    aux = routing.route(x, router, cfg)
    capacity = cfg.expert_capacity(routing_cases.T)
    self.assertEqual(capacity, math.ceil(0.5 * routing_cases.T * 2 / 8))
    ids = np.asarray(aux.expert_ids)
    want_kept = routing_cases.keep_mask(ids, 8, capacity)
    np.testing.assert_array_equal(aux.kept, want_kept)
    self.assertEqual(int(aux.dropped_tokens), (~want_kept).sum())
    self.assertGreater(int(aux.dropped_tokens), 0)
    np.testing.assert_array_equal(
        np.asarray(aux.combine_weights)[~want_kept], 0.0
    )
    dropless = routing.route(x, router, cfg.replace(capacity_factor=None))
    np.testing.assert_array_equal(
        np.asarray(aux.combine_weights)[want_kept],
        np.asarray(dropless.combine_weights)[want_kept],
    )
    # Counts are of the router's choices, before the drop.
    np.testing.assert_array_equal(
        aux.tokens_per_expert, np.bincount(ids.ravel(), minlength=8)
    )


class AuxLossTest(parameterized.TestCase):

  @parameterized.parameters("softmax", "sigmoid")
  def test_losses_match_numpy(self, score_func):
    cfg = routing_cases.small_cfg(top_k=3, score_func=score_func)
    x, router, _ = routing_cases.inputs(cfg, seed=7)
    aux = routing.route(x, router, cfg)
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    ids, probs = [], []
    for t in range(routing_cases.T):
      token_ids, _, token_probs = routing_cases.route_token(
          logits[t], cfg, None
      )
      ids += token_ids
      probs.append(token_probs)
    f = np.bincount(ids, minlength=8) / (routing_cases.T * cfg.top_k)
    p = np.mean(probs, axis=0)
    np.testing.assert_allclose(
        aux.load_balancing_loss, 8 * np.sum(f * p), rtol=1e-5
    )
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(aux.router_z_loss, np.mean(lse**2), rtol=1e-5)

  @parameterized.parameters(1, 2)
  def test_load_balancing_loss_is_one_at_perfect_balance(self, top_k):
    # Token t prefers expert t, then t+1 (cyclically): every expert gets the
    # same count and, by symmetry, the same mean probability.
    e = 8
    cfg = routing_cases.small_cfg(num_experts=e, top_k=top_k, hidden_size=e)
    x = 3.0 * np.eye(e) + 1.5 * np.roll(np.eye(e), 1, axis=1)
    aux = routing.route(
        jnp.asarray(x, jnp.float32), jnp.eye(e, dtype=jnp.float32), cfg
    )
    np.testing.assert_array_equal(aux.tokens_per_expert, top_k)
    np.testing.assert_allclose(aux.load_balancing_loss, 1.0, rtol=1e-6)

  def test_load_balancing_loss_is_e_when_collapsed(self):
    e = 8
    cfg = routing_cases.small_cfg(num_experts=e, top_k=1, hidden_size=e)
    x = np.zeros((routing_cases.T, e), np.float32)
    x[:, 0] = 50.0  # Every token sends all its probability to expert 0.
    aux = routing.route(jnp.asarray(x), jnp.eye(e, dtype=jnp.float32), cfg)
    np.testing.assert_allclose(aux.load_balancing_loss, e, rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
