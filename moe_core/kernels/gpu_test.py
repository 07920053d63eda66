"""The GPU probe the kernel backends share (`moe_core.kernels.gpu`).

Devices are fakes with the attributes JAX's devices carry (a real GPU's
`compute_capability` and `core_count`, an abstract one's `device_kind` and
`num_cores`), and the abstract GPU target is the one `moe_core.aot` sets (a
one-device abstract mesh), so that every path runs on a CPU host.
"""

from __future__ import annotations

import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax

from moe_core import compat
from moe_core.kernels import gpu


def _real(capability="9.0", kind="NVIDIA H100 80GB HBM3", cores=132):
  """A device as a CUDA GPU here reports itself."""
  return types.SimpleNamespace(
      platform="gpu",
      device_kind=kind,
      compute_capability=capability,
      core_count=cores,
  )


def _cpu():
  return types.SimpleNamespace(platform="cpu", device_kind="cpu")


class CapabilityTest(parameterized.TestCase):

  @parameterized.parameters(
      ("9.0", 90),
      ("10.0", 100),
      ("10.3", 103),
      ("8.0", 80),
      ("8.6", 86),
      ("12.0", 120),
      (None, None),
      ("", None),
      ("9", None),
      ("gfx942", None),
      ("9.x", None),
  )
  def test_parse(self, text, want):
    self.assertEqual(gpu.parse_capability(text), want)

  @parameterized.parameters(90, 100, 103, 80, 75)
  def test_text_reads_back(self, capability):
    text = gpu.capability_text(capability)
    self.assertEqual(gpu.parse_capability(text), capability)

  # Capabilities from NVIDIA's published tables (sm_90 Hopper, sm_100
  # Blackwell, sm_103 Blackwell Ultra); A100 (sm_80) is not a model any
  # backend builds for from its kind alone.
  @parameterized.parameters(
      ("NVIDIA H100 80GB HBM3", 90),
      ("NVIDIA H100 PCIe", 90),
      ("NVIDIA H200", 90),
      ("NVIDIA H800", 90),
      ("NVIDIA GH200 480GB", 90),
      ("NVIDIA B200", 100),
      ("NVIDIA GB200", 100),
      ("NVIDIA B300", 103),
      ("NVIDIA GB300", 103),
      ("NVIDIA A100-SXM4-80GB", None),
      ("cpu", None),
      ("", None),
  )
  def test_kind(self, kind, want):
    self.assertEqual(gpu.capability_of_kind(kind), want)


class ProbeTest(parameterized.TestCase):

  def test_a_real_device_is_read_by_its_capability(self):
    # Its capability string wins over its kind: an unlisted model is known.
    info = gpu.probe(_real("8.0", "NVIDIA A100-SXM4-80GB", 108))
    self.assertEqual(info, gpu.Gpu("NVIDIA A100-SXM4-80GB", 80, 108))

  def test_a_device_without_a_capability_has_none(self):
    # A GPU that reports none (not CUDA) is not given its kind's.
    info = gpu.probe(_real(None, "NVIDIA H200"))
    self.assertIsNone(info.capability)

  def test_an_abstract_device_is_read_by_its_kind(self):
    device = types.SimpleNamespace(
        platform="gpu", device_kind="NVIDIA B200", num_cores=148
    )
    self.assertEqual(gpu.probe(device), gpu.Gpu("NVIDIA B200", 100, 148))

  @parameterized.parameters(None, 0, -1, "132")
  def test_an_sm_count_that_is_not_a_count_is_none(self, cores):
    self.assertIsNone(gpu.probe(_real(cores=cores)).sm_count)

  def test_not_a_gpu(self):
    self.assertIsNone(gpu.probe(_cpu()))

  def test_the_target_comes_before_the_local_gpu(self):
    with (
        mock.patch.object(jax, "devices", return_value=[_real()]),
        compat.abstract_gpu_mesh("NVIDIA B200", num_cores=148),
    ):
      self.assertEqual(gpu.probe(), gpu.Gpu("NVIDIA B200", 100, 148))

  def test_a_given_device_comes_before_the_target(self):
    device = _real("8.0", "NVIDIA A100", 108)
    with compat.abstract_gpu_mesh("NVIDIA B200", num_cores=148):
      self.assertEqual(gpu.probe(device).capability, 80)
      self.assertEqual(gpu.probe(device).sm_count, 108)

  def test_without_a_target_the_local_gpu(self):
    with mock.patch.object(jax, "devices", return_value=[_real()]):
      self.assertIsNone(gpu.target_device())
      self.assertEqual(gpu.probe(), gpu.Gpu("NVIDIA H100 80GB HBM3", 90, 132))

  def test_none_without_a_target_or_a_local_gpu(self):
    with mock.patch.object(jax, "devices", return_value=[_cpu()]):
      self.assertIsNone(gpu.probe())

  def test_target_device(self):
    self.assertIsNone(gpu.target_device())
    with compat.abstract_gpu_mesh("NVIDIA H200"):
      self.assertEqual(gpu.target_device().device_kind, "NVIDIA H200")
      self.assertEqual(gpu.lowering_platform(), "gpu")
    # A mesh of CPU devices sets an abstract device that is not a GPU.
    mesh = jax.sharding.AbstractMesh(
        (1,),
        ("x",),
        abstract_device=jax.sharding.AbstractDevice(
            device_kind="cpu", num_cores=None, platform="cpu"
        ),
    )
    with jax.sharding.use_abstract_mesh(mesh):
      self.assertIsNone(gpu.target_device())
      self.assertEqual(gpu.lowering_platform(), "cpu")


if __name__ == "__main__":
  absltest.main()
