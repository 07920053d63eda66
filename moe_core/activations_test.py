"""The expert-FFN activation registry against numpy, and its extension point."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import activations
from moe_core import backend as backend_lib
from moe_core import registry

_BASE = dict(num_experts=4, top_k=2, hidden_size=8, expert_ffn_size=12)


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def _erf(z):
  return np.vectorize(math.erf)(z)


# Written from the model cards / transformers' modeling files, in float64:
# name -> (settings, h(gate, up)).
_NUMPY = {
    "silu": ({}, lambda g, u: g * _sigmoid(g) * u),
    "gelu": ({}, lambda g, u: 0.5 * g * (1 + _erf(g / math.sqrt(2))) * u),
    "gelu_tanh": (
        {},
        lambda g, u: (
            0.5
            * g
            * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
            * u
        ),
    ),
    "gpt_oss_glu": (
        dict(swiglu_alpha=1.702),
        lambda g, u: (u + 1) * g * _sigmoid(1.702 * g),
    ),
    "softcapped_silu": (
        dict(gate_softcap=0.7, up_softcap=1.3),
        lambda g, u: (
            0.7 * np.tanh(g / 0.7) * _sigmoid(g) * 1.3 * np.tanh(u / 1.3)
        ),
    ),
    "relu": ({}, lambda g, u: np.maximum(u, 0)),
    "relu2": ({}, lambda g, u: np.maximum(u, 0) ** 2),
}


def _products(seed=0):
  rng = np.random.default_rng(seed)
  # Wide enough that a clamp at 0.9 bites on both sides.
  gate, up = (3 * rng.standard_normal((2, 6, 12))).astype(np.float32)
  return gate, up


class ActivationMathTest(parameterized.TestCase):

  def test_every_builtin_has_a_numpy_formula(self):
    self.assertEqual(set(activations.names()), set(_NUMPY))

  @parameterized.product(name=tuple(_NUMPY), limit=(None, 0.9))
  def test_hidden_matches_numpy(self, name, limit):
    options, formula = _NUMPY[name]
    act = activations.get(name)
    if limit is not None and not act.gated:
      self.skipTest("a clamp needs a gated activation")
    gate, up = _products()
    settings = activations.Settings(name, swiglu_limit=limit, **options)
    got = activations.hidden(
        settings, jnp.asarray(gate) if act.gated else None, jnp.asarray(up)
    )
    g, u = gate.astype(np.float64), up.astype(np.float64)
    if limit is not None:  # gate <= L, -L <= up <= L, before the function.
      g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    np.testing.assert_allclose(got, formula(g, u), rtol=2e-5, atol=2e-6)

  @parameterized.product(name=tuple(_NUMPY), limit=(None, 0.9))
  def test_derivatives_match_numpy_differences(self, name, limit):
    # Elementwise, so d h / d gate and d h / d up are diagonal: one central
    # difference of the numpy formula per entry, away from the clamp's and
    # ReLU's kinks (within 1e-3 of them the quotient straddles).
    options, formula = _NUMPY[name]
    act = activations.get(name)
    if limit is not None and not act.gated:
      self.skipTest("a clamp needs a gated activation")
    gate, up = _products(seed=1)
    settings = activations.Settings(name, swiglu_limit=limit, **options)

    def h(g, u):
      return activations.hidden(settings, g if act.gated else None, u)

    d_gate, d_up = jax.grad(lambda g, u: jnp.sum(h(g, u)), argnums=(0, 1))(
        jnp.asarray(gate), jnp.asarray(up)
    )

    def numpy_h(g, u):
      if limit is not None:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
      return formula(g, u)

    g, u, eps = gate.astype(np.float64), up.astype(np.float64), 1e-5
    kinks = [0.0] + ([limit, -limit] if limit is not None else [])
    smooth = np.ones(g.shape, bool)
    for kink in kinks:
      smooth &= (np.abs(g - kink) > 1e-3) & (np.abs(u - kink) > 1e-3)
    want_gate = (numpy_h(g + eps, u) - numpy_h(g - eps, u)) / (2 * eps)
    want_up = (numpy_h(g, u + eps) - numpy_h(g, u - eps)) / (2 * eps)
    if act.gated:
      np.testing.assert_allclose(
          np.asarray(d_gate)[smooth], want_gate[smooth], rtol=1e-4, atol=1e-5
      )
    np.testing.assert_allclose(
        np.asarray(d_up)[smooth], want_up[smooth], rtol=1e-4, atol=1e-5
    )

  def test_registry_refuses_a_taken_name_and_unknown_options(self):
    silu = activations.get("silu")
    with self.assertRaisesRegex(ValueError, r"'silu' is already registered"):
      activations.register(silu)
    with self.assertRaisesRegex(ValueError, r"reads \['beta'\]"):
      activations.register(
          activations.Activation("x", True, silu.fn, reads=("beta",))
      )
    with self.assertRaisesRegex(TypeError, r"Activation, got <class 'str'>"):
      activations.register("silu")


class NonGatedAndBiasLayoutTest(absltest.TestCase):

  def test_param_shapes(self):
    e, d, f = 4, 8, 12
    relu = moe_core.MoEConfig(**_BASE, activation="relu", shared_ffn_size=6)
    self.assertNotIn("w_gate", moe_core.param_shapes(relu))
    self.assertNotIn("shared_w_gate", moe_core.param_shapes(relu))
    biased = moe_core.MoEConfig(**_BASE, expert_bias=True)
    shapes = moe_core.param_shapes(biased)
    self.assertEqual(
        (shapes["b_gate"], shapes["b_up"], shapes["b_down"]),
        ((e, f), (e, f), (e, d)),
    )
    both = moe_core.param_shapes(relu.replace(expert_bias=True))
    self.assertNotIn("b_gate", both)
    self.assertEqual(both["b_up"], (e, f))

  def test_biases_start_at_zero(self):
    cfg = moe_core.MoEConfig(**_BASE, expert_bias=True)
    params = moe_core.init_params(jax.random.key(0), cfg, jnp.bfloat16)
    for name in ("b_gate", "b_up", "b_down"):
      self.assertEqual(params[name].dtype, jnp.bfloat16)
      self.assertFalse(np.any(np.asarray(params[name], np.float32)))

  def test_checkpoint_names(self):
    xla = moe_core.get_backend("xla")
    self.assertEqual(
        xla.checkpoint_names("relu2"),
        (backend_lib.UP_NAME, backend_lib.DOWN_NAME),
    )
    cfg = moe_core.MoEConfig(**_BASE, swiglu_limit=7.0)
    self.assertEqual(xla.checkpoint_names(cfg), backend_lib.CHECKPOINT_NAMES)


class FusedEpilogueTest(parameterized.TestCase):
  """Which configs a fusing backend (pallas) hands its kernel epilogue."""

  def _check_layer(self, be, cfg):
    params = moe_core.init_params(jax.random.key(3), cfg)
    params = {
        n: v + 0.2 if n.startswith("b_") else v for n, v in params.items()
    }
    x = jax.random.normal(jax.random.key(4), (12, _BASE["hidden_size"]))
    want, _ = moe_core.moe_layer(params, x, cfg, backend="reference")
    got, _ = moe_core.moe_layer(params, x, cfg, backend=be)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  @parameterized.named_parameters(
      ("clamp", dict(swiglu_limit=0.3)),
      ("gpt_oss_glu", dict(activation="gpt_oss_glu", swiglu_alpha=1.702)),
      (
          "gpt_oss_glu_clamped",
          dict(activation="gpt_oss_glu", swiglu_alpha=1.702, swiglu_limit=0.3),
      ),
      (
          "softcapped_silu",
          dict(activation="softcapped_silu", gate_softcap=0.7, up_softcap=1.3),
      ),
  )
  def test_the_epilogue_computes_clamp_and_listed_activations(self, changes):
    # The epilogue computes activations.hidden of the config's settings;
    # the fused op names its residuals (gate, up, h) and down is named.
    pallas = moe_core.get_backend("pallas", fuse_activation=True)
    cfg = moe_core.MoEConfig(**_BASE, **changes)
    self.assertEqual(
        pallas.checkpoint_names(cfg),
        (*backend_lib.FUSED_CHECKPOINT_NAMES, backend_lib.DOWN_NAME),
    )
    self._check_layer(pallas, cfg)

  def test_biases_and_registered_activations_run_unfused(self):
    # Biases go between the products and the activation, and a registered
    # activation is arbitrary JAX a lowering may not have: the template must
    # not hand either to the epilogue (it would skip the biases).
    name = "abs_glu_for_epilogue_test"
    activations.register(
        activations.Activation(name, True, lambda g, u, s: jnp.abs(g) * u)
    )
    self.addCleanup(activations._REGISTRY.pop, name)
    pallas = moe_core.get_backend("pallas", fuse_activation=True)
    for changes in (
        dict(expert_bias=True),
        dict(expert_bias=True, swiglu_limit=0.3),
        dict(activation=name),
    ):
      cfg = moe_core.MoEConfig(**_BASE, **changes)
      with self.subTest(**{k: str(v) for k, v in changes.items()}):
        self.assertEqual(
            pallas.checkpoint_names(cfg), backend_lib.CHECKPOINT_NAMES
        )
        self._check_layer(pallas, cfg)


class ExtensionPointTest(absltest.TestCase):

  def test_a_registered_activation_runs_on_every_template_backend(self):
    # abs(g) * u: registered here, used by name, computed by the template
    # between the grouped GEMMs like the built-in ones.
    name = "abs_glu_for_test"
    activations.register(
        activations.Activation(name, True, lambda g, u, s: jnp.abs(g) * u)
    )
    # Other tests in this process see the built-in registry only.
    self.addCleanup(activations._REGISTRY.pop, name)
    cfg = moe_core.MoEConfig(**_BASE, activation=name)
    params = moe_core.init_params(jax.random.key(1), cfg)
    x = jax.random.normal(jax.random.key(2), (10, _BASE["hidden_size"]))
    want, aux = moe_core.moe_layer(params, x, cfg, backend="reference")
    # Every registered backend, so that a new one is covered by its registry
    # line; one that cannot run here is skipped with its reason.
    for name in registry.registered_backends():
      with self.subTest(backend=name):
        ok, reason = registry.availability(name)
        dtypes = moe_core.get_backend(name).dtypes if ok else None
        if dtypes is not None and jnp.dtype(jnp.float32) not in dtypes:
          ok, reason = False, "it does not compute in float32"
        if not ok:
          print(f"activations_test: {name} skipped: {reason}")
          self.skipTest(f"{name} cannot run here: {reason}")
        got, _ = moe_core.moe_layer(params, x, cfg, backend=name)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # One token by hand: sum_k w_k (|x Wg| * (x Wu)) Wd.
    t = 3
    by_hand = sum(
        float(aux.combine_weights[t, k])
        * (
            np.abs(x[t] @ params["w_gate"][e])
            * (x[t] @ params["w_up"][e])
            @ params["w_down"][e]
        )
        for k, e in enumerate(np.asarray(aux.expert_ids[t]))
    )
    np.testing.assert_allclose(want[t], by_hand, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
