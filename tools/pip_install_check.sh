#!/usr/bin/env bash
# CI check of the packaging (pyproject.toml): dropless installs with pip and
# works from outside the repository.
#
#   tools/pip_install_check.sh [PYTHON]
#
# PYTHON is an interpreter (default python3): a command, a path, or a
# version such as 3.12 (then python3.12 on PATH, else pyenv's newest 3.12.x).
# Steps, each printed on one line with its elapsed seconds:
#   1. copy the working tree (git's tracked and untracked-but-not-ignored
#      files) into a temporary directory. Installing from the copy keeps the
#      checkout clean (setuptools writes build/ and dropless.egg-info next to
#      pyproject.toml) and sees only what a fresh clone would.
#   2. `pip install <copy>` (non-editable) into a fresh venv, run from the
#      temporary directory; check the installed file list (the wheel's
#      RECORD): every module of moe_core, reference, backends, conformance
#      and hf_convert is there (their unit tests included), nothing of train,
#      bench, tools or bazel.
#   3. from the temporary directory, import moe_core, reference, backends.xla,
#      backends.pallas, conformance and hf_convert, check that they come from
#      the venv's site-packages, run one jitted moe_layer on the reference,
#      xla and pallas backends (shape, finiteness, agreement with the
#      reference).
#   4. `pip install -e <copy>` into a second fresh venv, and the same checks,
#      now expecting the modules to come from the copy, and that a module
#      added to the source after the install is importable (editable);
#      moe_layer on reference and xla only.
# Exits non-zero on the first failure.
#
# Environment:
#   PIP_CONSTRAINT  pip reads it natively; e.g.
#       PIP_CONSTRAINT=requirements/py313-jax0.12.txt \
#         tools/pip_install_check.sh 3.13
#     installs that leg's exact pins (relative paths are taken from the
#     directory the script is started in). It replaces, not extends, a
#     `constraint` set in pip's config files.
#   Any other PIP_* variable (PIP_INDEX_URL, PIP_FIND_LINKS, ...) also
#   reaches pip. Downloads go through pip's own cache, as pip is configured.
#   KEEP_TMP=1  keep the temporary directory (its path is printed).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${1:-python3}"
START="$(date +%s.%N)"
STEP_START="$START"

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b - a}'; }
step() {
  echo "pip_install_check: $* ($(elapsed "$STEP_START") s)"
  STEP_START="$(date +%s.%N)"
}
fail() { echo "pip_install_check: FAILED: $*" >&2; exit 1; }

# The interpreter: a version is looked up as tools/setup.sh does.
if [[ "$PYTHON" =~ ^3\.[0-9]+$ ]]; then
  source "$REPO/tools/legs.sh"
  want="$PYTHON"
  PYTHON="$(find_python "$want")" || fail "no Python $want found (PATH, pyenv)"
fi
"$PYTHON" -c "" 2>/dev/null || fail "'$PYTHON' does not run"
PY_VERSION="$("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"

# Relative constraint files are the caller's; the script changes directory.
if [[ -n "${PIP_CONSTRAINT:-}" ]]; then
  abs=()
  for f in $PIP_CONSTRAINT; do
    if [[ "$f" == *://* || "$f" == /* ]]; then abs+=("$f")
    else abs+=("$PWD/$f"); fi
    [[ "$f" == *://* || -f "${abs[-1]}" ]] \
      || fail "PIP_CONSTRAINT file not found: ${abs[-1]}"
  done
  export PIP_CONSTRAINT="${abs[*]}"
fi

TMP="$(mktemp -d "${TMPDIR:-/tmp}/dropless_pip_check.XXXXXX")"
if [[ "${KEEP_TMP:-0}" == 1 ]]; then
  trap 'echo "pip_install_check: kept $TMP"' EXIT
else
  trap 'rm -rf "$TMP"' EXIT
fi
cd "$TMP"
echo "pip_install_check: Python $PY_VERSION ($PYTHON), repo $REPO," \
  "work dir $TMP${PIP_CONSTRAINT:+, PIP_CONSTRAINT=$PIP_CONSTRAINT}"

# 1. The working tree, as a fresh clone (plus uncommitted changes) has it.
SRC="$TMP/src"
mkdir "$SRC"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
    | xargs -0 cp --parents -t "$SRC")
else
  tar -C "$REPO" --exclude='./.git' --exclude='./.venv*' \
    --exclude='./bazel-*' --exclude='./build' --exclude='*.egg-info' \
    --exclude='__pycache__' -cf - . | tar -C "$SRC" -xf -
fi
[[ -f "$SRC/pyproject.toml" ]] || fail "no pyproject.toml in $REPO"
step "copied the working tree: $(find "$SRC" -type f | wc -l) files"

# -qq: errors only (no per-index warnings).
PIP_FLAGS=(-qq --progress-bar off --disable-pip-version-check
           --no-compile)

# The Python side of steps 2-4: $1 = the venv, $2 = wheel | editable.
check() {
  "$1/bin/python" -I - "$2" "$SRC" <<'EOF'
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig
import time

mode, src = sys.argv[1], sys.argv[2]
os.chdir(os.path.dirname(src))  # outside the repository and its copy
if mode == "wheel":
  root = os.path.realpath(sysconfig.get_paths()["purelib"])
else:
  root = os.path.realpath(src)

# What the wheel holds (its RECORD, as installed).
if mode == "wheel":
  files = [str(f) for f in importlib.metadata.files("dropless")]
  py = sorted(f for f in files if f.endswith(".py"))
  tops = sorted({f.split("/")[0] for f in py})
  if tops != ["backends", "conformance", "hf_convert", "moe_core",
              "reference"]:
    sys.exit(f"unexpected top-level packages in the wheel: {tops}")
  want = set()
  for top in tops:
    for d, _, names in os.walk(os.path.join(src, top)):
      for n in names:
        if n.endswith(".py"):
          want.add(os.path.relpath(os.path.join(d, n), src))
  missing = sorted(want - set(py))
  if missing:
    sys.exit(f"modules missing from the wheel (see packages.find in "
             f"pyproject.toml): {missing}")
  counts = {}
  for f in py:
    pkg = ".".join(f.split("/")[:-1])
    counts[pkg] = counts.get(pkg, 0) + 1
  print("  wheel: %d files, %d modules: %s" % (
      len(files), len(py),
      ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))))
else:
  # A module added after the install is importable: the install is live.
  with open(os.path.join(src, "moe_core", "_editable_probe.py"), "w") as f:
    f.write("OK = True\n")

t = time.time()
import jax
import jax.numpy as jnp
import moe_core
import reference
import backends.xla
import backends.pallas
import conformance
import conformance.suite
import hf_convert
for mod in (moe_core, reference, backends, backends.xla, backends.pallas,
            conformance, conformance.suite, hf_convert):
  path = os.path.realpath(mod.__file__)
  if not path.startswith(root + os.sep):
    sys.exit(f"{mod.__name__} comes from {path}, not from {root}")
unwanted = ["train", "bench", "tools", "bazel"]
for name in unwanted:
  if importlib.util.find_spec(name) is not None:
    sys.exit(f"{name} is importable: it should not be installed")
if mode == "editable":
  importlib.import_module("moe_core._editable_probe")
print(f"  imports from {root} ({time.time() - t:.1f} s); jax {jax.__version__},"
      f" backends {moe_core.available_backends()}")

cfg = moe_core.MoEConfig(num_experts=4, top_k=2, hidden_size=16,
                         expert_ffn_size=32)
params = moe_core.init_params(jax.random.key(0), cfg, dtype=jnp.float32)
x = jax.random.normal(jax.random.key(1), (2, 8, 16), jnp.float32)
ys = {}
# pallas (interpreted on CPU) only once: the editable check is about paths.
for backend in ("reference", "xla") + (("pallas",) if mode == "wheel" else ()):
  t = time.time()
  layer = jax.jit(lambda p, x, b=backend: moe_core.moe_layer(p, x, cfg, b))
  y, aux = layer(params, x)
  y = jax.block_until_ready(y)
  if y.shape != x.shape or y.dtype != x.dtype:
    sys.exit(f"{backend}: y is {y.shape} {y.dtype}, want {x.shape} {x.dtype}")
  if not bool(jnp.isfinite(y).all()):
    sys.exit(f"{backend}: y is not finite")
  if int(aux.tokens_per_expert.sum()) != 16 * cfg.top_k:
    sys.exit(f"{backend}: tokens_per_expert {aux.tokens_per_expert}")
  ys[backend] = y
  err = float(jnp.abs(y - ys["reference"]).max())
  if err > 1e-4:
    sys.exit(f"{backend}: max |y - reference| = {err}")
  print(f"  moe_layer {backend}: y {y.shape}, max |y - reference| {err:.1e}"
        f" ({time.time() - t:.1f} s)")
EOF
}

# Venvs without their own pip (saves ensurepip's ~5 s per venv) when the
# interpreter has pip >= 22.3, which installs into another interpreter's
# environment with --python; else venvs with pip.
OUTER_PIP=0
if "$PYTHON" -c 'import sys
from pip import __version__ as v
sys.exit(tuple(map(int, v.split(".")[:2])) < (22, 3))' 2>/dev/null; then
  OUTER_PIP=1
fi
make_venv() {
  if [[ "$OUTER_PIP" == 1 ]]; then "$PYTHON" -m venv --without-pip "$1"
  else "$PYTHON" -m venv "$1"; fi
}
venv_pip() {
  local venv="$1"
  shift
  if [[ "$OUTER_PIP" == 1 ]]; then
    "$PYTHON" -m pip --python "$venv/bin/python" "$@"
  else
    "$venv/bin/python" -m pip "$@"
  fi
}

# 2-3. pip install <copy>, the wheel.
make_venv "$TMP/venv-wheel" || fail "python -m venv"
step "venv (wheel install)"
venv_pip "$TMP/venv-wheel" install "${PIP_FLAGS[@]}" "$SRC" \
  || fail "pip install $SRC"
step "pip install <repo> (non-editable)"
check "$TMP/venv-wheel" wheel || fail "the wheel install"
step "wheel install: contents, imports and moe_layer checked"
# Its ~0.6 GB are not needed for step 4 (the disk may be shared and full).
rm -rf "$TMP/venv-wheel"

# 4. pip install -e <copy>.
make_venv "$TMP/venv-editable" || fail "python -m venv"
step "venv (editable install)"
venv_pip "$TMP/venv-editable" install "${PIP_FLAGS[@]}" -e "$SRC" \
  || fail "pip install -e $SRC"
step "pip install -e <repo>"
check "$TMP/venv-editable" editable || fail "the editable install"
step "editable install: imports and moe_layer checked"

STEP_START="$START"
step "OK, Python $PY_VERSION: total"
