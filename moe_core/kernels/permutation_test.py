"""The permutation primitive's rules against autodiff of moe_core.permute.

The default `PermutationKernels` (plain JAX) inside the primitive: every
derivative comes from the primitive's jvp and transpose rules, compared with
JAX's own derivatives of `moe_core.permute.dispatch` and `combine`, the
contract, with dropped copies and invalid ids (NaN) included."""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import permute
from moe_core.kernels import permutation

KERNELS = permutation.PermutationKernels()  # The plain-JAX defaults.
T, K, D, E = 6, 2, 5, 4


def _setup(seed=0, drop=False, invalid=False):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (T, D))
  ids = jax.random.randint(keys[1], (T, K), 0, E)
  if invalid:
    ids = ids.at[2, 1].set(E + 3)
  weights = jax.random.uniform(keys[2], (T, K), minval=0.1, maxval=1.0)
  kept = None
  if drop:
    kept = jnp.ones((T, K), bool).at[1, 0].set(False).at[4, 1].set(False)
  return x, ids, weights, kept, keys[3]


def _ours(x, rows_scale, weights, ids, kept):
  """dispatch -> a row-wise op -> combine through the primitive."""
  plan = permutation.Plan.of(permute.plan(ids, E, kept), kept)
  rows = permutation.gather(KERNELS, x, plan, top_k=K)
  rows = jnp.tanh(rows * rows_scale)
  return permutation.combine(KERNELS, rows, weights, plan, top_k=K)


def _want(x, rows_scale, weights, ids, kept):
  d = permute.dispatch(x, ids, E, kept)
  rows = jnp.tanh(d.rows * rows_scale)
  return permute.combine(rows, d, weights, kept)


def _close(got, want, tol=1e-5):
  np.testing.assert_allclose(
      np.asarray(got), np.asarray(want), rtol=tol, atol=tol
  )


class PermutationTest(parameterized.TestCase):

  @parameterized.product(drop=[False, True], invalid=[False, True])
  def test_forward_and_gradients_match_permute(self, drop, invalid):
    x, ids, weights, kept, key = _setup(drop=drop, invalid=invalid)
    scale = jax.random.normal(key, (T * K, 1)) + 2.0
    ct = jax.random.normal(jax.random.key(3), (T, D))
    args = (x, scale, weights)

    def loss(fn):
      return lambda x, s, w, i, k: jnp.sum(
          jnp.nan_to_num(fn(x, s, w, i, k)) * ct
      )

    # Jitted: traced ids may be out of range (eager ones raise).
    got = jax.jit(_ours)(*args, ids, kept)
    want = jax.jit(_want)(*args, ids, kept)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    _close(jnp.nan_to_num(got), jnp.nan_to_num(want))
    for g, w in zip(
        jax.jit(jax.grad(loss(_ours), (0, 1, 2)))(*args, ids, kept),
        jax.jit(jax.grad(loss(_want), (0, 1, 2)))(*args, ids, kept),
    ):
      # NaN where the contract gives NaN (an invalid copy's weight).
      np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
      _close(jnp.nan_to_num(g), jnp.nan_to_num(w))

  def test_forward_mode_and_hessian(self):
    x, ids, weights, kept, key = _setup(drop=True)
    scale = jax.random.normal(key, (T * K, 1)) + 2.0
    tangents = (jnp.ones_like(x) * 0.3, scale * 0.1, weights * 0.5)
    got = jax.jvp(
        lambda *a: _ours(*a, ids, kept), (x, scale, weights), tangents
    )
    want = jax.jvp(
        lambda *a: _want(*a, ids, kept), (x, scale, weights), tangents
    )
    _close(got[0], want[0])
    _close(got[1], want[1])

    def loss(fn):
      return lambda v: jnp.sum(
          jnp.tanh(fn(x * v[0], scale, weights * v[1], ids, kept))
      )

    v = jnp.array([0.8, 1.2])
    _close(
        jax.jit(jax.hessian(loss(_ours)))(v), jax.hessian(loss(_want))(v), 1e-4
    )

  def test_vmap_of_gradient(self):
    batch = [_setup(seed=s) for s in range(3)]
    xs = jnp.stack([b[0] for b in batch])
    ids = jnp.stack([b[1] for b in batch])
    weights = jnp.stack([b[2] for b in batch])
    scale = jnp.ones((T * K, 1)) * 1.5

    def loss(fn):
      return lambda x, w, i: jnp.sum(fn(x, scale, w, i, None) ** 2)

    for g, w in zip(
        jax.jit(jax.vmap(jax.grad(loss(_ours), (0, 1))))(xs, weights, ids),
        jax.vmap(jax.grad(loss(_want), (0, 1)))(xs, weights, ids),
    ):
      _close(g, w)

  def test_shard_map_with_checked_variance(self):
    x, ids, weights, _, _ = _setup()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec
    scale = jnp.ones((T * K, 1))  # Replicated: the rows vary, it does not.

    def f(x, w, i):
      return _ours(x, scale, w, i, None)

    got = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(spec("data"), spec("data"), spec("data")),
            out_specs=spec("data"),
        )
    )(x, weights, ids)
    _close(got, _want(x, scale, weights, ids, None))

  def test_bad_kernels_are_refused(self):
    x, ids, _, _, _ = _setup()
    plan = permutation.Plan.of(permute.plan(ids, E), None)
    with self.assertRaisesRegex(TypeError, "kernels must be a Permutation"):
      permutation.gather(object(), x, plan, top_k=K)


if __name__ == "__main__":
  absltest.main()
