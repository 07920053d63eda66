"""RoutingSuite: every router option through the layer, and a numpy router."""

from __future__ import annotations

import dataclasses

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from conformance import base
from conformance import cases
from conformance import oracles
from conformance import tolerances


def _named(case_list):
  return parameterized.named_parameters(cases.named(case_list))


def _extreme_cfg(**changes) -> moe_core.MoEConfig:
  fields = dict(num_experts=8, top_k=2, hidden_size=8, expert_ffn_size=8)
  fields.update(changes)
  fields["hidden_size"] = fields["num_experts"]  # x = logits / 1e4.
  return moe_core.MoEConfig(**fields)


# Every score function, with and without renormalisation (epsilon 0 and
# 1e-20), a correction bias strong enough to choose experts whose scores
# underflow, both group scores, and capacity (so some copies are dropped).
EXTREME_CONFIGS = {
    "softmax_norm_eps0": _extreme_cfg(norm_topk_prob=True),
    "softmax_bias_norm_eps1e-20": _extreme_cfg(
        correction_bias=True, norm_topk_prob=True, norm_epsilon=1e-20
    ),
    "softmax_capacity_1.0": _extreme_cfg(capacity_factor=1.0),
    "sigmoid": _extreme_cfg(score_func="sigmoid"),
    "sigmoid_norm_eps0": _extreme_cfg(
        score_func="sigmoid", norm_topk_prob=True
    ),
    "sigmoid_bias_norm_eps0_capacity_1.0": _extreme_cfg(
        capacity_factor=1.0, **cases.SIGMOID_BIAS_NORM_ROUTER
    ),
    "groups_sum_top2_sigmoid_bias_norm_eps1e-20_scaled": _extreme_cfg(
        num_experts=16, top_k=4, **cases.DEEPSEEK_V3_ROUTER
    ),
    "sqrtsoftplus_bias_norm_eps1e-20": _extreme_cfg(
        score_func="sqrtsoftplus",
        correction_bias=True,
        norm_topk_prob=True,
        norm_epsilon=1e-20,
    ),
    # Capped at 5: every +-1e4 logit ties at about +-5.
    "sigmoid_softcap5_bias_norm_eps0": _extreme_cfg(
        router_logit_softcap=5.0, **cases.SIGMOID_BIAS_NORM_ROUTER
    ),
    "groups_max_softmax_bias_norm_eps0": _extreme_cfg(
        num_experts=16,
        top_k=3,
        correction_bias=True,
        norm_topk_prob=True,
        **cases.GROUPS_MAX_ROUTER,
    ),
}

# The router is 1e4 * I (huge weights), so these rows of x / 1e4 are each
# token's logits.
_EXTREME_ROWS = (
    "all -1e4 (every score underflows, all equal)",
    "-1e4 + N(0, 1)",
    "-110 - U(0, 5) (just past sigmoid's float32 underflow at -104)",
    "all +1e4 (sigmoid saturates at 1, all equal)",
    "one-hot: +1e4 for one expert, -1e4 for the others",
    "+-1e4, random signs",
    "all 0",
    "1e-30 * N(0, 1) (near ties)",
    "N(0, 1)",
    "N(0, 300)",
)


def extreme_inputs(cfg: moe_core.MoEConfig, dtype: str):
  """(params, x [T, E], cotangent [T, E]) as jax arrays, params and x of
  `dtype` (the correction bias float32): logits extreme but finite, one
  token for each of _EXTREME_ROWS."""
  rng = np.random.default_rng(7)
  e = cfg.num_experts
  one_hot = np.full(e, -1.0)
  one_hot[e // 2] = 1.0
  logits = np.stack(
      [
          np.full(e, -1e4),
          -1e4 + rng.standard_normal(e),
          -110.0 - rng.uniform(0.0, 5.0, e),
          np.full(e, 1e4),
          1e4 * one_hot,
          1e4 * np.sign(rng.standard_normal(e) + 1e-9),
          np.zeros(e),
          1e-30 * rng.standard_normal(e),
          rng.standard_normal(e),
          300.0 * rng.standard_normal(e),
      ]
  )
  params = {}
  for name, shape in moe_core.param_shapes(cfg).items():
    if name == "router":
      params[name] = 1e4 * np.eye(e)
    elif name == "correction_bias":
      # Spread 3, against scores in [0, 1]: the bias often chooses experts
      # whose scores are 0 in float32.
      params[name] = 3.0 * rng.standard_normal(shape)
    else:
      params[name] = rng.standard_normal(shape) * shape[-2] ** -0.5
  params = {
      n: jnp.asarray(v, jnp.float32 if n == "correction_bias" else dtype)
      for n, v in params.items()
  }
  x = jnp.asarray(logits / 1e4, dtype)
  cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  return params, x, cotangent


class RoutingSuite(base.BackendTestCase):
  """Routing variants end to end; the routing decision against numpy."""

  @_named(cases.LAYER_CASES + cases.ROUTING_VARIANTS + cases.CAPACITY_CASES)
  def test_routing_matches_numpy_router(self, case):
    self.skip_if_shared_router_variant(case)
    params, x, _ = cases.layer_inputs(case)
    cfg = case.cfg
    aux = self.run_layer(case).aux
    # Routing is float32 at HIGHEST precision on every platform.
    tol = tolerances.routing()

    def check_close(name, got, want):
      problem = tolerances.violation(got, want, tol)
      self.assertIsNone(problem, f"{name} vs numpy: {problem}")

    tokens = oracles.f64(x).reshape(-1, cfg.hidden_size)
    check_close(
        "router_logits",
        aux["router_logits"],
        oracles.router_logits(tokens, params, cfg),
    )
    bias = params.get("correction_bias")
    want = oracles.route(
        aux["router_logits"], cfg, bias, params.get("expert_output_scale")
    )
    np.testing.assert_array_equal(
        aux["expert_ids"], want["expert_ids"], "expert_ids vs numpy router"
    )
    np.testing.assert_array_equal(aux["kept"], want["kept"])
    np.testing.assert_array_equal(
        aux["tokens_per_expert"], want["tokens_per_expert"]
    )
    self.assertEqual(int(aux["dropped_tokens"]), want["dropped_tokens"])
    # Finite inputs: nothing is invalid (docs/api.md, "Guarantees").
    self.assertEqual(int(aux["invalid_assignments"]), 0)
    for name in (
        "combine_weights",
        "router_probs",
        "load_balancing_loss",
        "router_z_loss",
    ):
      check_close(name, aux[name], want[name])
    if bias is not None:
      unbiased = oracles.route(
          aux["router_logits"],
          dataclasses.replace(
              cfg, correction_bias=False, correction_bias_on="scores"
          ),
      )
      self.assertFalse(
          np.array_equal(unbiased["expert_ids"], want["expert_ids"]),
          "the case's correction bias should change some token's experts",
      )

  def test_hash_routing_takes_the_tables_experts(self):
    """DeepSeek-V4's hash layers: the experts are the table's row of each
    token id, weighted by their renormalised sqrt(softplus) scores; y and
    the gradients of x and the float params equal the reference's."""
    case = cases.HASH_ROUTING_CASE
    self.skip_unless_computes(case.dtype)
    cfg = case.cfg
    params, x, cotangent = cases.layer_inputs(case)
    token_ids = cases.hash_token_ids(case)
    floats = {n: v for n, v in params.items() if n != "hash_table"}

    def loss(floats, x, backend):
      y, aux = moe_core.moe_layer(
          dict(floats, hash_table=params["hash_table"]),
          x,
          cfg,
          backend=backend,
          token_ids=token_ids,
      )
      return jnp.sum(y.astype(jnp.float32) * cotangent), (y, aux)

    def run(backend):
      fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
      (_, (y, aux)), (d_floats, d_x) = jax.jit(fn, static_argnums=2)(
          floats, x, backend
      )
      return np.asarray(y), aux, dict(d_floats, x=d_x)

    y, aux, grads = run(self.backend)
    ids = np.asarray(params["hash_table"])[np.asarray(token_ids)]
    np.testing.assert_array_equal(aux.expert_ids, ids)
    logits = oracles.router_logits(x, params, cfg)
    want = oracles.renormalised(logits, ids, cfg) * cfg.routed_scaling_factor
    problem = tolerances.violation(
        aux.combine_weights, want, tolerances.routing()
    )
    self.assertIsNone(problem, f"combine_weights vs numpy: {problem}")
    self.assertClose(
        y,
        oracles.layer_from_routing(params, x, ids, aux.combine_weights, cfg),
        case.dtype,
        msg="y vs per-token float64 recomputation",
    )
    if not self.is_oracle():
      _, _, want_grads = run(moe_core.get_backend("reference"))
      for name, g in grads.items():
        with self.subTest(name):
          self.assertClose(g, want_grads[name], case.dtype, "gradient")

  def test_hash_routing_token_id_out_of_range_is_invalid(self):
    case = cases.HASH_ROUTING_CASE
    self.skip_unless_computes(case.dtype)
    params, x, _ = cases.layer_inputs(case)
    token_ids = cases.hash_token_ids(case).at[3].set(case.cfg.hash_vocab_size)
    y, aux = jax.jit(
        lambda p, x, t: moe_core.moe_layer(
            p, x, case.cfg, backend=self.backend, token_ids=t
        )
    )(params, x, token_ids)
    self.assertEqual(int(aux.invalid_assignments), case.cfg.top_k)
    self.assertTrue(np.all(np.isnan(np.asarray(y)[3])))
    self.assertTrue(np.all(np.isfinite(np.delete(np.asarray(y), 3, 0))))

  def test_hash_routing_through_flax_modules(self):
    """moe_core.flax.MoE (nnx) and LinenMoE take token_ids and keep the
    hash table as routing state (a HashTable; Linen's "moe_state"
    collection), never a trainable parameter; with the case's params both
    give moe_layer's y and aux."""
    case = cases.HASH_ROUTING_CASE
    self.skip_unless_computes(case.dtype)
    try:
      # pylint: disable-next=g-import-not-at-top
      from flax import nnx
      # pylint: disable-next=g-import-not-at-top
      from moe_core import flax as moe_flax
    except ImportError as e:
      self.skipTest(f"flax is not installed (pip install '.[train]'): {e}")
    cfg = case.cfg
    params, x, _ = cases.layer_inputs(case)
    token_ids = cases.hash_token_ids(case)
    want_y, want_aux = moe_core.moe_layer(
        params, x, cfg, backend=self.backend, token_ids=token_ids
    )

    layer = moe_flax.MoE(cfg, backend=self.backend, rngs=nnx.Rngs(0))
    self.assertIsInstance(layer.hash_table, moe_flax.HashTable)
    self.assertNotIn("hash_table", nnx.state(layer, nnx.Param))
    for name, value in params.items():
      moe_flax.set_value(getattr(layer, name), value)
    got = {"nnx": layer(x, token_ids)}

    module = moe_flax.LinenMoE(cfg, backend=self.backend)
    variables = module.init(jax.random.key(0), x, token_ids)
    self.assertNotIn("hash_table", variables["params"])
    table = variables["moe_state"]["hash_table"]
    self.assertEqual(table.dtype, jnp.int32)
    self.assertEqual(table.shape, (cfg.hash_vocab_size, cfg.top_k))
    floats = {n: v for n, v in params.items() if n != "hash_table"}
    state = {"hash_table": params["hash_table"]}
    got["linen"] = module.apply(
        {"params": floats, "moe_state": state}, x, token_ids
    )
    for name, (y, aux) in got.items():
      with self.subTest(name):
        np.testing.assert_array_equal(y, want_y, f"{name}: y")
        np.testing.assert_array_equal(aux.expert_ids, want_aux.expert_ids)
        np.testing.assert_array_equal(
            aux.combine_weights, want_aux.combine_weights
        )

  @parameterized.named_parameters(*EXTREME_CONFIGS.items())
  def test_extreme_finite_logits_give_finite_outputs(self, cfg):
    """Finite logits, however large (here up to 1e4 in magnitude, sigmoid
    and softmax scores underflowing to 0 or saturating), give finite y,
    aux and gradients, every assignment counted (docs/api.md, "Guarantees");
    the combine weights are the renormalised scores of the backend's own
    choice (oracles.renormalised) and y their weighted sum."""
    dtype = self.compute_dtype()
    params, x, cotangent = extreme_inputs(cfg, dtype)

    def loss(params, x):
      y, aux = moe_core.moe_layer(params, x, cfg, backend=self.backend)
      return jnp.sum(y.astype(jnp.float32) * cotangent), (y, aux)

    (_, (y, aux)), grads = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    )(params, x)
    y = np.asarray(y).astype(np.float64)
    aux = {
        f.name: np.asarray(getattr(aux, f.name))
        for f in dataclasses.fields(aux)
    }
    t, k = x.shape[0], cfg.top_k
    bad_rows = [
        _EXTREME_ROWS[i] for i in np.flatnonzero(~np.isfinite(y).all(-1))
    ]
    self.assertEqual(bad_rows, [], "tokens with a non-finite output row")
    for name, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
      self.assertTrue(
          np.all(np.isfinite(np.asarray(g))),
          f"gradient {jax.tree_util.keystr(name)} is not finite",
      )
    for name in (
        "router_logits",
        "router_probs",
        "combine_weights",
        "load_balancing_loss",
        "router_z_loss",
    ):
      self.assertTrue(np.all(np.isfinite(aux[name])), f"aux.{name}")
    self.assertEqual(int(aux["invalid_assignments"]), 0)
    self.assertEqual(
        int(aux["kept"].sum()) + int(aux["dropped_tokens"]),
        t * k,
        "kept + dropped + invalid != T*K",
    )
    self.assertEqual(int(aux["tokens_per_expert"].sum()), t * k)
    if cfg.capacity_factor is None:
      self.assertTrue(np.all(aux["kept"]))

    ids = aux["expert_ids"].astype(np.int64)
    logits = aux["router_logits"]
    if cfg.norm_topk_prob:
      want = oracles.renormalised(logits, ids, cfg)
    else:
      want = np.take_along_axis(
          oracles.score(logits, cfg.score_func), ids, axis=1
      )
    want = np.where(aux["kept"], want * cfg.routed_scaling_factor, 0.0)
    tol = tolerances.routing()
    problem = tolerances.violation(aux["combine_weights"], want, tol)
    self.assertIsNone(problem, f"combine_weights vs numpy: {problem}")
    want_probs = oracles.route(logits, cfg)["router_probs"]
    problem = tolerances.violation(aux["router_probs"], want_probs, tol)
    self.assertIsNone(problem, f"router_probs vs numpy: {problem}")
    self.assertClose(
        y,
        oracles.layer_from_routing(params, x, ids, aux["combine_weights"], cfg),
        dtype,
        msg="y vs per-token float64 recomputation",
    )
