"""gpu_check's workloads: shapes, correctness cases, timed problems, methods.

Every phase of bench/gpu_check.py (correctness, timing, lowering) reads its
shapes and builds its programs here, so that what is checked, what is timed
and what is lowered for CUDA are the same programs. Needs only jax and this
repository (no absl): it runs alone on the GPU machine.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from bench import gemm_workloads
from moe_core import ffn
from moe_core import precision
from moe_core import routing

# The methods a timed problem can have. "dense" is one jnp.dot (cuBLAS) of
# the same FLOPs; "ragged_dot" is jax.lax.ragged_dot (for the FFN, the xla
# backend built on it). ragged_dot comes last: on jax <= 0.11 XLA:GPU
# expands it into a dense product over every group, the method most likely
# to run out of memory, and every method before it is then already written.
GEMM_METHODS = (
    "dense",
    "pallas",
    "mosaic_gpu",
    "triton",
    "te",
    "ragged_dot",
)
FFN_METHODS = (
    "dense",
    "pallas",
    "pallas_fused_act",
    "mosaic_gpu",
    "mosaic_gpu_fused_act",
    "triton",
    "triton_fused_act",
    "te",
    "ragged_dot",
)
MOSAIC_METHODS = ("mosaic_gpu", "mosaic_gpu_fused_act")
# The routed experts (dispatch, expert FFN, combine: `routed_experts`) of
# each backend; "triton_fused_routing" also multiplies the combine weights
# in the down GEMM's epilogue (the triton backend's fuse_routing_weights).
# pallas, the first, is the baseline of the row's ratios.
ROUTED_METHODS = (
    "pallas",
    "pallas_fused_act",
    "triton",
    "triton_fused_act",
    "triton_fused_routing",
)
TRITON_METHODS = ("triton", "triton_fused_act", "triton_fused_routing")
# Transformer Engine's grouped GEMM (the te backend: TE's raw
# `cpp_extensions.grouped_gemm`), timed where TE is installed; its rows say
# why not elsewhere.
TE_METHODS = ("te",)
# The grouped GEMM on quantised operands (`moe_core.precision`), forward:
# "<backend>_<recipe>", bf16 inputs and output. Named by a workload only
# (`PRECISION`): no other row times them.
QUANTIZED_PALLAS_METHODS = tuple(
    f"pallas_{r}" for r in precision.QUANTIZED_RECIPES
)
QUANTIZED_XLA_METHODS = tuple(f"xla_{r}" for r in precision.QUANTIZED_RECIPES)
# The recipes' row: the bf16 pallas GEMM first, the baseline of every ratio.
PRECISION_METHODS = (
    ("pallas",) + QUANTIZED_PALLAS_METHODS + QUANTIZED_XLA_METHODS
)
PHASES = ("fwd", "fwd_bwd")
# A GEMM's backward in halves: dX alone and dW alone (gpu_timing's
# programs), each the forward's FLOPs.
GRAD_PHASES = ("dx", "dw")


class Workload(NamedTuple):
  """One timed model shape and what of it is timed.

  shape: tokens T, top_k, hidden D, ffn F, experts E (run here; may be a
  slice of the model's `model_experts`). problems, methods: the names kept
  (None: the GEMMs and the expert FFN, every plain method); phases: of
  `PHASES` + `GRAD_PHASES`.
  """

  name: str
  shape: dict[str, int]
  model_experts: int
  problems: tuple[str, ...] | None = None
  methods: tuple[str, ...] | None = None
  phases: tuple[str, ...] = PHASES
  # Why the workload is there, for the JSON.
  note: str = ""
  # (method, why) of methods recorded as skipped in its timing rows, not
  # run (they are still lowered by --lower_only).
  skipped: tuple[tuple[str, str], ...] = ()


# Timed shapes on the GPU. DeepSeek-V3 with all 256 experts: its three
# [E, 7168, 2048] bf16 matrices and their gradients take 45 GB of the
# H200's 141. T=4096 gives M=32768 rows (128 per expert on average), about
# 1 TFLOP per projection, so a launch runs far past its overhead.
DEEPSEEK_V3 = Workload(
    "deepseek_v3",
    {"tokens": 4096, "top_k": 8, "hidden": 7168, "ffn": 2048, "experts": 256},
    model_experts=256,
    # ragged_dot left out: XLA:GPU (jax <= 0.11) expands it into a dense
    # product over all 256 groups, ~120 GB here (public reports); Mixtral's
    # 8 groups time it.
    methods=tuple(m for m in FFN_METHODS if m != "ragged_dot"),
    note="DeepSeek-V3 routed experts; ragged_dot only on Mixtral (dense "
    "expansion over 256 groups would not fit)",
)
# Mixtral 8x7B: few experts, a wide F; M=16384 rows, ~2 TFLOP a projection.
MIXTRAL = Workload(
    "mixtral_8x7b",
    {"tokens": 8192, "top_k": 2, "hidden": 4096, "ffn": 14336, "experts": 8},
    model_experts=8,
    note="Mixtral 8x7B experts",
)
# A small contraction: [M, 1024] x [256, 1024, 7168], the down-shaped GEMM
# with F=1024. Its forward is where mosaic_gpu must beat the Pallas Triton
# kernel (`gpu_timing.goals`).
SMALL_K = Workload(
    "small_k",
    {"tokens": 4096, "top_k": 8, "hidden": 7168, "ffn": 1024, "experts": 256},
    model_experts=256,
    problems=("gemm_down",),
    methods=("dense", "pallas", "mosaic_gpu"),
    phases=("fwd",),
    note="K=1024 -> N=7168, 256 groups: mosaic_gpu vs pallas forward",
)
# xla's quantised GEMMs are float32 jax.lax.ragged_dot calls (one per K
# block for fp8_block): at 256 groups that is the expansion DEEPSEEK_V3
# leaves out, in float32.
_XLA_AT_256_GROUPS = (
    "xla's quantised forward is float32 jax.lax.ragged_dot over 256 groups, "
    "which XLA:GPU (jax <= 0.11) expands into a dense product over every "
    "group (256x the FLOPs; ~70 GB of float32 output); its quantised GEMMs "
    "are checked in the correctness phase"
)
# The low-precision recipes at DeepSeek-V3's gate/up GEMM, forward only: the
# bf16 pallas GEMM again (the baseline of the ratios, in the same row), then
# each quantised recipe. The time includes quantising both operands.
PRECISION = Workload(
    "deepseek_v3_precision",
    dict(DEEPSEEK_V3.shape),
    model_experts=256,
    problems=("gemm_up",),
    methods=PRECISION_METHODS,
    phases=("fwd",),
    note="DeepSeek-V3 gate/up GEMM forward, bf16 in and out, each recipe of "
    "moe_core.precision (quantising both operands included) vs the bf16 "
    "pallas GEMM",
    skipped=tuple((m, _XLA_AT_256_GROUPS) for m in QUANTIZED_XLA_METHODS),
)
# DeepSeek-V3's two GEMMs with the backward in halves, dX alone and dW
# alone, each against dense cuBLAS's (`gpu_timing.goals`: triton's targets).
DEEPSEEK_V3_GRADS = Workload(
    "deepseek_v3_grads",
    dict(DEEPSEEK_V3.shape),
    model_experts=256,
    problems=("gemm_up", "gemm_down"),
    methods=("dense", "pallas", "mosaic_gpu", "triton"),
    phases=GRAD_PHASES,
    note="DeepSeek-V3 GEMMs: dX alone and dW alone vs dense cuBLAS",
)
# DeepSeek-V3's routed experts (dispatch, expert FFN, combine) from a fixed
# routing with the workload's group sizes (`fixed_routing`): where the
# triton backend's fuse_routing_weights acts.
DEEPSEEK_V3_ROUTED = Workload(
    "deepseek_v3_routed",
    dict(DEEPSEEK_V3.shape),
    model_experts=256,
    problems=("routed",),
    methods=ROUTED_METHODS,
    note="DeepSeek-V3 routed experts (dispatch, FFN, combine), fixed "
    "routing: triton with and without the combine weights in the down "
    "GEMM, vs pallas",
)
# In this order: past gpu_check's --budget_s the last ones are skipped.
FULL = (
    DEEPSEEK_V3,
    SMALL_K,
    PRECISION,
    DEEPSEEK_V3_GRADS,
    DEEPSEEK_V3_ROUTED,
    MIXTRAL,
)

# --dry_run: tiny shapes on the CPU, kernels interpreted. Mosaic GPU's
# interpreter simulates every thread (seconds a call), so mosaic_gpu is
# checked on the first GEMM case only (DRY_MOSAIC_GEMM_CASES) and timed on
# the small-K row only, forward only. Triton's interpreter takes a tenth of
# a second or more a launch: triton is checked on DRY_TRITON_CASES only and
# timed at DRY_TRITON's shape.
DRY = {"tokens": 64, "top_k": 8, "hidden": 256, "ffn": 128, "experts": 8}
DRY_MOSAIC_GEMM_CASES = 1
DRY_TRITON = {"tokens": 16, "top_k": 2, "hidden": 64, "ffn": 32, "experts": 4}


def dry_workloads(shape=None, triton_shape=None):
  """The --dry_run workloads at `shape` (default DRY).

  The rows that time triton ("dry_triton", "dry_grads", "dry_routed") are
  at `triton_shape` (default DRY_TRITON).
  """
  shape = dict(DRY if shape is None else shape)
  triton_shape = dict(DRY_TRITON if triton_shape is None else triton_shape)
  return (
      Workload(
          "dry",
          shape,
          model_experts=shape["experts"],
          methods=tuple(
              m
              for m in FFN_METHODS
              if m not in MOSAIC_METHODS + TRITON_METHODS + TE_METHODS
          ),
          note="tiny, interpreted; mosaic_gpu only in dry_small_k, triton "
          "in dry_triton, te (no CPU kernels) nowhere",
      ),
      Workload(
          "dry_triton",
          triton_shape,
          model_experts=triton_shape["experts"],
          problems=("ffn",),
          methods=("dense", "triton", "triton_fused_act"),
          note="tinier, interpreted: triton's FFN row",
      ),
      Workload(
          "dry_small_k",
          shape,
          model_experts=shape["experts"],
          problems=SMALL_K.problems,
          methods=SMALL_K.methods,
          phases=SMALL_K.phases,
          note="tiny, interpreted: the small-K row's logic",
      ),
      Workload(
          "dry_precision",
          shape,
          model_experts=shape["experts"],
          problems=PRECISION.problems,
          methods=PRECISION.methods,
          phases=PRECISION.phases,
          note="tiny, interpreted: the recipes' row",
          skipped=PRECISION.skipped,
      ),
      Workload(
          "dry_grads",
          triton_shape,
          model_experts=triton_shape["experts"],
          problems=("gemm_up",),
          methods=("dense", "triton"),
          phases=DEEPSEEK_V3_GRADS.phases,
          note="tinier, interpreted: dX and dW alone",
      ),
      Workload(
          "dry_routed",
          triton_shape,
          model_experts=triton_shape["experts"],
          problems=DEEPSEEK_V3_ROUTED.problems,
          methods=("triton_fused_act", "triton_fused_routing"),
          note="tinier, interpreted: the routed experts' row",
      ),
  )


# Correctness cases: (M, C, N, group sizes, transpose_rhs). Every case leaves
# padding rows (sum(group sizes) < M), filled with NaN.
GEMM_CASES = [
    (64, 32, 48, (10, 0, 23, 21), False),  # Shared tiles, padding rows.
    (200, 96, 160, (0, 70, 1, 64, 0, 40), False),
    (130, 64, 80, (33, 0, 60, 7), True),  # The dX layout.
    # 32 groups of 0-30 rows (465 of 512 rows), the first and last empty.
    (512, 256, 384, tuple(range(0, 31)) + (0,), False),
    # 288 rows per expert and N = 2048: in bf16 the GPU heuristic picks
    # gmm_bf16_large for the pallas forward, as at the timed shapes (and
    # mosaic_gpu its "default" tiles, as at the timed shapes).
    (1152, 128, 2048, (300, 0, 517, 211), False),
]
# Expert FFN cases: (M, D, F, group sizes), bf16, plain and with the fused
# activation. The first one's fused gate+up forward runs pallas'
# gmm_bf16_large fitted to two accumulators (tiling.fit_gpu), as Mixtral's
# timed shapes do; the second's few rows per group run gmm_bf16_small, as
# DeepSeek-V3's 256 experts do.
FFN_CASES = [
    (1152, 128, 2048, (300, 0, 517, 211)),
    (512, 256, 384, tuple(range(0, 31)) + (0,)),
]
# The MoE layer case: its config and the [batch, sequence] of its input.
LAYER_CONFIG = {
    "num_experts": 8,
    "top_k": 2,
    "hidden_size": 256,
    "expert_ffn_size": 512,
    "shared_ffn_size": 256,
}
LAYER_BATCH = (2, 256)
# triton's correctness cases. On a GPU (`triton_cases`): everyone's cases
# and two of its own in bf16, and in float32 (where Triton's dot could
# round to TF32) a GEMM of each weight layout, one expert FFN case and the
# layer with both fusions. --dry_run runs its kernels in Triton's
# interpreter, where each launch costs a tenth of a second or more (the
# layer of LAYER_CONFIG: over three minutes): there two small GEMMs of its
# own, one per weight layout and dtype, and a smaller layer with both
# fusions (DRY_TRITON_CASES); the dry timing's FFN row checks the unfused
# and fused expert FFN.
TRITON_LAYERS = ("plain", "fused_act", "fused_routing")


class TritonCases(NamedTuple):
  """The cases triton is checked on.

  gemm: (M, C, N, group sizes, transpose_rhs, dtype); ffn: (M, D, F,
  group sizes, dtype); layers: (variant of TRITON_LAYERS, dtype); layer:
  None for the layer of LAYER_CONFIG on an input of LAYER_BATCH (in bf16
  beside the other backends', against the same reference run), or a
  (config, [batch, sequence]) of its own.
  """

  gemm: list
  ffn: list
  layers: list
  layer: tuple[dict, tuple[int, int]] | None = None


DRY_TRITON_CASES = TritonCases(
    gemm=[
        (48, 32, 40, (9, 0, 20), False, "bfloat16"),  # Shared tiles.
        (40, 32, 24, (0, 13, 17), True, "float32"),  # The dX layout.
    ],
    ffn=[],
    layers=[("fused_routing", "bfloat16")],
    layer=(
        {
            "num_experts": 4,
            "top_k": 2,
            "hidden_size": 32,
            "expert_ffn_size": 64,
            "shared_ffn_size": 32,
        },
        (2, 8),
    ),
)


# 1109 rows per group and N = 512: triton's "many_rows" tiles (128x256
# forward, 8 warps), which Mixtral's timed shapes run and no case of
# everyone's reaches.
TRITON_MANY_ROWS_GEMM = (3328, 128, 512, (1400, 0, 1800), False)
TRITON_MANY_ROWS_FFN = (3328, 128, 512, (1400, 0, 1800))


def triton_cases() -> TritonCases:
  """triton's cases on a GPU: everyone's (GEMM_CASES, FFN_CASES, the
  layer) and the many-rows ones in bf16; some of them in float32.

  Read when called, so that a test patching those tables patches these.
  """
  gemm = GEMM_CASES + [TRITON_MANY_ROWS_GEMM]
  first_of_each_layout = {c[4]: c for c in reversed(GEMM_CASES)}
  return TritonCases(
      gemm=[c + ("bfloat16",) for c in gemm]
      + [c + ("float32",) for c in first_of_each_layout.values()],
      ffn=[c + ("bfloat16",) for c in FFN_CASES + [TRITON_MANY_ROWS_FFN]]
      + [FFN_CASES[0] + ("float32",)],
      layers=[(v, "bfloat16") for v in TRITON_LAYERS]
      + [("fused_routing", "float32")],
  )


# Quantised GEMM cases, forward, each recipe on pallas and xla against the
# reference: (M, C, N, group sizes), bf16 inputs with NaN padding rows, a
# float32 output. C = 320 leaves fp8_block's last 128-wide block half
# padding, N = 96 a 128x128 weight block part padding; group 1 is empty.
QUANTIZED_GEMM_CASES = [(128, 320, 96, (37, 0, 51, 22))]

# The expert FFN's weights, the operand of every FFN method.
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


class Problem(NamedTuple):
  """One timed problem: the shapes of its operands and its forward FLOPs.

  kind is "gemm" (weights_shape [E, C, N]) or "ffn" (the weights are the
  expert FFN's, from `ffn_config`; weights_shape None). key is the name a
  `Workload` selects it by.
  """

  name: str
  kind: str
  rows_shape: tuple[int, int]
  weights_shape: tuple[int, int, int] | None
  out_shape: tuple[int, int]
  fwd_flops: int
  key: str = ""


def _gemm_problem(key, name, m, c, n, e):
  """[M, C] x [E, C, N] -> [M, N]: 2*M*C*N FLOPs."""
  return Problem(name, "gemm", (m, c), (e, c, n), (m, n), 2 * m * c * n, key)


def problems(shape, skew, keep=None):
  """(M, [E] group sizes, [Problem]) of the timed shapes.

  M = T * top_k rows; the gate/up-shaped and down-shaped grouped GEMMs, then
  the whole expert FFN (three such GEMMs); `keep` names those kept (None:
  these three). Only a `keep` naming "routed" adds the routed experts
  (kind "routed": tokens [T, D] -> [T, D] through dispatch, the expert FFN
  and combine, `fixed_routing`), where top_k <= E.
  """
  t = shape["tokens"]
  m = t * shape["top_k"]
  d, f, e = shape["hidden"], shape["ffn"], shape["experts"]
  sizes = gemm_workloads.skewed_group_sizes(skew, m, e)
  ffn_flops = 3 * 2 * m * d * f
  every = [
      _gemm_problem("gemm_up", "gemm_up [M,D]x[E,D,F]", m, d, f, e),
      _gemm_problem("gemm_down", "gemm_down [M,F]x[E,F,D]", m, f, d, e),
      Problem("expert_ffn", "ffn", (m, d), None, (m, d), ffn_flops, "ffn"),
  ]
  if keep is None:
    return m, sizes, every
  if shape["top_k"] <= e:  # Else no MoEConfig routes top_k of E experts.
    every.append(
        Problem(
            "routed_experts [T,D]",
            "routed",
            (t, d),
            None,
            (t, d),
            ffn_flops,
            "routed",
        )
    )
  return m, sizes, [p for p in every if p.key in keep]


def ffn_config(shape):
  """The MoEConfig of the timed expert FFN.

  The expert FFN reads only its sizes and activation; top_k only has to be
  valid (<= E) when --experts is small.
  """
  return moe_core.MoEConfig(
      num_experts=shape["experts"],
      top_k=min(shape["top_k"], shape["experts"]),
      hidden_size=shape["hidden"],
      expert_ffn_size=shape["ffn"],
  )


def expert_weights(params):
  """The expert FFN's weights out of a layer's params (or their shapes)."""
  return {k: params[k] for k in EXPERT_WEIGHTS}


def fixed_routing(group_sizes, num_tokens, cfg) -> routing.MoEAux:
  """A routing of T tokens' K copies that gives experts `group_sizes`.

  The sorted copies (group_sizes[e] of expert e, in order) are spread over
  the tokens by a fixed shuffle, so a token's K experts are scattered (two
  may coincide: dispatch and combine do not mind). The combine weights
  are a fixed positive draw summing to 1 per token; every copy is kept.
  Built on the device from the sizes (traced under jit, as the timed
  programs build it: no host sync); only the fields `routed_experts`
  reads carry information, the statistics are zeros.

  Args:
    group_sizes: [E] int32 summing to T * cfg.top_k.
    num_tokens: T.
    cfg: the block's MoEConfig (num_experts E, top_k K).
  """
  e, k = cfg.num_experts, cfg.top_k
  copies = num_tokens * k
  rng = np.random.default_rng(0)
  shuffle = rng.permutation(copies).astype(np.int32)
  weights = rng.uniform(0.5, 1.5, (num_tokens, k))
  weights /= weights.sum(axis=1, keepdims=True)
  sorted_ids = jnp.repeat(
      jnp.arange(e, dtype=jnp.int32),
      group_sizes,
      total_repeat_length=copies,
  )
  zero = jnp.zeros((), jnp.float32)
  return routing.MoEAux(
      router_logits=jnp.zeros((num_tokens, e), jnp.float32),
      router_probs=jnp.zeros((num_tokens, e), jnp.float32),
      expert_ids=sorted_ids[shuffle].reshape(num_tokens, k),
      combine_weights=jnp.asarray(weights, jnp.float32),
      kept=jnp.ones((num_tokens, k), bool),
      tokens_per_expert=jnp.asarray(group_sizes, jnp.int32),
      load_balancing_loss=zero,
      router_z_loss=zero,
      dropped_tokens=jnp.zeros((), jnp.int32),
      invalid_assignments=jnp.zeros((), jnp.int32),
  )


class Unbuilt:
  """Stands in for a backend that could not be built: every call raises.

  So each case and method that needs it records why, and the run goes on.
  """

  def __init__(self, name: str, error: str):
    self.name = name
    self.error = error

  def __repr__(self) -> str:
    return f"Unbuilt({self.name!r}: {self.error})"

  def _raise(self, *args, **kwargs):
    del args, kwargs
    raise RuntimeError(f"backend {self.name} was not built: {self.error}")

  grouped_gemm = expert_ffn = routed_experts = _raise


class Skip:
  """A method that is not run here: its entry says why."""

  def __init__(self, reason: str):
    self.reason = reason

  def __call__(self, *args, **kwargs):
    raise RuntimeError(f"skipped method called: {self.reason}")


class Unavailable:
  """An interpreted backend that says it cannot run here (`availability`).

  Only --dry_run interprets: there its cases and methods are skipped with
  the backend's reason (jax 0.10.2's Mosaic GPU interpreter, say) rather
  than failed. A compiled backend is never replaced: on a GPU it must run.
  """

  def __init__(self, name: str, reason: str):
    self.name = name
    self.reason = reason
    self.grouped_gemm = self.expert_ffn = Skip(reason)

  def __repr__(self) -> str:
    return f"Unavailable({self.name!r}: {self.reason})"


# What a `Backends` built without triton (te) holds there.
_TRITON_NOT_BUILT = Unavailable("triton", "triton: not built for this run")
_TE_NOT_BUILT = Unavailable("te", "te: not built for this run")
# Why te's cases and methods are skipped on a machine without Transformer
# Engine (the GPU machine has none: its wheels are too large to carry).
TE_NOT_INSTALLED = "Transformer Engine is not installed on this machine"
# The GPU --lower_only lowers te's programs for where TE is installed but no
# GPU is (`backends.te._te.compute_capability`): sm_90, the timed H200's.
TE_LOWERING_CAPABILITY = 90


class Backends(NamedTuple):
  """Every backend gpu_check checks or times (an `Unbuilt` if it failed)."""

  pallas: Any
  pallas_fused: Any
  mosaic: Any
  mosaic_fused: Any
  ragged: Any  # The xla backend on jax.lax.ragged_dot: the FFN baseline.
  # triton with fuse_activation False and True, and with both the
  # activation and the routing weights fused (fuse_routing_weights).
  triton: Any = _TRITON_NOT_BUILT
  triton_fused: Any = _TRITON_NOT_BUILT
  triton_routed: Any = _TRITON_NOT_BUILT
  te: Any = _TE_NOT_BUILT  # Transformer Engine's grouped GEMM.

  def describe(self) -> dict[str, str]:
    """{field: repr}, for the JSON: options, or why it was not built."""
    return {k: repr(v) for k, v in self._asdict().items()}


def _build(name, **options):
  """The backend, an `Unbuilt` if that raised, or an `Unavailable`."""
  try:
    be = moe_core.get_backend(name, **options)
    if options.get("interpret"):
      ok, reason = be.availability()
      if not ok:
        return Unavailable(name, reason)
    return be
  except Exception as e:  # pylint: disable=broad-except
    return Unbuilt(name, f"{type(e).__name__}: {e}"[:500])


# Why --lower_only skips triton off a GPU, after its availability reason.
TRITON_NOT_LOWERED = (
    " --lower_only cannot lower it here either: a jax-triton call is lowered "
    "by compiling its kernel through the CUDA plugin's Triton bindings "
    "(jaxlib's gpu_triton), which a CPU jaxlib lacks."
)


def _build_triton(compiled, **options):
  """The triton backend, or an `Unbuilt`, or an `Unavailable` with why.

  Unlike pallas and mosaic_gpu, triton needs a package that may be absent
  (jax-triton) even on a GPU: where `availability()` says no, compiled or
  interpreted, its cases and methods are skipped with that reason.
  """
  be = _build("triton", interpret=not compiled, **options)
  if isinstance(be, (Unbuilt, Unavailable)):
    return be
  ok, reason = be.availability()
  if ok:
    return be
  if compiled and jax.default_backend() != "gpu":
    reason += TRITON_NOT_LOWERED
  return Unavailable("triton", reason)


def _build_te(compiled):
  """The te backend, or an `Unbuilt`, or an `Unavailable` with why.

  Transformer Engine is a package the GPU machine may not have: then every
  te case and method is skipped with TE_NOT_INSTALLED. Installed, te runs
  where `availability()` says so (a CUDA GPU); compiled but off a GPU (the
  CUDA lowering of --lower_only) it is kept, for `gpu_lowering` to lower
  under a patched compute capability; interpreted (--dry_run) it has no
  kernels to run: skipped with its reason.
  """
  if importlib.util.find_spec("transformer_engine") is None:
    return Unavailable("te", TE_NOT_INSTALLED)
  be = _build("te")
  if isinstance(be, Unbuilt):
    return be
  ok, reason = be.availability()
  if ok or (compiled and jax.default_backend() != "gpu"):
    return be
  return Unavailable("te", reason)


def backends(on_gpu) -> Backends:
  """The backends, compiled or interpreted.

  on_gpu None lets pallas choose (interpreted off a GPU) and interprets
  mosaic_gpu and triton off a GPU (they have no automatic mode); True or
  False forces compiled or interpreted kernels (True: for the CUDA
  lowering).
  """
  if on_gpu is None:
    on_gpu = jax.default_backend() == "gpu"
    pallas_interpret = None
  else:
    pallas_interpret = not on_gpu
  mosaic_interpret = not on_gpu
  return Backends(
      pallas=_build("pallas", interpret=pallas_interpret),
      pallas_fused=_build(
          "pallas", interpret=pallas_interpret, fuse_activation=True
      ),
      mosaic=_build("mosaic_gpu", interpret=mosaic_interpret),
      mosaic_fused=_build(
          "mosaic_gpu", interpret=mosaic_interpret, fuse_activation=True
      ),
      ragged=_build("xla", use_ragged_dot=True),
      triton=_build_triton(on_gpu, fuse_activation=False),
      triton_fused=_build_triton(on_gpu, fuse_activation=True),
      triton_routed=_build_triton(
          on_gpu, fuse_activation=True, fuse_routing_weights=True
      ),
      te=_build_te(on_gpu),
  )


def gemm_methods(bes: Backends):
  """name -> f(rows, weights, group_sizes) -> [M, N]."""
  return {
      "dense": gemm_workloads.dense_gemm,
      "pallas": bes.pallas.grouped_gemm,
      "mosaic_gpu": bes.mosaic.grouped_gemm,
      "triton": bes.triton.grouped_gemm,
      "te": bes.te.grouped_gemm,
      "ragged_dot": gemm_workloads.ragged_dot_gemm,
  }


def ffn_methods(bes: Backends, cfg):
  """name -> f(rows, expert weights, group_sizes) -> [M, D]."""

  def dense(x, p, g):
    del g  # Every row through one expert's [D, F], [D, F], [F, D].
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    gate = dot(x, p["w_gate"]).astype(x.dtype)
    up = dot(x, p["w_up"]).astype(x.dtype)
    h = ffn.gated(gate, up, cfg.activation)
    return dot(h, p["w_down"]).astype(x.dtype)

  def of(be):
    if isinstance(be, Unavailable):
      return be.expert_ffn
    return lambda x, p, g: be.expert_ffn(x, g, p, cfg)

  return {
      "dense": dense,
      "pallas": of(bes.pallas),
      "pallas_fused_act": of(bes.pallas_fused),
      "mosaic_gpu": of(bes.mosaic),
      "mosaic_gpu_fused_act": of(bes.mosaic_fused),
      "triton": of(bes.triton),
      "triton_fused_act": of(bes.triton_fused),
      "te": of(bes.te),
      "ragged_dot": of(bes.ragged),
  }


def routed_methods(bes: Backends, cfg):
  """name -> f(tokens [T, D], expert weights, group_sizes) -> [T, D].

  Each backend's `routed_experts` on `fixed_routing(group_sizes)`.
  """

  def of(be):
    if isinstance(be, Unavailable):
      return be.expert_ffn

    def run(x, p, g):
      return be.routed_experts(p, x, fixed_routing(g, x.shape[0], cfg), cfg)

    return run

  return {
      "pallas": of(bes.pallas),
      "pallas_fused_act": of(bes.pallas_fused),
      "triton": of(bes.triton),
      "triton_fused_act": of(bes.triton_fused),
      "triton_fused_routing": of(bes.triton_routed),
  }


def method_recipe(method: str) -> str:
  """The `moe_core.precision` recipe a method multiplies with ("bf16")."""
  for recipe in precision.QUANTIZED_RECIPES:
    if method.endswith("_" + recipe):
      return recipe
  return "bf16"


def quantized_gemm_methods(bes: Backends):
  """ "<backend>_<recipe>" -> f(rows, weights, group_sizes) -> [M, N].

  pallas and xla (on jax.lax.ragged_dot, as on a GPU), bf16 out.
  """

  def of(be, recipe):
    if isinstance(be, Unavailable):
      return be.grouped_gemm
    return lambda x, w, g: be.grouped_gemm(x, w, g, precision=recipe)

  methods = {}
  for recipe in precision.QUANTIZED_RECIPES:
    methods[f"pallas_{recipe}"] = of(bes.pallas, recipe)
  for recipe in precision.QUANTIZED_RECIPES:
    methods[f"xla_{recipe}"] = of(bes.ragged, recipe)
  return methods


def methods_for(kind, bes: Backends, cfg, keep=None, skipped=()):
  """The methods of a problem of `kind` ("gemm", "ffn" or "routed"), in
  keep's order.

  keep None: every plain (bf16) method of that kind; the quantised GEMMs
  only where keep names them. A method in `skipped` ((name, why) pairs) is
  a `Skip` with its reason.
  """
  if kind == "gemm":
    methods = {**gemm_methods(bes), **quantized_gemm_methods(bes)}
    plain = GEMM_METHODS
  elif kind == "routed":
    methods = routed_methods(bes, cfg)
    plain = ROUTED_METHODS
  else:
    methods = ffn_methods(bes, cfg)
    plain = FFN_METHODS
  methods.update((name, Skip(why)) for name, why in skipped)
  names = plain if keep is None else keep
  return {k: methods[k] for k in names if k in methods}


def output_and_grads(fn, x, w, cotangent):
  """(fn(x, w), d x, d w): the output and its VJP with `cotangent`."""
  out, vjp = jax.vjp(fn, x, w)
  return (out,) + vjp(cotangent)
