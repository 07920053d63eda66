"""tpu_check's programs: the grouped GEMMs' methods per pass, tiles, layers.

A grouped GEMM is rows x [M, K] times weights w [E, K, N] over ragged groups, in
three passes of 2*M*K*N useful FLOPs each: "fwd" (x w -> [M, N]), "dx" (dy w^T
-> [M, K]) and "dw" (x^T dy per group -> [E, K, N]). Each method (`METHODS`)
builds one jittable f(x, w, group_sizes, dy) per pass: dense `jnp.dot` of one
expert's weights over every row (the baseline), `lax.ragged_dot` and its VJP,
megablox's gmm/tgmm at a tiling, and the dropless backends (`mosaic_tpu`, `xla`)
through `Backend.grouped_gemm` and its VJP. The MoE layers and their dense
SwiGLU FFN are here too, and `MegabloxBackend`, megablox's gmm as a dropless
backend for the layer. The dense FFN is bench/micro/layer_bench.py's
`dense_ffn`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from bench.workloads import gemm_workloads
from train import presets

PASSES = ("fwd", "dx", "dw")
ROUTINGS = ("even", "zipf")
ZIPF_EXPONENT = 1.5
# The backend kernels each pass runs (the pallas backends' `TileConfig`
# fields): the forward gmm, the dX gmm and the dW tgmm.
KERNEL_OF_PASS = {"fwd": "fwd", "dx": "dgrad", "dw": "wgrad"}
OURS = "mosaic_tpu"
_MEGABLOX = "jax.experimental.pallas.ops.tpu.megablox"


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One grouped GEMM shape: [M, K] x [E, K, N]."""

  name: str
  experts: int
  m: int
  k: int
  n: int

  def flops(self) -> int:
    """Useful FLOPs of one pass."""
    return 2 * self.m * self.k * self.n

  def pass_dims(self, pass_: str) -> tuple[int, int, int]:
    """(rows, contracted, output) of the pass's kernel, as megablox tiles
    them (tm, tk, tn): fwd (M, K, N), dx (M, N, K), dw (M, K, N) (tgmm
    contracts the rows; tk and tn tile its [K, N] output)."""
    return {
        "fwd": (self.m, self.k, self.n),
        "dx": (self.m, self.n, self.k),
        "dw": (self.m, self.k, self.n),
    }[pass_]


@dataclasses.dataclass(frozen=True)
class Layer:
  """One MoE layer: E experts, top-K, model width D, expert width F, T
  tokens; its dense twin is a SwiGLU FFN of width K*F on the T tokens."""

  name: str
  experts: int
  top_k: int
  hidden: int
  ffn: int
  tokens: int

  def config(self) -> moe_core.MoEConfig:
    return moe_core.MoEConfig(
        num_experts=self.experts,
        top_k=self.top_k,
        hidden_size=self.hidden,
        expert_ffn_size=self.ffn,
    )

  def flops(self) -> int:
    """Useful FLOPs of forward+backward: three expert GEMMs, x3."""
    return 3 * 3 * 2 * self.tokens * self.top_k * self.hidden * self.ffn


def _up_down(name: str, preset: str, m: int, ep: int = 1):
  """A model's (a train/presets/ name) up and down GEMMs of M rows, its
  experts split over `ep` devices."""
  moe = presets.get_preset(preset).model.moe
  e, d, f = moe.num_experts // ep, moe.hidden_size, moe.expert_ffn_size
  return (
      Gemm(f"{name}_up", e, m, d, f),
      Gemm(f"{name}_down", e, m, f, d),
  )


def _layer(name: str, preset: str, tokens: int, ep: int = 1) -> Layer:
  """A model's MoE layer on `tokens` tokens, its experts split over `ep`."""
  moe = presets.get_preset(preset).model.moe
  return Layer(
      name,
      moe.num_experts // ep,
      moe.top_k,
      moe.hidden_size,
      moe.expert_ffn_size,
      tokens,
  )


# M = tokens x top-k rows. Up: [M, D] x [E, D, F]; down: [M, F] x [E, F, D].
GEMMS = (
    *_up_down("mixtral", "mixtral_8x7b", 8192),
    *_up_down("dsv3_ep8", "deepseek_v3", 16384, ep=8),
    *_up_down("qwen3_30b", "qwen3_30b_a3b", 32768),
    *_up_down("olmoe", "olmoe_1b_7b", 32768),
)
LAYERS = (
    _layer("mixtral", "mixtral_8x7b", 4096),
    _layer("dsv3_ep8", "deepseek_v3", 2048, ep=8),
    _layer("qwen3_30b", "qwen3_30b_a3b", 4096),
    _layer("olmoe", "olmoe_1b_7b", 4096),
)
# --dry_run's: interpreted kernels on the CPU, 128-row tiles.
DRY_GEMMS = (Gemm("dry_up", 4, 512, 256, 384),)
DRY_LAYERS = (Layer("dry", 4, 2, 128, 128, 128),)


def group_sizes(routing: str, gemm: Gemm):
  """[E] int32 summing to M: even, or Zipf(1.5) with a fixed seed."""
  return jnp.asarray(
      gemm_workloads.skewed_group_sizes(
          routing, gemm.m, gemm.experts, seed=0, zipf_exponent=ZIPF_EXPONENT
      )
  )


def inputs(gemm: Gemm, key):
  """(x [M, K], w [E, K, N], dy [M, N]), bf16, random (the dense baseline
  takes w[0])."""
  kx, kw, kd = jax.random.split(key, 3)
  bf16 = jnp.bfloat16
  shape = (gemm.experts, gemm.k, gemm.n)
  x = jax.random.normal(kx, (gemm.m, gemm.k), bf16)
  w = jax.random.normal(kw, shape, bf16) * jnp.asarray(gemm.k**-0.5, bf16)
  dy = jax.random.normal(kd, (gemm.m, gemm.n), bf16)
  return x, w, dy


# --- Methods: pass -> f(x, w, group_sizes, dy) -------------------------------


def _vjp_passes(fwd):
  """fwd, dX and dW of f(x, w, gs) -> [M, N], each alone (the other operand
  is a constant of the VJP, so its gradient is not computed)."""

  def dx(x, w, gs, dy):
    return jax.vjp(lambda x: fwd(x, w, gs), x)[1](dy)[0]

  def dw(x, w, gs, dy):
    return jax.vjp(lambda w: fwd(x, w, gs), w)[1](dy)[0]

  return {"fwd": lambda x, w, gs, dy: fwd(x, w, gs), "dx": dx, "dw": dw}


def dense_passes():
  """The dense baseline: every row times one [K, N] weight."""
  f32 = jnp.float32

  def fwd(x, w, gs, dy):
    del gs, dy
    return jnp.dot(x, w, preferred_element_type=f32).astype(x.dtype)

  def dx(x, w, gs, dy):
    del x, gs
    return jnp.dot(dy, w.T, preferred_element_type=f32).astype(dy.dtype)

  def dw(x, w, gs, dy):
    del w, gs
    return jnp.dot(x.T, dy, preferred_element_type=f32).astype(x.dtype)

  return {"fwd": fwd, "dx": dx, "dw": dw}


def ragged_dot_passes():
  return _vjp_passes(gemm_workloads.ragged_dot_gemm)


def backend_passes(backend: moe_core.Backend):
  """A dropless backend's `grouped_gemm` and its VJP."""
  return _vjp_passes(
      lambda x, w, gs: backend.grouped_gemm(x, w, gs, out_dtype=x.dtype)
  )


def megablox_module(name: str = "gmm"):
  """megablox's `gmm` (kernels) or `ops` (custom VJP) module.

  By import_module: the package's `gmm` attribute is the ops function,
  which hides the module of the same name.
  """
  return importlib.import_module(f"{_MEGABLOX}.{name}")


def megablox_passes(tiles: dict, interpret: bool = False):
  """megablox's kernels, each at its pass's (tm, tk, tn) in `tiles`
  (pass -> tuple; a pass missing from it is not built)."""
  gmm = megablox_module("gmm")
  call = {"interpret": interpret}

  def fwd(x, w, gs, dy):
    del dy
    return gmm.gmm(x, w, gs, x.dtype, tiling=tiles["fwd"], **call)

  def dx(x, w, gs, dy):
    del x
    return gmm.gmm(
        dy, w, gs, dy.dtype, tiling=tiles["dx"], transpose_rhs=True, **call
    )

  def dw(x, w, gs, dy):
    del w
    # As megablox's own VJP: its tgmm takes the rows transposed.
    return gmm.tgmm(x.T, dy, gs, x.dtype, tiling=tiles["dw"], **call)

  return {p: f for p, f in (("fwd", fwd), ("dx", dx), ("dw", dw)) if p in tiles}


def our_backend(tiles: dict | None = None, interpret: bool = False):
  """The mosaic_tpu backend; tiles: pass -> its kernel's tile (`our_tile`
  dicts; None: the backend's own table). Raises what building it raises
  (ValueError while it is not registered, ImportError while it cannot
  import)."""
  options = {"interpret": True} if interpret else {}
  if tiles:
    options["tiles"] = {
        KERNEL_OF_PASS[p]: our_tile(t) for p, t in tiles.items()
    }
  return moe_core.get_backend(OURS, **options)


def our_tile(tile) -> dict:
  """A mosaic_tpu tile as the dict of its fields (JSON, and the backend's
  `tiles` option): from a `tiling.Tiles`, a dict, or (bm, bk, bn)."""
  if dataclasses.is_dataclass(tile):
    return dataclasses.asdict(tile)
  if isinstance(tile, dict):
    return dict(tile)
  return dict(zip(("bm", "bk", "bn"), tile))


def our_status(interpret: bool) -> str | None:
  """None if mosaic_tpu can be built and runs here, else why not."""
  try:
    ok, why = our_backend(interpret=interpret).availability()
  except (ValueError, ImportError) as e:
    return f"backend missing: {type(e).__name__}: {str(e)[:300]}"
  return None if ok else f"unavailable: {why}"


# --- Tiles -------------------------------------------------------------------

# megablox's best on a v5e (bench notes): the prior the sweep starts from.
MEGABLOX_PRIOR = (512, 1024, 1024)
# Operand, accumulator and output blocks (bf16 inputs double-buffered)
# past this many bytes do not fit megablox's scoped VMEM on a v5e
# ((1024, 1024, 1024), 16 MiB, fails to compile): not tried.
MEGABLOX_VMEM_BYTES = 14 * 2**20


def _block_bytes(tm, tk, tn) -> int:
  return 2 * 2 * (tm * tk + tk * tn) + 4 * tm * tn + 2 * 2 * tm * tn


def _prior_order(cands, prior):
  """Nearest to `prior` first (log2 distance), then larger tiles."""

  def distance(t):
    return (
        sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(t, prior)),
        -t[0] * t[1] * t[2],
    )

  return sorted(set(cands), key=distance)


def megablox_candidates(gemm: Gemm, pass_: str, dry: bool = False):
  """(tm, tk, tn) tilings worth timing, most promising first.

  tm divides M (megablox requires it); tk and tn are powers of two up to
  their dimension, or the whole dimension. --dry_run adds one that must
  fail (tm not dividing M), so a failed compile is recorded.
  """
  m, c, n = gemm.pass_dims(pass_)
  if dry:
    return [(128, 128, 128), (384, 128, 128)]
  rows = [t for t in (256, 512, 1024) if m % t == 0]
  widths = lambda d: sorted({d, *(t for t in (256, 512, 1024, 2048) if t < d)})
  cands = [
      (tm, tk, tn)
      for tm in rows
      for tk in widths(c)
      for tn in widths(n)
      if _block_bytes(tm, tk, tn) <= MEGABLOX_VMEM_BYTES
  ]
  return _prior_order(cands, MEGABLOX_PRIOR)


# Until backends/mosaic_tpu/tiling.py gives its own: megablox's grid.
def _placeholder_candidates(gemm, pass_, dry):
  return megablox_candidates(gemm, pass_, dry)[: 1 if dry else None]


def our_candidates(gemm: Gemm, pass_: str, dry: bool = False):
  """([tile dict], where they came from) for mosaic_tpu, in its order.

  From `backends.mosaic_tpu.tiling.candidates`, called with those of
  (kind, m, k, n, num_groups, dtype) it takes (kind "fwd", "dgrad" or
  "wgrad"; m, k, n as `Gemm.pass_dims`), or the placeholder grid while it
  does not exist. --dry_run: the first.
  """
  m, c, n = gemm.pass_dims(pass_)
  try:
    tiling = importlib.import_module(f"backends.{OURS}.tiling")
    offered = {
        "kind": KERNEL_OF_PASS[pass_],
        "m": m,
        "k": c,
        "n": n,
        "num_groups": gemm.experts,
        "dtype": jnp.bfloat16,
    }
    wanted = inspect.signature(tiling.candidates).parameters
    found = tiling.candidates(
        **{k: v for k, v in offered.items() if k in wanted}
    )
    out = [our_tile(t) for t in found]
    return (out[:1] if dry else out), f"backends.{OURS}.tiling.candidates"
  except Exception as e:  # pylint: disable=broad-except
    why = f"placeholder ({type(e).__name__}: {str(e)[:200]})"
    return [our_tile(t) for t in _placeholder_candidates(gemm, pass_, dry)], why


# --- Layers ------------------------------------------------------------------


class MegabloxBackend(moe_core.Backend):
  """megablox's gmm (its custom VJP) as the layer's grouped GEMM; the
  route, dispatch and combine are dropless's. Rows past sum(group_sizes)
  are not zeroed: fine for timing a dropless layer (there are none)."""

  name = "megablox"
  dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

  def __init__(self, interpret: bool = False):
    self.interpret = interpret

  def tiling(self, c: int, n: int) -> tuple[int, int, int]:
    """(512, 1024, 1024), or the whole dimension where 1024 does not
    divide it ((128,) * 3 interpreted)."""
    if self.interpret:
      return (128, 128, 128)
    fit = lambda d: 1024 if d % 1024 == 0 else d
    return (512, fit(c), fit(n))

  def _grouped_gemm(self, gemm):
    ops = megablox_module("ops")
    w = gemm.weights
    c, n = (w.shape[2], w.shape[1]) if gemm.transpose_rhs else w.shape[1:]
    return ops.gmm(
        gemm.rows,
        w,
        gemm.group_sizes,
        gemm.out_dtype,
        self.tiling(c, n),
        None,
        None,
        gemm.transpose_rhs,
        self.interpret,
    )


def dense_ffn_params(layer: Layer, key, dtype=jnp.bfloat16) -> dict:
  """The dense SwiGLU FFN's [D, K*F], [D, K*F], [K*F, D] weights."""
  d, width = layer.hidden, layer.top_k * layer.ffn
  kg, ku, kd = jax.random.split(key, 3)
  return {
      "w_gate": (jax.random.normal(kg, (d, width)) / d**0.5).astype(dtype),
      "w_up": (jax.random.normal(ku, (d, width)) / d**0.5).astype(dtype),
      "w_down": (jax.random.normal(kd, (width, d)) / width**0.5).astype(dtype),
  }


def moe_fn(layer: Layer, backend):
  cfg = layer.config()
  return functools.partial(_moe, cfg, backend)


def _moe(cfg, backend, params, x):
  return moe_core.moe_layer(params, x, cfg, backend=backend)[0]


# The layer's routings besides its router's own (`moe_fn`): each token's K
# experts drawn, so that a routing's time can be set beside another's.
LAYER_ROUTINGS = ("uniform", "zipf")


def layer_expert_ids(layer: Layer, routing: str, seed: int = 0):
  """[T, K] int32: each token's K distinct experts, drawn without
  replacement with probabilities p over the experts ("uniform", or "zipf":
  p(rank r) ~ r^-ZIPF_EXPONENT, the ranks shuffled), by the Gumbel top-K.

  A token takes an expert at most once, so no expert receives more than T
  of the T*K copies: Zipf's head is capped there (at E=32, K=8 the first
  ranks get 12.5%, 11.9%, 10.3% of the copies instead of 44%, 16%, 9%).
  """
  if routing not in LAYER_ROUTINGS:
    raise ValueError(
        f"routing must be one of {LAYER_ROUTINGS}, got {routing!r}."
    )
  rng = np.random.default_rng(seed)
  p = np.full(layer.experts, 1.0 / layer.experts)
  if routing == "zipf":
    p = rng.permutation(1.0 / np.arange(1, layer.experts + 1) ** ZIPF_EXPONENT)
  keys = np.log(p) + rng.gumbel(size=(layer.tokens, layer.experts))
  return np.argsort(-keys, axis=1)[:, : layer.top_k].astype(np.int32)


def moe_fn_with_ids(layer: Layer, backend, expert_ids):
  """`moe_fn` with the router's choice replaced by `expert_ids` [T, K]: the
  router still runs (its weights and the combine weights are its own), the
  routed experts then see the given experts."""
  cfg = layer.config()
  ids = jnp.asarray(expert_ids, jnp.int32)

  def fn(params, x):
    aux = backend.route(x, params["router"], cfg)
    aux = dataclasses.replace(aux, expert_ids=ids)
    return backend.routed_experts(params, x, aux, cfg)

  return fn
