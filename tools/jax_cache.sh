# Sourced by tools/test.sh and tools/test_te.sh: where a leg's persistent
# JAX compilation cache lives, kept under a size cap.
#
#   jax_cache_dir LEG   prints the directory (made if missing), or nothing
#                       when the cache is off.
#
# DROPLESS_JAX_CACHE picks the place:
#   machine (default)  ${XDG_CACHE_HOME:-~/.cache}/dropless/jax/LEG, shared by
#                      every checkout and run on the machine, like pip's
#                      cache: a run compiles only the programs no earlier run
#                      compiled (the key is the program, its compile options
#                      and the jax and jaxlib versions, not the file paths, so
#                      a change to the code misses exactly where it changes
#                      what is compiled).
#   clone              .cache/jax/LEG in the checkout (git-ignored): a fresh
#                      clone starts cold, which is how CI's cold figures in
#                      docs/testing.md are measured.
#   0                  no persistent cache.
# DROPLESS_JAX_CACHE_DIR names the directory outright.
#
# The cap: before a run, the oldest entries go until the directory holds at
# most DROPLESS_JAX_CACHE_MAX_MB (default 4096; a whole CI run writes about
# 300 MB a leg). JAX's own jax_compilation_cache_max_size would need the
# filelock package on every leg.

jax_cache_dir() {
  local leg="$1" mode="${DROPLESS_JAX_CACHE:-machine}" dir
  case "$mode" in
    0) return 0 ;;
    clone) dir="$PWD/.cache/jax/$leg" ;;
    machine | 1) dir="${XDG_CACHE_HOME:-$HOME/.cache}/dropless/jax/$leg" ;;
    *)
      echo "DROPLESS_JAX_CACHE must be machine, clone or 0, got '$mode'" >&2
      return 1
      ;;
  esac
  dir="${DROPLESS_JAX_CACHE_DIR:-$dir}"
  mkdir -p "$dir" || return 1
  _jax_cache_trim "$dir" "${DROPLESS_JAX_CACHE_MAX_MB:-4096}"
  echo "$dir"
}

# Deletes the least recently written files of $1 until it holds at most $2
# MB.
_jax_cache_trim() {
  local dir="$1" cap=$(($2 * 1024 * 1024)) total
  total="$(du -sb "$dir" 2>/dev/null | cut -f1)"
  if [[ -z "$total" || "$total" -le "$cap" ]]; then
    return 0
  fi
  find "$dir" -type f -printf '%T@ %s %p\n' | sort -n |
    while read -r _ size path; do
      [[ "$total" -le "$cap" ]] && break
      rm -f "$path"
      total=$((total - size))
    done
  echo "jax_cache: trimmed $dir to at most $2 MB" >&2
}
