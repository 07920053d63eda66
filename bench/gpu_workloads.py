"""gpu_check's workloads: shapes, correctness cases, timed problems, methods.

Every phase of bench/gpu_check.py (correctness, timing, lowering) reads its
shapes and builds its programs here, so that what is checked, what is timed
and what is lowered for CUDA are the same programs. Needs only jax and this
repository (no absl): it runs alone on the GPU machine.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import moe_core
from bench import gemm_workloads
from moe_core import ffn
from moe_core import precision

# The methods a timed problem can have. "dense" is one jnp.dot (cuBLAS) of
# the same FLOPs; "ragged_dot" is jax.lax.ragged_dot (for the FFN, the xla
# backend built on it). ragged_dot comes last: on jax <= 0.11 XLA:GPU
# expands it into a dense product over every group, the method most likely
# to run out of memory, and every method before it is then already written.
GEMM_METHODS = ("dense", "pallas", "mosaic_gpu", "ragged_dot")
FFN_METHODS = (
    "dense",
    "pallas",
    "pallas_fused_act",
    "mosaic_gpu",
    "mosaic_gpu_fused_act",
    "ragged_dot",
)
MOSAIC_METHODS = ("mosaic_gpu", "mosaic_gpu_fused_act")
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


class Workload(NamedTuple):
  """One timed model shape and what of it is timed.

  shape: tokens T, top_k, hidden D, ffn F, experts E (run here; may be a
  slice of the model's `model_experts`). problems, methods: the names kept
  (None: all); phases: of `PHASES`.
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
# In this order: past gpu_check's --budget_s the last ones are skipped.
FULL = (DEEPSEEK_V3, SMALL_K, PRECISION, MIXTRAL)

# --dry_run: tiny shapes on the CPU, kernels interpreted. Mosaic GPU's
# interpreter simulates every thread (seconds a call), so mosaic_gpu is
# checked on the first GEMM case only (DRY_MOSAIC_GEMM_CASES) and timed on
# the small-K row only, forward only.
DRY = {"tokens": 64, "top_k": 8, "hidden": 256, "ffn": 128, "experts": 8}
DRY_MOSAIC_GEMM_CASES = 1


def dry_workloads(shape=None):
  """The --dry_run workloads at `shape` (default DRY)."""
  shape = dict(DRY if shape is None else shape)
  return (
      Workload(
          "dry",
          shape,
          model_experts=shape["experts"],
          methods=tuple(m for m in FFN_METHODS if m not in MOSAIC_METHODS),
          note="tiny, interpreted; mosaic_gpu only in dry_small_k",
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
  all).
  """
  m = shape["tokens"] * shape["top_k"]
  d, f, e = shape["hidden"], shape["ffn"], shape["experts"]
  sizes = gemm_workloads.skewed_group_sizes(skew, m, e)
  every = [
      _gemm_problem("gemm_up", "gemm_up [M,D]x[E,D,F]", m, d, f, e),
      _gemm_problem("gemm_down", "gemm_down [M,F]x[E,F,D]", m, f, d, e),
      Problem(
          "expert_ffn", "ffn", (m, d), None, (m, d), 3 * 2 * m * d * f, "ffn"
      ),
  ]
  return m, sizes, [p for p in every if keep is None or p.key in keep]


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

  grouped_gemm = expert_ffn = _raise


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


class Backends(NamedTuple):
  """Every backend gpu_check checks or times (an `Unbuilt` if it failed)."""

  pallas: Any
  pallas_fused: Any
  mosaic: Any
  mosaic_fused: Any
  ragged: Any  # The xla backend on jax.lax.ragged_dot: the FFN baseline.

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


def backends(on_gpu) -> Backends:
  """The backends, compiled or interpreted.

  on_gpu None lets pallas choose (interpreted off a GPU) and interprets
  mosaic_gpu off a GPU (it has no automatic mode); True or False forces
  compiled or interpreted kernels (True: for the CUDA lowering).
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
  )


def gemm_methods(bes: Backends):
  """name -> f(rows, weights, group_sizes) -> [M, N]."""
  return {
      "dense": gemm_workloads.dense_gemm,
      "pallas": bes.pallas.grouped_gemm,
      "mosaic_gpu": bes.mosaic.grouped_gemm,
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
      "ragged_dot": of(bes.ragged),
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
  """The methods of a problem of `kind` ("gemm" or "ffn"), in keep's order.

  keep None: every plain (bf16) method of that kind; the quantised GEMMs
  only where keep names them. A method in `skipped` ((name, why) pairs) is
  a `Skip` with its reason.
  """
  if kind == "gemm":
    methods = {**gemm_methods(bes), **quantized_gemm_methods(bes)}
    plain = GEMM_METHODS
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
