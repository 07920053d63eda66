"""moe_core.routing against a per-token numpy router written with loops."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import config as config_lib
from moe_core import routing
from moe_core import score_functions

_T, _D = 24, 16


def _route_token(logits, cfg, bias):
  """One token, float64: (ids best first, combine weights, probs [E])."""
  logits = [float(v) for v in logits]
  if cfg.score_func == "softmax":
    m = max(logits)
    exps = [math.exp(v - m) for v in logits]
    scores = [v / sum(exps) for v in exps]
    probs = scores
  else:
    scores = [1 / (1 + math.exp(-v)) for v in logits]
    probs = [s / sum(scores) for s in scores]
  shift = [0.0] * cfg.num_experts if bias is None else [float(b) for b in bias]
  choice = [s + b for s, b in zip(scores, shift)]
  eligible = list(range(cfg.num_experts))
  if cfg.n_group > 1:
    size = cfg.num_experts // cfg.n_group
    group_score = {}
    for g in range(cfg.n_group):
      members = sorted(choice[g * size : (g + 1) * size], reverse=True)
      group_score[g] = (
          members[0] if cfg.group_score == "max" else members[0] + members[1]
      )
    best = sorted(group_score, key=lambda g: -group_score[g])[: cfg.topk_group]
    eligible = [e for e in eligible if e // size in best]
  ids = sorted(eligible, key=lambda e: -choice[e])[: cfg.top_k]
  weights = [scores[e] for e in ids]
  if cfg.norm_topk_prob:
    total = sum(weights) + cfg.norm_epsilon
    weights = [w / total for w in weights]
  weights = [w * cfg.routed_scaling_factor for w in weights]
  return ids, weights, probs


def _keep_mask(ids, num_experts, capacity):
  """GShard priority: all first choices (token order), then all second..."""
  t, k = ids.shape
  used = [0] * num_experts
  kept = np.zeros((t, k), bool)
  for choice in range(k):
    for token in range(t):
      e = ids[token, choice]
      if used[e] < capacity:
        kept[token, choice] = True
        used[e] += 1
  return kept


def _inputs(cfg, seed=0, bias_scale=0.0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((_T, cfg.hidden_size)).astype(np.float32)
  router = (
      0.4 * rng.standard_normal((cfg.hidden_size, cfg.num_experts))
  ).astype(np.float32)
  bias = None
  if cfg.correction_bias:
    bias = (bias_scale * rng.standard_normal(cfg.num_experts)).astype(
        np.float32
    )
  return jnp.asarray(x, dtype), jnp.asarray(router, dtype), bias


def _cfg(**kw):
  fields = dict(num_experts=8, top_k=2, hidden_size=_D, expert_ffn_size=8)
  fields.update(kw)
  return config_lib.MoEConfig(**fields)


class RouteTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("softmax", dict()),
      ("softmax_norm", dict(norm_topk_prob=True)),
      ("softmax_norm_epsilon", dict(norm_topk_prob=True, norm_epsilon=0.5)),
      ("softmax_scaled", dict(top_k=3, routed_scaling_factor=16.0)),
      ("softmax_top1", dict(top_k=1)),
      ("sigmoid", dict(score_func="sigmoid")),
      (
          "sigmoid_norm_scaled",
          dict(
              score_func="sigmoid",
              norm_topk_prob=True,
              routed_scaling_factor=2.5,
          ),
      ),
      (
          "sigmoid_bias",
          dict(
              score_func="sigmoid",
              correction_bias=True,
              norm_topk_prob=True,
              norm_epsilon=1e-20,
          ),
      ),
      (
          "groups_max",
          dict(
              num_experts=16,
              top_k=3,
              n_group=4,
              topk_group=2,
              group_score="max",
              routed_scaling_factor=16.0,
          ),
      ),
      (
          "groups_sum_top2_bias",
          dict(
              num_experts=16,
              top_k=4,
              n_group=4,
              topk_group=2,
              group_score="sum_top2",
              score_func="sigmoid",
              correction_bias=True,
              norm_topk_prob=True,
              routed_scaling_factor=2.5,
          ),
      ),
      (
          "groups_sum_top2_softmax",
          dict(
              num_experts=12,
              top_k=2,
              n_group=3,
              topk_group=1,
              group_score="sum_top2",
          ),
      ),
      (
          "groups_top_k_fills_groups",
          dict(num_experts=8, top_k=4, n_group=4, topk_group=2),
      ),
  )
  def test_matches_per_token_numpy(self, fields):
    cfg = _cfg(**fields)
    x, router, bias = _inputs(cfg, bias_scale=0.3)
    aux = routing.route(
        x, router, cfg, None if bias is None else jnp.asarray(bias)
    )
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-5, atol=1e-5)
    for t in range(_T):
      ids, weights, probs = _route_token(logits[t], cfg, bias)
      np.testing.assert_array_equal(aux.expert_ids[t], ids, f"token {t}")
      np.testing.assert_allclose(
          aux.combine_weights[t],
          weights,
          rtol=1e-5,
          atol=1e-7,
          err_msg=f"token {t}",
      )
      np.testing.assert_allclose(
          aux.router_probs[t], probs, rtol=1e-5, atol=1e-7, err_msg=f"token {t}"
      )
    self.assertTrue(aux.kept.all())
    self.assertEqual(aux.dropped_tokens, 0)
    np.testing.assert_array_equal(
        aux.tokens_per_expert,
        np.bincount(
            np.asarray(aux.expert_ids).ravel(), minlength=cfg.num_experts
        ),
    )

  def test_norm_epsilon_shrinks_weight_sum(self):
    cfg = _cfg(norm_topk_prob=True, norm_epsilon=0.5)
    x, router, _ = _inputs(cfg)
    aux = routing.route(x, router, cfg)
    chosen = np.take_along_axis(
        np.asarray(aux.router_probs), np.asarray(aux.expert_ids), -1
    ).sum(-1)
    np.testing.assert_allclose(
        aux.combine_weights.sum(-1), chosen / (chosen + 0.5), rtol=1e-5
    )

  def test_correction_bias_moves_choice_not_weights(self):
    cfg = _cfg(score_func="sigmoid", correction_bias=True)
    x, router, _ = _inputs(cfg)
    bias = jnp.zeros(cfg.num_experts).at[5].set(10.0)  # Expert 5 always wins.
    aux = routing.route(x, router, cfg, bias)
    np.testing.assert_array_equal(aux.expert_ids[:, 0], 5)
    scores = jax.nn.sigmoid(np.asarray(x, np.float64) @ np.asarray(router))
    np.testing.assert_allclose(
        aux.combine_weights,
        np.take_along_axis(scores, np.asarray(aux.expert_ids), -1),
        rtol=1e-5,
    )
    plain = routing.route(x, router, cfg.replace(correction_bias=False))
    self.assertFalse((np.asarray(plain.expert_ids)[:, 0] == 5).all())

  def test_correction_bias_gets_no_gradient(self):
    cfg = _cfg(score_func="sigmoid", correction_bias=True)
    x, router, bias = _inputs(cfg, bias_scale=0.3)

    def loss(b):
      return routing.route(x, router, cfg, b).combine_weights.sum()

    np.testing.assert_array_equal(jax.grad(loss)(jnp.asarray(bias)), 0.0)

  def test_groups_never_choose_outside_best_groups_negative_scores(self):
    # Biased scores all negative: masking excluded groups with 0.0 would
    # let them win; -inf never does. The numpy router only ever looks at
    # the eligible experts.
    cfg = _cfg(
        num_experts=16,
        top_k=4,
        n_group=4,
        topk_group=2,
        group_score="sum_top2",
        score_func="sigmoid",
        correction_bias=True,
    )
    x, router, _ = _inputs(cfg)
    bias = -2.0 * jnp.ones(cfg.num_experts)
    aux = routing.route(x, router, cfg, bias)
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    for t in range(_T):
      ids, _, _ = _route_token(logits[t], cfg, np.asarray(bias))
      np.testing.assert_array_equal(aux.expert_ids[t], ids, f"token {t}")

  def test_requires_bias_iff_config_says_so(self):
    cfg = _cfg(correction_bias=True)
    x, router, _ = _inputs(cfg)
    with self.assertRaisesRegex(
        ValueError,
        r"correction_bias must be given iff cfg.correction_bias "
        r"is True, got cfg.correction_bias=True, correction_bias=None",
    ):
      routing.route(x, router, cfg)
    with self.assertRaisesRegex(
        ValueError, r"cfg.correction_bias=False, correction_bias" r"=an array"
    ):
      routing.route(x, router, _cfg(), jnp.zeros(8))

  @parameterized.parameters(jnp.bfloat16, jnp.float16)
  def test_low_precision_inputs_route_in_float32(self, dtype):
    cfg = _cfg(norm_topk_prob=True)
    x, router, _ = _inputs(cfg, dtype=dtype)
    aux = routing.route(x, router, cfg)
    for name in (
        "router_logits",
        "router_probs",
        "combine_weights",
        "load_balancing_loss",
        "router_z_loss",
    ):
      self.assertEqual(getattr(aux, name).dtype, jnp.float32, name)
    # Exactly the float32 routing of the rounded inputs: no bf16 products.
    want = routing.route(x.astype(jnp.float32), router.astype(jnp.float32), cfg)
    np.testing.assert_array_equal(aux.expert_ids, want.expert_ids)
    np.testing.assert_allclose(
        aux.router_logits, want.router_logits, rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        aux.combine_weights, want.combine_weights, rtol=1e-6
    )


def _route_logits(logits, cfg, bias=None):
  """routing.route of tokens whose logits are exactly `logits` [T, E]:
  x = logits, router = the identity (so hidden_size = E)."""
  logits = jnp.asarray(logits, jnp.float32)
  e = logits.shape[-1]
  cfg = cfg.replace(hidden_size=e)
  router = jnp.eye(e, dtype=jnp.float32)
  return routing.route(logits, router, cfg, bias)


class ExtremeLogitsTest(parameterized.TestCase):
  """Finite logits give finite weights, probabilities and losses
  (docs/api.md, "Guarantees"): where the scores underflow to 0 the
  renormalisation is computed from their logs (`routing.renormalise`)."""

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
    cfg = _cfg(score_func="sigmoid", norm_topk_prob=True, norm_epsilon=epsilon)
    logits = np.array(
        [
            [-200.0, -201.0, -300.0, -300.0, -300.0, -300.0, -300.0, -300.0],
            -1e4 - np.arange(8.0),
            -105.0 - np.arange(8.0),
        ],
        np.float32,
    )
    aux = _route_logits(logits, cfg)
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
    cfg = _cfg(score_func="softmax", correction_bias=True, norm_topk_prob=True)
    logits = np.full((2, 8), -1e4, np.float32)
    logits[:, 0] = 1e4
    logits[1, 1:] -= np.arange(7.0)
    bias = jnp.zeros(8).at[0].set(-5.0)
    aux = _route_logits(logits, cfg, bias)
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
      cfg = _cfg(norm_topk_prob=norm, norm_epsilon=epsilon, **fields)
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
    got = routing.renormalise(
        jnp.asarray(np.log(w), jnp.float32),
        math.log(epsilon) if epsilon else None,
    )
    np.testing.assert_allclose(
        got, w / (w.sum(-1, keepdims=True) + epsilon), rtol=2e-6
    )

  def test_underflowing_scores_keep_their_ratios(self):
    # exp(-1e4) is 0 even in float64; the logs are not.
    logs = np.asarray([[-1e4, -1e4 - math.log(3.0)]], np.float32)
    got = routing.renormalise(jnp.asarray(logs))
    gap = float(logs[0, 0]) - float(logs[0, 1])  # log 3, to float32's ulp.
    np.testing.assert_allclose(
        got, [[1 / (1 + math.exp(-gap)), 1 / (1 + math.exp(gap))]], rtol=1e-6
    )
    got = routing.renormalise(
        jnp.asarray([[-1e4, -1e4]]), log_epsilon=math.log(1e-20)
    )
    np.testing.assert_array_equal(got, [[0.0, 0.0]])


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
    kept = routing.capacity_keep_mask(jnp.asarray(ids), 6, capacity)
    np.testing.assert_array_equal(kept, _keep_mask(ids, 6, capacity))

  def test_first_choices_beat_earlier_tokens_second_choices(self):
    ids = jnp.asarray([[0, 1], [1, 0]], jnp.int32)
    kept = routing.capacity_keep_mask(ids, 2, capacity=1)
    # Both first choices fit; both second choices find their expert full.
    np.testing.assert_array_equal(kept, [[True, False], [True, False]])

  def test_route_with_capacity_drops_and_counts(self):
    cfg = _cfg(top_k=2, capacity_factor=0.5)
    x, router, _ = _inputs(cfg, seed=3)
    aux = routing.route(x, router, cfg)
    capacity = cfg.expert_capacity(_T)
    self.assertEqual(capacity, math.ceil(0.5 * _T * 2 / 8))
    ids = np.asarray(aux.expert_ids)
    want_kept = _keep_mask(ids, 8, capacity)
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
    cfg = _cfg(top_k=3, score_func=score_func)
    x, router, _ = _inputs(cfg, seed=7)
    aux = routing.route(x, router, cfg)
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    ids, probs = [], []
    for t in range(_T):
      token_ids, _, token_probs = _route_token(logits[t], cfg, None)
      ids += token_ids
      probs.append(token_probs)
    f = np.bincount(ids, minlength=8) / (_T * cfg.top_k)
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
    cfg = _cfg(num_experts=e, top_k=top_k, hidden_size=e)
    x = 3.0 * np.eye(e) + 1.5 * np.roll(np.eye(e), 1, axis=1)
    aux = routing.route(
        jnp.asarray(x, jnp.float32), jnp.eye(e, dtype=jnp.float32), cfg
    )
    np.testing.assert_array_equal(aux.tokens_per_expert, top_k)
    np.testing.assert_allclose(aux.load_balancing_loss, 1.0, rtol=1e-6)

  def test_load_balancing_loss_is_e_when_collapsed(self):
    e = 8
    cfg = _cfg(num_experts=e, top_k=1, hidden_size=e)
    x = np.zeros((_T, e), np.float32)
    x[:, 0] = 50.0  # Every token sends all its probability to expert 0.
    aux = routing.route(jnp.asarray(x), jnp.eye(e, dtype=jnp.float32), cfg)
    np.testing.assert_allclose(aux.load_balancing_loss, e, rtol=1e-5)


class UpdateCorrectionBiasTest(absltest.TestCase):

  def test_underloaded_up_overloaded_down(self):
    bias = jnp.asarray([0.0, 0.5, -0.5, 0.1])
    load = jnp.asarray([1, 10, 5, 4])  # mean 5
    new = routing.update_correction_bias(bias, load, rate=0.01)
    np.testing.assert_allclose(new, [0.01, 0.49, -0.5, 0.11], atol=1e-7)

  def test_sums_leading_axes(self):
    bias = jnp.zeros(3)
    load = jnp.asarray([[3, 0, 0], [0, 0, 3]])  # totals 3, 0, 3; mean 2.
    new = routing.update_correction_bias(bias, load, rate=1.0)
    np.testing.assert_array_equal(new, [-1.0, 1.0, -1.0])

  def test_errors_name_shapes(self):
    with self.assertRaisesRegex(
        ValueError, r"correction_bias must be 1-D \[E\], got " r"shape \(2, 2\)"
    ):
      routing.update_correction_bias(jnp.zeros((2, 2)), jnp.zeros(2))
    with self.assertRaisesRegex(
        ValueError, r"tokens_per_expert must end in E=4, got " r"shape \(3,\)"
    ):
      routing.update_correction_bias(jnp.zeros(4), jnp.zeros(3))


def _logits(cfg, seed):
  """[T, E] float64 logits of `_inputs`' x and router (no extras)."""
  x, router, _ = _inputs(cfg, seed=seed)
  return np.asarray(x, np.float64) @ np.asarray(router, np.float64)


def _plain_top_k(values, k):
  """[T, K] ids of the k largest values per row, lower index on ties."""
  return np.argsort(-values, axis=-1, kind="stable")[:, :k]


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
    cfg = _cfg(top_k=3, score_func=name, norm_topk_prob=norm)
    x, router, _ = _inputs(cfg, seed=11)
    aux = routing.route(x, router, cfg)
    logits = _logits(cfg, seed=11)
    ids = _plain_top_k(logits, 3)
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
    cfg = _cfg(score_func="sparsemixer", sparsemixer_epsilon=epsilon)
    x, router, _ = _inputs(cfg, seed=12)
    aux = routing.route(x, router, cfg)
    logits = _logits(cfg, seed=12)
    ids = _plain_top_k(logits, 2)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    # Phi-MoE's eval-mode sparsemixer, transcribed: step 1 masks experts
    # far below the best, step 2 also masks the first choice.
    want = np.zeros((_T, 2))
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
          _cfg(score_func="sparsemixer", **{field: value})


class RouterSwitchTest(parameterized.TestCase):
  """The router switches of GPT-OSS, Laguna, Kolibri and Gemma 4, each
  against its family's formula in numpy."""

  def _route(self, cfg, seed, **extras):
    x, router, bias = _inputs(cfg, seed=seed, bias_scale=1.0)
    aux = routing.route(
        x,
        router,
        cfg,
        None if bias is None else jnp.asarray(bias),
        **{n: jnp.asarray(v) for n, v in extras.items()},
    )
    xw = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    return aux, np.asarray(x, np.float64), xw, bias

  def test_router_bias_gpt_oss(self):
    # GPT-OSS: logits = x W + b; top-k of the logits; softmax over those K.
    cfg = _cfg(top_k=3, router_bias=True, norm_topk_prob=True)
    b = np.linspace(-1.0, 1.0, cfg.num_experts).astype(np.float32)
    aux, _, xw, _ = self._route(cfg, 13, router_bias=b)
    logits = xw + b
    np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-5, atol=1e-6)
    ids = _plain_top_k(logits, 3)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    top = np.take_along_axis(logits, ids, axis=-1)
    want = np.exp(top) / np.exp(top).sum(-1, keepdims=True)
    np.testing.assert_allclose(aux.combine_weights, want, rtol=1e-5)

  def test_logit_softcap_laguna(self):
    cfg = _cfg(
        score_func="sigmoid", norm_topk_prob=True, router_logit_softcap=0.7
    )
    aux, _, xw, _ = self._route(cfg, 14)
    logits = 0.7 * np.tanh(xw / 0.7)
    np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-5, atol=1e-6)
    ids = _plain_top_k(logits, 2)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    w = 1 / (1 + np.exp(-np.take_along_axis(logits, ids, axis=-1)))
    np.testing.assert_allclose(
        aux.combine_weights, w / w.sum(-1, keepdims=True), rtol=1e-5
    )

  def test_correction_bias_on_logits_kolibri(self):
    # Kolibri: top-k of logits + bias; weights sigmoid(unbiased logits).
    cfg = _cfg(
        score_func="sigmoid",
        norm_topk_prob=True,
        correction_bias=True,
        correction_bias_on="logits",
    )
    aux, _, xw, bias = self._route(cfg, 15)
    ids = _plain_top_k(xw + bias, 2)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    w = 1 / (1 + np.exp(-np.take_along_axis(xw, ids, axis=-1)))
    np.testing.assert_allclose(
        aux.combine_weights, w / w.sum(-1, keepdims=True), rtol=1e-5
    )
    # The same bias on the scores chooses otherwise (it is added to values
    # in (0, 1) there): the two sites differ.
    on_scores = routing.route(
        *_inputs(cfg, seed=15)[:2],
        cfg.replace(correction_bias_on="scores"),
        jnp.asarray(bias),
    )
    self.assertFalse(np.array_equal(on_scores.expert_ids, aux.expert_ids))

  def test_router_input_norm_and_expert_scale_gemma4(self):
    cfg = _cfg(
        top_k=3,
        norm_topk_prob=True,
        router_input_norm=True,
        input_norm_epsilon=1e-6,
        router_input_scale=_D**-0.5,
        expert_output_scale=True,
    )
    rng = np.random.default_rng(16)
    norm_scale = rng.uniform(0.5, 2.0, _D).astype(np.float32)
    expert_scale = rng.uniform(0.5, 2.0, cfg.num_experts).astype(np.float32)
    aux, x, _, _ = self._route(
        cfg, 16, router_norm_scale=norm_scale, expert_output_scale=expert_scale
    )
    _, router, _ = _inputs(cfg, seed=16)
    # Gemma4TextRouter: norm without weight, * scale * D^-0.5, proj,
    # softmax, top-k, renormalise, * per_expert_scale[ids].
    h = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6)
    logits = (h * norm_scale * _D**-0.5) @ np.asarray(router, np.float64)
    np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-5, atol=1e-6)
    ids = _plain_top_k(logits, 3)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top = np.take_along_axis(p, ids, axis=-1)
    want = top / top.sum(-1, keepdims=True) * expert_scale[ids]
    np.testing.assert_allclose(aux.combine_weights, want, rtol=1e-5)

  def test_learned_router_params_get_gradients(self):
    cfg = _cfg(
        router_bias=True, router_input_norm=True, expert_output_scale=True
    )
    x, router, _ = _inputs(cfg, seed=17)
    extras = dict(
        router_bias=jnp.zeros(8),
        router_norm_scale=jnp.ones(_D),
        expert_output_scale=jnp.ones(8),
    )

    def loss(extras):
      aux = routing.route(x, router, cfg, **extras)
      return jnp.sum(aux.combine_weights * jnp.arange(2.0))

    grads = jax.grad(loss)(extras)
    for name, g in grads.items():
      with self.subTest(name):
        self.assertTrue(np.any(np.asarray(g) != 0), f"d {name} is all 0")

  @parameterized.parameters(
      ("router_bias", "router_bias", (8,)),
      ("router_input_norm", "router_norm_scale", (_D,)),
      ("expert_output_scale", "expert_output_scale", (8,)),
  )
  def test_router_params_required_iff_enabled(self, field, name, shape):
    x, router, _ = _inputs(_cfg(), seed=18)
    with self.assertRaisesRegex(
        ValueError, rf"{name} must be given iff cfg.{field} is True"
    ):
      routing.route(x, router, _cfg(**{field: True}))
    with self.assertRaisesRegex(
        ValueError, rf"{name} must be given iff cfg.{field} is True"
    ):
      routing.route(x, router, _cfg(), **{name: jnp.ones(shape)})
    with self.assertRaisesRegex(ValueError, rf"{name} must have shape"):
      routing.route(x, router, _cfg(**{field: True}), **{name: jnp.ones((3,))})


class ZeroExpertTest(parameterized.TestCase):
  """Zero experts through moe_layer: chosen, they add x (or nothing)."""

  @parameterized.parameters("identity", "zero")
  def test_tokens_choosing_only_zero_experts(self, output):
    cfg = _cfg(
        num_experts=4, top_k=2, num_zero_experts=2, zero_expert_output=output
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    self.assertEqual(params["router"].shape, (_D, 6))
    x, _, _ = _inputs(cfg, seed=19)
    # Token t < 12 prefers the zero experts 4 and 5, the rest expert 0, 1.
    prefer = np.zeros((_T, 6), np.float32)
    prefer[:12, 4:] = 1.0
    prefer[12:, :2] = 1.0
    x = jnp.concatenate([x[:, :10], jnp.asarray(prefer)], axis=1)
    router = np.zeros((_D, 6), np.float32)
    router[10:, :] = 50.0 * np.eye(6)
    params["router"] = jnp.asarray(router)
    y, aux = moe_core.moe_layer(params, x, cfg, backend="xla")
    np.testing.assert_array_equal(aux.expert_ids[:12] >= 4, True)
    np.testing.assert_array_equal(aux.expert_ids[12:] < 4, True)
    self.assertEqual(int(aux.tokens_per_expert[4:].sum()), 24)
    self.assertEqual(int(aux.kept.sum()), _T * 2)
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
          _cfg(num_zero_experts=2, **{field: value})


class HashRoutingTest(absltest.TestCase):
  """DeepSeek-V4's hash router: experts from the table, weights scored."""

  def test_matches_deepseek_v4_hash_router(self):
    cfg = _cfg(
        top_k=3,
        hash_vocab_size=11,
        score_func="sqrtsoftplus",
        norm_topk_prob=True,
        norm_epsilon=1e-20,
        routed_scaling_factor=1.5,
    )
    x, router, _ = _inputs(cfg, seed=21)
    table = moe_core.init_params(jax.random.key(1), cfg)["hash_table"]
    self.assertEqual(table.dtype, jnp.int32)
    token_ids = jnp.arange(_T, dtype=jnp.int32) % 11
    aux = routing.route(x, router, cfg, hash_table=table, token_ids=token_ids)
    ids = np.asarray(table)[np.asarray(token_ids)]
    np.testing.assert_array_equal(aux.expert_ids, ids)
    # DeepseekV4HashRouter: w = score_fn(logits)[ids]; w / (sum + 1e-20).
    w = np.take_along_axis(
        np.sqrt(np.log1p(np.exp(_logits(cfg, seed=21)))), ids, axis=-1
    )
    want = w / (w.sum(-1, keepdims=True) + 1e-20) * 1.5
    np.testing.assert_allclose(aux.combine_weights, want, rtol=1e-5)

  def test_needs_token_ids_and_a_table_of_expert_ids(self):
    cfg = _cfg(hash_vocab_size=5)
    x, router, _ = _inputs(cfg, seed=22)
    table = jnp.zeros((5, 2), jnp.int32)
    ids = jnp.zeros(_T, jnp.int32)
    with self.assertRaisesRegex(ValueError, "token_ids must be given iff"):
      routing.route(x, router, cfg, hash_table=table)
    with self.assertRaisesRegex(ValueError, "hash_table must be given iff"):
      routing.route(x, router, cfg, token_ids=ids)
    with self.assertRaisesRegex(TypeError, "token_ids must be an int array"):
      routing.route(x, router, cfg, hash_table=table, token_ids=ids * 1.0)
    with self.assertRaisesRegex(ValueError, r"hash_table must hold .*\[0, 8\)"):
      routing.route(x, router, cfg, hash_table=table + 8, token_ids=ids)
    with self.assertRaisesRegex(ValueError, "hash_vocab_size > 0 .*correct"):
      _cfg(hash_vocab_size=5, correction_bias=True)


if __name__ == "__main__":
  absltest.main()
