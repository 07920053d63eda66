"""gpu_check --lower_only: every timed GPU program, lowered for CUDA.

On any machine, a CPU-only one included (`moe_core.testing.cuda_export`):
each method of each timed problem, forward and forward+backward, at the
timed shapes, with abstract arguments. Needs only jax (no absl).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import moe_core
from bench import gemm_workloads
from bench import gpu_workloads
from bench import timing
from moe_core import compat
from moe_core.testing import cuda_export


def _abstract_weights(problem, cfg):
  """The weights of a problem as bf16 ShapeDtypeStructs."""
  if problem.kind == "gemm":
    return jax.ShapeDtypeStruct(problem.weights_shape, jnp.bfloat16)
  return {
      k: jax.ShapeDtypeStruct(v, jnp.bfloat16)
      for k, v in gpu_workloads.expert_weights(
          moe_core.param_shapes(cfg)
      ).items()
  }


def _lower(program, args):
  """(True, what it calls) if `program` lowers for CUDA, else (False, why)."""
  try:
    text = cuda_export.export_for_cuda(program, *args).mlir_module()
  except Exception as e:  # pylint: disable=broad-except
    return False, f"{type(e).__name__}: {e}"[:300]
  calls = cuda_export.custom_calls(text)
  others = sorted(set(calls) - {cuda_export.TRITON_CALL})
  return True, (
      f"{calls.count(cuda_export.TRITON_CALL)} triton kernels"
      + (f", other custom calls {others}" if others else "")
  )


def lower_only(shape):
  """Lowers every timed GPU program for CUDA; returns [(name, ok, detail)]."""
  pallas, fused, xla = gpu_workloads.backends(on_gpu=True)
  cfg = gpu_workloads.ffn_config(shape)
  _, _, problems = gpu_workloads.problems(shape, "random")
  s = jax.ShapeDtypeStruct
  group_sizes = s((shape["experts"],), jnp.int32)
  out = []
  for problem in problems:
    operand = _abstract_weights(problem, cfg)
    rows = s(problem.rows_shape, jnp.bfloat16)
    cot = s(problem.out_shape, jnp.float32)
    methods = gpu_workloads.methods_for(problem.kind, pallas, fused, xla, cfg)
    for method, fn in methods.items():
      if method == "dense":
        weights = gemm_workloads.one_expert(operand)
      else:
        weights = operand
      args = (rows, weights, group_sizes)
      for mode, program, program_args in (
          ("fwd", fn, args),
          ("fwd+bwd", timing.with_grad(fn), args + (cot,)),
      ):
        ok, detail = _lower(program, program_args)
        out.append((f"{problem.name} {method} {mode}", ok, detail))
  return out


def run(shape):
  """Lowers, prints a line per program and the totals; the exit status."""
  filtered = compat.triton_deprecations_filtered()
  results = lower_only(shape)
  for label, ok, detail in results:
    print(f"{'ok  ' if ok else 'FAIL'} {label}: {detail}")
  failed = sum(not ok for _, ok, _ in results)
  print(f"lowered {len(results) - failed}/{len(results)} programs for CUDA")
  print(
      f"Pallas Triton deprecation warnings filtered: "
      f"{compat.triton_deprecations_filtered() - filtered}"
  )
  return 1 if failed else 0
