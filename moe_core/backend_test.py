"""Backend's template: validation once, and the routing-weights hook."""

import collections
import dataclasses
import sys

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import backend as backend_lib
from moe_core import validation
from backends.xla import backend as xla_backend

_CFG = moe_core.MoEConfig(
    num_experts=4, top_k=2, hidden_size=8, expert_ffn_size=16
)


def _inputs():
  params = moe_core.init_params(jax.random.key(0), _CFG)
  x = jax.random.normal(jax.random.key(1), (6, 8))
  aux = moe_core.route(x, params["router"], _CFG)
  return params, x, aux


class _WeightsInDown(xla_backend.XlaBackend):
  """The xla backend with the routing weights in the down projection (the
  default `_down`, which scales its rows)."""

  name = "xla_weights_in_down"
  downs_with_weights = 0  # Traces of `_down` that got the row weights.

  def _routing_weights_in_down(self, cfg, dtype):
    return True

  def _down(self, h, ffn_in):
    type(self).downs_with_weights += ffn_in.row_weights is not None
    return super()._down(h, ffn_in)


def _validation_entries(fn) -> collections.Counter:
  """Calls fn(); counts the calls into moe_core/validation.py from outside
  it, by function name."""
  entries = collections.Counter()

  def profile(frame, event, arg):
    del arg
    code = frame.f_code
    if (
        event == "call"
        and code.co_filename == validation.__file__
        and frame.f_back.f_code.co_filename != validation.__file__
    ):
      entries[code.co_name] += 1

  sys.setprofile(profile)
  try:
    fn()
  finally:
    sys.setprofile(None)
  return entries


class ValidateOnceTest(absltest.TestCase):

  def test_each_public_entry_validates_once(self):
    params, x, aux = _inputs()
    backend = moe_core.get_backend("xla")
    self.assertEqual(
        _validation_entries(
            lambda: backend.routed_experts(params, x, aux, _CFG)
        ),
        {"check_routed_experts": 1},
    )
    self.assertEqual(
        _validation_entries(
            lambda: moe_core.moe_layer(params, x, _CFG, backend="xla")
        ),
        {"check_moe_layer": 1},
    )


class TemplateTest(absltest.TestCase):

  def test_overriding_a_template_method_is_refused(self):
    with self.assertRaisesRegex(
        TypeError, "overrides Backend.routed_experts.*_routed_experts"
    ):

      class _Bypass(xla_backend.XlaBackend):  # pylint: disable=unused-variable

        def routed_experts(self, params, x, aux, cfg):
          return x


class EarlierHookTest(absltest.TestCase):
  """A backend written to the earlier `_grouped_gemm(rows, weights,
  group_sizes, *, transpose_rhs, out_dtype)` keeps working, with a warning
  that names the hook it now takes, not a TypeError deep in a call."""

  def test_the_earlier_signature_works_and_warns(self):
    with self.assertWarnsRegex(DeprecationWarning, r"gemm: moe_core"):

      class Earlier(moe_core.Backend):
        name = "earlier"

        def _grouped_gemm(
            self, rows, weights, group_sizes, *, transpose_rhs, out_dtype
        ):
          if transpose_rhs:
            weights = jnp.swapaxes(weights, 1, 2)
          return jax.lax.ragged_dot(rows, weights, group_sizes).astype(
              out_dtype
          )

    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(12, 5)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(3, 7, 5)), jnp.float32)
    sizes = jnp.asarray([4, 0, 6], jnp.int32)
    got, want = (
        backend.grouped_gemm(rows, weights, sizes, transpose_rhs=True)
        for backend in (Earlier(), moe_core.get_backend("xla"))
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Rows past the groups: zeros, as every backend's.
    np.testing.assert_array_equal(got[10:], 0.0)


class HookContractTest(absltest.TestCase):
  """The hooks are a versioned contract, checked where a backend's class is
  defined: a hook that cannot take the templates' call fails there, naming
  the call and the page, not with a TypeError deep in a layer."""

  def test_a_hook_of_another_signature_fails_where_it_is_defined(self):
    with self.assertRaisesRegex(
        TypeError,
        r"Odd\._down\(self, h\) cannot take the call the templates make,"
        r" _down\(self, h, ffn_in\) \(backend hooks version 2,"
        r" docs/backends\.md#the-hooks-a-backend-fills\)",
    ):

      class Odd(xla_backend.XlaBackend):  # pylint: disable=unused-variable

        def _down(self, h):
          return h

  def test_every_hook_is_checked(self):
    for name, args in backend_lib.HOOK_CALLS.items():
      with (
          self.subTest(name),
          self.assertRaisesRegex(
              TypeError, f"{name}\\(self, {', '.join(args)}"
          ),
      ):
        type("Short", (xla_backend.XlaBackend,), {name: lambda self: None})

  def test_extra_optional_arguments_and_keyword_row_weights_pass(self):
    calls = []

    class Wide(xla_backend.XlaBackend):

      def _gather(self, x, plan, extra=None):
        calls.append(extra)
        return super()._gather(x, plan)

      def _expert_ffn(self, rows, group_sizes, params, cfg, **kwargs):
        return super()._expert_ffn(rows, group_sizes, params, cfg, **kwargs)

    params, x, aux = _inputs()
    got = Wide().routed_experts(params, x, aux, _CFG)
    want = moe_core.get_backend("xla").routed_experts(params, x, aux, _CFG)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    self.assertEqual(calls, [None])

  def test_a_missing_row_weights_keyword_fails(self):
    with self.assertRaisesRegex(TypeError, r"row_weights=\.\.\."):

      class NoWeights(xla_backend.XlaBackend):  # pylint: disable=unused-variable

        def _expert_ffn(self, rows, group_sizes, params, cfg):
          return rows

  def test_a_static_hook_fails(self):
    with self.assertRaisesRegex(TypeError, "_gate_up must be a plain method"):

      class Static(xla_backend.XlaBackend):  # pylint: disable=unused-variable

        @staticmethod
        def _gate_up(ffn_in):
          return ffn_in

  def test_a_newer_version_is_refused_and_the_current_one_taken(self):
    self.assertEqual(moe_core.BACKEND_HOOKS_VERSION, backend_lib.HOOKS_VERSION)
    with self.assertRaisesRegex(
        TypeError, "written for backend hooks version 3; this dropless has"
    ):

      class Future(xla_backend.XlaBackend):  # pylint: disable=unused-variable
        hooks_version = backend_lib.HOOKS_VERSION + 1

    class Current(xla_backend.XlaBackend):
      hooks_version = backend_lib.HOOKS_VERSION

    self.assertEqual(Current.hooks_version, 2)


class RoutingWeightsInDownTest(absltest.TestCase):

  def test_same_block_output_and_gradients(self):
    params, x, aux = _inputs()

    def loss(backend):
      def f(params, x):
        return jnp.sum(jnp.sin(backend.routed_experts(params, x, aux, _CFG)))

      return jax.jit(jax.value_and_grad(f, (0, 1)))(params, x)

    got = loss(_WeightsInDown())
    self.assertGreater(_WeightsInDown.downs_with_weights, 0)
    want = loss(moe_core.get_backend("xla"))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

  def test_a_nan_weight_still_makes_its_token_nan(self):
    params, x, aux = _inputs()
    weights = aux.combine_weights.at[2, 1].set(jnp.nan)
    aux = dataclasses.replace(aux, combine_weights=weights)
    y = np.asarray(_WeightsInDown().routed_experts(params, x, aux, _CFG))
    self.assertTrue(np.isnan(y[2]).all())
    self.assertFalse(np.isnan(np.delete(y, 2, axis=0)).any())

  def test_bad_traced_sizes_poison_through_the_row_weights(self):
    # `_expert_ffn` with row weights puts a bad call's NaN into the weights
    # instead of a pass over the output: the output and the gradients of
    # the rows, the weights and the row weights all NaN, as without them.
    params, _, _ = _inputs()
    rows = jax.random.normal(jax.random.key(5), (12, 8))
    row_weights = jax.random.uniform(jax.random.key(6), (12,), minval=0.1)
    backend = _WeightsInDown()

    def loss(sizes, params, rows, row_weights):
      out = backend._expert_ffn(  # pylint: disable=protected-access
          rows, sizes, params, _CFG, row_weights=row_weights
      )
      return jnp.sum(out), out

    grad = jax.jit(jax.grad(loss, (1, 2, 3), has_aux=True))
    good = jnp.array([3, 0, 5, 4], jnp.int32)
    (g_params, g_rows, g_weights), out = grad(good, params, rows, row_weights)
    self.assertTrue(np.isfinite(out).all())
    unweighted = backend._expert_ffn(  # pylint: disable=protected-access
        rows, good, params, _CFG
    )
    np.testing.assert_allclose(
        out, unweighted * row_weights[:, None], rtol=1e-5, atol=1e-6
    )
    for bad in ([3, -1, 5, 4], [3, 0, 5, 9]):
      with self.subTest(bad=bad):
        (g_params, g_rows, g_weights), out = grad(
            jnp.array(bad, jnp.int32), params, rows, row_weights
        )
        self.assertTrue(np.isnan(out).all())
        self.assertTrue(np.isnan(g_rows).all())
        self.assertTrue(np.isnan(g_weights).all())
        for name in ("w_gate", "w_up", "w_down"):
          self.assertTrue(np.isnan(g_params[name][0]).all(), name)


class DeprecatedRecipeAliasTest(absltest.TestCase):
  """precision="bf16" (deprecated) is the "unquantized" recipe, which runs
  in the operands' dtype: float32 stays float32."""

  _WARNING = r"'bf16' is deprecated: use 'unquantized'"

  def test_grouped_gemm_gives_the_unquantized_output(self):
    rows = jax.random.normal(jax.random.key(2), (12, 8), jnp.float32)
    weights = jax.random.normal(jax.random.key(3), (3, 8, 5), jnp.float32)
    sizes = jnp.array([4, 0, 6], jnp.int32)
    backend = moe_core.get_backend("xla")
    want = backend.grouped_gemm(rows, weights, sizes, precision="unquantized")
    with self.assertWarnsRegex(DeprecationWarning, self._WARNING) as caught:
      got = backend.grouped_gemm(rows, weights, sizes, precision="bf16")
    self.assertEqual(caught.filename, __file__)  # The caller's line.
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_array_equal(got, want)
    # Never rounded to bfloat16 (8 bits): float32 products of the float64
    # reference, rows past sum(sizes) zero.
    r, w = np.asarray(rows, np.float64), np.asarray(weights, np.float64)
    exact = np.zeros((12, 5))
    exact[:4] = r[:4] @ w[0]
    exact[4:10] = r[4:10] @ w[2]
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)

  def test_moe_layer_of_a_bf16_config_is_the_unquantized_layer(self):
    with self.assertWarnsRegex(DeprecationWarning, self._WARNING):
      old = _CFG.replace(precision="bf16")
    self.assertEqual(old.precision, "unquantized")
    params, x, _ = _inputs()
    y_old, aux_old = moe_core.moe_layer(params, x, old, backend="xla")
    y_new, aux_new = moe_core.moe_layer(
        params, x, _CFG.replace(precision="unquantized"), backend="xla"
    )
    np.testing.assert_array_equal(y_old, y_new)
    for a, b in zip(jax.tree.leaves(aux_old), jax.tree.leaves(aux_new)):
      np.testing.assert_array_equal(a, b)

  def test_checkpoint_names_take_it(self):
    backend = moe_core.get_backend("xla")
    with self.assertWarnsRegex(DeprecationWarning, self._WARNING):
      got = backend.checkpoint_names("silu", "bf16")
    self.assertEqual(got, backend.checkpoint_names("silu", "unquantized"))
    with self.assertRaisesRegex(ValueError, "one of \\('unquantized'"):
      backend.checkpoint_names("silu", "fp4")


if __name__ == "__main__":
  absltest.main()
