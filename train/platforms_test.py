"""platforms: JAX_PLATFORMS by the accelerator a host has, never the user's
own setting overridden."""

import os
from unittest import mock

from absl.testing import absltest

from train import platforms


def _host(files):
  """Patches the device files the host seems to have (glob patterns and
  paths matched by prefix)."""
  exists = lambda path: path in files
  matching = lambda pattern: [f for f in files if f.startswith(pattern[:9])]
  libtpu = lambda name: object() if "libtpu" in files else None
  return (
      mock.patch.object(platforms.os.path, "exists", exists),
      mock.patch.object(platforms.glob, "glob", matching),
      mock.patch.object(platforms.importlib.util, "find_spec", libtpu),
  )


class DefaultPlatformsTest(absltest.TestCase):

  def _platforms(self, files, preset=None):
    env = {} if preset is None else {"JAX_PLATFORMS": preset}
    exists, globbed, found = _host(files)
    with exists, globbed, found, mock.patch.dict(os.environ, env, clear=True):
      platforms.set_default_platforms()
      return os.environ.get("JAX_PLATFORMS")

  def test_each_host_class(self):
    self.assertEqual(self._platforms([]), "cpu")
    self.assertEqual(self._platforms(["/dev/accel0", "libtpu"]), "tpu,cpu")
    self.assertEqual(self._platforms(["/dev/vfio/0", "libtpu"]), "tpu,cpu")
    # A passed-through device without libtpu is no TPU; libtpu alone (the
    # legs have it, to compile for TPUs) is none either.
    self.assertEqual(self._platforms(["/dev/vfio/0"]), "cpu")
    self.assertEqual(self._platforms(["libtpu"]), "cpu")
    # A GPU host: JAX chooses (its CUDA plugin finds the GPU).
    self.assertIsNone(self._platforms(["/dev/nvidiactl"]))

  def test_the_users_setting_stands(self):
    for files in ([], ["/dev/accel0", "libtpu"], ["/dev/nvidiactl"]):
      self.assertEqual(self._platforms(files, preset="cpu"), "cpu")


if __name__ == "__main__":
  absltest.main()
