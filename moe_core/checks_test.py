"""The run-time policy's building blocks (moe_core/checks.py) and routing's
accounting of invalid assignments. The policy on every backend is the
conformance suite's (conformance/bad_input_table.py)."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import checks


def _gemm(rows, weights, bad):
  return checks.poison_if(bad, rows @ weights, rows, weights)


class PoisonTest(parameterized.TestCase):

  def test_valid_call_is_bit_exact_and_its_gradient_untouched(self):
    rows = jax.random.normal(jax.random.key(0), (5, 3))
    weights = jax.random.normal(jax.random.key(1), (3, 4))
    cotangent = jax.random.normal(jax.random.key(2), (5, 4))

    def loss(r, w, bad):
      return jnp.sum(_gemm(r, w, bad) * cotangent)

    np.testing.assert_array_equal(
        _gemm(rows, weights, jnp.bool_(False)), rows @ weights
    )
    got = jax.grad(loss, argnums=(0, 1))(rows, weights, jnp.bool_(False))
    want = jax.grad(lambda r, w: jnp.sum((r @ w) * cotangent), (0, 1))(
        rows, weights
    )
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)

  def test_nan_input_row_does_not_leak_into_a_valid_call(self):
    # Padding rows may hold NaN: the poison's witness reads rows[0] and
    # must not turn a valid output or gradient into NaN.
    rows = jnp.ones((3, 2)).at[0, 0].set(jnp.nan)
    weights = jnp.ones((2, 2))
    out = checks.poison_if(jnp.bool_(False), jnp.zeros((3, 2)), rows, weights)
    np.testing.assert_array_equal(out, np.zeros((3, 2)))

  def test_bad_call_is_nan_with_nan_gradients(self):
    rows = jnp.ones((4, 3))
    weights = jnp.ones((3, 2))
    out = jax.jit(_gemm)(rows, weights, jnp.bool_(True))
    self.assertTrue(np.isnan(out).all())
    grads = jax.grad(lambda r, w: jnp.sum(_gemm(r, w, True)), (0, 1))(
        rows, weights
    )
    for g in grads:
      self.assertTrue(np.isnan(g).any())

  def test_nan_if_is_bit_exact_when_valid_and_nan_through_the_backward(self):
    rows = jax.random.normal(jax.random.key(0), (5, 3)).at[1, 1].set(-0.0)
    weights = jax.random.normal(jax.random.key(1), (3, 4))
    cotangent = jax.random.normal(jax.random.key(2), (5, 4))

    def loss(r, w, bad):
      return jnp.sum(checks.nan_if(bad, r @ w) * cotangent)

    for dtype in (jnp.float32, jnp.bfloat16):
      out = (rows @ weights).astype(dtype)
      np.testing.assert_array_equal(checks.nan_if(jnp.bool_(False), out), out)
      self.assertTrue(np.isnan(checks.nan_if(jnp.bool_(True), out)).all())
    valid = jax.grad(loss, argnums=(0, 1))(rows, weights, jnp.bool_(False))
    plain = jax.grad(lambda r, w: jnp.sum((r @ w) * cotangent), (0, 1))(
        rows, weights
    )
    for got, want in zip(valid, plain):
      np.testing.assert_array_equal(got, want)
    # Bad: the cotangent is NaN, so everything computed from it is.
    for g in jax.jit(jax.grad(loss, argnums=(0, 1)))(
        rows, weights, jnp.bool_(True)
    ):
      self.assertTrue(np.isnan(g).all())
    _, tangent = jax.jvp(
        lambda r: checks.nan_if(jnp.bool_(True), r @ weights),
        (rows,),
        (jnp.ones_like(rows),),
    )
    self.assertTrue(np.isnan(tangent).all())

  @parameterized.named_parameters(
      ("valid", [2, 0, 3], 5, False),
      ("fewer_rows_used", [1, 1, 1], 5, False),
      ("negative", [-1, 3, 3], 5, True),
      ("past_the_rows", [2, 2, 2], 5, True),
      # int32 wrap-around: the exact sum is 2**31 + 1, the int32 sum is
      # negative; the float32 sum catches it.
      ("wraps_around", [2**31 - 1, 2, 0], 5, True),
  )
  def test_bad_group_sizes(self, sizes, num_rows, want):
    sizes = jnp.asarray(sizes, jnp.int32)
    self.assertEqual(bool(checks.bad_group_sizes(sizes, num_rows)), want)
    self.assertEqual(
        bool(
            jax.jit(checks.bad_group_sizes, static_argnums=1)(sizes, num_rows)
        ),
        want,
    )


class InvalidRoutingTest(parameterized.TestCase):
  """route: kept + dropped + invalid accounts for all T*K assignments."""

  @parameterized.product(
      capacity_factor=(None, 0.5),
      poison=("x", "router", "bias"),
  )
  def test_every_assignment_accounted_for(self, capacity_factor, poison):
    cfg = moe_core.MoEConfig(
        num_experts=8,
        top_k=2,
        hidden_size=16,
        expert_ffn_size=8,
        score_func="sigmoid",
        correction_bias=True,
        capacity_factor=capacity_factor,
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (10, 16))
    router, bias = params["router"], params["correction_bias"]
    if poison == "x":
      x = x.at[4, 3].set(jnp.inf)
      want_invalid_tokens = [4]
    elif poison == "router":
      router = router.at[5, 2].set(jnp.nan)  # Every token's score 2.
      want_invalid_tokens = list(range(10))
    else:
      bias = bias.at[7].set(jnp.nan)
      want_invalid_tokens = list(range(10))
    aux = jax.jit(moe_core.route, static_argnums=2)(x, router, cfg, bias)
    t, k = aux.expert_ids.shape
    self.assertEqual(
        int(aux.kept.sum())
        + int(aux.dropped_tokens)
        + int(aux.invalid_assignments),
        t * k,
    )
    self.assertEqual(int(aux.invalid_assignments), k * len(want_invalid_tokens))
    nan_tokens = np.flatnonzero(np.isnan(aux.combine_weights).any(axis=1))
    self.assertEqual(nan_tokens.tolist(), want_invalid_tokens)
    self.assertEqual(
        int(aux.tokens_per_expert.sum()), t * k - int(aux.invalid_assignments)
    )

  def test_invalid_tokens_take_no_capacity(self):
    # With capacity for every valid token, poisoning token 0 (first in the
    # priority order) must not drop anything else.
    cfg = moe_core.MoEConfig(
        num_experts=4,
        top_k=1,
        hidden_size=8,
        expert_ffn_size=4,
        capacity_factor=4.0,
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (6, 8)).at[0, 0].set(jnp.nan)
    aux = moe_core.route(x, params["router"], cfg)
    self.assertEqual(int(aux.dropped_tokens), 0)
    self.assertEqual(aux.kept[:, 0].tolist(), [False] + [True] * 5)


class CheckedModeTest(absltest.TestCase):

  def test_checked_raises_the_eager_words(self):
    x = jnp.ones((3, 4))
    ids = jnp.array([[0, 1], [2, 9], [1, 0]], jnp.int32)
    with self.assertRaisesRegex(
        ValueError,
        r"expert_ids must lie in \[0, num_experts=8\), got values "
        r"in \[0, 9\]",
    ):
      moe_core.dispatch(x, ids, 8)
    dispatch = jax.jit(moe_core.dispatch, static_argnums=2)
    with self.assertRaisesRegex(
        ValueError,
        r"expert_ids must lie in \[0, num_experts=8\), got values "
        r"in \[0, 9\]",
    ):
      moe_core.checked(dispatch)(x, ids, 8)
    # Unchecked under jit: no error, the copy is marked invalid instead.
    self.assertEqual(int(dispatch(x, ids, 8).invalid.sum()), 1)

  def test_checks_are_traced_only_under_checked(self):
    # A check left in a plain program carries checkify's ErrorEffect, which
    # jax.export cannot serialise.
    def f(x):
      checks.debug_check(jnp.all(x > 0), "x must be > 0, got {}.", x.min())
      return x * 2

    plain = jax.make_jaxpr(f)(jnp.ones(3))
    self.assertEmpty(plain.effects)
    exported = jax.export.export(jax.jit(f))(jnp.ones(3))
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(restored.call(-jnp.ones(3)), -2 * np.ones(3))

  def test_checked_retraces_a_function_jitted_without_checks(self):
    # The jit cache of a function first traced plainly must not hand
    # `checked` the program without checks, nor the reverse.
    ids = jnp.array([[0, 9]], jnp.int32)
    dispatch = jax.jit(moe_core.dispatch, static_argnums=2)
    x = jnp.ones((1, 4))
    self.assertEqual(int(dispatch(x, ids, 8).invalid.sum()), 1)
    with self.assertRaisesRegex(ValueError, "expert_ids must lie in"):
      moe_core.checked(dispatch)(x, ids, 8)
    self.assertEqual(int(dispatch(x, ids, 8).invalid.sum()), 1)
    self.assertFalse(checks.tracing_checked())


if __name__ == "__main__":
  absltest.main()
