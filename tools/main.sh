#!/usr/bin/env bash
# Sets up the machine (tools/setup.sh), then runs the main job with the
# default leg's python: the training program, `python -m train.main`, on the
# CPU, offline. Arguments go to it (e.g. --moe_backend=reference, --steps=50,
# --help). `tools/main.sh demo [...]` runs the one-layer backend demo
# (`python -m bench.micro.demo`) instead. DROPLESS_LEG=py311-jax0.10 (any leg of
# tools/legs.sh) runs it under that leg instead of the default.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
setup_args=()
if [[ -n "${DROPLESS_LEG:-}" ]]; then
  setup_args+=("--leg=$DROPLESS_LEG")
fi
PY="$(tools/setup.sh "${setup_args[@]}")/bin/python"
# The leg carries JAX's CUDA plugin; with no GPU here, JAX runs on the CPU.
if [[ ! -e /dev/nvidiactl ]]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
fi
# The cpu backend's grouped GEMM (XLA FFI custom calls, backends/cpu) is a
# C++ library: Bazel builds it against this leg's jaxlib (seconds once
# cached), and "auto" then picks it on the CPU where its kernels for this
# CPU beat xla's (backends/cpu/verdicts.py). Otherwise auto trains on the
# xla backend, and the line below says why.
DROPLESS_VENV_STAMP="$(cat "$(dirname "$PY")/../.requirements.sha256" 2>/dev/null || true)"
export DROPLESS_VENV_STAMP
if ! PYTHON_BIN_PATH="$PY" bazel build //backends/cpu:libdropless_cpu.so \
    >/dev/null 2>&1; then
  echo "main: building the cpu backend's library failed (rerun: bazel build //backends/cpu:libdropless_cpu.so)" >&2
fi
"$PY" -c 'from moe_core import registry
b = registry.get_backend("auto")
ok, why = registry.auto_choice("cpu")
print(f"main: grouped GEMM under --moe_backend=auto: {b!r}"
      + ("" if ok else f" ({why})"))' >&2
if [[ "${1:-}" == "demo" ]]; then
  shift
  exec "$PY" -m bench.micro.demo "$@"
fi
exec "$PY" -m train.main "$@"
