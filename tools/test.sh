#!/usr/bin/env bash
# Sets up the machine (tools/setup.sh), then runs every Bazel test under one
# leg's Python (default: the newest leg this machine has, see tools/legs.sh),
# then lists skipped tests with their reasons and the targets whose tests all
# skipped (tools/whole_skips.py). Exits with bazel's code, or 1 if bazel
# passed but a target skipped wholly without declaring it for this machine
# (a `skips-without-<what>` tag).
#
#   tools/test.sh [--leg=LEG] [--matrix] [bazel test arguments...]
#
#   --leg=LEG  run under requirements/LEG.txt's environment, e.g.
#              --leg=py311-jax0.10 (tools/setup.sh lists the legs).
#   --matrix   only the targets tagged `matrix`: what must pass on every leg
#              that runs the version matrix (conformance, kernels, CUDA lowering, the bounds-checking
#              interpreter, EP, gpu_check's rehearsals, HF parity, the
#              source checks).
#   --matrix=no-conformance  the same less the conformance suites (the
#              targets tagged `conformance`): .ci/run's shortest leg.
#   --matrix=oldest  the same as --matrix less the targets tagged
#              `not-on-oldest-leg` (second configurations of a backend's
#              suite, the GPU machine's rehearsals): .ci/run's oldest leg.
# Other arguments go to `bazel test`, e.g.
#   tools/test.sh --test_output=all //moe_core/...
# (targets given after the flags are added to //...).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

setup_args=()
bazel_args=()
for arg in "$@"; do
  case "$arg" in
    --leg=*) setup_args+=("$arg") ;;
    --matrix)
      # Replaces .bazelrc's filter: tagged `matrix`, and still not GPU/TPU.
      bazel_args+=(--build_tests_only
        --test_tag_filters=matrix,-requires-gpu,-requires-tpu) ;;
    --matrix=no-conformance)
      bazel_args+=(--build_tests_only
        --test_tag_filters=matrix,-conformance,-requires-gpu,-requires-tpu) ;;
    --matrix=oldest)
      bazel_args+=(--build_tests_only
        --test_tag_filters=matrix,-not-on-oldest-leg,-requires-gpu,-requires-tpu) ;;
    *) bazel_args+=("$arg") ;;
  esac
done

venv="$(tools/setup.sh "${setup_args[@]}")"

# One persistent JAX compilation cache per leg, shared by every test target of
# a run and, by default, by every run on the machine (tools/jax_cache.sh:
# DROPLESS_JAX_CACHE=clone keeps it in the checkout, cold in a fresh clone;
# =0 turns it off). The suites compile many of the same programs (each
# backend's suite compiles the reference's oracle programs too); programs
# with host callbacks (the Pallas and Mosaic GPU interpreters) are never
# cached. A half-written entry read by a concurrent test is a warning and a
# recompile.
source tools/jax_cache.sh
cache_args=()
jax_cache="$(jax_cache_dir "$(basename "$venv")")" || exit 1
if [[ -n "$jax_cache" ]]; then
  # Triton's kernel cache (backends/triton's compile and interpreter tests)
  # stays in the clone: a fresh clone compiles its kernels cold, instead of
  # reusing ~/.triton from earlier runs on the machine.
  triton_cache="$PWD/.cache/triton/$(basename "$venv")"
  mkdir -p "$triton_cache"
  cache_args=(--sandbox_writable_path="$jax_cache"
    --sandbox_writable_path="$triton_cache"
    --test_env=TRITON_CACHE_DIR="$triton_cache"
    --test_env=JAX_COMPILATION_CACHE_DIR="$jax_cache"
    --test_env=JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    --test_env=JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1)
fi

export PYTHON_BIN_PATH="$venv/bin/python"
# Changes whenever the pins are reinstalled, so test results cached under
# other packages are not reused (.bazelrc passes it to actions).
DROPLESS_VENV_STAMP="$(cat "$venv/.requirements.sha256")"
export DROPLESS_VENV_STAMP

echo "test: PYTHON_BIN_PATH=$PYTHON_BIN_PATH bazel test //... ${cache_args[*]} ${bazel_args[*]}" >&2
# The run's build events: which targets it tested, their tags and logs.
bep="$(mktemp)"
trap 'rm -f "$bep"' EXIT
rc=0
bazel test //... "${cache_args[@]}" "${bazel_args[@]}" \
  --build_event_json_file="$bep" || rc=$?
# Bazel reports a target whose tests all skipped as PASSED: say what did not
# run, and why; a target that ran nothing and does not declare it for this
# machine fails the run (when bazel itself passed).
tools/skipped_tests.sh || true
"$PYTHON_BIN_PATH" tools/whole_skips.py "$bep" || rc=$(( rc ? rc : 1 ))
exit "$rc"
