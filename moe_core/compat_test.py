"""Tests of moe_core.compat: the Triton deprecation filter, the GPU mesh."""

import warnings

from absl.testing import absltest
import jax

from moe_core import compat


def _warn(message, category=DeprecationWarning):
  warnings.warn(message, category, stacklevel=2)


class FilterTritonDeprecationTest(absltest.TestCase):

  def test_swallows_and_counts_the_exact_warning_only(self):
    with warnings.catch_warnings(record=True) as shown:
      warnings.simplefilter("always")
      before = compat.triton_deprecations_filtered()
      with compat.filter_triton_deprecation():
        _warn(compat.TRITON_DEPRECATION_MESSAGE)
        _warn(compat.TRITON_DEPRECATION_MESSAGE)
        _warn(compat.TRITON_DEPRECATION_MESSAGE + " And more.")
        _warn("something else is deprecated")
        _warn(compat.TRITON_DEPRECATION_MESSAGE, UserWarning)
    self.assertEqual(compat.triton_deprecations_filtered() - before, 2)
    self.assertEqual(
        [(str(w.message), w.category) for w in shown],
        [
            (
                compat.TRITON_DEPRECATION_MESSAGE + " And more.",
                DeprecationWarning,
            ),
            ("something else is deprecated", DeprecationWarning),
            (compat.TRITON_DEPRECATION_MESSAGE, UserWarning),
        ],
    )

  def test_counts_it_even_where_it_would_be_ignored_or_raise(self):
    for action in ("ignore", "error"):
      with self.subTest(action), warnings.catch_warnings():
        warnings.simplefilter(action)
        before = compat.triton_deprecations_filtered()
        with compat.filter_triton_deprecation():
          _warn(compat.TRITON_DEPRECATION_MESSAGE)
        self.assertEqual(compat.triton_deprecations_filtered() - before, 1)

  def test_other_warnings_keep_the_filters_outside(self):
    with warnings.catch_warnings(record=True) as shown:
      warnings.simplefilter("default")  # Once per place it is raised.
      with compat.filter_triton_deprecation():
        for _ in range(3):
          _warn("shown once")
      with self.assertRaisesRegex(UserWarning, "an error"):
        warnings.simplefilter("error", UserWarning)
        with compat.filter_triton_deprecation():
          _warn("an error", UserWarning)
    self.assertEqual([str(w.message) for w in shown], ["shown once"])

  def test_restores_the_warnings_state(self):
    filters, show = list(warnings.filters), warnings.showwarning
    with compat.filter_triton_deprecation():
      pass
    self.assertEqual(warnings.filters, filters)
    self.assertIs(warnings.showwarning, show)


class AbstractGpuMeshTest(absltest.TestCase):

  def test_sets_an_abstract_gpu_mesh_with_auto_axes(self):
    if not hasattr(jax.sharding, "AbstractDevice"):
      self.skipTest("this jax has no jax.sharding.AbstractDevice.")
    with compat.abstract_gpu_mesh("NVIDIA H100", 132):
      mesh = jax.sharding.get_abstract_mesh()
    self.assertEqual(mesh.axis_names, ("x",))
    self.assertEqual(mesh.axis_types, (jax.sharding.AxisType.Auto,))
    self.assertEqual(mesh.abstract_device.device_kind, "NVIDIA H100")


if __name__ == "__main__":
  absltest.main()
