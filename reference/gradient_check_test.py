"""The reference backend's gradients against central finite differences.

The conformance suite checks every backend's gradients against the
reference's; this file checks the reference's own, by directional central
differences: for a direction v, (f(p + eps v) - f(p - eps v)) / (2 eps)
against the autodiff <grad f(p), v>, with f(p) = sum(y * cotangent).

The reference computes in float32 whatever its inputs (routing by design,
its routed experts for simplicity), so float64 inputs do not make it a
float64 function. float64 (jax_enable_x64, on while this module's tests run,
and the reason this file is its own Bazel target) still makes the inputs,
the steps, the loss sum and the difference quotient exact enough that the
float32 rounding inside the layer is the only noise. The step is 1e-3 of
each argument's norm: large against that noise, small enough for the
O(eps^2) error of the central difference. Top-k is piecewise
constant: every difference checks that the experts chosen (and, with
capacity, the copies kept) at p + eps v and p - eps v are those at p, so no
difference straddles a switch.

Directions: the gradient itself (a wrong scale or a missing factor shows in
full there), and random ones confined to one leading index (one expert, one
token, one input feature), so that a gradient wrong in one place is not
averaged away. CheckerSensitivityTest shows that the check catches a
gradient that lacks the combine weight.
"""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from conformance import cases
import moe_core
from moe_core import params as params_lib
from reference import backend as reference

_saved_x64 = None


def setUpModule():
  # float64 inputs stay float64 (see the docstring). Set for this module's
  # tests only, not at import: one pytest process runs every test file.
  global _saved_x64
  _saved_x64 = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)


def tearDownModule():
  jax.config.update("jax_enable_x64", _saved_x64)


# Relative step: each argument moves by EPS times its own norm.
EPS = 1e-3
# |fd - autodiff| may be RTOL |g_v| |v| + NOISE |g| |v|, with g_v the
# gradient where v moves (|<g, v>| <= |g_v| |v|): RTOL for the error of the
# difference quotient in the moved block, NOISE for the float32 rounding of
# the whole loss divided by eps. Measured here: the correct gradients stay
# under 0.1 of that bound, a gradient missing the combine weight exceeds it
# 5 to 380 times (CheckerSensitivityTest).
RTOL = 1e-3
NOISE = 3e-4
_RANDOM_DIRECTIONS = 2


def _cfg(**changes) -> moe_core.MoEConfig:
  base = dict(num_experts=8, top_k=2, hidden_size=16, expert_ffn_size=24)
  base.update(changes)
  return moe_core.MoEConfig(**base)


# name, config, tokens T.
LAYER_CASES = (
    ("softmax_norm_topk", _cfg(norm_topk_prob=True), 16),
    # DeepSeek-V3's router.
    (
        "dsv3_sigmoid_bias_groups_scaled",
        _cfg(num_experts=16, top_k=3, **cases.DEEPSEEK_V3_ROUTER),
        16,
    ),
    (
        "shared_gated_gelu",
        _cfg(activation="gelu", shared_ffn_size=20, shared_expert_gate=True),
        16,
    ),
    # ceil(0.5 * 16 * 2 / 8) = 2 slots per expert: copies are dropped.
    ("capacity_0.5", _cfg(capacity_factor=0.5), 16),
    # The expert-FFN switches: GPT-OSS's clamped GLU with biases; Inkling
    # 2's soft caps; a non-gated squared ReLU with biases, its shared
    # expert and Llama 4's weights on the input.
    (
        "gpt_oss_glu_bias_limit",
        _cfg(
            activation="gpt_oss_glu",
            swiglu_alpha=1.702,
            # Above these products (the clamp's kink would break the
            # difference quotient): the clamp's derivative is checked
            # against the reference on every backend instead.
            swiglu_limit=4.0,
            expert_bias=True,
        ),
        12,
    ),
    (
        "softcapped_silu",
        _cfg(activation="softcapped_silu", gate_softcap=0.7, up_softcap=0.9),
        16,
    ),
    (
        "relu2_bias_weights_on_input",
        _cfg(
            activation="relu2",
            expert_bias=True,
            shared_ffn_size=20,
            routing_weights_on_input=True,
        ),
        16,
    ),
    # Every learned router switch at once, through sqrt(softplus) scores.
    (
        "router_switches_sqrtsoftplus",
        _cfg(
            score_func="sqrtsoftplus",
            norm_topk_prob=True,
            router_bias=True,
            router_logit_softcap=2.0,
            router_input_norm=True,
            router_input_scale=0.5,
            expert_input_norm=True,
            expert_output_scale=True,
        ),
        16,
    ),
    (
        "sparsemixer",
        _cfg(score_func="sparsemixer", sparsemixer_epsilon=0.3),
        16,
    ),
)


def _layer_inputs(cfg, num_tokens, seed):
  """(params, x): float64 numpy, matrices of std 1/sqrt(fan_in)."""
  rng = np.random.default_rng(seed)
  params = {}
  for name, shape in moe_core.param_shapes(cfg).items():
    if name in params_lib.CONSTANT_INIT:  # A bias or scale, moved off 0 or 1.
      start = params_lib.CONSTANT_INIT[name]
      params[name] = start + 0.3 * rng.standard_normal(shape)
      continue
    scale = 0.1 if name == "correction_bias" else shape[-2] ** -0.5
    params[name] = scale * rng.standard_normal(shape)
  x = rng.standard_normal((num_tokens, cfg.hidden_size))
  return params, x


def _directions(value, grad, rng):
  """(label, v) pairs: the gradient, then random blocks, |v| = |value|.

  A block is one leading index (one expert of an expert weight, one token
  of x) or all of a vector. Entries where `value` is NaN (padding rows) are
  never moved, and blocks that are all NaN are not drawn.
  """
  movable = ~np.isnan(value)
  size = np.linalg.norm(np.where(movable, value, 0.0))
  out = []
  if np.any(grad != 0):
    out.append(("gradient", grad))
  if value.ndim == 1:
    blocks = [np.s_[:]] * _RANDOM_DIRECTIONS
  else:
    candidates = np.flatnonzero(movable.reshape(len(value), -1).any(axis=1))
    blocks = [
        np.s_[int(i)]
        for i in rng.choice(
            candidates,
            _RANDOM_DIRECTIONS,
            replace=len(candidates) < _RANDOM_DIRECTIONS,
        )
    ]
  for where in blocks:
    v = np.zeros(value.shape)
    v[where] = rng.standard_normal(v[where].shape)
    out.append((f"random block [{where}]", np.where(movable, v, 0.0)))
  return [(label, v * (size / np.linalg.norm(v))) for label, v in out]


def finite_difference_mismatches(f, args, grads, seed=0) -> list[str]:
  """Where autodiff `grads` of f at `args` disagree with central differences.

  Args:
    f: jitted args -> (scalar float64 loss, decision), where decision is a
      pytree of integer/bool arrays (chosen experts, kept copies) that must
      not change between the evaluation points (AssertionError if it does).
    args: dict of float64 numpy arrays; NaN entries are never moved.
    grads: dict of the autodiff gradients of the loss at `args`.
    seed: of the random directions.

  Returns:
    One message per direction v whose difference quotient is further than
    RTOL |g_v| |v| + NOISE |g| |v| from <g, v> (g_v: g where v moves);
    empty if none.
  """
  rng = np.random.default_rng(seed)
  _, decision = f(args)
  problems = []
  for name in sorted(args):
    value = np.asarray(args[name])
    g = np.where(np.isnan(value), 0.0, np.asarray(grads[name]))
    for label, v in _directions(value, g, rng):
      values = []
      for sign in (1.0, -1.0):
        loss, moved_decision = f(
            dict(args, **{name: args[name] + sign * EPS * v})
        )
        jax.tree.map(
            lambda a, b, name=name: np.testing.assert_array_equal(
                a,
                b,
                f"a step along d {name} changes the routing: pick "
                "another seed",
            ),
            moved_decision,
            decision,
        )
        values.append(float(loss))
      fd = (values[0] - values[1]) / (2 * EPS)
      want = float(np.sum(g * v))
      bound = np.linalg.norm(v) * (
          RTOL * np.linalg.norm(np.where(v != 0, g, 0.0))
          + NOISE * np.linalg.norm(g)
      )
      if not abs(fd - want) <= bound:
        problems.append(
            f"d {name} along the {label}: finite difference "
            f"{fd:.8g}, autodiff {want:.8g}"
        )
  return problems


class FiniteDifferenceCase(parameterized.TestCase):

  def assertMatchesFiniteDifferences(self, f, args, grads, seed=0):
    """See finite_difference_mismatches."""
    problems = finite_difference_mismatches(f, args, grads, seed)
    self.assertEmpty(problems, "\n".join(problems))


def _layer_loss(cfg, cotangent, backend):
  """args -> (sum(y * cotangent), (expert_ids, kept)), jitted, and the
  jitted gradient of the loss; args holds the params and "x"."""

  def loss(args):
    params = {n: a for n, a in args.items() if n != "x"}
    y, aux = moe_core.moe_layer(params, args["x"], cfg, backend=backend)
    return jnp.sum(y * cotangent), (aux.expert_ids, aux.kept)

  return jax.jit(loss), jax.jit(jax.grad(lambda a: loss(a)[0]))


class LayerGradientTest(FiniteDifferenceCase):

  @parameterized.named_parameters(*LAYER_CASES)
  def test_layer_gradients_match_finite_differences(self, cfg, num_tokens):
    params, x = _layer_inputs(cfg, num_tokens, seed=0)
    args = dict(params, x=x)
    cotangent = np.random.default_rng(1).standard_normal(x.shape)
    f, grad = _layer_loss(cfg, cotangent, "reference")
    grads = grad(args)
    self.assertEqual(sorted(grads), sorted(args))
    for name, g in grads.items():
      self.assertEqual(g.dtype, jnp.float64, f"d {name} dtype")
      self.assertTrue(np.isfinite(g).all(), f"d {name} finite")
    _, (_, kept) = f(args)
    if cfg.capacity_factor is not None:
      self.assertFalse(np.asarray(kept).all(), "the case should drop copies")
    if cfg.correction_bias:
      # It steers the choice only: exactly no gradient (and the central
      # differences below see none either, the choice being unchanged).
      np.testing.assert_array_equal(grads["correction_bias"], 0.0)
    self.assertMatchesFiniteDifferences(f, args, grads)


class ExpertFfnGradientTest(FiniteDifferenceCase):

  def test_expert_ffn_on_dispatched_rows(self):
    """Groups (5, 0, 9, 7) of 26 rows: expert 1 empty, rows 21.. padding
    (NaN), whose gradient is exactly zero, as is expert 1's."""
    cfg = _cfg(num_experts=4, activation="gelu_tanh")
    group_sizes = jnp.asarray([5, 0, 9, 7], jnp.int32)
    used = 21
    rng = np.random.default_rng(2)
    params = {
        n: s[-2] ** -0.5 * rng.standard_normal(s)
        for n, s in moe_core.param_shapes(cfg).items()
        if n.startswith("w_")
    }
    rows = rng.standard_normal((26, cfg.hidden_size))
    rows[used:] = np.nan
    cotangent = rng.standard_normal(rows.shape)
    be = moe_core.get_backend("reference")

    def loss(args):
      out = be.expert_ffn(
          args["rows"],
          group_sizes,
          {n: a for n, a in args.items() if n != "rows"},
          cfg,
      )
      return jnp.sum(out * cotangent), ()

    args = dict(params, rows=rows)
    f = jax.jit(loss)
    grads = jax.jit(jax.grad(lambda a: loss(a)[0]))(args)
    np.testing.assert_array_equal(
        grads["rows"][used:], 0.0, "d of NaN padding rows"
    )
    for name in params:
      np.testing.assert_array_equal(
          grads[name][1], 0.0, f"d {name} of the empty expert 1"
      )
      self.assertTrue(np.isfinite(grads[name]).all(), f"d {name} finite")
    self.assertMatchesFiniteDifferences(f, args, grads, seed=3)


class GroupedGemmGradientTest(FiniteDifferenceCase):

  @parameterized.named_parameters(("plain", False), ("transposed", True))
  def test_grouped_gemm_vjp(self, transpose_rhs):
    """[20, 6] x [5, 6, 7] over groups (3, 0, 7, 1, 4): rows 15.. padding."""
    sizes = jnp.asarray([3, 0, 7, 1, 4], jnp.int32)
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((20, 6))
    rows[15:] = np.nan
    weights = rng.standard_normal((5, 7, 6) if transpose_rhs else (5, 6, 7))
    cotangent = rng.standard_normal((20, 7))
    be = moe_core.get_backend("reference")

    def gemm(r, w):
      return be.grouped_gemm(r, w, sizes, transpose_rhs=transpose_rhs)

    def loss(args):
      return jnp.sum(gemm(args["rows"], args["weights"]) * cotangent), ()

    args = {"rows": rows, "weights": weights}
    out, vjp = jax.vjp(gemm, rows, weights)
    d_rows, d_weights = vjp(jnp.asarray(cotangent))
    self.assertEqual(out.dtype, jnp.float64)
    np.testing.assert_array_equal(d_rows[15:], 0.0, "d of NaN padding rows")
    np.testing.assert_array_equal(d_weights[1], 0.0, "d of empty group 1")
    self.assertMatchesFiniteDifferences(
        jax.jit(loss), args, {"rows": d_rows, "weights": d_weights}, seed=5
    )


class _NoCombineWeightInGradient(reference.ReferenceBackend):
  """The reference's forward, with a wrong gradient: that of the experts'
  outputs summed without their combine weights."""

  name = "reference_without_combine_weight_gradient"

  def _routed_experts(self, params, x, aux, cfg):
    y = super()._routed_experts(params, x, aux, cfg)
    unweighted = super()._routed_experts(
        params,
        x,
        dataclasses.replace(
            aux, combine_weights=jnp.ones_like(aux.combine_weights)
        ),
        cfg,
    )
    stop = jax.lax.stop_gradient
    return stop(y) + unweighted - stop(unweighted)


class CheckerSensitivityTest(FiniteDifferenceCase):

  def test_a_missing_combine_weight_is_caught(self):
    name, cfg, num_tokens = LAYER_CASES[0]
    del name
    params, x = _layer_inputs(cfg, num_tokens, seed=0)
    args = dict(params, x=x)
    cotangent = np.random.default_rng(1).standard_normal(x.shape)
    f, _ = _layer_loss(cfg, cotangent, "reference")
    _, wrong_grad = _layer_loss(cfg, cotangent, _NoCombineWeightInGradient())
    problems = finite_difference_mismatches(f, args, wrong_grad(args))
    wrong = {p.split()[1] for p in problems}
    # The combine weight multiplies every expert's output, so the gradient
    # of every expert weight and of x is wrong, and of the router (the
    # weights' own gradient is gone).
    self.assertContainsSubset(
        {"w_gate", "w_up", "w_down", "x", "router"}, wrong, "\n".join(problems)
    )


if __name__ == "__main__":
  absltest.main()
