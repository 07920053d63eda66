"""TEBackend: Transformer Engine's router, grouped GEMMs and permutation."""

from __future__ import annotations

import logging
from typing import ClassVar

import jax
import jax.numpy as jnp

from backends.te import _te
from backends.te import gemm as gemm_lib
from backends.te import permutation
from backends.te import router as router_lib
from moe_core import backend
from moe_core import config as config_lib
from moe_core import operands
from moe_core import precision as precision_lib
from moe_core import routing
from moe_core import validation
from moe_core.kernels import gpu

FP8_SCALINGS = ("current", "delayed")
# moe_core recipes TE 2.20 has no grouped GEMM for in JAX, and why.
_NO_TE_RECIPE = {
    "fp8_block": (
        "TE has no DeepSeek-style blockwise FP8 (1x128 / 128x128 scales) "
        "for JAX grouped GEMMs"
    ),
    "nvfp4": "TE has no NVFP4 for JAX grouped GEMMs",
}

_logged: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _logged:
    _logged.add(message)
    logging.info(message)


class TEBackend(backend.Backend):
  """The routed block through Transformer Engine (TE 2.20) on NVIDIA GPUs.

  What of TE is used:
    route      `transformer_engine.jax.router.fused_topk_with_score_function`
               where `router_choice(cfg)` says it computes the config's
               routing; `moe_core.routing.route` otherwise (the reason is
               logged once).
    combine    `transformer_engine.jax.permutation.pure_jax_token_combine`
               over the library's dispatch plan and gather (see
               `backends.te.permutation` for why not TE's dispatch).
    GEMMs      `transformer_engine.jax.cpp_extensions.grouped_gemm`, the
               raw grouped GEMM behind `dense.grouped_dense` (cuBLAS,
               float32 accumulation), as `gemm.TEKernels`: moe_core's
               grouped-matmul primitive differentiates it, so forward
               and reverse mode, vmap and shard_map all run TE's kernel
               (`_te.grouped_gemm_path` says which one a GPU gets).
               Quantised recipes: `grouped_dense` with TE's quantizer sets
               (`QuantizerFactory.create_set`), forward only.
  With expert parallelism (a mesh) only the routing and the expert FFN are
  the backend's; the exchange is moe_core's (or TE's NCCL-EP exchange).

  Where TE differs from the moe_core contract:
    * Rows past sum(group_sizes): TE's kernels need the sizes to sum to M
      and may leave such rows unwritten. They are zeroed and added to the
      last group, their outputs and gradients masked to zeros: equal.
    * float32 operands: TE's cuBLAS GEMM computes them in TF32, which is
      not the float32 contract: float32 raises NotImplementedError.
    * The fused router: see `router.choice`. Inexpressible configs use the
      library's router. Rounding: TE computes scores in its own kernel and
      recovers an unbiased sigmoid score as (score + bias) - bias, off by
      up to an ulp of |score| + |bias|; a renormalised softmax weight is
      softmax over the K logits rather than p / sum(p).
    * "fp8_tensor" (current scaling), "mxfp8": the same recipes as
      moe_core.precision (one scale per group of rows and per expert's
      weights; E8M0 scales rounded up per 32 elements along the
      contraction, no saturation), with these rounding differences: TE's
      tensor scale is 448 / amax divided in float32 where moe_core
      multiplies amax by fl(1/448); TE gives an all-zero MXFP8 block the
      scale 2^-127 and moe_core 2^0 (both quantise it to zeros). A NaN or
      Inf makes TE fall back to scale 1 (an Inf clips to 448): the backend
      makes NaN every output moe_core's recipe makes NaN
      (`gemm.non_finite_outputs`).
    * Gradients of quantised GEMMs: TE's own backward quantises the
      gradient to E5M2 per group and multiplies it with FP8 copies of the
      operands; moe_core's contract is straight-through gradients in the
      activation dtype. The backend keeps the contract: TE's quantised
      grouped_dense runs the forward only, and the derivatives (of every
      order, forward mode too) are those of TE's unquantised grouped GEMM
      (`quantized_gemm.straight_through`).
    * fp8_scaling="delayed": TE's delayed scaling keeps an amax history
      that only a flax module's variables carry between steps; without it
      every call would scale by 1. It raises NotImplementedError.
    * "fp8_block", "nvfp4": TE has no JAX grouped GEMM for them:
      NotImplementedError naming the recipe ("auto" falls through).

  Args:
    fused_router: route with TE's fused router where it can.
    fused_permutation: combine with TE's permutation helper (False:
      moe_core.permute's); the dispatch plan and gather are the library's.
    fp8_scaling: "current" (per-call amax) or "delayed" (raises, see above)
      for the "fp8_tensor" recipe.
  """

  name: ClassVar[str] = "te"
  # float16 runs TE's per-group path; float32 would be TF32 (see above).
  dtypes: ClassVar[tuple[jnp.dtype, ...]] = tuple(
      jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16)
  )
  precisions: ClassVar[tuple[str, ...]] = (
      precision_lib.UNQUANTIZED,
      "fp8_tensor",
      "mxfp8",
  )

  def __init__(
      self,
      *,
      fused_router: bool = True,
      fused_permutation: bool = True,
      fp8_scaling: str = "current",
  ):
    for option, value in (
        ("fused_router", fused_router),
        ("fused_permutation", fused_permutation),
    ):
      if not isinstance(value, bool):
        raise TypeError(f"{option} must be a bool, got {type(value).__name__}.")
    if fp8_scaling not in FP8_SCALINGS:
      raise ValueError(
          f"fp8_scaling must be one of {FP8_SCALINGS}, got {fp8_scaling!r}."
      )
    self.fused_router = fused_router
    self.fused_permutation = fused_permutation
    self.fp8_scaling = fp8_scaling

  def __repr__(self) -> str:
    return (
        f"TEBackend(fused_router={self.fused_router}, fused_permutation="
        f"{self.fused_permutation}, fp8_scaling={self.fp8_scaling!r})"
    )

  def availability(self) -> tuple[bool, str]:
    """TE installed, a CUDA GPU, and a bf16 grouped GEMM TE can run on it."""
    ok, reason = _te.availability()
    if not ok:
      return False, f"te: {reason}"
    capability = gpu.probe(jax.devices()[0]).capability
    ok, reason = _te.grouped_gemm_runs(capability)
    if not ok:
      return False, f"te: {reason}"
    return True, ""

  def _check_precision(self, recipe) -> str:
    recipe = precision_lib.check_recipe(recipe)
    if recipe in _NO_TE_RECIPE:
      raise NotImplementedError(
          f"te: precision {recipe!r} is not supported: {_NO_TE_RECIPE[recipe]} "
          f"(supported: {list(self.precisions)})."
      )
    return super()._check_precision(recipe)

  # --- Routing ----------------------------------------------------------------

  def router_choice(self, cfg: config_lib.MoEConfig) -> tuple[bool, str]:
    """(TE's fused router computes `cfg`'s routing, why not).

    When not, `route` uses `moe_core.routing.route` (same results).
    """
    validation.check_config(cfg)
    if not self.fused_router:
      return False, "fused_router=False"
    return router_lib.choice(cfg)

  def _route(self, x, router, cfg, correction_bias, **extras):
    """x [T, D], router [D, E] -> `MoEAux`, through TE's fused router where
    `router_choice(cfg)` allows, else the library's router (validated
    arguments; `extras` are `routing.route`'s optional router params)."""
    fused, why = self.router_choice(cfg)
    if not fused:
      _log_once(f"te: routing with moe_core.routing.route: {why}.")
      return routing.route_unchecked(x, router, cfg, correction_bias, **extras)
    return router_lib.route(x, router, cfg, correction_bias, **extras)

  # --- The grouped GEMM -------------------------------------------------------

  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    return gemm_lib.grouped_gemm(
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
        transpose_rhs=gemm.transpose_rhs,
        out_dtype=gemm.out_dtype,
    )

  def _check_quantized(self, recipe: str):
    """NotImplementedError where TE cannot run `recipe` here."""
    if recipe == "fp8_tensor" and self.fp8_scaling == "delayed":
      raise NotImplementedError(
          "te: fp8_scaling='delayed' needs the amax history TE keeps in a "
          "flax module's variables between steps; moe_core's functional API "
          "has nowhere to keep it (use fp8_scaling='current')."
      )
    needed = gemm_lib.MIN_COMPUTE_CAPABILITY[recipe]
    capability = _te.te_compute_capability()
    if capability is not None and capability < needed:
      raise NotImplementedError(
          f"te: precision {recipe!r} needs sm_{needed}+ in TE, this GPU is "
          f"sm_{capability}."
      )

  def _quantized_forward(self, gemm: operands.GemmOperands, recipe: str):
    """The forward through TE's quantizer set: TE quantises both operands
    itself (per group of rows and per expert for "fp8_tensor"); the outputs
    moe_core's recipe makes NaN are NaN. Gradients stay the base class's
    straight-through ones."""
    self._check_quantized(recipe)

    def forward(rows, weights, group_sizes):
      out = gemm_lib.quantized_grouped_gemm(
          rows,
          weights,
          group_sizes,
          transpose_rhs=gemm.transpose_rhs,
          out_dtype=gemm.out_dtype,
          recipe=recipe,
          scaling=self.fp8_scaling,
      )
      bad = gemm_lib.non_finite_outputs(
          rows,
          weights,
          group_sizes,
          transpose_rhs=gemm.transpose_rhs,
          recipe=recipe,
      )
      return jnp.where(bad, jnp.asarray(jnp.nan, out.dtype), out)

    return forward

  # --- Dispatch and combine ---------------------------------------------------

  def _combine(self, expert_out, dispatched, combine_weights, kept):
    if not self.fused_permutation:
      return super()._combine(expert_out, dispatched, combine_weights, kept)
    return permutation.combine(expert_out, dispatched, combine_weights, kept)
