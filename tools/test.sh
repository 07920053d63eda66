#!/usr/bin/env bash
# Sets up the machine (tools/setup.sh), then runs every Bazel test under
# .venv/bin/python. Extra arguments go to `bazel test`, e.g.
#   tools/test.sh --test_output=all //moe_core/...
# (targets given after the flags are added to //...), then lists skipped
# tests with their reasons. Exits with bazel's code.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/setup.sh

export PYTHON_BIN_PATH="$PWD/.venv/bin/python"
# Changes whenever the requirements are reinstalled, so test results cached
# under the old packages are not reused (.bazelrc passes it to actions).
DROPLESS_VENV_STAMP="$(cat .venv/.requirements.sha256)"
export DROPLESS_VENV_STAMP

echo "test: PYTHON_BIN_PATH=$PYTHON_BIN_PATH bazel test //... $*" >&2
rc=0
bazel test //... "$@" || rc=$?
# Bazel reports a target whose tests all skipped as PASSED: say what did not
# run, and why.
tools/skipped_tests.sh || true
exit "$rc"
