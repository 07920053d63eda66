#!/usr/bin/env bash
# Re-resolves one leg's lock file: requirements/LEG.in (the direct
# dependencies, pinned exactly) installed into a throwaway venv with the
# leg's Python, then frozen into requirements/LEG.txt, which tools/setup.sh
# installs. Run it after changing a .in file; commit both.
#
#   tools/lock_requirements.sh LEG [LEG ...]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tools/legs.sh

for leg in "$@"; do
  version="$(leg_python_version "$leg")" || {
    echo "lock: unknown leg '$leg'; the legs are: ${LEGS[*]}" >&2; exit 2; }
  python="$(find_python "$version")" || {
    echo "lock: leg $leg needs Python $version, not found" >&2; exit 1; }
  tmp="$(mktemp -d)"
  "$python" -m venv "$tmp/venv"
  "$tmp/venv/bin/python" -m pip install -qq --progress-bar off \
    --disable-pip-version-check -r "requirements/$leg.in"
  {
    echo "# The full lock of leg $leg (Python $version), made by"
    echo "# tools/lock_requirements.sh from requirements/$leg.in; do not edit."
    "$tmp/venv/bin/python" -m pip freeze --all --exclude pip \
      --exclude setuptools --exclude wheel
  } > "requirements/$leg.txt"
  rm -rf "$tmp"
  echo "lock: wrote requirements/$leg.txt" \
    "($(grep -vc '^#' "requirements/$leg.txt") packages)"
done
