"""The TPU's Pallas attention path of `causal_attention` against its XLA
path, with either kernel (`attention.ATTENTION_KERNELS`).

On any host, the path's own work (the heads-first layout, grouped kv heads
repeated, the scale, when it is taken): with splash attention the kernel
itself in Pallas' interpreter; JAX's older flash attention kernel has no
interpreter mode, so there it is replaced by JAX's reference of the same
contract (`mha_reference_no_custom_vjp`). On a single TPU (the
repository's conftest starts JAX there on a TPU host) both kernels
compiled, skipped elsewhere with the reason.
"""

import functools
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


def _kernel_env(kernel):
  return mock.patch.dict(os.environ, {"DROPLESS_TPU_ATTENTION_KERNEL": kernel})


class FlashPathTest(parameterized.TestCase):
  """The wrapper around the kernel, on any host."""

  @parameterized.product(
      (
          dict(t=256, h=4, hkv=4),
          dict(t=256, h=4, hkv=2),  # query heads 0, 1 read kv head 0
          dict(t=128, h=3, hkv=1),
          dict(t=384, h=2, hkv=2),  # 128-row blocks, three of them
      ),
      kernel=attention.ATTENTION_KERNELS,
  )
  def test_wrapper_matches_xla_path(self, t, h, hkv, kernel):
    q, k, v, cot = _inputs(t, h, hkv, jnp.float32)
    interpreted_splash = functools.partial(
        attention._splash_kernel_call,  # pylint: disable=protected-access
        interpret=True,
    )
    # Float32 products in full on every host: a TPU's default is one bf16
    # pass, which the two paths' different orders of work would show.
    with (
        mock.patch.object(flash, "flash_attention", _reference_kernel),
        mock.patch.object(attention, "_splash_kernel_call", interpreted_splash),
        mock.patch.object(attention, "tpu_flash_fits", lambda *_: True),
        _kernel_env(kernel),
        jax.default_matmul_precision("highest"),
    ):
      got = _value_and_grads(attention.causal_attention, q, k, v, cot)
    with jax.default_matmul_precision("highest"):
      want = _value_and_grads(_xla_attention, q, k, v, cot)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    for name, g, w in zip("qkv", got[1], want[1]):
      # atol: gradients reach 4 here; on a TPU the interpreted splash
      # kernel's dv differed from the XLA path's by 1.5e-4 at 2 of 131,072
      # elements near 0.02 (its exp and sums run in another order).
      np.testing.assert_allclose(g, w, rtol=1e-3, atol=5e-4, err_msg=f"d{name}")

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

  def test_kernel_by_the_variable_splash_when_unset(self):
    with mock.patch.dict(os.environ, clear=False) as env:
      env.pop("DROPLESS_TPU_ATTENTION_KERNEL", None)
      self.assertEqual(attention.tpu_attention_kernel(), "splash")
    with _kernel_env("flash"):
      self.assertEqual(attention.tpu_attention_kernel(), "flash")
    with _kernel_env("ring"):
      with self.assertRaisesRegex(
          ValueError,
          r"DROPLESS_TPU_ATTENTION_KERNEL must be one of .*'splash'.*"
          r"got 'ring'",
      ):
        attention.tpu_attention_kernel()


class TpuFlashAttentionTest(parameterized.TestCase):
  """The kernel itself, on a TPU."""

  def setUp(self):
    super().setUp()
    if jax.default_backend() != "tpu" or jax.device_count() != 1:
      self.skipTest(
          f"the flash path runs on a single TPU only; the default backend is "
          f"{jax.default_backend()!r} with {jax.device_count()} devices"
      )

  @parameterized.product(
      (
          dict(t=512, h=8, hkv=8),  # tpu_v5e_dsv3's attention
          dict(t=256, h=4, hkv=2),  # grouped kv heads
          dict(t=384, h=2, hkv=1),  # 128-row blocks
      ),
      kernel=attention.ATTENTION_KERNELS,
  )
  def test_matches_xla_forward_and_gradients(self, t, h, hkv, kernel):
    q, k, v, cot = _inputs(t, h, hkv, jnp.bfloat16)
    self.assertTrue(attention.tpu_flash_fits(q, k, v))
    with _kernel_env(kernel):
      # A fresh function for each kernel: jit's cache keys on the function,
      # not on the variable read while tracing.
      got_out = jax.jit(lambda *qkv: attention.causal_attention(*qkv))(q, k, v)
      _, got = _value_and_grads(attention.causal_attention, q, k, v, cot)
    want_out = jax.jit(_xla_attention)(q, k, v)
    np.testing.assert_allclose(
        np.asarray(got_out, np.float32),
        np.asarray(want_out, np.float32),
        atol=2e-2,
        rtol=2e-2,
    )
    _, want = _value_and_grads(_xla_attention, q, k, v, cot)
    for name, g, w in zip("qkv", got, want):
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      scale = np.max(np.abs(w))
      self.assertLess(np.max(np.abs(g - w)) / scale, 3e-2, f"d{name} differs")


if __name__ == "__main__":
  absltest.main()
