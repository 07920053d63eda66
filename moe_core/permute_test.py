"""moe_core.permute: dispatch sorts copies by expert; combine undoes it."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import permute

_E = 5


def _case(t=12, k=2, d=6, seed=0):
  """x [T, D] float32 and distinct expert_ids [T, K] int32 (numpy)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((t, d)).astype(np.float32)
  ids = np.stack([rng.choice(_E, k, replace=False) for _ in range(t)])
  return x, ids.astype(np.int32)


def _expert_of_rows(group_sizes, num_rows):
  """[M] the expert owning each sorted row; E for rows past the groups."""
  owner = np.repeat(np.arange(len(group_sizes)), group_sizes)
  return np.concatenate(
      [owner, np.full(num_rows - len(owner), len(group_sizes))]
  )


class DispatchTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 3)
  def test_rows_sorted_by_expert_stably(self, k):
    x, ids = _case(k=k)
    out = permute.dispatch(jnp.asarray(x), jnp.asarray(ids), _E)
    np.testing.assert_array_equal(
        out.group_sizes, np.bincount(ids.ravel(), minlength=_E)
    )
    self.assertEqual(out.group_sizes.dtype, jnp.int32)
    assignment = np.asarray(out.assignment)
    owner = _expert_of_rows(np.asarray(out.group_sizes), len(assignment))
    np.testing.assert_array_equal(ids.ravel()[assignment], owner)
    # Stable: within an expert, assignments (so tokens) keep their order.
    for e in range(_E):
      mine = assignment[owner == e]
      np.testing.assert_array_equal(mine, np.sort(mine))
    np.testing.assert_array_equal(out.rows, x[assignment // k])
    np.testing.assert_array_equal(
        np.asarray(out.position)[assignment], np.arange(len(assignment))
    )

  def test_dropped_copies_come_after_every_group(self):
    x, ids = _case(k=2, seed=1)
    kept = np.random.default_rng(2).random(ids.shape) > 0.3
    out = permute.dispatch(
        jnp.asarray(x), jnp.asarray(ids), _E, jnp.asarray(kept)
    )
    want_sizes = np.bincount(ids[kept], minlength=_E)
    np.testing.assert_array_equal(out.group_sizes, want_sizes)
    n = want_sizes.sum()
    assignment = np.asarray(out.assignment)
    self.assertTrue(kept.ravel()[assignment[:n]].all())
    self.assertFalse(kept.ravel()[assignment[n:]].any())
    np.testing.assert_array_equal(assignment[n:], np.flatnonzero(~kept.ravel()))

  def test_under_jit(self):
    x, ids = _case(k=2)
    eager = permute.dispatch(jnp.asarray(x), jnp.asarray(ids), _E)
    jitted = jax.jit(permute.dispatch, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(ids), _E
    )
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
      np.testing.assert_array_equal(a, b)


class PlanTest(parameterized.TestCase):
  """permute.plan is dispatch's sort without the rows."""

  @parameterized.parameters(False, True)
  def test_plan_then_gather_is_dispatch(self, drop):
    x, ids = _case(k=3, seed=4)
    ids[5, 1] = _E + 2  # An invalid copy: traced, so only under jit.
    kept = None
    if drop:
      kept = jnp.asarray(np.random.default_rng(5).random(ids.shape) > 0.3)

    def split(x, ids, kept):
      plan = permute.plan(ids, _E, kept)
      return plan, permute.gather_unchecked(x, plan)

    plan, gathered = jax.jit(split)(jnp.asarray(x), jnp.asarray(ids), kept)
    want = jax.jit(permute.dispatch, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(ids), _E, kept
    )
    self.assertEqual(plan.top_k, 3)
    self.assertIsInstance(plan, permute.DispatchPlan)
    for name in ("group_sizes", "assignment", "position", "invalid"):
      np.testing.assert_array_equal(getattr(plan, name), getattr(want, name))
    np.testing.assert_array_equal(gathered.rows, want.rows)  # NaN == NaN.
    self.assertTrue(np.isnan(np.asarray(gathered.rows)).any())
    for a, b in zip(jax.tree.leaves(gathered.plan), jax.tree.leaves(plan)):
      np.testing.assert_array_equal(a, b)

  def test_plan_checks_its_inputs(self):
    _, ids = _case(k=2)
    with self.assertRaisesRegex(ValueError, r"expert_ids must lie in \[0"):
      permute.plan(jnp.asarray(ids).at[0, 0].set(_E), _E)
    with self.assertRaisesRegex(ValueError, "num_experts must be a positive"):
      permute.plan(jnp.asarray(ids), 0)
    with self.assertRaisesRegex(TypeError, "expert_ids must be an integer"):
      permute.plan(jnp.asarray(ids, jnp.float32), _E)
    with self.assertRaisesRegex(ValueError, "kept must have"):
      permute.plan(jnp.asarray(ids), _E, jnp.ones((3, 2), bool))


class CombineTest(parameterized.TestCase):

  def test_round_trip_top1_weight_one(self):
    x, ids = _case(k=1)
    out = permute.dispatch(jnp.asarray(x), jnp.asarray(ids), _E)
    y = permute.combine(out.rows, out, jnp.ones(ids.shape))
    np.testing.assert_array_equal(y, x)

  @parameterized.parameters(2, 3)
  def test_weighted_sum_of_each_tokens_copies(self, k):
    x, ids = _case(k=k, seed=k)
    w = np.random.default_rng(3).random(ids.shape).astype(np.float32)
    out = permute.dispatch(jnp.asarray(x), jnp.asarray(ids), _E)
    # Each expert e scales its rows by (e + 1), so a mix-up of copies or
    # experts changes the result.
    owner = _expert_of_rows(np.asarray(out.group_sizes), out.rows.shape[0])
    expert_out = out.rows * (owner[:, None] + 1.0)
    y = permute.combine(expert_out, out, jnp.asarray(w))
    want = np.einsum("tk,td->td", w * (ids + 1.0), x)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)

  def test_dropped_copies_contribute_zero_even_if_nan(self):
    x, ids = _case(k=2, seed=4)
    kept = np.ones(ids.shape, bool)
    kept[::3, 1] = False
    kept[5, 0] = False
    w = np.random.default_rng(5).random(ids.shape).astype(np.float32)
    out = permute.dispatch(
        jnp.asarray(x), jnp.asarray(ids), _E, jnp.asarray(kept)
    )
    n = int(np.sum(out.group_sizes))
    expert_out = out.rows.at[n:].set(jnp.nan)
    # Non-zero weights on dropped copies: combine must still ignore them.
    y = permute.combine(expert_out, out, jnp.asarray(w), jnp.asarray(kept))
    np.testing.assert_allclose(
        y, (w * kept).sum(-1, keepdims=True) * x, rtol=1e-6, atol=1e-6
    )
    grads = jax.grad(
        lambda o, cw: permute.combine(o, out, cw, jnp.asarray(kept)).sum(),
        argnums=(0, 1),
    )(expert_out, jnp.asarray(w))
    for g in grads:
      self.assertTrue(np.isfinite(g).all())
    np.testing.assert_array_equal(grads[0][n:], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1])[~kept], 0.0)

  def test_weight_gradient_is_per_copy_output(self):
    x, ids = _case(k=3, d=4, seed=6)
    w = np.random.default_rng(7).random(ids.shape).astype(np.float32)
    out = permute.dispatch(jnp.asarray(x), jnp.asarray(ids), _E)
    expert_out = jnp.asarray(
        np.random.default_rng(8)
        .standard_normal(out.rows.shape)
        .astype(np.float32)
    )
    jac = jax.jacobian(lambda cw: permute.combine(expert_out, out, cw))(
        jnp.asarray(w)
    )  # [T, D, T, K]
    t, k = ids.shape
    per_copy = np.asarray(expert_out)[np.asarray(out.position)].reshape(
        t, k, -1
    )
    want = np.zeros(jac.shape, np.float32)
    for token in range(t):
      want[token, :, token, :] = per_copy[token].T
    np.testing.assert_allclose(jac, want, rtol=1e-6, atol=1e-7)

  def test_output_dtype_follows_expert_out(self):
    x, ids = _case(k=2)
    out = permute.dispatch(jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), _E)
    y = permute.combine(out.rows, out, jnp.full(ids.shape, 0.5))
    self.assertEqual(y.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(y, jnp.asarray(x, jnp.bfloat16))


if __name__ == "__main__":
  absltest.main()
