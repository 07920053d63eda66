"""The xla backend's default picks its product by the platform it is lowered
for, not by the host that traces it.

A training step traced on this CPU and compiled for GPUs (`moe_core.aot`,
`jax.export`) must multiply through `jax.lax.ragged_dot` there: the tile
loop is a CPU design whose bulk buffer grows with the worst-case rows.
"""

import re

from absl.testing import absltest
import jax
from jax import export
import jax.numpy as jnp
import numpy as np

from backends.xla import backend as xla_backend

_M, _C, _N, _E = 64, 16, 32, 4
# The op itself (chlo.ragged_dot), not a source location that names the
# backend's `_ragged_dot`.
_RAGGED_DOT_OP = re.compile(r"\b[a-z]+\.ragged_dot\b")


def _loss(backend):
  def loss(rows, weights, group_sizes):
    out = backend.grouped_gemm(rows, weights, group_sizes)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  return loss


def _exported_text(fn, platform: str, num_groups: int = _E) -> str:
  args = (
      jax.ShapeDtypeStruct((_M, _C), jnp.bfloat16),
      jax.ShapeDtypeStruct((num_groups, _C, _N), jnp.bfloat16),
      jax.ShapeDtypeStruct((num_groups,), jnp.int32),
  )
  return export.export(jax.jit(fn), platforms=(platform,))(*args).mlir_module()


class PlatformChoiceTest(absltest.TestCase):

  def test_default_lowers_ragged_dot_for_gpu_and_the_tile_loop_for_cpu(self):
    step = jax.grad(_loss(xla_backend.XlaBackend()), argnums=(0, 1))
    cuda = _exported_text(step, "cuda")
    self.assertIn("ragged_dot", cuda)
    self.assertNotIn("stablehlo.while", cuda)  # No tile loop.
    # The CPU's module may keep the other branch under a constant index;
    # its executable runs the tile loop.
    args = (
        jnp.zeros((_M, _C), jnp.bfloat16),
        jnp.zeros((_E, _C, _N), jnp.bfloat16),
        jnp.zeros((_E,), jnp.int32),
    )
    cpu = jax.jit(step).lower(*args).compile().as_text()
    self.assertIn(" while(", cpu)

  def test_forced_choices_hold_on_every_platform(self):
    loop = _loss(xla_backend.XlaBackend(use_ragged_dot=False))
    ragged = _loss(xla_backend.XlaBackend(use_ragged_dot=True))
    self.assertNotIn("ragged_dot", _exported_text(loop, "cuda"))
    self.assertIn("ragged_dot", _exported_text(ragged, "cpu"))

  def test_one_group_lowers_a_dot_not_ragged_dot(self):
    # XLA:TPU in libtpu 0.0.42 (JAX 0.10's) fails to compile ragged_dot of
    # one group with computed sizes (RET_CHECK in mask_aggregator.cc, the
    # custom call MaskAggregatorBlock): one group is a plain dot.
    backend = xla_backend.XlaBackend(use_ragged_dot=True)
    step = jax.grad(_loss(backend), argnums=(0, 1))
    one = _exported_text(step, "tpu", num_groups=1)
    self.assertIsNone(_RAGGED_DOT_OP.search(one))
    self.assertIn("stablehlo.dot_general", one)
    self.assertIsNotNone(_RAGGED_DOT_OP.search(_exported_text(step, "tpu")))

  def test_one_group_matches_the_reference_with_padding_rows(self):
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(_M, _C)).astype(np.float32)
    rows[50:] = np.nan  # Past the group: must not reach any result.
    weights = jnp.asarray(rng.normal(size=(1, _C, _N)), jnp.float32)
    sizes = jnp.asarray([50], jnp.int32)
    backend = xla_backend.XlaBackend(use_ragged_dot=True)
    out, vjp = jax.vjp(
        lambda r, w: backend.grouped_gemm(r, w, sizes),
        jnp.asarray(rows),
        weights,
    )
    d_rows, d_weights = vjp(jnp.ones_like(out))
    used = rows[:50].astype(np.float64)
    w = np.asarray(weights[0], np.float64)
    np.testing.assert_allclose(out[:50], used @ w, rtol=1e-5, atol=1e-5)
    self.assertTrue(np.all(np.asarray(out[50:]) == 0))
    np.testing.assert_allclose(
        d_rows[:50], np.ones((50, _N)) @ w.T, rtol=1e-5, atol=1e-5
    )
    self.assertTrue(np.all(np.asarray(d_rows[50:]) == 0))
    np.testing.assert_allclose(
        d_weights[0], used.T @ np.ones((50, _N)), rtol=1e-5, atol=1e-4
    )

  def test_default_matches_both_forced_paths_here(self):
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(_M, _C)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(_E, _C, _N)), jnp.float32)
    sizes = jnp.asarray([10, 0, 30, 20], jnp.int32)  # 4 rows past the end.
    got = {}
    for name, choice in (("auto", None), ("loop", False), ("ragged", True)):
      backend = xla_backend.XlaBackend(use_ragged_dot=choice)
      got[name] = jax.jit(jax.value_and_grad(_loss(backend), (0, 1)))(
          rows, weights, sizes
      )
    for other in ("loop", "ragged"):
      for a, b in zip(
          jax.tree.leaves(got["auto"]), jax.tree.leaves(got[other])
      ):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-4)


if __name__ == "__main__":
  absltest.main()
