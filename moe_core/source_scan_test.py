"""Library code uses no JAX API that changed meaning or vanished under it.

* `jnp.empty` / `empty_like` (and `lax.empty`): since jax 0.11 they return
  uninitialised memory on GPU and TPU (zeros on the CPU, so CPU tests cannot
  see it). dropless relies on zeros in the buffers it builds: the
  ragged_all_to_all output buffers and padded rows past sum(group_sizes).
  Use `jnp.zeros` / `jnp.zeros_like`.
* `pl.dot`: deprecated in jax 0.10.2, an AttributeError since 0.11.2. Use
  `lax.dot_general` or `jnp.dot`, which lower to the same Triton dot.

The scan parses each file (so a docstring or comment that names these is
fine) and covers the library code of moe_core, backends, reference, train,
bench and conformance: every .py file but tests. Under Bazel it sees the
files of the libraries this test depends on.
"""

import ast
import os

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = (
    "moe_core",
    "backends",
    "reference",
    "train",
    "bench",
    "conformance",
)

_EMPTY = (
    "returns uninitialised memory on GPU/TPU since jax 0.11, and "
    "dropless relies on zeros in its buffers: use jnp.zeros / "
    "jnp.zeros_like"
)
_PL_DOT = (
    "raises AttributeError since jax 0.11.2: use lax.dot_general or " "jnp.dot"
)
# (module, attribute) -> why not. A module is matched by the name the file
# uses for it, spelled as dropless spells it (jnp, lax, pl) or in full.
_BANNED = {
    ("jnp", "empty"): _EMPTY,
    ("jax.numpy", "empty"): _EMPTY,
    ("lax", "empty"): _EMPTY,
    ("jax.lax", "empty"): _EMPTY,
    ("pl", "dot"): _PL_DOT,
    ("jax.experimental.pallas", "dot"): _PL_DOT,
}
# Banned whatever module it comes from (numpy's is uninitialised too).
_BANNED_ANYWHERE = {"empty_like": _EMPTY}


def _dotted(node):
  """'a.b.c' for the expression a.b.c, else None."""
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    base = _dotted(node.value)
    return base and f"{base}.{node.attr}"
  return None


def banned_uses(source: str, filename: str = "<source>") -> list[str]:
  """'file:line: name: why' for each banned API the source uses."""
  found = []
  for node in ast.walk(ast.parse(source, filename)):
    names = []
    if isinstance(node, ast.Attribute):
      names.append((_dotted(node.value), node.attr))
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.extend((node.module, alias.name) for alias in node.names)
    for module, attr in names:
      why = _BANNED.get((module, attr)) or _BANNED_ANYWHERE.get(attr)
      if why:
        found.append((node.lineno, f"{module}.{attr} {why}"))
  return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def _library_files():
  for package in _PACKAGES:
    for folder, _, files in os.walk(os.path.join(_ROOT, package)):
      for name in sorted(files):
        if name.endswith(".py") and not name.endswith("_test.py"):
          yield package, os.path.join(folder, name)


class SourceScanTest(absltest.TestCase):

  def test_library_code_uses_no_banned_api(self):
    found, scanned = [], set()
    for package, path in _library_files():
      scanned.add(package)
      with open(path, encoding="utf-8") as fh:
        found.extend(banned_uses(fh.read(), os.path.relpath(path, _ROOT)))
    self.assertEqual(scanned, set(_PACKAGES), "packages with no file found")
    self.assertEmpty(found, "\n" + "\n".join(found))

  def test_the_scan_finds_each_banned_use(self):
    source = "\n".join(
        [
            "import jax.numpy as jnp",
            "from jax import lax",
            "from jax.experimental import pallas as pl",
            "from jax.numpy import empty",
            "a = jnp.empty((4, 3))",
            "b = jnp.empty_like(a)",
            "c = np.empty_like(a)",
            "d = jax.numpy.empty(3)",
            "e = pl.dot(a, b)",
            "f = lax.empty((3,), jnp.float32)",
            "g = jnp.zeros((4, 3))  # jnp.empty would be wrong here.",
            '"""Not jnp.empty((2,)) either."""',
        ]
    )
    found = banned_uses(source)
    self.assertEqual(
        [line.split(":")[1] for line in found],
        ["4", "5", "6", "7", "8", "9", "10"],
    )
    self.assertIn("uninitialised memory", found[1])
    self.assertIn("lax.dot_general", found[5])


if __name__ == "__main__":
  absltest.main()
