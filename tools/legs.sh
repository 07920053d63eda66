# Sourced by tools/setup.sh, tools/test.sh and tools/lock_requirements.sh:
# the supported (Python, JAX) legs and how to find each one's interpreter.
#
# A leg is one exactly pinned environment, requirements/<leg>.txt, installed
# into .venvs/<leg>. Newest first: the first leg whose Python the machine has
# is the default.
LEGS=(py313-jax0.12 py312-jax0.11 py311-jax0.10)

# The Python version ("3.13") a leg runs on.
leg_python_version() {
  case "$1" in
    py313-*) echo 3.13 ;;
    py312-*) echo 3.12 ;;
    py311-*) echo 3.11 ;;
    *) return 1 ;;
  esac
}

# The leg for a Python version, or nothing.
leg_for_version() {
  local leg
  for leg in "${LEGS[@]}"; do
    if [[ "$(leg_python_version "$leg")" == "$1" ]]; then
      echo "$leg"
      return 0
    fi
  done
  return 1
}

# "3.12" for an interpreter that runs, else nothing.
python_version_of() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

# The path of a working interpreter for Python $1 ("3.12"): python3.12 on
# PATH, else the newest pyenv-installed 3.12.x. pyenv's `python3.12` shim
# refuses a version that is not selected, so its versions/ folder is searched
# directly; the shim is accepted only when it really runs that version.
find_python() {
  local want="$1" candidate root
  if candidate="$(command -v "python$want")" \
      && [[ "$(python_version_of "$candidate")" == "$want" ]]; then
    echo "$candidate"
    return 0
  fi
  root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
  for candidate in $(ls -d "$root"/versions/"$want".*/bin/"python$want" \
      2>/dev/null | sort -V -r); do
    if [[ "$(python_version_of "$candidate")" == "$want" ]]; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}
