#!/usr/bin/env bash
# Sets up the machine (tools/setup.sh), then runs the main job with .venv's
# python: the training program, `python -m train.main`, on the CPU, offline.
# Arguments go to it (e.g. --moe_backend=reference, --steps=50, --help).
# `tools/main.sh demo [...]` runs the one-layer backend demo
# (`python -m bench.demo`) instead.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/setup.sh

PY="$PWD/.venv/bin/python"
if [[ "${1:-}" == "demo" ]]; then
  shift
  exec "$PY" -m bench.demo "$@"
fi
exec "$PY" -m train.main "$@"
