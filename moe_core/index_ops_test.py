"""index_ops against the jnp operations they stand in for: bincount,
take_along_axis (values and gradients, out-of-range ids, NaN elsewhere in
the row), the inverse permutation, a scattered one-hot mask."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import index_ops


class IndexOpsTest(absltest.TestCase):

  def test_count_is_bincount(self):
    rng = np.random.default_rng(0)
    for length in (1, 5, 33):
      values = rng.integers(-3, length + 3, size=(7, 9)).astype(np.int32)
      want = np.bincount(
          values[(values >= 0) & (values < length)], minlength=length
      )
      got = jax.jit(index_ops.count, static_argnums=1)(values, length)
      np.testing.assert_array_equal(got, want)
      self.assertEqual(got.dtype, jnp.int32)

  def test_pick_is_take_along_axis(self):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 8)).astype(np.float32)
    x[2, 5] = np.nan  # Not picked in row 2: must not leak.
    x[3, 1] = np.inf
    ids = rng.integers(0, 8, size=(6, 3)).astype(np.int32)
    ids[2] = (0, 1, 7)
    ids[3] = (1, 4, 4)
    ids[4] = (-1, 8, -9)  # -1: the last; past either end: NaN (its fill).
    want = jnp.take_along_axis(jnp.asarray(x), ids, axis=-1)
    got = jax.jit(index_ops.pick)(x, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    self.assertTrue(np.isnan(got[4, 1]) and np.isnan(got[4, 2]))

  def test_pick_gradient_is_take_along_axis_gradient(self):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(5, 6)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 6, size=(5, 4)), jnp.int32)
    ct = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    loss = lambda f: lambda x: jnp.sum(f(x, ids) * ct)
    take = lambda x, i: jnp.take_along_axis(x, i, axis=-1)
    want = jax.grad(loss(take))(x)
    got = jax.grad(loss(index_ops.pick))(x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    _, tangent = jax.jvp(lambda x: index_ops.pick(x, ids), (x,), (x,))
    np.testing.assert_array_equal(tangent, take(x, ids))

  def test_inverse_permutation(self):
    perm = np.random.default_rng(3).permutation(37).astype(np.int32)
    position = jax.jit(index_ops.inverse_permutation)(perm)
    np.testing.assert_array_equal(np.asarray(position)[perm], np.arange(37))

  def test_permute_values_is_the_gather_forward_and_backward(self):
    rng = np.random.default_rng(4)
    source = rng.permutation(41).astype(np.int32)
    destination = np.asarray(index_ops.inverse_permutation(source))
    values = rng.normal(size=41).astype(np.float32)
    values[7] = np.nan  # Moves with its slot, touches no other.
    ct = rng.normal(size=41).astype(np.float32)
    ours = lambda v: index_ops.permute_values(v, destination, source)
    gather = lambda v: v[source]
    np.testing.assert_array_equal(jax.jit(ours)(values), values[source])
    finite = np.nan_to_num(values)
    for mode in ("jvp", "vjp"):
      with self.subTest(mode):
        if mode == "jvp":
          got = jax.jvp(ours, (finite,), (ct,))
          want = jax.jvp(gather, (finite,), (ct,))
        else:
          got = jax.vjp(ours, finite)[1](ct)
          want = jax.vjp(gather, finite)[1](ct)
        for g, w in zip(got, want):
          np.testing.assert_array_equal(g, w)
    # Reverse mode sorts back: no scatter, no gather of single elements.
    jaxpr = str(
        jax.make_jaxpr(jax.grad(lambda v: jnp.vdot(ours(v), ct)))(finite)
    )
    self.assertNotIn("scatter", jaxpr)
    self.assertNotIn("gather", jaxpr)
    # Batched values, one permutation.
    batch = rng.normal(size=(3, 41)).astype(np.float32)
    got = jax.vmap(ours)(batch)
    np.testing.assert_array_equal(got, batch[:, source])

  def test_one_hot_rows(self):
    ids = np.array([[0, 2], [3, 3], [1, 0]], np.int32)
    want = np.zeros((3, 4), bool)
    want[np.arange(3)[:, None], ids] = True
    np.testing.assert_array_equal(index_ops.one_hot_rows(ids, 4), want)


if __name__ == "__main__":
  absltest.main()
