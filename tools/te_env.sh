#!/usr/bin/env bash
# Runs a command in the Transformer Engine environment's library path:
#   tools/te_env.sh PYTHON [args...]
# PYTHON is .venvs/te-py311-jax0.10/bin/python (tools/setup_te.sh). Puts the
# stub libcuda.so.1 and the CUDA wheels' libraries (NCCL, cuDNN, cuBLAS) on
# LD_LIBRARY_PATH, which TE's import needs on a machine without a driver, and
# keeps JAX on the CPU.
set -euo pipefail
python="$1"
shift
venv="$(cd "$(dirname "$python")/.." && pwd)"
site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
paths="$venv/lib/cuda_stub"
for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do
  [[ -d "$d" ]] && paths="$paths:$d"
done
export LD_LIBRARY_PATH="$paths${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec "$python" "$@"
