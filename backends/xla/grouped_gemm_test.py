"""The xla grouped GEMM's two paths (batched bulk, tile loop) against numpy.

The shared conformance suite runs the backend as users do, where the bulk
size and the balanced-or-not choice follow from the shapes and the routing;
here each path and tile layout is forced, so every one of them is checked on
every group layout, whatever the heuristics pick. The third path, XLA's
`ragged_dot` (the default off the CPU), is checked the same way through the
backend's API: its conformance suite runs on demand only
(`//backends/xla:conformance_test_ragged_dot`, tagged manual).
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from backends.xla import backend as xla_backend
from backends.xla import grouped_gemm
from backends.xla import layout as layout_lib

_GROUP_LAYOUTS = {
    "ragged_with_empty": [30, 0, 7, 41, 12],
    "all_in_last": [0, 0, 0, 0, 100],
    "all_in_first_and_one_row": [99, 0, 0, 0, 1],
    "even": [20, 20, 20, 20, 20],
    "short_of_m": [3, 0, 0, 4, 0],  # 7 of 100 rows used.
    "nothing": [0, 0, 0, 0, 0],
}
_M, _C, _N = 100, 16, 24


def _numpy_gmm(rows, weights, sizes):
  """float64 loop over groups; rows past sum(sizes) are zero."""
  out = np.zeros((rows.shape[0], weights.shape[2]))
  start = 0
  for g, size in enumerate(sizes):
    out[start : start + size] = rows[start : start + size] @ weights[g]
    start += size
  return out


def _numpy_grads(rows, weights, sizes, dy):
  d_rows = np.zeros_like(rows)
  d_weights = np.zeros_like(weights)
  start = 0
  for g, size in enumerate(sizes):
    part = slice(start, start + size)
    d_rows[part] = dy[part] @ weights[g].T
    d_weights[g] = rows[part].T @ dy[part]
    start += size
  return d_rows, d_weights


class GroupedGemmPathsTest(parameterized.TestCase):

  def _check_against_numpy(self, layout, seed, transpose_rhs, forward):
    """Runs `forward(x, w, group_sizes, dy) -> (out, d_rows, d_weights)` on
    `layout`'s groups, its unused rows NaN, against float64 numpy."""
    sizes = _GROUP_LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(_M, _C))
    weights = rng.normal(size=(len(sizes), _C, _N))
    dy = rng.normal(size=(_M, _N))
    used = sum(sizes)
    poisoned = rows.copy()
    poisoned[used:] = np.nan  # Unused rows must not leak anywhere.
    w = np.swapaxes(weights, 1, 2) if transpose_rhs else weights
    out, d_rows, d_weights = jax.jit(forward)(
        jnp.asarray(poisoned, jnp.float32),
        jnp.asarray(w, jnp.float32),
        jnp.asarray(sizes, jnp.int32),
        jnp.asarray(dy, jnp.float32),
    )
    want_rows, want_weights = _numpy_grads(rows, weights, sizes, dy)
    if transpose_rhs:
      want_weights = np.swapaxes(want_weights, 1, 2)
    np.testing.assert_allclose(
        out, _numpy_gmm(rows, weights, sizes), atol=1e-4, rtol=1e-4
    )
    np.testing.assert_allclose(d_rows, want_rows, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(d_weights, want_weights, atol=1e-4, rtol=1e-4)
    self.assertTrue(np.all(np.asarray(out)[used:] == 0))
    self.assertTrue(np.all(np.asarray(d_rows)[used:] == 0))

  @parameterized.product(
      layout=list(_GROUP_LAYOUTS),
      bulk=[0, 8, _M],
      levels=[(256, 64, 16), (16, 4)],
      transpose_rhs=[False, True],
  )
  def test_forward_and_gradients_match_numpy(
      self, layout, bulk, levels, transpose_rhs
  ):
    # Called directly: _gmm/_tgmm take the bulk as given, no cond.
    loop = grouped_gemm.Loop(levels, None, bulk)

    def forward_and_grads(x, w, gs, dy):
      out = grouped_gemm._gmm(x, w, gs, transpose_rhs, jnp.float32, loop)
      dx = grouped_gemm._gmm(dy, w, gs, not transpose_rhs, jnp.float32, loop)
      lhs, rhs = (dy, x) if transpose_rhs else (x, dy)
      dw = grouped_gemm._tgmm(lhs, rhs, gs, w.shape[0], jnp.float32, loop)
      return out, dx, dw

    seed = len(_GROUP_LAYOUTS[layout]) + bulk
    self._check_against_numpy(layout, seed, transpose_rhs, forward_and_grads)

  @parameterized.product(
      layout=list(_GROUP_LAYOUTS), transpose_rhs=[False, True]
  )
  def test_ragged_dot_path_matches_numpy(self, layout, transpose_rhs):
    backend = xla_backend.XlaBackend(use_ragged_dot=True)

    def forward_and_grads(x, w, gs, dy):
      out, vjp = jax.vjp(
          lambda x, w: backend.grouped_gemm(
              x, w, gs, transpose_rhs=transpose_rhs
          ),
          x,
          w,
      )
      return (out, *vjp(dy))

    seed = 11 + len(layout)
    self._check_against_numpy(layout, seed, transpose_rhs, forward_and_grads)

  @parameterized.parameters(0, 8, None)
  def test_custom_vjp_matches_numpy(self, bulk):
    sizes = _GROUP_LAYOUTS["ragged_with_empty"]
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(_M, _C))
    weights = rng.normal(size=(len(sizes), _C, _N))
    dy = rng.normal(size=(_M, _N))
    gs = jnp.asarray(sizes, jnp.int32)
    out, vjp = jax.vjp(
        lambda x, w: grouped_gemm.grouped_gemm(
            x, w, gs, False, None, (16, 4), None, bulk
        ),
        jnp.asarray(rows, jnp.float32),
        jnp.asarray(weights, jnp.float32),
    )
    d_rows, d_weights = vjp(jnp.asarray(dy, jnp.float32))
    want_rows, want_weights = _numpy_grads(rows, weights, sizes, dy)
    np.testing.assert_allclose(
        out, _numpy_gmm(rows, weights, sizes), atol=1e-4, rtol=1e-4
    )
    np.testing.assert_allclose(d_rows, want_rows, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(d_weights, want_weights, atol=1e-4, rtol=1e-4)

  def test_balanced_rule_takes_the_bulk_only_for_balanced_sizes(self):
    bulk = layout_lib.bulk_rows(4096, 8)
    self.assertEqual(bulk, 560)  # 512 + 2 * sqrt(512) = 557, rounded to 8.
    even = jnp.full((8,), 512, jnp.int32)
    skewed = jnp.asarray([2048, 1024, 512, 256, 128, 64, 32, 32], jnp.int32)
    self.assertTrue(bool(layout_lib.balanced(even, bulk, 4096)))
    self.assertFalse(bool(layout_lib.balanced(skewed, bulk, 4096)))

  def test_balanced_rule_takes_the_bulk_for_multinomial_routing(self):
    # At E=64 the bulk holds 64 * 80 = 5120 rows for 4096 by design (mean
    # + 2 sigma each); multinomial sizes must not fall to the tile loop.
    bulk = layout_lib.bulk_rows(4096, 64)
    self.assertEqual(bulk, 80)  # 64 + 2 * sqrt(64) = 80.
    for seed in range(5):
      sizes = np.random.default_rng(seed).multinomial(4096, [1 / 64] * 64)
      with self.subTest(seed=seed):
        self.assertTrue(
            bool(layout_lib.balanced(jnp.asarray(sizes, jnp.int32), bulk, 4096))
        )
    # Few real rows in a large buffer (EP receive buffers) stay in the loop:
    # the bulk would be mostly padding.
    sparse = jnp.full((64,), 16, jnp.int32)
    self.assertFalse(bool(layout_lib.balanced(sparse, bulk, 4096)))

  def test_no_bulk_when_it_would_be_mostly_padding(self):
    self.assertEqual(layout_lib.bulk_rows(16, 256), 0)


if __name__ == "__main__":
  absltest.main()
