"""Tests of moe_core.xla_flags: this jaxlib accepts every GPU EP flag."""

import os
import subprocess
import sys

from absl.testing import absltest

from moe_core import xla_flags


class XlaFlagsTest(absltest.TestCase):

  def _start_jax(self, flags: str):
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import jax.numpy as jnp; print(float((jnp.ones(3) * 2).sum()))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

  def test_this_jaxlib_accepts_every_flag(self):
    # XLA parses every GPU flag on any platform and aborts on unknown ones.
    done = self._start_jax(xla_flags.format_flags(xla_flags.gpu_ep_flags()))
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertEqual(done.stdout.strip(), "6.0")

  def test_an_unknown_flag_is_rejected(self):
    # The control for the test above: the check does catch a bad flag.
    done = self._start_jax("--xla_gpu_no_such_flag_for_moe=true")
    self.assertNotEqual(done.returncode, 0)
    self.assertIn("Unknown flag", done.stderr)

  def test_merge_keeps_flags_the_user_set(self):
    env = {
        "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false "
        "--xla_dump_to=/tmp/d"
    }
    merged = xla_flags.apply_gpu_ep_flags(environ=env)
    self.assertEqual(merged, env["XLA_FLAGS"])
    parts = merged.split()
    self.assertIn("--xla_gpu_enable_latency_hiding_scheduler=false", parts)
    self.assertNotIn("--xla_gpu_enable_latency_hiding_scheduler=true", parts)
    self.assertIn("--xla_dump_to=/tmp/d", parts)
    names = [p.split("=")[0] for p in parts]
    self.assertLen(set(names), len(names))
    for flag in xla_flags.gpu_ep_flags():
      self.assertIn(f"--{flag.name}", names)

  def test_every_flag_is_explained(self):
    text = xla_flags.explain()
    for flag in xla_flags.gpu_ep_flags():
      self.assertIn(f"--{flag.name}={flag.value}", text)
      self.assertGreater(len(flag.why), 30)


if __name__ == "__main__":
  absltest.main()
