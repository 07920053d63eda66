#!/usr/bin/env bash
# Lint and format check with the pinned ruff (configuration: [tool.ruff] in
# pyproject.toml; the pin: the `lint` extra there).
#
#   tools/lint.sh [PATH...]      # default: the whole repository
#
# Runs `ruff check` and `ruff format --check` (both, even when the first
# fails) and exits non-zero on any violation. Bazel's output links
# (bazel-*), .venv* and .venvs are excluded by the configuration, also when
# named on the command line. `ruff format --check` lists the files it would
# change; `ruff format --diff PATH` shows how, `ruff format PATH` applies it.
#
# Environment:
#   RUFF    a ruff executable to use instead (warns when its version is not
#           the pinned one: versions format differently).
#   PYTHON  interpreter that creates .venvs/lint (default python3), where
#           the pinned ruff is installed on first use.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

WANT="$(sed -n 's/.*"ruff==\([0-9][0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)"
if [[ -z "$WANT" ]]; then
  echo "lint: no ruff==VERSION pin in pyproject.toml's lint extra" >&2
  exit 2
fi

version_of() { "$1" --version 2>/dev/null | awk '{print $2}'; }

if [[ -n "${RUFF:-}" ]]; then
  have="$(version_of "$RUFF")"
  if [[ -z "$have" ]]; then
    echo "lint: RUFF=$RUFF does not run" >&2
    exit 2
  fi
  if [[ "$have" != "$WANT" ]]; then
    echo "lint: warning: RUFF is ruff $have, the pin is $WANT" >&2
  fi
else
  RUFF=.venvs/lint/bin/ruff
  if [[ "$(version_of "$RUFF")" != "$WANT" ]]; then
    echo "lint: installing ruff $WANT into .venvs/lint" >&2
    python="${PYTHON:-python3}"
    if [[ ! -x .venvs/lint/bin/python ]]; then
      rm -rf .venvs/lint
      "$python" -m venv .venvs/lint || exit 2
    fi
    .venvs/lint/bin/python -m pip install -qq --progress-bar off \
      --disable-pip-version-check "ruff==$WANT" || exit 2
  fi
fi

paths=("$@")
[[ ${#paths[@]} -gt 0 ]] || paths=(.)

rc=0
echo "lint: ruff $(version_of "$RUFF") check ${paths[*]}" >&2
"$RUFF" check --force-exclude --output-format concise "${paths[@]}" || rc=1
echo "lint: ruff $(version_of "$RUFF") format --check ${paths[*]}" >&2
"$RUFF" format --check --force-exclude --output-format concise \
  "${paths[@]}" || rc=1
if [[ "$rc" != 0 ]]; then
  echo "lint: FAILED" >&2
else
  echo "lint: OK" >&2
fi
exit "$rc"
