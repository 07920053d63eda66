"""The backend registry, the "auto" order and the --moe_backend flag."""

import os
import sys
import tempfile
import textwrap
from unittest import mock

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import jax
import numpy as np

import moe_core
from moe_core import backend as backend_lib
from moe_core import flags as moe_flags
from moe_core import registry


class _Toy(backend_lib.Backend):
  """A backend whose grouped GEMM is a dense loop (tests only)."""

  name = "toy"

  def __init__(self, scale: float = 1.0):
    self.scale = scale

  def _grouped_gemm(self, gemm):
    raise NotImplementedError("toy: no grouped GEMM")


class _Raises(_Toy):
  """Refuses every routed block, as a backend does for inputs it lacks."""

  name = "toy_raises"
  calls = 0

  def _routed_experts(self, params, x, aux, cfg):
    type(self).calls += 1
    raise NotImplementedError("toy_raises: never supported")


class _Unavailable(_Toy):

  name = "toy_unavailable"

  def availability(self):
    return False, "toy_unavailable: not on this machine"


class _EverywhereCpu(_Toy):
  """A stand-in for the native cpu backend where its library is built."""

  name = "cpu"


class RegistryTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # Every test may register names; restore the registry afterwards.
    self.enter_context(mock.patch.dict(registry._REGISTRY))
    self.enter_context(mock.patch.dict(registry._instances))

  def test_unknown_name_lists_valid_names(self):
    with self.assertRaisesRegex(
        ValueError,
        r"unknown MoE backend 'nope'; valid names: \['auto', "
        r"'reference', 'xla'.*\]",
    ):
      registry.get_backend("nope")
    with self.assertRaisesRegex(ValueError, r"unknown MoE backend 'nope'"):
      registry.availability("nope")

  def test_builtin_names(self):
    self.assertContainsSubset(
        {"reference", "xla", "pallas"}, registry.registered_backends()
    )
    self.assertContainsSubset(
        {"reference", "xla"}, registry.available_backends()
    )
    self.assertEqual(registry.get_backend("reference").name, "reference")
    self.assertEqual(registry.get_backend("xla").name, "xla")

  @parameterized.parameters("cpu", "gpu", "tpu", "some_new_platform")
  def test_auto_order_ends_at_reference(self, platform):
    order = registry.auto_order(platform)
    self.assertEqual(order[-1], "reference")
    self.assertLen(set(order), len(order))

  def test_auto_order_skips_unregistered_names(self):
    self.enter_context(
        mock.patch.dict(
            registry.AUTO_ORDER, {"cpu": ("not_registered", "xla", "reference")}
        )
    )
    self.assertEqual(registry.auto_order("cpu"), ("xla", "reference"))

  @parameterized.parameters(
      ("tpu", "TPU v5 lite"), ("gpu", "NVIDIA H100 80GB HBM3"), ("cpu", "cpu")
  )
  def test_auto_orders_by_the_platform_lowered_for(self, platform, kind):
    """In a program lowered for `platform` (moe_core.aot.compile's abstract
    mesh) auto takes that platform's order, not the host's: on a CPU host
    whose native "cpu" backend is available (a stand-in here, which runs
    everywhere), a TPU program got its CPU-only custom calls."""
    self.enter_context(
        mock.patch.dict(registry._REGISTRY, {"cpu": _EverywhereCpu})
    )
    self.enter_context(mock.patch.dict(registry._instances, clear=True))
    device = jax.sharding.AbstractDevice(
        device_kind=kind, num_cores=1, platform=platform
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
      self.assertEqual(registry.auto_order(), registry.auto_order(platform))
      resolved = registry.get_backend("auto").name
    self.assertIn(resolved, registry.auto_order(platform))
    self.assertEqual(resolved == "cpu", platform == "cpu")

  def test_backend_class_without_building_one(self):
    self.assertIs(
        registry.backend_class("reference"),
        type(registry.get_backend("reference")),
    )
    registry.register_backend("toy_factory", lambda: _Toy())
    self.assertIsNone(registry.backend_class("toy_factory"))
    registry.register_backend("toy_absent", "no_such_package.backend:B")
    with self.assertRaises(ImportError):
      registry.backend_class("toy_absent")
    with self.assertRaisesRegex(ValueError, "'auto' is no one class"):
      registry.backend_class("auto")

  def test_every_builtin_backend_keeps_the_hook_contract(self):
    # Importing a class runs the check of its hooks (Backend's
    # __init_subclass__); one written to another contract raises there.
    for name in registry.registered_backends():
      with self.subTest(name):
        cls = registry.backend_class(name)
        if cls is not None:
          self.assertLessEqual(
              cls.hooks_version or 0, moe_core.BACKEND_HOOKS_VERSION
          )

  def test_auto_is_first_available(self):
    first = [n for n in registry.auto_order() if registry.availability(n)[0]]
    self.assertEqual(registry.get_backend("auto").name, first[0])
    with self.assertRaisesRegex(
        ValueError, r"backend 'auto' takes no options, got " r"\['levels'\]"
    ):
      registry.get_backend("auto", levels=(8,))

  def test_register_class_and_options_are_cached_per_options(self):
    registry.register_backend("toy", _Toy)
    a = registry.get_backend("toy", scale=2.0)
    self.assertIsInstance(a, _Toy)
    self.assertEqual(a.scale, 2.0)
    self.assertIs(registry.get_backend("toy", scale=2.0), a)
    self.assertIsNot(registry.get_backend("toy", scale=3.0), a)
    self.assertIn("toy", registry.registered_backends())
    self.assertIs(registry.get_backend(a), a)  # An instance passes through.

  def test_register_string_imports_lazily(self):
    module = "dropless_registry_test_toy_backend"
    # tempfile, not create_tempdir: the latter needs parsed flags (pytest).
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    with open(os.path.join(tmp, f"{module}.py"), "w") as f:
      f.write(textwrap.dedent("""
        from moe_core import backend

        class LazyToy(backend.Backend):
          name = "lazy_toy"

          def _grouped_gemm(self, gemm):
            raise NotImplementedError
        """))
    self.enter_context(mock.patch.object(sys, "path", [tmp] + sys.path))
    self.addCleanup(sys.modules.pop, module, None)
    registry.register_backend("lazy_toy", f"{module}:LazyToy")
    self.assertNotIn(module, sys.modules)
    self.assertIn("lazy_toy", registry.registered_backends())
    self.assertNotIn(module, sys.modules)  # Listing does not import either.
    be = registry.get_backend("lazy_toy")
    self.assertIn(module, sys.modules)
    self.assertEqual(type(be).__name__, "LazyToy")

  def test_missing_module_is_unavailable_not_fatal(self):
    registry.register_backend("ghost", "no_such_module_for_dropless:Ghost")
    with self.assertRaises(ImportError):
      registry.get_backend("ghost")
    ok, why = registry.availability("ghost")
    self.assertFalse(ok)
    self.assertIn("no_such_module_for_dropless", why)
    self.assertNotIn("ghost", registry.available_backends())

  def test_target_must_build_a_backend(self):
    registry.register_backend("not_a_backend", lambda: object())
    with self.assertRaisesRegex(
        TypeError,
        r"backend 'not_a_backend' built <class "
        r"'object'>, not a moe_core Backend",
    ):
      registry.get_backend("not_a_backend")

  @parameterized.parameters("", "auto", None)
  def test_register_rejects_bad_names(self, name):
    with self.assertRaisesRegex(
        ValueError,
        r"backend name must be a non-empty string "
        rf"other than 'auto', got {name!r}",
    ):
      registry.register_backend(name, _Toy)

  def test_register_twice_needs_overwrite(self):
    registry.register_backend("toy", _Toy)
    first = registry.get_backend("toy")
    with self.assertRaisesRegex(
        ValueError,
        r"backend 'toy' is already registered; pass " r"overwrite=True",
    ):
      registry.register_backend("toy", _Toy)
    registry.register_backend("toy", _Raises, overwrite=True)
    self.assertIsInstance(registry.get_backend("toy"), _Raises)
    self.assertIsNot(registry.get_backend("toy"), first)

  def test_unavailable_backend_is_skipped_by_auto(self):
    registry.register_backend("toy_unavailable", _Unavailable)
    self.assertEqual(
        registry.availability("toy_unavailable"),
        (False, "toy_unavailable: not on this machine"),
    )
    self.assertNotIn("toy_unavailable", registry.available_backends())
    self.enter_context(
        mock.patch.dict(
            registry.AUTO_ORDER,
            {jax.default_backend(): ("toy_unavailable", "reference")},
        )
    )
    self.assertEqual(registry.get_backend("auto").name, "reference")


class AutoFallthroughTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.enter_context(mock.patch.dict(registry._REGISTRY))
    self.enter_context(mock.patch.dict(registry._instances))
    registry.register_backend("toy_raises", _Raises)
    _Raises.calls = 0
    self.cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=8, expert_ffn_size=8
    )
    self.params = moe_core.init_params(jax.random.key(0), self.cfg)
    self.x = jax.random.normal(jax.random.key(1), (6, 8))

  def test_falls_through_not_implemented(self):
    self.enter_context(
        mock.patch.dict(
            registry.AUTO_ORDER,
            {jax.default_backend(): ("toy_raises", "reference")},
        )
    )
    y, _ = moe_core.moe_layer(self.params, self.x, self.cfg, backend="auto")
    self.assertEqual(_Raises.calls, 1)
    want, _ = moe_core.moe_layer(
        self.params, self.x, self.cfg, backend="reference"
    )
    np.testing.assert_array_equal(y, want)

  def test_named_backend_does_not_fall_through(self):
    with self.assertRaisesRegex(NotImplementedError, "never supported"):
      moe_core.moe_layer(self.params, self.x, self.cfg, backend="toy_raises")

  def test_all_refusing_lists_every_reason(self):
    self.enter_context(
        mock.patch.dict(
            registry.AUTO_ORDER, {jax.default_backend(): ("toy_raises",)}
        )
    )
    with self.assertRaisesRegex(
        NotImplementedError,
        r"no available backend supports this call: "
        r"toy_raises: toy_raises: never supported",
    ):
      moe_core.moe_layer(self.params, self.x, self.cfg, backend="auto")


class FlagTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.enter_context(flagsaver.flagsaver())
    self.enter_context(mock.patch.dict(registry._REGISTRY))

  def test_default_is_auto(self):
    flags.FLAGS(["prog"])
    self.assertEqual(moe_flags.MOE_BACKEND.value, "auto")

  def test_parses_registered_name(self):
    flags.FLAGS(["prog", "--moe_backend=xla"])
    self.assertEqual(moe_flags.MOE_BACKEND.value, "xla")
    self.assertEqual(flags.FLAGS.moe_backend, "xla")

  def test_rejects_unknown_name(self):
    with self.assertRaisesRegex(
        flags.IllegalFlagValueError,
        r"--moe_backend must be 'auto' or a "
        r"registered backend name, one of "
        r"\['auto', .*'reference'.*\]; got "
        r"'nope'",
    ):
      flags.FLAGS(["prog", "--moe_backend=nope"])

  def test_accepts_names_registered_later(self):
    registry.register_backend("toy", _Toy)
    flags.FLAGS(["prog", "--moe_backend=toy"])
    self.assertEqual(moe_flags.MOE_BACKEND.value, "toy")


if __name__ == "__main__":
  absltest.main()
