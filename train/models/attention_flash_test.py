"""The TPU's flash attention path of `causal_attention` against its XLA path.

JAX's Pallas flash attention kernel has no interpreter mode, so two parts:
on any host, the path's own work (the heads-first layout, grouped kv heads
repeated, the scale, when it is taken) with the kernel replaced by JAX's
reference of the same contract (`mha_reference_no_custom_vjp`); on a
single TPU (the repository's conftest starts JAX there on a TPU host) the
kernel itself, skipped elsewhere with the reason.
"""

import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.experimental.pallas.ops.tpu import flash_attention as flash
import jax.numpy as jnp
import numpy as np

from train.models import attention


def _xla_attention(q, k, v):
  """The XLA path: every query row against every key, one block."""
  return attention._attention_rows(q, k, v, 0)  # pylint: disable=protected-access


def _inputs(t, h, hkv, dtype, d=128, b=2):
  kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (b, t, h, d), dtype)
  k = jax.random.normal(kk, (b, t, hkv, d), dtype)
  v = jax.random.normal(kv, (b, t, hkv, d), dtype)
  cot = jax.random.normal(kc, (b, t, h, d), jnp.float32)
  return q, k, v, cot


def _value_and_grads(fn, q, k, v, cot):
  loss = lambda q, k, v: jnp.vdot(fn(q, k, v).astype(jnp.float32), cot)
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)


def _reference_kernel(q, k, v, *, causal, sm_scale, block_sizes):
  """flash_attention's contract ([B, H, T, d] each) by JAX's reference."""
  del block_sizes
  return flash.mha_reference_no_custom_vjp(
      q, k, v, causal=causal, sm_scale=sm_scale
  )


class FlashPathTest(parameterized.TestCase):
  """The wrapper around the kernel, on any host."""

  @parameterized.parameters(
      dict(t=256, h=4, hkv=4),
      dict(t=256, h=4, hkv=2),  # query heads 0, 1 read kv head 0
      dict(t=128, h=3, hkv=1),
  )
  def test_wrapper_matches_xla_path(self, t, h, hkv):
    q, k, v, cot = _inputs(t, h, hkv, jnp.float32)
    # Float32 products in full on every host: a TPU's default is one bf16
    # pass, which the two paths' different orders of work would show.
    with (
        mock.patch.object(flash, "flash_attention", _reference_kernel),
        mock.patch.object(attention, "tpu_flash_fits", lambda *_: True),
        jax.default_matmul_precision("highest"),
    ):
      got = _value_and_grads(attention.causal_attention, q, k, v, cot)
    with jax.default_matmul_precision("highest"):
      want = _value_and_grads(_xla_attention, q, k, v, cot)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    for name, g, w in zip("qkv", got[1], want[1]):
      np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4, err_msg=f"d{name}")

  def test_taken_on_a_tpu_for_the_kernels_shapes_only(self):
    q, k, v, _ = _inputs(256, 4, 2, jnp.bfloat16)
    with (
        mock.patch.object(jax, "default_backend", lambda: "tpu"),
        mock.patch.object(jax, "device_count", lambda: 1),
    ):
      self.assertTrue(attention.tpu_flash_fits(q, k, v))
      # Head size not a multiple of 128 (MLA's 192 / 128 too).
      self.assertFalse(attention.tpu_flash_fits(q[..., :64], k[..., :64], v))
      self.assertFalse(attention.tpu_flash_fits(q, k, v[..., :64]))
      # Sequence not a multiple of 128.
      self.assertFalse(
          attention.tpu_flash_fits(q[:, :200], k[:, :200], v[:, :200])
      )
      with mock.patch.dict(os.environ, {"DROPLESS_TPU_FLASH_ATTENTION": "0"}):
        self.assertFalse(attention.tpu_flash_fits(q, k, v))
    with mock.patch.object(jax, "default_backend", lambda: "cpu"):
      self.assertFalse(attention.tpu_flash_fits(q, k, v))
    # A mesh of several chips keeps XLA's attention, which it partitions.
    with (
        mock.patch.object(jax, "default_backend", lambda: "tpu"),
        mock.patch.object(jax, "device_count", lambda: 4),
    ):
      self.assertFalse(attention.tpu_flash_fits(q, k, v))


class TpuFlashAttentionTest(parameterized.TestCase):
  """The kernel itself, on a TPU."""

  def setUp(self):
    super().setUp()
    if jax.default_backend() != "tpu" or jax.device_count() != 1:
      self.skipTest(
          f"the flash path runs on a single TPU only; the default backend is "
          f"{jax.default_backend()!r} with {jax.device_count()} devices"
      )

  @parameterized.parameters(
      dict(t=512, h=8, hkv=8),  # tpu_v5e_dsv3's attention
      dict(t=256, h=4, hkv=2),  # grouped kv heads
      dict(t=384, h=2, hkv=1),  # 128-row blocks
  )
  def test_matches_xla_forward_and_gradients(self, t, h, hkv):
    q, k, v, cot = _inputs(t, h, hkv, jnp.bfloat16)
    self.assertTrue(attention.tpu_flash_fits(q, k, v))
    got_out = jax.jit(attention.causal_attention)(q, k, v)
    want_out = jax.jit(_xla_attention)(q, k, v)
    np.testing.assert_allclose(
        np.asarray(got_out, np.float32),
        np.asarray(want_out, np.float32),
        atol=2e-2,
        rtol=2e-2,
    )
    _, got = _value_and_grads(attention.causal_attention, q, k, v, cot)
    _, want = _value_and_grads(_xla_attention, q, k, v, cot)
    for name, g, w in zip("qkv", got, want):
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      scale = np.max(np.abs(w))
      self.assertLess(np.max(np.abs(g - w)) / scale, 3e-2, f"d{name} differs")


if __name__ == "__main__":
  absltest.main()
