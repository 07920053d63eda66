"""quantized_gemm.straight_through: a forward's value, the derivatives of
the unquantised GEMM at every order."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import quantized_gemm
from moe_core.kernels import primitive


def _rounded_product(rows, weights, group_sizes):
  """(rows and weights rounded to 1/4, multiplied per group,): a kernel
  without derivatives of its own."""
  del group_sizes  # One group in these tests.
  rows, weights = (jnp.round(x * 4) / 4 for x in (rows, weights))
  return (rows @ weights[0],)


def _quantized(rows, weights, group_sizes):
  # An opaque primitive: JAX has no rule to differentiate it.
  return primitive.call_kernel(_rounded_product, rows, weights, group_sizes)[0]


def _unquantized(rows, weights, group_sizes):
  del group_sizes
  return rows @ weights[0]


class StraightThroughTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    keys = jax.random.split(jax.random.key(0), 3)
    self.rows = jax.random.normal(keys[0], (6, 4))
    self.weights = jax.random.normal(keys[1], (1, 4, 3))
    self.cotangent = jax.random.normal(keys[2], (6, 3))
    self.group_sizes = jnp.array([6], jnp.int32)

  def loss(self, gemm):
    """A 2 x 2 Hessian: scalars scale the rows and the weights."""

    def f(v):
      out = gemm(self.rows * v[0], self.weights * v[1], self.group_sizes)
      return jnp.sum(jnp.tanh(out) * self.cotangent)

    return f

  def test_hessian_is_the_unquantized_gemms_at_the_quantized_value(self):
    def straight_through(rows, weights, group_sizes):
      return quantized_gemm.straight_through(
          _quantized, _unquantized, rows, weights, group_sizes
      )

    def stop_gradient_form(rows, weights, group_sizes):
      # The textbook straight-through estimator: the quantised value, every
      # derivative the unquantised product's.
      plain = _unquantized(rows, weights, group_sizes)
      value = _rounded_product(rows, weights, group_sizes)[0]
      return plain + jax.lax.stop_gradient(value - plain)

    v = jnp.array([1.1, 0.9])
    got = jax.jit(jax.hessian(self.loss(straight_through)))(v)
    want = jax.hessian(self.loss(stop_gradient_form))(v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    self.assertFalse(np.allclose(want, jax.hessian(self.loss(_unquantized))(v)))


if __name__ == "__main__":
  absltest.main()
