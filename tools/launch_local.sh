#!/usr/bin/env bash
# Runs the training program as N processes on this machine, joined by JAX's
# distributed runtime over 127.0.0.1 (tools/launch_local.py), with the
# default leg's python (tools/setup.sh, as tools/main.sh does):
#
#   tools/launch_local.sh 2 --mesh=data=2,expert=4 --steps=20
#
# runs 2 copies of `python -m train.main --mesh=data=2,expert=4 --steps=20`,
# each line of their output prefixed with [p0] or [p1]. DROPLESS_LEG=LEG runs
# another leg of tools/legs.sh. Launcher options (--grace_s, --timeout_s,
# ...): call tools/launch_local.py itself.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ! "${1:-}" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: tools/launch_local.sh NUM_PROCESSES [train.main flags...];" \
    "NUM_PROCESSES must be an integer >= 1, got '${1:-}'" >&2
  exit 2
fi
num_processes="$1"
shift
setup_args=()
if [[ -n "${DROPLESS_LEG:-}" ]]; then
  setup_args+=("--leg=$DROPLESS_LEG")
fi
PY="$(tools/setup.sh "${setup_args[@]}")/bin/python"
exec "$PY" tools/launch_local.py --num_processes="$num_processes" -- \
  "$PY" -m train.main "$@"
