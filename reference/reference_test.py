"""The reference backend against float64 numpy loops: GEMM and whole layer."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from reference import backend as reference


def _numpy_gmm(rows, weights, group_sizes, transpose_rhs=False):
  """float64, one group at a time; rows past sum(group_sizes) stay zero."""
  rows = np.asarray(rows, np.float64)
  weights = np.asarray(weights, np.float64)
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  out = np.zeros((rows.shape[0], n))
  start = 0
  for e, size in enumerate(group_sizes):
    w = weights[e].T if transpose_rhs else weights[e]
    out[start : start + size] = rows[start : start + size] @ w
    start += size
  return out


def _gmm_case(m=20, k=6, n=5, sizes=(3, 0, 7, 1, 4), seed=0):
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal((m, k)).astype(np.float32)
  weights = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
  return rows, weights, np.asarray(sizes, np.int32)


class GroupedGemmTest(parameterized.TestCase):

  @parameterized.product(
      sizes=[
          (3, 0, 7, 1, 4),
          (20, 0, 0, 0, 0),
          (0, 0, 0, 0, 0),
          (4, 4, 4, 4, 4),
      ],
      transpose_rhs=[False, True],
  )
  def test_matches_numpy_loop(self, sizes, transpose_rhs):
    rows, weights, gs = _gmm_case(sizes=sizes)
    if transpose_rhs:
      weights = np.swapaxes(weights, 1, 2).copy()
    got = reference.grouped_gemm(
        jnp.asarray(rows),
        jnp.asarray(weights),
        jnp.asarray(gs),
        transpose_rhs=transpose_rhs,
    )
    want = _numpy_gmm(rows, weights, gs, transpose_rhs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[gs.sum() :], 0.0)

  def test_nan_padding_rows_are_zero_with_zero_gradient(self):
    rows, weights, gs = _gmm_case()
    used = gs.sum()  # 15 of 20 rows.
    rows[used:] = np.nan
    be = moe_core.get_backend("reference")
    out = be.grouped_gemm(
        jnp.asarray(rows), jnp.asarray(weights), jnp.asarray(gs)
    )
    np.testing.assert_array_equal(np.asarray(out)[used:], 0.0)
    dy = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
    d_rows, d_weights = jax.grad(
        lambda r, w: jnp.sum(be.grouped_gemm(r, w, jnp.asarray(gs)) * dy),
        argnums=(0, 1),
    )(jnp.asarray(rows), jnp.asarray(weights))
    clean = np.where(np.isnan(rows), 0.0, rows)
    # dX = dY @ W_e^T inside each group; dW_e = X_e^T @ dY_e.
    np.testing.assert_allclose(
        d_rows,
        _numpy_gmm(dy, weights, gs, transpose_rhs=True),
        rtol=1e-5,
        atol=1e-5,
    )
    np.testing.assert_array_equal(np.asarray(d_rows)[used:], 0.0)
    start = 0
    for e, size in enumerate(gs):
      want = (
          clean[start : start + size].astype(np.float64).T
          @ dy[start : start + size]
      )
      np.testing.assert_allclose(
          d_weights[e], want, rtol=1e-5, atol=1e-5, err_msg=f"expert {e}"
      )
      start += size

  def test_bfloat16_accumulates_in_float32(self):
    rows, weights, gs = _gmm_case(k=64)
    rows_bf16 = jnp.asarray(rows, jnp.bfloat16)
    weights_bf16 = jnp.asarray(weights, jnp.bfloat16)
    got = reference.grouped_gemm(
        rows_bf16, weights_bf16, jnp.asarray(gs), out_dtype=jnp.float32
    )
    self.assertEqual(got.dtype, jnp.float32)
    want = _numpy_gmm(
        np.asarray(rows_bf16, np.float32),
        np.asarray(weights_bf16, np.float32),
        gs,
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)

  def test_group_row_mask(self):
    mask = reference.group_row_mask(6, jnp.asarray([2, 0, 3]))
    np.testing.assert_array_equal(
        mask, [[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]]
    )


def _act(name, h):
  if name == "silu":
    return h / (1 + np.exp(-h))
  if name == "gelu":
    return 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
  return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))


def _numpy_moe(p, x, cfg):
  """Per-token float64 MoE block with GShard capacity; returns y [T, D]."""
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  x = np.asarray(x, np.float64)
  t = x.shape[0]
  choices = []  # Per token: [(expert, weight)] best first.
  for token in range(t):
    logits = x[token] @ p["router"]
    if cfg.score_func == "softmax":
      scores = np.exp(logits - logits.max())
      scores /= scores.sum()
    else:
      scores = 1 / (1 + np.exp(-logits))
    choice = scores + p.get("correction_bias", 0.0)
    eligible = list(range(cfg.num_experts))
    if cfg.n_group > 1:
      size = cfg.experts_per_group

      def group_score(g, choice=choice, size=size):
        top = sorted(choice[g * size : (g + 1) * size], reverse=True)
        return top[0] + top[1] if cfg.group_score == "sum_top2" else top[0]

      best = sorted(range(cfg.n_group), key=lambda g: -group_score(g))
      eligible = [e for e in eligible if e // size in best[: cfg.topk_group]]
    ids = sorted(eligible, key=lambda e: -choice[e])[: cfg.top_k]
    w = scores[ids]
    if cfg.norm_topk_prob:
      w = w / (w.sum() + cfg.norm_epsilon)
    choices.append(list(zip(ids, w * cfg.routed_scaling_factor)))
  capacity = cfg.expert_capacity(t) or t * cfg.top_k
  used = [0] * cfg.num_experts
  y = np.zeros_like(x)
  for k in range(cfg.top_k):  # GShard: all first choices, then seconds...
    for token in range(t):
      e, w = choices[token][k]
      if used[e] >= capacity:
        continue
      used[e] += 1
      h = _act(cfg.activation, x[token] @ p["w_gate"][e]) * (
          x[token] @ p["w_up"][e]
      )
      y[token] += w * (h @ p["w_down"][e])
  if cfg.shared_ffn_size:
    h = _act(cfg.activation, x @ p["shared_w_gate"]) * (x @ p["shared_w_up"])
    shared = h @ p["shared_w_down"]
    if cfg.shared_expert_gate:
      shared *= 1 / (1 + np.exp(-(x @ p["shared_gate"])))
    y += shared
  return y


_LAYER_CASES = (
    ("mixtral_like", dict(num_experts=8, top_k=2, norm_topk_prob=True)),
    (
        "qwen2_like_gelu",
        dict(
            num_experts=8,
            top_k=4,
            shared_ffn_size=24,
            shared_expert_gate=True,
            activation="gelu",
        ),
    ),
    (
        "deepseek_v2_like",
        dict(
            num_experts=8,
            top_k=3,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=16.0,
            shared_ffn_size=32,
            activation="gelu_tanh",
        ),
    ),
    (
        "deepseek_v3_like",
        dict(
            num_experts=16,
            top_k=4,
            score_func="sigmoid",
            correction_bias=True,
            n_group=4,
            topk_group=2,
            group_score="sum_top2",
            norm_topk_prob=True,
            norm_epsilon=1e-20,
            routed_scaling_factor=2.5,
            shared_ffn_size=16,
        ),
    ),
    ("capacity_drops", dict(num_experts=4, top_k=2, capacity_factor=0.5)),
)


class ReferenceLayerTest(parameterized.TestCase):

  def _case(self, fields, dtype=jnp.float32, tokens=(3, 8)):
    cfg = moe_core.MoEConfig(hidden_size=16, expert_ffn_size=20, **fields)
    params = moe_core.init_params(jax.random.key(0), cfg)
    params["router"] = params["router"] * 3.0  # Clear, spread choices.
    if cfg.correction_bias:
      params["correction_bias"] = 0.2 * jax.random.normal(
          jax.random.key(2), (cfg.num_experts,)
      )
    x = jax.random.normal(jax.random.key(1), (*tokens, 16))
    params = {
        k: v.astype(dtype) if k != "correction_bias" else v
        for k, v in params.items()
    }
    return cfg, params, x.astype(dtype)

  @parameterized.named_parameters(*_LAYER_CASES)
  def test_matches_per_token_numpy(self, fields):
    cfg, params, x = self._case(fields)
    y, aux = moe_core.moe_layer(params, x, cfg, backend="reference")
    self.assertEqual(y.shape, x.shape)
    want = _numpy_moe(params, x.reshape(-1, 16), cfg).reshape(x.shape)
    np.testing.assert_allclose(
        y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
    )
    if cfg.capacity_factor is not None:
      self.assertGreater(int(aux.dropped_tokens), 0)

  def test_bfloat16_close_to_float64(self):
    cfg, params, x = self._case(dict(_LAYER_CASES[3][1]), jnp.bfloat16)
    y, _ = moe_core.moe_layer(params, x, cfg, backend="reference")
    self.assertEqual(y.dtype, jnp.bfloat16)
    want = _numpy_moe(params, x.reshape(-1, 16).astype(jnp.float32), cfg)
    np.testing.assert_allclose(
        np.asarray(y, np.float32).reshape(want.shape),
        want,
        rtol=2e-2,
        atol=2e-2 * np.abs(want).max(),
    )


def _dot_precisions(jaxpr) -> list:
  """The precision of every dot_general in `jaxpr` and its sub-jaxprs."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # A ClosedJaxpr's own jaxpr.
        if hasattr(sub, "eqns"):
          found += _dot_precisions(sub)
  return found


class MatmulPrecisionTest(absltest.TestCase):
  """The oracle multiplies float32 exactly on every platform: every product
  of the layer and its gradients, the shared expert's and the latent
  projections' included, asks for HIGHEST (a TPU's default for float32 is
  one bfloat16 pass), whatever the caller's default."""

  def _precisions(self, backend) -> list:
    cfg = moe_core.MoEConfig(
        num_experts=4,
        top_k=2,
        hidden_size=16,
        expert_ffn_size=8,
        expert_latent_size=8,
        shared_ffn_size=8,
        shared_expert_gate=True,
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    x = jnp.ones((6, cfg.hidden_size), jnp.float32)

    def loss(params, x):
      y, _ = moe_core.moe_layer(params, x, cfg, backend=backend)
      return jnp.sum(y * y)

    fn = jax.grad(loss, argnums=(0, 1))
    with jax.default_matmul_precision("bfloat16"):
      return _dot_precisions(jax.make_jaxpr(fn)(params, x).jaxpr)

  def test_every_product_of_the_reference_layer_is_highest(self):
    highest = (jax.lax.Precision.HIGHEST,) * 2
    got = self._precisions("reference")
    self.assertGreater(len(got), 10)
    self.assertEqual([p for p in got if p != highest], [])

  def test_the_caller_default_still_reaches_other_backends(self):
    # The scope is the reference's: the xla backend's shared expert and
    # latent products follow the caller's default ("bfloat16", DEFAULT).
    default = (jax.lax.Precision.DEFAULT,) * 2
    self.assertIn(default, self._precisions("xla"))


if __name__ == "__main__":
  absltest.main()
