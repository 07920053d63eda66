#!/usr/bin/env bash
# The Transformer Engine step of .ci/run: sets up .venvs/te-py311-jax0.10
# (tools/setup_te.sh: TE's wheels and transformer_engine_jax built from its
# sdist, about 1.7 GB, kept out of every other leg), then runs the te
# backend's Bazel targets under that interpreter:
#   helpers_test   the import; TE's pure-JAX helpers on the CPU against the
#                  reference;
#   lowering_test  jax.export of the te backend's layer (forward, jax.grad,
#                  jax.jvp, jax.hessian, jax.vmap, a user's shard_map) for
#                  CUDA at compute capability 90 and 100: custom-call
#                  targets, operand shapes and dtypes, serialisation;
#   nccl_ep_test   the NCCL-EP exchange's registration and lowering;
#   conformance_test(_ep)  the shared suite, which skips on a CPU with the
#                  backend's reason.
# DROPLESS_EXPECT_TE=1 turns "TE is not installed" from a skip into a
# failure there. Exits with bazel's code, or 1 if a target skipped wholly
# without declaring it (tools/whole_skips.py).
#
#   tools/test_te.sh [bazel test arguments...]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="$(tools/setup_te.sh)"
python="$venv/bin/python"
site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# As tools/te_env.sh: the stub driver, then the CUDA wheels' libraries.
libs="$venv/lib/cuda_stub"
for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do
  [[ -d "$d" ]] && libs="$libs:$d"
done

export PYTHON_BIN_PATH="$python"
DROPLESS_VENV_STAMP="$(cat "$venv/.requirements.sha256")"
export DROPLESS_VENV_STAMP

# The leg's persistent JAX compilation cache, as tools/test.sh's.
source tools/jax_cache.sh
jax_cache="$(jax_cache_dir "$(basename "$venv")")" || exit 1
cache_args=()
if [[ -n "$jax_cache" ]]; then
  cache_args=(--sandbox_writable_path="$jax_cache"
    --test_env=JAX_COMPILATION_CACHE_DIR="$jax_cache")
fi
echo "test_te: PYTHON_BIN_PATH=$python bazel test //backends/te/..." >&2
bep="$(mktemp)"
trap 'rm -f "$bep"' EXIT
rc=0
bazel test //backends/te/... \
  --build_event_json_file="$bep" \
  --test_env=LD_LIBRARY_PATH="$libs" \
  --test_env=JAX_PLATFORMS=cpu \
  --test_env=DROPLESS_EXPECT_TE=1 \
  "${cache_args[@]}" \
  "$@" || rc=$?
tools/skipped_tests.sh backends/te || true
# As tools/test.sh: an undeclared whole skip fails the step.
"$python" tools/whole_skips.py "$bep" || rc=$(( rc ? rc : 1 ))
exit "$rc"
