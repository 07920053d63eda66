#!/usr/bin/env bash
# Prints every skipped test method of the last `bazel test` with its reason,
# grouped by reason, from the logs in bazel-testlogs/. Bazel itself reports
# a target whose tests all skipped as PASSED; this says what did not run.
#   tools/skipped_tests.sh [PACKAGE]   # e.g. backends/te: that package only
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
logs="bazel-testlogs${1:+/$1}"
if [[ ! -d "$logs" ]]; then
  exit 0
fi
# absltest writes "[  SKIPPED ] Class.test_name - reason" for each skip, and
# "[  SKIPPED ] Class.test_name0 (params) - reason" for a parameterized one.
skips="$(find -L "$logs" -name test.log -print0 2>/dev/null \
  | xargs -0 -r grep -h '^\[  SKIPPED \] ' 2>/dev/null \
  | sed -e 's/^\[  SKIPPED \] //' | sort -u)"
if [[ -z "$skips" ]]; then
  echo "skipped tests: none"
  exit 0
fi
echo "skipped tests: $(wc -l <<<"$skips"), by reason:"
sed -E -e 's/^[^ ]+( \([^)]*\))? - //' <<<"$skips" | sort | uniq -c | sort -rn \
  | sed -e 's/^ */  /'
