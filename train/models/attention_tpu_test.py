"""The TPU's flash attention path of `causal_attention` against its XLA path.

Runs on a TPU only (JAX's Pallas flash attention kernel has no interpreter
mode); elsewhere every test is skipped with the reason.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from train.models import attention


def _xla_attention(q, k, v):
  """The XLA path: every query row against every key, one block."""
  return attention._attention_rows(q, k, v, 0)  # pylint: disable=protected-access


class TpuFlashAttentionTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if jax.default_backend() != "tpu":
      self.skipTest(
          f"the flash path runs on a TPU only; the default backend is "
          f"{jax.default_backend()!r}"
      )

  @parameterized.parameters(
      dict(t=512, h=8, hkv=8),  # tpu_v5e_dsv3's attention
      dict(t=256, h=4, hkv=2),  # grouped kv heads
      dict(t=384, h=2, hkv=1),  # 128-row blocks
  )
  def test_matches_xla_forward_and_gradients(self, t, h, hkv):
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    b, d = 2, 128
    q = jax.random.normal(kq, (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, t, hkv, d), jnp.bfloat16)
    cot = jax.random.normal(kc, (b, t, h, d), jnp.float32)
    self.assertTrue(attention.tpu_flash_fits(q, k, v))

    def loss(fn):
      return lambda q, k, v: jnp.vdot(fn(q, k, v).astype(jnp.float32), cot)

    flash = jax.jit(jax.value_and_grad(loss(attention.causal_attention), (0, 1, 2)))
    xla = jax.jit(jax.value_and_grad(loss(_xla_attention), (0, 1, 2)))
    got_out = jax.jit(attention.causal_attention)(q, k, v)
    want_out = jax.jit(_xla_attention)(q, k, v)
    np.testing.assert_allclose(
        np.asarray(got_out, np.float32),
        np.asarray(want_out, np.float32),
        atol=2e-2,
        rtol=2e-2,
    )
    (_, got), (_, want) = flash(q, k, v), xla(q, k, v)
    for name, g, w in zip("qkv", got, want):
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      scale = np.max(np.abs(w))
      self.assertLess(
          np.max(np.abs(g - w)) / scale, 3e-2, f"d{name} differs"
      )


if __name__ == "__main__":
  absltest.main()
