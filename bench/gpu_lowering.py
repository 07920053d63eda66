"""gpu_check --lower_only: every timed GPU program, lowered for CUDA.

On any machine, a CPU-only one included (`moe_core.testing.cuda_export`):
each method of each timed problem of each workload, forward and
forward+backward, at the timed shapes, with abstract arguments, the
quantised GEMMs ("pallas_fp8_block", ...) included; a method its workload
records as skipped (`Workload.skipped`) is not run on the GPU, so it is
listed as skipped here, not lowered. Each program's custom calls are
counted: a pallas program (of any recipe) must call Triton, a mosaic_gpu
one Mosaic GPU (`mosaic_gpu_v2`), and its forward+backward also Triton
(its dW is the Pallas Triton kernel). A te one (Transformer Engine) must call
the grouped-GEMM kernel TE picks for sm_90 (`_te.grouped_gemm_path`); off a
GPU it is lowered with TE believing the GPU is sm_90
(`_te.compute_capability`), and where TE is not installed its methods are
listed as skipped, with that reason. Needs only jax (no absl).
"""

from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp

import moe_core
from bench import gemm_workloads
from bench import gpu_workloads
from bench import timing
from moe_core import compat
from moe_core.testing import cuda_export

# The custom-call target of a Mosaic GPU kernel (jax 0.10.2 to 0.12).
MOSAIC_CALL = "mosaic_gpu_v2"
# jax-triton's (0.3.1 and 0.4.x): the triton backend's kernels. Lowering it
# needs jaxlib's CUDA plugin, so on a CPU machine those methods are skipped.
JAX_TRITON_CALL = "triton_kernel_call"


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


def expected_calls(method, mode):
  """Custom calls a method's program must contain ("fwd" or "fwd+bwd")."""
  if method.startswith("pallas"):
    return {cuda_export.TRITON_CALL}
  if method.startswith("triton"):
    return {JAX_TRITON_CALL}
  if method.startswith("mosaic_gpu"):
    if mode == "fwd":
      return {MOSAIC_CALL}
    return {MOSAIC_CALL, cuda_export.TRITON_CALL}
  if method in gpu_workloads.TE_METHODS:
    # "te_grouped_gemm_v2_ffi: ..." or "te_grouped_gemm_ffi: ...".
    path = _te().grouped_gemm_path(gpu_workloads.TE_LOWERING_CAPABILITY)
    return {path.split(":")[0]}
  return set()


def _te():
  """backends.te._te, imported only for te's programs."""
  # pylint: disable-next=g-import-not-at-top
  from backends.te import _te as te_helpers

  return te_helpers


def _call_names(target):
  return "triton" if target == cuda_export.TRITON_CALL else target


def lower(program, args, expected=(), more_calls=()):
  """(ok, what it calls) of `program` lowered for CUDA, or (False, why).

  ok also needs every custom call in `expected` to be there; `more_calls`
  are custom-call targets allowed besides Triton's.
  """
  try:
    text = cuda_export.export_for_cuda(
        program, *args, disabled_custom_calls=(JAX_TRITON_CALL, *more_calls)
    ).mlir_module()
  except Exception as e:  # pylint: disable=broad-except
    return False, f"{type(e).__name__}: {e}"[:300]
  counts = collections.Counter(cuda_export.custom_calls(text))
  detail = (
      ", ".join(f"{n} {_call_names(t)}" for t, n in sorted(counts.items()))
      or "no custom calls"
  )
  missing = sorted(_call_names(t) for t in set(expected) - set(counts))
  if missing:
    return False, f"{detail}; missing {missing}"
  return True, detail


def lower_only(workloads):
  """Lowers every timed GPU program for CUDA; returns [(name, ok, detail)].

  ok is None for a method the workload skips (detail: why).
  """
  bes = gpu_workloads.backends(on_gpu=True)
  out = []
  for workload in workloads:
    shape = workload.shape
    cfg = gpu_workloads.ffn_config(shape)
    _, _, problems = gpu_workloads.problems(shape, "random", workload.problems)
    s = jax.ShapeDtypeStruct
    group_sizes = s((shape["experts"],), jnp.int32)
    for problem in problems:
      operand = _abstract_weights(problem, cfg)
      rows = s(problem.rows_shape, jnp.bfloat16)
      cot = s(problem.out_shape, jnp.float32)
      methods = gpu_workloads.methods_for(
          problem.kind, bes, cfg, workload.methods, workload.skipped
      )
      for method, fn in methods.items():
        if isinstance(fn, gpu_workloads.Skip):
          out.append(
              (f"{workload.name} {problem.name} {method}", None, fn.reason)
          )
          continue
        if method == "dense":
          weights = gemm_workloads.one_expert(operand)
        else:
          weights = operand
        args = (rows, weights, group_sizes)
        modes = {
            "fwd": (fn, args),
            "fwd+bwd": (timing.with_grad(fn), args + (cot,)),
        }
        if "fwd_bwd" not in workload.phases:
          del modes["fwd+bwd"]
        for mode, (program, program_args) in modes.items():
          if method in gpu_workloads.TE_METHODS:
            ok, detail = _lower_te(program, program_args, method, mode)
          else:
            ok, detail = lower(
                program, program_args, expected_calls(method, mode)
            )
          label = f"{workload.name} {problem.name} {method} {mode}"
          out.append((label, ok, detail))
  return out


def _lower_te(program, args, method, mode):
  """`lower` for a te program: TE's custom calls allowed and, off a GPU,
  TE's tracing told the GPU is sm_90 (it asks the driver otherwise)."""
  te = _te()
  if jax.default_backend() == "gpu":
    capability = contextlib.nullcontext()
  else:
    capability = te.compute_capability(gpu_workloads.TE_LOWERING_CAPABILITY)
  with capability:
    return lower(
        program,
        args,
        expected_calls(method, mode),
        more_calls=te.custom_call_targets(),
    )


_STATUS = {True: "ok  ", False: "FAIL", None: "skip"}


def run(workloads):
  """Lowers, prints a line per program and the totals; the exit status."""
  filtered = compat.triton_deprecations_filtered()
  results = lower_only(workloads)
  for label, ok, detail in results:
    print(f"{_STATUS[ok]} {label}: {detail}")
  lowered = [ok for _, ok, _ in results if ok is not None]
  failed = lowered.count(False)
  skipped = len(results) - len(lowered)
  print(
      f"lowered {len(lowered) - failed}/{len(lowered)} programs for CUDA "
      f"({skipped} methods skipped, not run on the GPU either)"
  )
  print(
      f"Pallas Triton deprecation warnings filtered: "
      f"{compat.triton_deprecations_filtered() - filtered}"
  )
  return 1 if failed else 0
