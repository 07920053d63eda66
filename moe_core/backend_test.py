"""The Backend base class: its hook signatures, old and new."""

import warnings

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import backend as backend_lib


def _dense_loop(rows, weights, group_sizes, transpose_rhs, out_dtype):
  """rows [M, C] x weights [E, C, N] per group, by a Python loop: [M, N]."""
  if transpose_rhs:
    weights = jnp.swapaxes(weights, 1, 2)
  ends = np.cumsum(np.asarray(group_sizes))
  out = np.zeros((rows.shape[0], weights.shape[2]), np.float32)
  start = 0
  for group, end in enumerate(ends):
    out[start:end] = np.asarray(rows[start:end]) @ np.asarray(weights[group])
    start = end
  return jnp.asarray(out, out_dtype)


class LegacyHookTest(absltest.TestCase):
  """A backend written against the old keyword `_grouped_gemm` still runs."""

  def _define_legacy_backend(self):
    class Legacy(backend_lib.Backend):
      name = "legacy"

      def _grouped_gemm(
          self, rows, weights, group_sizes, *, transpose_rhs, out_dtype
      ):
        return _dense_loop(rows, weights, group_sizes, transpose_rhs, out_dtype)

    return Legacy

  def test_old_signature_warns_once_when_defined(self):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      self._define_legacy_backend()
    deprecations = [
        w for w in caught if issubclass(w.category, DeprecationWarning)
    ]
    self.assertLen(deprecations, 1)
    self.assertIn("GemmOperands", str(deprecations[0].message))

  def test_old_signature_gets_the_operands_unpacked(self):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      legacy = self._define_legacy_backend()()
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(7, 4)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
    sizes = jnp.asarray([2, 0, 4], jnp.int32)
    out = legacy.grouped_gemm(
        rows, weights, sizes, transpose_rhs=True, out_dtype=jnp.bfloat16
    )
    expected = _dense_loop(rows, weights, sizes, True, jnp.bfloat16)
    self.assertEqual(out.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))

  def test_new_signature_is_left_alone(self):
    class Current(backend_lib.Backend):
      name = "current"

      def _grouped_gemm(self, gemm):
        return jnp.zeros(
            (gemm.rows.shape[0], gemm.weights.shape[2]), gemm.out_dtype
        )

    with warnings.catch_warnings():
      warnings.simplefilter("error", DeprecationWarning)
      out = Current().grouped_gemm(
          jnp.ones((3, 2)), jnp.ones((1, 2, 5)), jnp.asarray([3])
      )
    self.assertEqual(out.shape, (3, 5))
    self.assertIsInstance(out, jax.Array)


if __name__ == "__main__":
  absltest.main()
