"""moe_core.routing against a per-token numpy router written with loops."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import routing
from moe_core.testing import routing_cases


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
    cfg = routing_cases.small_cfg(**fields)
    x, router, bias = routing_cases.inputs(cfg, bias_scale=0.3)
    aux = routing.route(
        x, router, cfg, None if bias is None else jnp.asarray(bias)
    )
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-5, atol=1e-5)
    for t in range(routing_cases.T):
      ids, weights, probs = routing_cases.route_token(logits[t], cfg, bias)
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
    cfg = routing_cases.small_cfg(norm_topk_prob=True, norm_epsilon=0.5)
    x, router, _ = routing_cases.inputs(cfg)
    aux = routing.route(x, router, cfg)
    chosen = np.take_along_axis(
        np.asarray(aux.router_probs), np.asarray(aux.expert_ids), -1
    ).sum(-1)
    np.testing.assert_allclose(
        aux.combine_weights.sum(-1), chosen / (chosen + 0.5), rtol=1e-5
    )

  def test_correction_bias_moves_choice_not_weights(self):
    cfg = routing_cases.small_cfg(score_func="sigmoid", correction_bias=True)
    x, router, _ = routing_cases.inputs(cfg)
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
    cfg = routing_cases.small_cfg(score_func="sigmoid", correction_bias=True)
    x, router, bias = routing_cases.inputs(cfg, bias_scale=0.3)

    def loss(b):
      return routing.route(x, router, cfg, b).combine_weights.sum()

    np.testing.assert_array_equal(jax.grad(loss)(jnp.asarray(bias)), 0.0)

  def test_groups_never_choose_outside_best_groups_negative_scores(self):
    # Biased scores all negative: masking excluded groups with 0.0 would
    # let them win; -inf never does. The numpy router only ever looks at
    # the eligible experts.
    cfg = routing_cases.small_cfg(
        num_experts=16,
        top_k=4,
        n_group=4,
        topk_group=2,
        group_score="sum_top2",
        score_func="sigmoid",
        correction_bias=True,
    )
    x, router, _ = routing_cases.inputs(cfg)
    bias = -2.0 * jnp.ones(cfg.num_experts)
    aux = routing.route(x, router, cfg, bias)
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    for t in range(routing_cases.T):
      ids, _, _ = routing_cases.route_token(logits[t], cfg, np.asarray(bias))
      np.testing.assert_array_equal(aux.expert_ids[t], ids, f"token {t}")

  def test_requires_bias_iff_config_says_so(self):
    cfg = routing_cases.small_cfg(correction_bias=True)
    x, router, _ = routing_cases.inputs(cfg)
    with self.assertRaisesRegex(
        ValueError,
        r"correction_bias must be given iff cfg.correction_bias "
        r"is True, got cfg.correction_bias=True, correction_bias=None",
    ):
      routing.route(x, router, cfg)
    with self.assertRaisesRegex(
        ValueError, r"cfg.correction_bias=False, correction_bias" r"=an array"
    ):
      routing.route(x, router, routing_cases.small_cfg(), jnp.zeros(8))

  @parameterized.parameters(jnp.bfloat16, jnp.float16)
  def test_low_precision_inputs_route_in_float32(self, dtype):
    cfg = routing_cases.small_cfg(norm_topk_prob=True)
    x, router, _ = routing_cases.inputs(cfg, dtype=dtype)
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


class RouterSwitchTest(parameterized.TestCase):
  """The router switches of GPT-OSS, Laguna, Kolibri and Gemma 4, each
  against its family's formula in numpy."""

  def _route(self, cfg, seed, **extras):
    x, router, bias = routing_cases.inputs(cfg, seed=seed, bias_scale=1.0)
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
    cfg = routing_cases.small_cfg(
        top_k=3, router_bias=True, norm_topk_prob=True
    )
    b = np.linspace(-1.0, 1.0, cfg.num_experts).astype(np.float32)
    aux, _, xw, _ = self._route(cfg, 13, router_bias=b)
    logits = xw + b
    np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-5, atol=1e-6)
    ids = routing_cases.plain_top_k(logits, 3)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    top = np.take_along_axis(logits, ids, axis=-1)
    want = np.exp(top) / np.exp(top).sum(-1, keepdims=True)
    np.testing.assert_allclose(aux.combine_weights, want, rtol=1e-5)

  def test_logit_softcap_laguna(self):
    cfg = routing_cases.small_cfg(
        score_func="sigmoid", norm_topk_prob=True, router_logit_softcap=0.7
    )
    aux, _, xw, _ = self._route(cfg, 14)
    logits = 0.7 * np.tanh(xw / 0.7)
    np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-5, atol=1e-6)
    ids = routing_cases.plain_top_k(logits, 2)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    w = 1 / (1 + np.exp(-np.take_along_axis(logits, ids, axis=-1)))
    np.testing.assert_allclose(
        aux.combine_weights, w / w.sum(-1, keepdims=True), rtol=1e-5
    )

  def test_correction_bias_on_logits_kolibri(self):
    # Kolibri: top-k of logits + bias; weights sigmoid(unbiased logits).
    cfg = routing_cases.small_cfg(
        score_func="sigmoid",
        norm_topk_prob=True,
        correction_bias=True,
        correction_bias_on="logits",
    )
    aux, _, xw, bias = self._route(cfg, 15)
    ids = routing_cases.plain_top_k(xw + bias, 2)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    w = 1 / (1 + np.exp(-np.take_along_axis(xw, ids, axis=-1)))
    np.testing.assert_allclose(
        aux.combine_weights, w / w.sum(-1, keepdims=True), rtol=1e-5
    )
    # The same bias on the scores chooses otherwise (it is added to values
    # in (0, 1) there): the two sites differ.
    on_scores = routing.route(
        *routing_cases.inputs(cfg, seed=15)[:2],
        cfg.replace(correction_bias_on="scores"),
        jnp.asarray(bias),
    )
    self.assertFalse(np.array_equal(on_scores.expert_ids, aux.expert_ids))

  def test_router_input_norm_and_expert_scale_gemma4(self):
    cfg = routing_cases.small_cfg(
        top_k=3,
        norm_topk_prob=True,
        router_input_norm=True,
        input_norm_epsilon=1e-6,
        router_input_scale=routing_cases.D**-0.5,
        expert_output_scale=True,
    )
    rng = np.random.default_rng(16)
    norm_scale = rng.uniform(0.5, 2.0, routing_cases.D).astype(np.float32)
    expert_scale = rng.uniform(0.5, 2.0, cfg.num_experts).astype(np.float32)
    aux, x, _, _ = self._route(
        cfg, 16, router_norm_scale=norm_scale, expert_output_scale=expert_scale
    )
    _, router, _ = routing_cases.inputs(cfg, seed=16)
    # Gemma4TextRouter: norm without weight, * scale * D^-0.5, proj,
    # softmax, top-k, renormalise, * per_expert_scale[ids].
    h = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6)
    logits = (h * norm_scale * routing_cases.D**-0.5) @ np.asarray(
        router, np.float64
    )
    np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-5, atol=1e-6)
    ids = routing_cases.plain_top_k(logits, 3)
    np.testing.assert_array_equal(aux.expert_ids, ids)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top = np.take_along_axis(p, ids, axis=-1)
    want = top / top.sum(-1, keepdims=True) * expert_scale[ids]
    np.testing.assert_allclose(aux.combine_weights, want, rtol=1e-5)

  def test_learned_router_params_get_gradients(self):
    cfg = routing_cases.small_cfg(
        router_bias=True, router_input_norm=True, expert_output_scale=True
    )
    x, router, _ = routing_cases.inputs(cfg, seed=17)
    extras = dict(
        router_bias=jnp.zeros(8),
        router_norm_scale=jnp.ones(routing_cases.D),
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
      ("router_input_norm", "router_norm_scale", (routing_cases.D,)),
      ("expert_output_scale", "expert_output_scale", (8,)),
  )
  def test_router_params_required_iff_enabled(self, field, name, shape):
    x, router, _ = routing_cases.inputs(routing_cases.small_cfg(), seed=18)
    with self.assertRaisesRegex(
        ValueError, rf"{name} must be given iff cfg.{field} is True"
    ):
      routing.route(x, router, routing_cases.small_cfg(**{field: True}))
    with self.assertRaisesRegex(
        ValueError, rf"{name} must be given iff cfg.{field} is True"
    ):
      routing.route(
          x, router, routing_cases.small_cfg(), **{name: jnp.ones(shape)}
      )
    with self.assertRaisesRegex(ValueError, rf"{name} must have shape"):
      routing.route(
          x,
          router,
          routing_cases.small_cfg(**{field: True}),
          **{name: jnp.ones((3,))},
      )


class HashRoutingTest(absltest.TestCase):
  """DeepSeek-V4's hash router: experts from the table, weights scored."""

  def test_matches_deepseek_v4_hash_router(self):
    cfg = routing_cases.small_cfg(
        top_k=3,
        hash_vocab_size=11,
        score_func="sqrtsoftplus",
        norm_topk_prob=True,
        norm_epsilon=1e-20,
        routed_scaling_factor=1.5,
    )
    x, router, _ = routing_cases.inputs(cfg, seed=21)
    table = moe_core.init_params(jax.random.key(1), cfg)["hash_table"]
    self.assertEqual(table.dtype, jnp.int32)
    token_ids = jnp.arange(routing_cases.T, dtype=jnp.int32) % 11
    aux = routing.route(x, router, cfg, hash_table=table, token_ids=token_ids)
    ids = np.asarray(table)[np.asarray(token_ids)]
    np.testing.assert_array_equal(aux.expert_ids, ids)
    # DeepseekV4HashRouter: w = score_fn(logits)[ids]; w / (sum + 1e-20).
    w = np.take_along_axis(
        np.sqrt(np.log1p(np.exp(routing_cases.float64_logits(cfg, seed=21)))),
        ids,
        axis=-1,
    )
    want = w / (w.sum(-1, keepdims=True) + 1e-20) * 1.5
    np.testing.assert_allclose(aux.combine_weights, want, rtol=1e-5)

  def test_needs_token_ids_and_a_table_of_expert_ids(self):
    cfg = routing_cases.small_cfg(hash_vocab_size=5)
    x, router, _ = routing_cases.inputs(cfg, seed=22)
    table = jnp.zeros((5, 2), jnp.int32)
    ids = jnp.zeros(routing_cases.T, jnp.int32)
    with self.assertRaisesRegex(ValueError, "token_ids must be given iff"):
      routing.route(x, router, cfg, hash_table=table)
    with self.assertRaisesRegex(ValueError, "hash_table must be given iff"):
      routing.route(x, router, cfg, token_ids=ids)
    with self.assertRaisesRegex(TypeError, "token_ids must be an int array"):
      routing.route(x, router, cfg, hash_table=table, token_ids=ids * 1.0)
    with self.assertRaisesRegex(ValueError, r"hash_table must hold .*\[0, 8\)"):
      routing.route(x, router, cfg, hash_table=table + 8, token_ids=ids)
    with self.assertRaisesRegex(ValueError, "hash_vocab_size > 0 .*correct"):
      routing_cases.small_cfg(hash_vocab_size=5, correction_bias=True)


if __name__ == "__main__":
  absltest.main()
