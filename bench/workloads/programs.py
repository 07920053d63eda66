"""The GPU programs: backend variant x workload x (fwd | fwd_bwd), one table.

Every GPU check of bench/ reads its programs here (`gpu_check
--lower_only`, bench/compile/, `gpu_check`), so that what is exported,
compiled and timed are the same programs. Variants come from the registry
(`variants`): every backend "auto" may pick on a GPU gets its default
variant and a grouped-GEMM variant per quantised recipe; `OPTION_VARIANTS`
adds the other options worth programs, so a new backend needs no edit
here. A row of `KERNELS` makes a silent fallback to XLA's own ops fail its
compile check; programs that cannot be compiled yet are `EXCEPTIONS`, with
why. Needs only jax and this repository: it runs on the GPU machine too.
Over 400 lines because it is the one table of GPU programs (variants x
workloads x modes) that every GPU check reads.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import importlib.util
import inspect
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

import moe_core
from bench.workloads import gemm_workloads
from moe_core import precision as moe_precision
from moe_core import registry
from train import presets

MODES = ("fwd", "fwd_bwd")
KINDS = ("layer", "gemm", "ep_layer")

# Custom-call targets of compiled kernels.
TRITON_CALL = "__gpu$xla.gpu.triton"  # A Pallas Triton kernel.
MOSAIC_CALL = "mosaic_gpu_v2"  # A Mosaic GPU kernel.
# A raw Triton kernel (jax-triton): 0.3's call target, a prefix of 0.4's.
JAX_TRITON_CALL = "triton_kernel_call"
JAX_TRITON_CALLS = (JAX_TRITON_CALL, "triton_kernel_call_ffi")
TE_GEMM_CALL = "te_grouped_gemm"  # Prefix of TE's grouped-GEMM calls.
# The expert-parallel layer's exchange, a collective of `collective_bytes`.
RAGGED_ALL_TO_ALL = "ragged-all-to-all"

# backend -> mode -> custom calls its executable must contain (a prefix of
# one each): without them it fell back to XLA's own ops. mosaic_gpu's dW is
# the Pallas Triton kernel. xla has no kernels (XLA:GPU expands ragged_dot
# into a dot over every group).
KERNELS: dict[str, dict[str, tuple[str, ...]]] = {
    "pallas": {"fwd": (TRITON_CALL,), "fwd_bwd": (TRITON_CALL,)},
    "mosaic_gpu": {
        "fwd": (MOSAIC_CALL,),
        "fwd_bwd": (MOSAIC_CALL, TRITON_CALL),
    },
    "triton": {"fwd": (JAX_TRITON_CALL,), "fwd_bwd": (JAX_TRITON_CALL,)},
    "te": {"fwd": (TE_GEMM_CALL,), "fwd_bwd": (TE_GEMM_CALL,)},
    "xla": {"fwd": (), "fwd_bwd": ()},
}

# Programs that are not compiled, and why: fnmatch pattern over
# "<target>/<workload>/<variant>/<mode>" -> reason. Delete a row when what
# it names is fixed; the compile check then covers those programs.
EXCEPTIONS = {
    "*/*/te*/*": (
        "Transformer Engine is not installed on this leg (its CUDA lowering "
        "is checked in its own environment: tools/test_te.sh)"
    ),
}


def exception(target: str, program: Program) -> str | None:
  """Why `program` is not compiled for `target`, or None."""
  interpreted = os.environ.get("TRITON_INTERPRET", "0").lower()
  if program.variant.backend == "triton":
    if interpreted in ("1", "on", "true"):
      return "TRITON_INTERPRET=1: Triton interprets its kernels, compiles none"
    if importlib.util.find_spec("jax_triton") is None:
      return (
          "jax-triton is not installed here (the oldest leg: it needs "
          "Python >= 3.12 or a CUDA jaxlib); the triton backend launches its "
          "GPU kernels through it"
      )
  key = f"{target}/{program.name}"
  for pattern, reason in EXCEPTIONS.items():
    if fnmatch.fnmatchcase(key, pattern):
      return reason
  return None


# --- Variants -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
  """A backend with some options: one column of every result.

  Attributes:
    name: "pallas", "pallas_fused_act", "pallas_fp8_block", ...
    backend: the registered name.
    options: (keyword, value) pairs of `moe_core.get_backend`, beyond
      `platform_options`.
    precision: the grouped GEMM's recipe (`moe_core.precision`).
    kinds: the workload kinds (`KINDS`) it has programs for.
    modes: of `MODES`.
  """

  name: str
  backend: str
  options: tuple[tuple[str, Any], ...] = ()
  precision: str = moe_precision.UNQUANTIZED
  kinds: tuple[str, ...] = KINDS
  modes: tuple[str, ...] = MODES

  def build(self, interpret: bool = False) -> moe_core.Backend:
    """The backend, compiled for a GPU on any host (or interpreted)."""
    options = {
        **platform_options(self.backend, interpret),
        **dict(self.options),
    }
    return moe_core.get_backend(self.backend, **options)


def _backend_class(name: str):
  target = registry._REGISTRY[name]  # pylint: disable=protected-access
  if not isinstance(target, str):
    return target
  module, _, attr = target.partition(":")
  return getattr(importlib.import_module(module), attr)


def platform_options(backend: str, interpret: bool = False) -> dict:
  """Options that make `backend`, built here, what it is on a GPU.

  Every `interpret` is set, not left to the backend's default (False for
  mosaic_gpu and triton, auto for pallas): False, the GPU's compiled
  kernels, whatever the host; True for a CPU rehearsal. xla's default
  follows the platform a program is lowered for (ragged_dot on GPUs, its
  tile loop on the CPU), so a CPU rehearsal would time the tile loop:
  its `use_ragged_dot` is True.
  """
  parameters = inspect.signature(_backend_class(backend)).parameters
  options = {}
  if "interpret" in parameters:
    options["interpret"] = interpret
  if "use_ragged_dot" in parameters:
    options["use_ragged_dot"] = True
  return options


# Options of a backend's default variant (and its recipes') beyond its
# defaults. Every kernel backend's fused activation epilogue is off by
# default (opt-in until a GPU measurement shows it faster), but the triton
# programs measured and compiled so far fuse it (its default until then):
# they stay the same programs, and `triton_unfused_act` their twin.
DEFAULT_OPTIONS: dict[str, tuple[tuple[str, Any], ...]] = {
    "triton": (("fuse_activation", True),),
}

# The options worth programs of their own, on one GPU's layer, where they
# act (the FFN and the combine); each backend's defaults and recipes come
# from the registry (`variants`).
_LAYER = ("layer",)
OPTION_VARIANTS = (
    Variant(
        "pallas_fused_act", "pallas", (("fuse_activation", True),), kinds=_LAYER
    ),
    Variant(
        "mosaic_gpu_fused_act",
        "mosaic_gpu",
        (("fuse_activation", True),),
        kinds=_LAYER,
    ),
    # triton's default variant fuses the activation (`DEFAULT_OPTIONS`).
    Variant(
        "triton_unfused_act",
        "triton",
        (("fuse_activation", False),),
        kinds=_LAYER,
    ),
    Variant(
        "triton_fused_routing",
        "triton",
        (("fuse_activation", True), ("fuse_routing_weights", True)),
        kinds=_LAYER,
    ),
)


def gpu_backends() -> tuple[str, ...]:
  """The registered backends "auto" may pick on a GPU, less the oracle."""
  return tuple(n for n in registry.auto_order("gpu") if n != "reference")


def _recipes(backend: str) -> tuple[str, ...]:
  """The quantised recipes `backend` multiplies; () if it does not import."""
  try:
    cls = _backend_class(backend)
  except ImportError:
    return ()  # Its default variant's programs say why.
  return tuple(
      r
      for r in getattr(cls, "precisions", ())
      if r != moe_precision.UNQUANTIZED
  )


def variants() -> tuple[Variant, ...]:
  """Defaults and recipes from the registry, then `OPTION_VARIANTS`.

  A default variant and its recipes take the backend's `DEFAULT_OPTIONS`.
  A recipe has grouped-GEMM programs, forward only (its backward is the
  unquantized GEMM's: straight through).
  """
  found = []
  for name in gpu_backends():
    options = DEFAULT_OPTIONS.get(name, ())
    found.append(Variant(name, name, options))
    found += [
        Variant(
            f"{name}_{r}",
            name,
            options,
            precision=r,
            kinds=("gemm",),
            modes=("fwd",),
        )
        for r in _recipes(name)
    ]
  found += [v for v in OPTION_VARIANTS if v.backend in gpu_backends()]
  return tuple(found)


# --- Workloads ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Size:
  """T tokens (per GPU; a GEMM's M rows), D hidden, F expert hidden, and E
  experts (None: the model's)."""

  tokens: int
  hidden: int
  ffn: int
  experts: int | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
  """One model's MoE layer, or a grouped GEMM of its shape, at two sizes.

  Attributes:
    name: "deepseek_v3", "deepseek_v3_ep64", "small_k", ...
    model: the `train.presets` model: its experts, top-k, router and
      activation.
    kind: "layer" (`moe_layer` on one GPU), "gemm" (the grouped GEMM [M, D]
      x [E, D, F] on one GPU) or "ep_layer" (`moe_layer` with its experts
      over every GPU of `topology`, the ragged exchange).
    full: the model's size, what a GPU times.
    ci: a size that compiles in seconds (CI's compile check).
    topology: "SxHxG", the GPUs it runs on.
    variants: the only variants it has programs of (names); () for all.
    modes: of `MODES`.
  """

  name: str
  model: str
  kind: str
  full: Size
  ci: Size
  topology: str = "1x1x1"
  variants: tuple[str, ...] = ()
  modes: tuple[str, ...] = MODES

  def size(self, size: str) -> Size:
    """`full`, `ci` or `DRY` by name."""
    return {"full": self.full, "ci": self.ci, "dry": DRY}[size]

  @property
  def num_devices(self) -> int:
    s, h, g = (int(n) for n in self.topology.split("x"))
    return s * h * g

  def config(self, size: str) -> moe_core.MoEConfig:
    """The model's MoE block at `size` ("full", "ci" or "dry")."""
    s = self.size(size)
    cfg = presets.get_preset(self.model).model.moe
    return cfg.replace(
        num_experts=s.experts or cfg.num_experts,
        hidden_size=s.hidden,
        expert_ffn_size=s.ffn,
        shared_ffn_size=s.ffn if cfg.shared_ffn_size else 0,
    )


def model_size(model: str, tokens: int) -> Size:
  """`tokens` of a layer of `model` (a train/presets/ name), its hidden size
  D and expert width F the preset's: the full-size workloads' shape."""
  moe = presets.get_preset(model).model.moe
  return Size(tokens=tokens, hidden=moe.hidden_size, ffn=moe.expert_ffn_size)


# A CPU rehearsal's size (gpu_check --dry_run: kernels interpreted).
DRY = Size(tokens=32, hidden=64, ffn=32)
DSV3 = model_size("deepseek_v3", 4096)
# CI sizes keep a model's routing (top-k, groups) but the single-GPU
# layers have fewer experts: Mosaic GPU's layout inference for the sm_100
# kernel grows with E (a GEMM at E=256: 16.6 s for a B200, E=32: 1.5 s; a
# DeepSeek-V3 layer at E=64 16.7 s, E=32 3.8 s; jax 0.12.0.1, in
# `_is_supported_smem_transfer`). E=256 is
# compiled by the grouped-GEMM workloads.
_DSV3_CI = Size(tokens=512, hidden=512, ffn=128, experts=32)
WORKLOADS = (
    # DeepSeek-V3: 256 experts, top-8 within 4 of 8 groups, sigmoid scores,
    # a shared expert.
    Workload("deepseek_v3", "deepseek_v3", "layer", DSV3, _DSV3_CI),
    # Mixtral 8x7B: 8 experts, top-2, a wide F.
    Workload(
        "mixtral_8x7b",
        "mixtral_8x7b",
        "layer",
        model_size("mixtral_8x7b", 8192),
        Size(512, 512, 1792),
    ),
    # Qwen3-30B-A3B: 128 experts, top-8, a narrow F.
    Workload(
        "qwen3_30b_a3b",
        "qwen3_30b_a3b",
        "layer",
        model_size("qwen3_30b_a3b", 8192),
        Size(512, 256, 96, experts=32),
    ),
    # Grouped GEMMs (M rows): DeepSeek-V3's gate/up, M = 4096 tokens x top-8,
    # and a small contraction, [M, 1024] x [256, 1024, 7168], where
    # mosaic_gpu must beat pallas (and where mosaic_tpu's tiles are tested
    # on a short K: bench/workloads/tpu_programs.py).
    Workload(
        "deepseek_v3_gemm",
        "deepseek_v3",
        "gemm",
        model_size("deepseek_v3", 32768),
        Size(4096, 512, 128),
    ),
    Workload(
        "small_k",
        "deepseek_v3",
        "gemm",
        Size(32768, 1024, DSV3.hidden),
        Size(4096, 128, 512),
        variants=("pallas", "mosaic_gpu", "mosaic_tpu"),
        modes=("fwd",),
    ),
    # Expert parallelism, the ragged exchange: 8 GPUs of one host, and 64
    # GPUs of 8 hosts (4 experts each; the exchange crosses hosts).
    Workload(
        "deepseek_v3_ep8", "deepseek_v3", "ep_layer", DSV3, _DSV3_CI, "1x1x8"
    ),
    Workload(
        "deepseek_v3_ep64",
        "deepseek_v3",
        "ep_layer",
        DSV3,
        Size(64, 512, 128),
        "1x8x8",
    ),
)


# --- Programs -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
  """One jitted function of the table and what its compile must contain."""

  workload: Workload
  variant: Variant
  mode: str

  @property
  def name(self) -> str:
    return f"{self.workload.name}/{self.variant.name}/{self.mode}"

  @property
  def kernels(self) -> tuple[str, ...]:
    """Custom calls the executable must contain (`KERNELS`)."""
    return KERNELS.get(self.variant.backend, {}).get(self.mode, ())

  @property
  def collectives(self) -> tuple[str, ...]:
    """Collectives it must contain."""
    return (RAGGED_ALL_TO_ALL,) if self.workload.kind == "ep_layer" else ()

  def expert_flops(self, size: str) -> int:
    """FLOPs of its expert GEMMs (3 a layer; the backward's twice more)."""
    w, s = self.workload, self.workload.size(size)
    if w.kind == "gemm":
      flops = 2 * s.tokens * s.hidden * s.ffn
    else:
      cfg = w.config(size)
      flops = 6 * s.tokens * w.num_devices * cfg.top_k * s.hidden * s.ffn
    return flops * (3 if self.mode == "fwd_bwd" else 1)

  def build(self, size: str, mesh=None, interpret: bool = False):
    """(fn, abstract args, PartitionSpecs of the args) at `size`.

    mesh: the mesh of an "ep_layer" program (experts over one axis,
    "expert", of all its devices); None for the others, whose specs are
    then None (one device).
    """
    w = self.workload
    backend = self.variant.build(interpret=interpret)
    s = w.size(size)
    bf16, f32 = jnp.bfloat16, jnp.float32
    if w.kind == "gemm":
      e = s.experts or presets.get_preset(w.model).model.moe.num_experts
      args = (
          jax.ShapeDtypeStruct((s.tokens, s.hidden), bf16),
          jax.ShapeDtypeStruct((e, s.hidden, s.ffn), bf16),
          jax.ShapeDtypeStruct((e,), jnp.int32),
      )
      cot = jax.ShapeDtypeStruct((s.tokens, s.ffn), f32)
      recipe = self.variant.precision
      fn = functools.partial(_gemm, backend, recipe)
      specs = None
    else:
      cfg = w.config(size)
      params = jax.eval_shape(
          lambda: moe_core.init_params(jax.random.key(0), cfg, dtype=bf16)
      )
      tokens = s.tokens * w.num_devices
      args = (params, jax.ShapeDtypeStruct((tokens, s.hidden), bf16))
      cot = jax.ShapeDtypeStruct((tokens, s.hidden), f32)
      fn = functools.partial(_layer, backend, cfg, mesh)
      specs = None
      if mesh is not None:
        p = jax.sharding.PartitionSpec
        specs = (moe_core.parallel.param_specs(cfg), p("expert"))
    if self.mode == "fwd_bwd":
      fn, args = with_grad(fn), args + (cot,)
      if specs is not None:
        specs = specs + (jax.sharding.PartitionSpec("expert"),)
    return fn, args, specs


def _gemm(backend, recipe, rows, weights, group_sizes):
  return backend.grouped_gemm(rows, weights, group_sizes, precision=recipe)


def _layer(backend, cfg, mesh, params, x):
  if mesh is None:
    return moe_core.moe_layer(params, x, cfg, backend=backend)[0]
  return moe_core.moe_layer(
      params,
      x,
      cfg,
      backend=backend,
      mesh=mesh,
      expert_axis="expert",
      data_axes=(),
      ep_options=moe_core.EPOptions(exchange="ragged"),
  )[0]


def with_grad(fn: Callable) -> Callable:
  """f(a, b, *rest, cotangent) -> (vdot(fn(...), cotangent), (d a, d b))."""

  def loss(a, b, *rest):
    *rest, cotangent = rest
    return jnp.vdot(fn(a, b, *rest).astype(jnp.float32), cotangent)

  return jax.value_and_grad(loss, argnums=(0, 1))


def programs(
    kinds: tuple[str, ...] = KINDS,
    workloads: tuple[Workload, ...] = WORKLOADS,
    table: tuple[Variant, ...] | None = None,
) -> tuple[Program, ...]:
  """Every program of the table, workload by workload (`table`: the
  variants, default the GPU's, `variants()`)."""
  table = variants() if table is None else table
  return tuple(
      Program(w, v, mode)
      for w in workloads
      if w.kind in kinds
      for v in table
      if w.kind in v.kinds and (not w.variants or v.name in w.variants)
      for mode in v.modes
      if mode in w.modes
  )


def select(patterns: str, table=None) -> tuple[Program, ...]:
  """The programs whose name matches one of comma-separated fnmatch
  `patterns` ("mixtral_8x7b/pallas*/*,small_k/*")."""
  found = tuple(
      p
      for p in (programs() if table is None else table)
      if any(fnmatch.fnmatchcase(p.name, q) for q in patterns.split(",") if q)
  )
  if not found:
    raise ValueError(f"no program matches {patterns!r}.")
  return found


def concrete_args(program: Program, size: str, key=None):
  """Random arrays for `program.build`'s abstract args (one device).

  Group sizes: a random split of the rows over the experts (each expert
  gets some rows; `gemm_workloads.skewed_group_sizes`).
  """
  _, args, _ = program.build(size)
  keys = iter(
      jax.random.split(key if key is not None else jax.random.key(0), 8)
  )
  if program.workload.kind == "gemm":
    rows, weights, sizes = args[:3]
    out = [
        jax.random.normal(next(keys), rows.shape, rows.dtype),
        jax.random.normal(next(keys), weights.shape, weights.dtype)
        * jnp.asarray(weights.shape[1] ** -0.5, weights.dtype),
        jnp.asarray(
            gemm_workloads.skewed_group_sizes(
                "random", rows.shape[0], sizes.shape[0]
            )
        ),
    ]
  else:
    cfg = program.workload.config(size)
    params, x = args[:2]
    out = [
        moe_core.init_params(next(keys), cfg, dtype=jnp.bfloat16),
        jax.random.normal(next(keys), x.shape, x.dtype),
    ]
  if program.mode == "fwd_bwd":
    out.append(jax.random.normal(next(keys), args[-1].shape, args[-1].dtype))
  return tuple(out)
