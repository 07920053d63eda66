#!/usr/bin/env bash
# Sets up the machine (tools/setup.sh), then runs the main job,
# `python -m bench.demo`, with .venv's python. Arguments go to the demo.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/setup.sh

PY="$PWD/.venv/bin/python"
if [[ ! -f bench/demo.py ]]; then
  echo "main: bench/demo.py does not exist yet, so there is no main job to" \
    "run; run the tests with tools/test.sh." >&2
  exit 1
fi
exec "$PY" -m bench.demo "$@"
