"""Shared helpers of the expert-parallel tests (8 devices, backend "xla")."""

from __future__ import annotations

import math

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core

DEVICES = 8
BACKEND = "xla"


def cfg(**changes) -> moe_core.MoEConfig:
  """A small config: E=8, K=2, D=16, F=24, with `changes`."""
  base = dict(num_experts=8, top_k=2, hidden_size=16, expert_ffn_size=24)
  base.update(changes)
  return moe_core.MoEConfig(**base)


def inputs(config, num_tokens, seed=0, hot_expert=None):
  """params and x [num_tokens, D] in float32 from a fixed numpy seed.

  hot_expert: every token's best expert (router row 0 is huge for it and
  feature 0 is positive for every token).
  """
  rng = np.random.default_rng(seed)
  params = {}
  for name, shape in moe_core.param_shapes(config).items():
    scale = 0.1 if name == "correction_bias" else shape[-2] ** -0.5
    params[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
  x = rng.standard_normal((num_tokens, config.hidden_size)).astype(np.float32)
  if hot_expert is not None:
    x[:, 0] = 1.0 + np.abs(x[:, 0])
    params["router"][0, hot_expert] = 40.0
  return {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x)


def mesh(shape, names) -> jax.sharding.Mesh:
  """A mesh over the first prod(shape) devices."""
  return jax.sharding.Mesh(
      np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names
  )


def max_rel_err(got, want) -> float:
  """max |got - want|, relative to the largest |want|."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = np.max(np.abs(want))
  return float(np.max(np.abs(got - want)) / (scale if scale else 1.0))


class DevicesTestCase(parameterized.TestCase):
  """Skips (with the reason) where fewer than DEVICES devices exist."""

  def setUp(self):
    super().setUp()
    if jax.device_count() < DEVICES:
      self.skipTest(
          f"needs {DEVICES} devices, found {jax.device_count()}: set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} "
          "before jax is imported."
      )


class LayerTestCase(DevicesTestCase):
  """Runs `moe_core.moe_layer` with and without a mesh, and compares."""

  def run_layer(self, config, params, x, grads=False, **kwargs):
    """(y, aux, grads of (params, x) or None) of a jitted layer."""
    cotangent = jnp.asarray(
        np.random.default_rng(9).standard_normal(x.shape).astype(np.float32)
    )

    def loss(params, x):
      y, aux = moe_core.moe_layer(params, x, config, backend=BACKEND, **kwargs)
      return (
          jnp.sum(y.astype(jnp.float32) * cotangent)
          + aux.load_balancing_loss
          + 0.1 * aux.router_z_loss
      ), (y, aux)

    if not grads:
      return jax.jit(lambda p, x: loss(p, x)[1])(params, x) + (None,)
    (_, (y, aux)), g = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    )(params, x)
    return y, aux, g

  def assertMatches(self, got, want, what, tol=1e-5):
    err = max_rel_err(got, want)
    self.assertLessEqual(
        err,
        tol,
        f"{what}: max error {err} (relative to the largest expected value)",
    )

  def assertLayerMatches(self, got, want):
    """got and want: `run_layer` results; want usually without a mesh."""
    y, aux, grads = got
    y0, aux0, grads0 = want
    self.assertMatches(y, y0, "y")
    np.testing.assert_array_equal(aux.expert_ids, aux0.expert_ids)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux0.tokens_per_expert)
    for name in ("load_balancing_loss", "router_z_loss", "combine_weights"):
      self.assertMatches(getattr(aux, name), getattr(aux0, name), name)
    self.assertEqual(int(aux.dropped_tokens), 0)
    if grads0 is not None:
      for (name, g), g0 in zip(grads[0].items(), grads0[0].values()):
        self.assertMatches(g, g0, f"d {name}", 5e-5)
      self.assertMatches(grads[1], grads0[1], "d x", 5e-5)
