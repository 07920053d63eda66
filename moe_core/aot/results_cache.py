"""What a deviceless compile found, kept for the next compile of the same
program by the same compiler.

JAX's persistent compilation cache writes a deviceless compile's
executable but cannot read it back (loading one needs a device: "PjRtCompiler
must be constructed with a Client to call DeserializeLoadedExecutable"), so
every compile for a GPU or TPU topology from a CPU host ran in full, every
time. This cache keeps `compile.CompiledProgram`'s figures and the compiled
module's text instead, one gzipped JSON file per key, in
`<jax_compilation_cache_dir>/dropless-aot/`: on only where JAX's cache is
(the programs' and tests' setting), off otherwise.

The key is a hash of everything the compiler's output depends on: the
lowered StableHLO (the program, its shardings and every kernel's own
serialised body, with the source tree's folder taken out of the kernels'
source locations, so that the same tree checked out elsewhere, or in
another Bazel sandbox, finds the entry), the XLA options, the target, the
topology's devices in the mesh's order and its axis names, XLA_FLAGS and
LIBTPU_INIT_ARGS, and the versions of jax, jaxlib and the compiler plugins
(libtpu, the CUDA plugin). A compile that fails is not kept: it fails
again.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import tempfile
from typing import Any

import jax

# Bumped when what is kept, or how the key is made, changes.
FORMAT = 1
_FOLDER = "dropless-aot"
# The packages whose versions decide what a deviceless compile makes.
_COMPILER_PACKAGES = (
    "jax",
    "jaxlib",
    "libtpu",
    "libtpu-nightly",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
)
# A Mosaic kernel's serialised MLIR and its source locations in a custom
# call's backend config (base64, in the StableHLO text's escaped quotes).
_KERNEL_BODY = re.compile(
    r"\\22(?:body|debug_locations)\\22: \\22([A-Za-z0-9+/=]+)\\22"
)
# A Mosaic GPU kernel's hash of its module (whose source locations the
# text keeps, normalised below): derived from the module, so left out.
_KERNEL_HASH = re.compile(r'kernel_hash = "[^"]*"')
# The folder holding moe_core/: kernels record their source files under it.
_TREE = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
# Fields of a kept record that are not `CompiledProgram` fields.
_DERIVED = ("name", "cached", "peak_bytes", "fits")


def directory() -> str | None:
  """Where results are kept: beside JAX's compilation cache, or None (off)."""
  base = jax.config.jax_compilation_cache_dir
  if not base:
    return None
  return os.path.join(base, _FOLDER)


def _versions() -> dict[str, str]:
  found = {}
  for package in _COMPILER_PACKAGES:
    try:
      found[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      continue
  return found


def key(stablehlo: str, options: dict, topology, mesh) -> str:
  """The hex digest naming one compile's result.

  Args:
    stablehlo: the lowered program's text (`Lowered.as_text()`).
    options: the XLA options it is compiled with.
    topology: the `topology.Topology` it is compiled for.
    mesh: the mesh whose devices run it (the context mesh of the compile).
  """
  devices = [int(d.id) for d in mesh.devices.flat]
  parts = {
      "format": FORMAT,
      "options": sorted((str(k), repr(v)) for k, v in options.items()),
      "target": topology.target.name,
      "topology": topology.spec,
      "devices": devices,
      "axes": [str(a) for a in mesh.axis_names],
      "shape": list(mesh.devices.shape),
      "env": [os.environ.get(v, "") for v in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")],
      "versions": _versions(),
  }
  digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode())
  tree = _TREE.encode()
  for kernel in _KERNEL_BODY.findall(stablehlo):
    digest.update(base64.b64decode(kernel).replace(tree, b"<tree>"))
  rest = _KERNEL_HASH.sub("", _KERNEL_BODY.sub("", stablehlo))
  digest.update(rest.replace(_TREE, "<tree>").encode())
  return digest.hexdigest()


def read(digest: str) -> dict[str, Any] | None:
  """The kept `CompiledProgram` fields (with `hlo_text`) for `digest`, or
  None: no cache, no entry, or an entry that cannot be read."""
  folder = directory()
  if folder is None:
    return None
  path = os.path.join(folder, digest + ".json.gz")
  try:
    with gzip.open(path, "rt", encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  if record.pop("format", None) != FORMAT:
    return None
  for name in _DERIVED:
    record.pop(name, None)
  return record


def write(digest: str, record: dict[str, Any]) -> None:
  """Keeps `record` (a `CompiledProgram.to_json()` with `hlo_text`) under
  `digest`; a cache that cannot be written is skipped (it is an
  optimisation, never a failure)."""
  folder = directory()
  if folder is None:
    return
  text = json.dumps(dict(record, format=FORMAT))
  try:
    os.makedirs(folder, exist_ok=True)
    # Written whole under a temporary name, then renamed: a reader in
    # another process never sees half a file.
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
  except OSError:
    return
  try:
    with os.fdopen(handle, "wb") as raw:
      raw.write(gzip.compress(text.encode("utf-8")))
    os.replace(temporary, os.path.join(folder, digest + ".json.gz"))
  except OSError:
    if os.path.exists(temporary):
      os.remove(temporary)
