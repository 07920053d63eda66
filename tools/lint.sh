#!/usr/bin/env bash
# Lint and format check with the pinned tools (the `lint` extra and the
# [tool.ruff] / [tool.pyink] settings in pyproject.toml):
#   ruff check      pycodestyle errors and warnings, pyflakes;
#   pyink --check   the formatter (Google's black: 2-space indents, 4-space
#                   continuation lines, 80 columns).
#
#   tools/lint.sh [PATH...]      # default: the whole repository
#
# Runs both (the second even when the first fails) and exits non-zero on any
# violation. `pyink PATH` applies the formatting. Bazel's output links,
# .venv and .venvs are excluded by the configuration. The pinned tools are
# installed into .venvs/lint on first use (PYTHON: the interpreter that
# creates it, default python3).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

pins=($(sed -n 's/^lint = \[\(.*\)\]/\1/p' pyproject.toml | tr -d '",'))
if [[ ${#pins[@]} -eq 0 ]]; then
  echo "lint: no lint extra in pyproject.toml" >&2
  exit 2
fi

LINT_VENV=.venvs/lint
installed="$("$LINT_VENV/bin/python" -m pip freeze 2>/dev/null \
  | grep -cxF -f <(printf '%s\n' "${pins[@]}") || true)"
if [[ "$installed" != "${#pins[@]}" ]]; then
  echo "lint: installing ${pins[*]} into $LINT_VENV" >&2
  if [[ ! -x "$LINT_VENV/bin/python" ]]; then
    rm -rf "$LINT_VENV"
    "${PYTHON:-python3}" -m venv "$LINT_VENV" || exit 2
  fi
  "$LINT_VENV/bin/python" -m pip install -qq --progress-bar off \
    --disable-pip-version-check "${pins[@]}" || exit 2
fi

paths=("$@")
[[ ${#paths[@]} -gt 0 ]] || paths=(.)

rc=0
echo "lint: ruff check ${paths[*]}" >&2
"$LINT_VENV/bin/ruff" check --force-exclude --output-format concise \
  "${paths[@]}" || rc=1
echo "lint: pyink --check ${paths[*]}" >&2
"$LINT_VENV/bin/pyink" --check "${paths[@]}" || rc=1
if [[ "$rc" != 0 ]]; then
  echo "lint: FAILED (pyink PATH fixes the formatting)" >&2
else
  echo "lint: OK" >&2
fi
exit "$rc"
