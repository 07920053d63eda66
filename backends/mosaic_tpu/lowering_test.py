"""Lowers the mosaic_tpu kernels for a TPU on this (CPU) machine: jax.export.

The Pallas -> Mosaic TPU lowering runs in Python, so a kernel that would not
lower for a TPU (a block that breaks the (8, 128) rule, an unsupported
primitive, a bad index map) fails here. What only Mosaic's compiler sees
(VMEM overflow, layouts) needs libtpu's compiler (bench/compile/) or the
chip (bench/on_device/tpu_check.py).
"""

import os
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import export
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.mosaic_tpu import kernels
from moe_core import aot


def _kernel_names(module_text: str) -> list[str]:
  """The kernel names of the module's tpu_custom_calls, in order."""
  return re.findall(r'kernel_name = "(\w+)"', module_text)


def _layer_grad(cfg, backend):
  def loss(params, x):
    y, _ = moe_core.moe_layer(params, x, cfg, backend=backend)
    return jnp.sum(y.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1)))


class LoweringTest(parameterized.TestCase):

  @parameterized.product(
      dtype=["bfloat16", "float32"],
      fuse_activation=[True, False],
      activation=["silu", "gpt_oss_glu"],
  )
  def test_layer_forward_and_backward_lower_to_our_kernels(
      self, dtype, fuse_activation, activation
  ):
    options = {}
    if activation == "gpt_oss_glu":
      options = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
    cfg = moe_core.MoEConfig(
        num_experts=4,
        top_k=2,
        hidden_size=256,
        expert_ffn_size=384,
        activation=activation,
        **options,
    )
    params = moe_core.init_params(jax.random.key(0), cfg, dtype=dtype)
    x = jnp.ones((64, 256), dtype)
    # interpret=False: compiled kernels, as on a TPU (auto would pick the
    # interpreter here, where nothing names a TPU to lower for).
    backend = moe_core.get_backend(
        "mosaic_tpu", interpret=False, fuse_activation=fuse_activation
    )
    exported = export.export(_layer_grad(cfg, backend), platforms=["tpu"])(
        params, x
    )
    names = _kernel_names(exported.mlir_module())
    self.assertIn(kernels.GMM_NAME, names)
    self.assertIn(kernels.TGMM_NAME, names)
    self.assertEqual(set(names), {kernels.GMM_NAME, kernels.TGMM_NAME})
    # Shipped to another process or machine: it serialises.
    self.assertNotEmpty(exported.serialize())

  def test_auto_interprets_where_no_tpu_is_lowered_for(self):
    cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=128, expert_ffn_size=128
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    exported = export.export(
        _layer_grad(cfg, moe_core.get_backend("mosaic_tpu")),
        platforms=["tpu"],
    )(params, jnp.ones((8, 128)))
    self.assertEmpty(_kernel_names(exported.mlir_module()))

  def test_a_v4_is_refused_where_xla_compiles(self):
    """libtpu's v4 (no TPU needed): NotImplementedError naming its
    device_kind at trace time, so "auto" moves on; `xla` compiles the same
    layer there. Found: the v5e's tiles, 18.5 MiB of scoped VMEM against the
    v4's 16, failed in XLA's compiler."""
    if not aot.libtpu_installed():
      self.skipTest("compiling for a TPU v4 needs libtpu, absent here")
    # As moe_core.aot does: a parallel test process may hold libtpu too.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # pylint: disable-next=g-import-not-at-top
    from jax.experimental import topologies

    device = topologies.get_topology_desc(
        "v4:2x2x1",
        platform="tpu",
        num_slices=1,
        chips_per_host_bounds=(2, 2, 1),
    ).devices[0]
    self.assertEqual(device.device_kind, "TPU v4")
    cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=128, expert_ffn_size=256
    )
    on_chip = jax.sharding.SingleDeviceSharding(device)
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_chip),
        jax.eval_shape(
            lambda: (
                moe_core.init_params(jax.random.key(0), cfg, jnp.bfloat16),
                jnp.ones((64, 128), jnp.bfloat16),
            )
        ),
    )
    mesh = jax.sharding.Mesh(np.array([device]), ("tpu",))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      with self.assertRaisesRegex(
          NotImplementedError, "got device_kind 'TPU v4'; backend 'xla'"
      ):
        _layer_grad(cfg, moe_core.get_backend("mosaic_tpu")).lower(*args)
      _layer_grad(cfg, moe_core.get_backend("xla")).lower(*args).compile()


if __name__ == "__main__":
  absltest.main()
