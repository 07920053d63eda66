"""platforms: JAX_PLATFORMS by the accelerator a host has, never the user's
own setting overridden, and set only when a program asks: importing the
package sets nothing."""

import os
import subprocess
import sys
import types
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


class ImportedJaxTest(absltest.TestCase):
  """After jax is imported, the choice also goes to jax.config (which
  counts until JAX starts its backends), unless the program set one."""

  def _call(self, config_value):
    updates = []
    config = types.SimpleNamespace(
        jax_platforms=config_value,
        update=lambda name, value: updates.append((name, value)),
    )
    exists, globbed, found = _host([])  # no accelerator: "cpu"
    with (
        exists,
        globbed,
        found,
        mock.patch.dict(os.environ, {}, clear=True),
        mock.patch.dict(
            sys.modules, {"jax": types.SimpleNamespace(config=config)}
        ),
    ):
      platforms.set_default_platforms()
      return updates, os.environ.get("JAX_PLATFORMS")

  def test_the_config_follows_the_environment(self):
    self.assertEqual(self._call(None), ([("jax_platforms", "cpu")], "cpu"))
    self.assertEqual(self._call(""), ([("jax_platforms", "cpu")], "cpu"))

  def test_the_programs_own_config_stands(self):
    self.assertEqual(self._call("tpu"), ([], "cpu"))


class NoSideEffectTest(absltest.TestCase):

  def test_importing_train_sets_nothing(self):
    # A fresh interpreter: this one has imported the package already.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, train, train.platforms; "
            "print(os.environ.get('JAX_PLATFORMS'))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    self.assertEqual(out.stdout.strip(), "None", out.stderr)


if __name__ == "__main__":
  absltest.main()
