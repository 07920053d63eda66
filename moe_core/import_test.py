"""Smoke test: `import moe_core` works and imports no backend or vendor code."""

import json
import os
import subprocess
import sys

from absl.testing import absltest

# Module prefixes that `import moe_core` must leave unimported: backends are
# imported by the registry on first use, and hardware-only packages stay
# inside their backend (the team's style guide, ../shared/STYLE.md, section 4).
_FORBIDDEN = (
    "backends",
    "reference",
    # The Hugging Face converter depends on moe_core, never the other way.
    "hf_convert",
    "jax.experimental.pallas",
    "jax_triton",
    "triton",
    "transformer_engine",
    # moe_core.flax needs flax (the `train` extra); moe_core itself must not.
    "flax",
)

# Runs in a fresh interpreter, so that modules the test runner (or other tests
# in the same pytest session) imported cannot hide or fake a leak.
_PROBE = """
import json, sys
import moe_core
names = moe_core.registered_backends()
print(json.dumps({"backends": names, "modules": sorted(sys.modules)}))
"""


def _is_under(module, prefix):
  return module == prefix or module.startswith(prefix + ".")


class ImportTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    import moe_core  # pylint: disable=g-import-not-at-top
    # The directory that holds moe_core/, for the child's sys.path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(moe_core.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
      raise AssertionError(
          f"`import moe_core` failed in a fresh interpreter "
          f"(exit {done.returncode}):\n{done.stderr}"
      )
    cls.probe = json.loads(done.stdout.strip().splitlines()[-1])

  def test_registered_backends_lists_the_builtin_ones(self):
    names = self.probe["backends"]
    print(f"registered backends: {names}")
    self.assertContainsSubset({"reference", "xla", "pallas"}, set(names))
    self.assertLen(set(names), len(names))

  def test_import_loads_no_backend_or_vendor_module(self):
    leaked = [
        m
        for m in self.probe["modules"]
        if any(_is_under(m, p) for p in _FORBIDDEN)
    ]
    self.assertEmpty(leaked, f"import moe_core also imported {leaked}")

  def test_import_loads_moe_core_and_jax(self):
    # Guards the test above against a probe that imported nothing at all.
    modules = set(self.probe["modules"])
    self.assertContainsSubset({"moe_core", "moe_core.registry", "jax"}, modules)


if __name__ == "__main__":
  absltest.main()
