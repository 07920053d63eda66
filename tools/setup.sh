#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian 12 machine: Bazel (Debian's
# bazel-bootstrap, offline-capable), then .venv with the pinned requirements.
# A second run does nothing but check (a stamp holds the requirements' hash).
#
# Environment:
#   PYTHON  interpreter that creates .venv (default: python3 on PATH).
#   FORCE_PIP=1  reinstall the requirements even if the stamp matches.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"
VENV="$REPO/.venv"
STAMP="$VENV/.requirements.sha256"
REQUIREMENTS=(requirements.txt requirements-dev.txt)

log() { echo "setup: $*" >&2; }

as_root() {
  if [[ "$(id -u)" == 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    log "need root for '$*' and sudo is missing; run it as root."
    exit 1
  fi
}

APT_UPDATED=0
apt_install() {
  if ! command -v apt-get >/dev/null; then
    log "apt-get not found: install $* by hand (Debian 12 package names)."
    exit 1
  fi
  if [[ "$APT_UPDATED" == 0 ]]; then
    log "apt-get update"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
  log "apt-get install -y $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

# 1. Bazel 4.2.3 and the rules_java copy that WORKSPACE points at.
if ! command -v bazel >/dev/null \
    || [[ ! -f /usr/share/bazel/rules/java/WORKSPACE ]]; then
  apt_install bazel-bootstrap bazel-rules-java
else
  log "bazel found: $(command -v bazel) ($(bazel --version 2>/dev/null))"
fi

# 2. The virtual environment.
PYTHON="${PYTHON:-python3}"
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "" 2>/dev/null; then
  log ".venv exists ($("$VENV/bin/python" --version 2>&1))"
else
  if ! command -v "$PYTHON" >/dev/null; then
    log "'$PYTHON' not found: install Python 3.11 (apt-get install python3)" \
      "or set PYTHON=/path/to/python3."
    exit 1
  fi
  rm -rf "$VENV"
  log "creating .venv with $(command -v "$PYTHON")" \
    "($("$PYTHON" --version 2>&1))"
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
    # Debian's own python3 ships venv/ensurepip in a separate package.
    rm -rf "$VENV"
    apt_install python3-venv
    "$PYTHON" -m venv "$VENV"
  fi
fi

# 3. The requirements, skipped when the stamp matches their hash.
want="$(cat "${REQUIREMENTS[@]}" | sha256sum | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$want" == "$have" && "${FORCE_PIP:-0}" != 1 ]]; then
  log "requirements already installed (stamp ${want:0:12})"
else
  pip_args=()
  for r in "${REQUIREMENTS[@]}"; do pip_args+=(-r "$r"); done
  log "pip install ${pip_args[*]} (a few minutes on a new .venv)"
  rm -f "$STAMP"
  "$VENV/bin/python" -m pip install --quiet --progress-bar off \
    --disable-pip-version-check "${pip_args[@]}" >&2
  echo "$want" > "$STAMP"
  log "requirements installed (stamp ${want:0:12})"
fi
