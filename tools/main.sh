#!/usr/bin/env bash
# Sets up the machine (tools/setup.sh), then runs the main job with the
# default leg's python: the training program, `python -m train.main`, on the
# CPU, offline. Arguments go to it (e.g. --moe_backend=reference, --steps=50,
# --help). `tools/main.sh demo [...]` runs the one-layer backend demo
# (`python -m bench.demo`) instead. DROPLESS_LEG=py311-jax0.10 (any leg of
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
if [[ "${1:-}" == "demo" ]]; then
  shift
  exec "$PY" -m bench.demo "$@"
fi
exec "$PY" -m train.main "$@"
