#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian 12 machine: Bazel (Debian's
# bazel-bootstrap, offline-capable), then a virtual environment with one
# leg's exact pins. Prints that environment's path on standard output (its
# only output there; progress goes to standard error). A second run does
# nothing but check (a stamp holds the lock file's hash).
#
#   tools/setup.sh [--leg=LEG]
#
# Legs (tools/legs.sh; pins in requirements/LEG.txt):
#   py313-jax0.12  Python 3.13, jax 0.12.0.1 (newest)
#   py312-jax0.11  Python 3.12, jax 0.11.2 (the lent GPU machine's JAX)
#   py311-jax0.10  Python 3.11, jax 0.10.2 (oldest; Hugging Face parity tests)
# Without --leg: the leg of $PYTHON if set, else the newest leg whose Python
# this machine has (python3.X on PATH, or pyenv's versions/). The default
# leg's environment is also linked as .venv, which tools/main.sh runs.
#
# Environment:
#   PYTHON  interpreter to use (its version picks the leg).
#   FORCE_PIP=1  reinstall the pins even if the stamp matches.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"
source tools/legs.sh

log() { echo "setup: $*" >&2; }

leg=""
for arg in "$@"; do
  case "$arg" in
    --leg=*) leg="${arg#--leg=}" ;;
    *) log "unknown argument '$arg' (expected --leg=LEG)"; exit 2 ;;
  esac
done

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

# 2. The leg and its interpreter.
python=""
if [[ -n "$leg" ]]; then
  if ! want="$(leg_python_version "$leg")"; then
    log "unknown leg '$leg'; the legs are: ${LEGS[*]}"
    exit 2
  fi
  if [[ -n "${PYTHON:-}" ]]; then
    if [[ "$(python_version_of "$PYTHON")" != "$want" ]]; then
      log "PYTHON=$PYTHON is not Python $want, which leg $leg needs."
      exit 1
    fi
    python="$PYTHON"
  elif ! python="$(find_python "$want")"; then
    log "leg $leg needs Python $want, and this machine has no python$want" \
      "(on PATH or under pyenv's versions/): install it, e.g." \
      "'pyenv install $want', or pick another leg."
    exit 1
  fi
elif [[ -n "${PYTHON:-}" ]]; then
  have="$(python_version_of "$PYTHON")"
  if ! leg="$(leg_for_version "$have")"; then
    log "PYTHON=$PYTHON is Python ${have:-(does not run)}; supported:" \
      "3.11, 3.12, 3.13."
    exit 1
  fi
  python="$PYTHON"
else
  for candidate in "${LEGS[@]}"; do
    if python="$(find_python "$(leg_python_version "$candidate")")"; then
      leg="$candidate"
      break
    fi
  done
  if [[ -z "$leg" ]]; then
    log "no supported Python found: install Python 3.13, 3.12 or 3.11" \
      "(Debian 12: apt-get install python3 python3-venv gives 3.11)."
    exit 1
  fi
  default_leg=1
fi
LOCK="$REPO/requirements/$leg.txt"
# The triton backend's extras (requirements/triton/README.md), installed
# --no-deps after the lock: exact pins that pip's resolver would refuse on
# the GPU machine's leg (jax-triton 0.4.1 declares triton >= 3.7).
EXTRAS="$REPO/requirements/triton/$leg.txt"
VENV="$REPO/.venvs/$leg"
STAMP="$VENV/.requirements.sha256"
log "leg $leg: $python ($(python_version_of "$python")), pins $LOCK"

# 3. The virtual environment.
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "" 2>/dev/null; then
  log "$VENV exists ($("$VENV/bin/python" --version 2>&1))"
else
  rm -rf "$VENV"
  mkdir -p "$REPO/.venvs"
  log "creating $VENV"
  if ! "$python" -m venv "$VENV" 2>/dev/null; then
    # Debian's own python3 ships venv/ensurepip in a separate package.
    rm -rf "$VENV"
    apt_install python3-venv
    "$python" -m venv "$VENV"
  fi
fi

# 4. The pins, skipped when the stamp matches the hash of the lock and extras.
want="$(cat "$LOCK" "$EXTRAS" 2>/dev/null | sha256sum | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$want" == "$have" && "${FORCE_PIP:-0}" != 1 ]]; then
  log "pins already installed (stamp ${want:0:12})"
else
  log "pip install -r requirements/$leg.txt (a few minutes on a new venv)"
  rm -f "$STAMP"
  # -qq: errors only (pip's configured indexes warn once per package).
  "$VENV/bin/python" -m pip install -qq --progress-bar off \
    --disable-pip-version-check -r "$LOCK" >&2
  if [[ -f "$EXTRAS" ]]; then
    log "pip install --no-deps -r requirements/triton/$leg.txt"
    "$VENV/bin/python" -m pip install -qq --progress-bar off \
      --disable-pip-version-check --no-deps -r "$EXTRAS" >&2
  fi
  echo "$want" > "$STAMP"
  log "pins installed (stamp ${want:0:12})"
fi

# 5. .venv names the default leg's environment (an older checkout's .venv
# directory, made before the legs existed, is replaced).
if [[ "${default_leg:-0}" == 1 ]]; then
  if [[ -e .venv && ! -L .venv ]]; then
    log "replacing the old .venv directory with a link to .venvs/$leg"
    rm -rf .venv
  fi
  ln -sfn ".venvs/$leg" .venv
fi
echo "$VENV"
