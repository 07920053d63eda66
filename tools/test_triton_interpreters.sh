#!/usr/bin/env bash
# The triton backend's interpreted kernel tests on every Triton a leg pins.
#
# The kernels run in Triton's interpreter on torch CPU tensors, and torch has
# a CPU wheel for Python 3.11 only, so the oldest leg (triton 3.8.0) runs
# them in the matrix. This runs the same kernel tests on that leg's Python
# with the other legs' Tritons, 3.6.0 (the GPU machine's) and 3.9.0 (the
# newest leg's), each installed alone into .venvs/overlays/triton-<version>
# and put first on PYTHONPATH: the interpreter needs no compiler, so only
# Triton's Python package differs. About 2 minutes a version on 2 cores.
#
#   tools/test_triton_interpreters.sh [VERSION...]   # default: 3.6.0 3.9.0
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(tools/setup.sh --leg=py311-jax0.10)"
python="$venv/bin/python"
versions=("$@")
if [[ ${#versions[@]} -eq 0 ]]; then
  versions=(3.6.0 3.9.0)
fi
tests=(
  backends/triton/kernels_interpret_test.py
  backends/triton/permute_interpret_test.py
)
for version in "${versions[@]}"; do
  overlay=".venvs/overlays/triton-$version"
  if [[ ! -f "$overlay/.installed" ]]; then
    rm -rf "$overlay"
    "$python" -m pip install --quiet --no-deps --target "$overlay" \
      "triton==$version"
    touch "$overlay/.installed"
  fi
  got="$(PYTHONPATH="$overlay" "$python" -c \
    'import triton; print(triton.__version__)')"
  if [[ "$got" != "$version" ]]; then
    echo "triton interpreters: wanted triton $version, imported $got" >&2
    exit 1
  fi
  echo "triton interpreters: triton $version on $("$python" -V)"
  PYTHONPATH="$overlay" TRITON_CACHE_DIR="$PWD/.cache/triton/overlay-$version" \
    "$python" -m pytest -q -p no:cacheprovider "${tests[@]}"
done
