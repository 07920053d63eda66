"""Block sizes and Triton settings of the pallas kernels, and a heuristic.

Every number a kernel uses comes from a `Tiles` (whose attributes say what
each block size means for gmm and for tgmm); `TileConfig` holds one per
kernel (forward, dX, dW) and `choose` fills in whatever the caller left to
the heuristic.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from moe_core.kernels import tile_settings

# Blocks are powers of two >= this, as Triton's tl.dot needs.
MIN_BLOCK = tile_settings.TRITON_MIN_BLOCK
# Shared memory per thread block on Hopper (sm_90): 227 KiB.
HOPPER_SMEM_BYTES = 227 * 1024
# Registers: a Hopper thread has at most 255 32-bit registers (64K per SM).
# Every float32 accumulator element of a program lives in a register of one
# of its 32 * num_warps threads, for the whole C loop. The operand fragments,
# addresses, masks and loop state need registers too, so past about half the
# limit ptxas spills to local memory, which costs far more than a smaller
# tile: keep the accumulators at most this many registers per thread.
ACC_REGS_PER_THREAD = 128
# The most warps `fit_registers` raises a program to: two warpgroups, the
# largest count Triton's Hopper matmul configurations use.
MAX_FIT_WARPS = 8
KINDS = ("fwd", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Block sizes and launch settings of one kernel.

  Attributes:
    bm: rows per tile. For gmm, the granularity of the tile list; for tgmm,
      the reduction step over a group's rows.
    bk: for gmm, the step along the contracted width C; for tgmm, dW rows
      per program (C is then the dW row count).
    bn: output columns per program.
    num_warps: Triton warps per program (ignored when interpreting).
    num_stages: Triton software-pipelining stages (ignored when
      interpreting).
  """

  bm: int = 128
  bk: int = 64
  bn: int = 128
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    tile_settings.check_triton_tiles(self, ("bm", "bk", "bn"))

  def smem_bytes(self, kind: str, dtype, num_operands: int = 1) -> int:
    """Shared memory Triton's pipeliner needs for the operand blocks.

    Args:
      kind: "fwd", "dgrad" or "wgrad".
      dtype: the operands' dtype.
      num_operands: products per step (2 for the fused gate/up pass).
    """
    _check_kind(kind)
    if kind == "wgrad":
      per_stage = self.bm * self.bk + num_operands * self.bm * self.bn
    else:
      per_stage = num_operands * (self.bm * self.bk + self.bk * self.bn)
    return per_stage * jnp.dtype(dtype).itemsize * self.num_stages

  def acc_regs_per_thread(self, kind: str, num_accumulators: int = 1) -> int:
    """float32 accumulator elements each of the program's threads holds.

    Args:
      kind: "fwd", "dgrad" (accumulators [bm, bn]) or "wgrad" ([bk, bn]).
      num_accumulators: accumulators carried through the loop (2 for the
        fused gate/up forward and its dW).
    """
    _check_kind(kind)
    rows = self.bk if kind == "wgrad" else self.bm
    return -(-num_accumulators * rows * self.bn // (32 * self.num_warps))


@dataclasses.dataclass(frozen=True)
class TileConfig(tile_settings.PerKernel, item=Tiles):
  """Tiles per kernel; None leaves that kernel to the heuristic.

  `TileConfig.parse` reads the backend's `tiles` option (`PerKernel.parse`:
  a Tiles for every kernel, a dict of its fields, or one per kernel).

  Attributes:
    fwd: the forward gmm (and the fused gate/up pass).
    dgrad: the dX gmm (the forward kernel reading the weights transposed).
    wgrad: the dW tgmm.
  """

  fwd: Tiles | None = None
  dgrad: Tiles | None = None
  wgrad: Tiles | None = None


def _check_kind(kind):
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")


# Configurations shipped for the GPU (Triton lowering). On the GPU `choose`
# starts from one of these and `fit_gpu` shrinks it for the fused kernels; a
# test lowers every one of them, and their fused variants, for CUDA. Shared
# memory stays under Hopper's 227 KiB and accumulators within
# ACC_REGS_PER_THREAD (checked by tiling_test).
GPU_TILES: dict[str, Tiles] = {
    # Large groups, bf16: wide tiles, 8 warps for the 128x256 accumulator.
    "gmm_bf16_large": Tiles(bm=128, bk=64, bn=256, num_warps=8, num_stages=3),
    "gmm_bf16": Tiles(bm=128, bk=64, bn=128, num_warps=4, num_stages=4),
    # Small groups: shorter row tiles waste fewer rows per group boundary.
    "gmm_bf16_small": Tiles(bm=64, bk=64, bn=128, num_warps=4, num_stages=4),
    "gmm_f32": Tiles(bm=64, bk=32, bn=128, num_warps=4, num_stages=3),
    "tgmm_bf16": Tiles(bm=64, bk=128, bn=128, num_warps=8, num_stages=3),
    "tgmm_f32": Tiles(bm=32, bk=64, bn=128, num_warps=4, num_stages=3),
}

# Interpret mode (CPU) pays a fixed cost per grid step and per loop step plus
# the math, which XLA:CPU does best in large dots: few, large blocks. Row
# tiles follow the average group, since each group boundary costs up to one
# extra tile of rows (measured on 2 cores: the forward runs at about
# dense time x rows visited / rows).
_INTERPRET_MAX_BK = 512
_INTERPRET_MAX_BN = 1024
_INTERPRET_MAX_BM = 128
_INTERPRET_MAX_WGRAD_BM = 256


def _pow2_floor(x: int) -> int:
  return 1 << (max(int(x), 1).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def fit_block(dim: int, target: int) -> int:
  """A block for an axis of length `dim`, at most `target` if possible.

  The largest power of two in [MIN_BLOCK, target] that divides `dim` (no
  padding needed); if none divides it, the smallest power of two covering
  `dim`, capped at `target` (the caller pads the axis).
  """
  target = max(_pow2_floor(target), MIN_BLOCK)
  block = target
  while block >= MIN_BLOCK:
    if dim % block == 0:
      return block
    block //= 2
  return max(MIN_BLOCK, min(target, _pow2_ceil(dim)))


def padded(dim: int, block: int) -> int:
  """`dim` rounded up to a multiple of `block`."""
  return -(-dim // block) * block


def _row_block(m: int, num_groups: int, cap: int) -> int:
  """Row tile: at most the average group size, so boundaries waste little."""
  average = max(m // max(num_groups, 1), 1)
  bm = min(cap, max(MIN_BLOCK, _pow2_floor(average)))
  return min(bm, max(MIN_BLOCK, _pow2_ceil(m)))


def heuristic(
    kind: str,
    m: int,
    c: int,
    n: int,
    num_groups: int,
    dtype,
    *,
    interpret: bool,
    num_operands: int = 1,
) -> Tiles:
  """Tiles for one kernel call by shape.

  Args:
    kind: "fwd" or "dgrad" (gmm: [m, c] x [E, c, n], contracting c) or
      "wgrad" (tgmm: [m, c]^T x [m, n] per group -> [E, c, n], contracting
      m).
    m, c, n: the problem's dimensions as above.
    num_groups: E.
    dtype: operand dtype.
    interpret: the kernels run in interpret mode (CPU), not on a GPU.
    num_operands: products per step (2 for the fused gate/up pass), which
      multiplies the shared memory a GPU program needs and, for "fwd" and
      "wgrad" (one output per product), the accumulators (`fit_gpu`).
  """
  _check_kind(kind)
  if interpret:
    if kind == "wgrad":
      return Tiles(
          bm=_row_block(m, num_groups, _INTERPRET_MAX_WGRAD_BM),
          bk=fit_block(c, _INTERPRET_MAX_BK),
          bn=fit_block(n, _INTERPRET_MAX_BN),
      )
    return Tiles(
        bm=_row_block(m, num_groups, _INTERPRET_MAX_BM),
        bk=fit_block(c, _INTERPRET_MAX_BK),
        bn=fit_block(n, _INTERPRET_MAX_BN),
    )
  f32 = jnp.dtype(dtype) == jnp.float32
  if kind == "wgrad":
    base = GPU_TILES["tgmm_f32" if f32 else "tgmm_bf16"]
    return fit_gpu(
        dataclasses.replace(
            base, bk=fit_block(c, base.bk), bn=fit_block(n, base.bn)
        ),
        kind,
        dtype,
        num_operands,
    )
  if f32:
    base = GPU_TILES["gmm_f32"]
  elif m // max(num_groups, 1) < 256:
    base = GPU_TILES["gmm_bf16_small"]
  elif n >= 2048 and n % 256 == 0:
    base = GPU_TILES["gmm_bf16_large"]
  else:
    base = GPU_TILES["gmm_bf16"]
  return fit_gpu(
      dataclasses.replace(
          base,
          bm=min(base.bm, max(MIN_BLOCK, _pow2_ceil(m))),
          bk=fit_block(c, base.bk),
          bn=fit_block(n, base.bn),
      ),
      kind,
      dtype,
      num_operands,
  )


def num_accumulators(kind: str, num_operands: int = 1) -> int:
  """Accumulators of a kernel with `num_operands` products per step.

  The forward (gate and up) and dW (dW_gate and dW_up) write one output per
  product; dX sums its products into one output, hence one accumulator.
  """
  _check_kind(kind)
  return 1 if kind == "dgrad" else num_operands


def fit_gpu(tiles: Tiles, kind: str, dtype, num_operands: int = 1) -> Tiles:
  """The tiles a GPU program runs with: within registers, then shared memory.

  Registers first: narrowing the tile also shrinks its shared memory, which
  may then keep more pipeline stages.
  """
  tiles = fit_registers(tiles, kind, num_accumulators(kind, num_operands))
  return fit_smem(tiles, kind, dtype, num_operands)


def fit_registers(tiles: Tiles, kind: str, num_accumulators: int = 1) -> Tiles:
  """`tiles` with more warps, then narrower bn, then fewer accumulator rows.

  It stops once the accumulators take at most ACC_REGS_PER_THREAD registers
  per thread. The rows are bm for gmm and bk for tgmm (dW blocks [bk, bn]).
  """
  rows = "bk" if kind == "wgrad" else "bm"
  return tile_settings.fit_triton_registers(
      tiles,
      lambda t: t.acc_regs_per_thread(kind, num_accumulators)
      > ACC_REGS_PER_THREAD,
      max_warps=MAX_FIT_WARPS,
      halve=("bn", rows),
  )


def fit_smem(tiles: Tiles, kind: str, dtype, num_operands: int = 1) -> Tiles:
  """`tiles` with fewer stages, then narrower bn, until it fits on Hopper."""
  return tile_settings.fit_triton_smem(
      tiles,
      lambda t: t.smem_bytes(kind, dtype, num_operands) > HOPPER_SMEM_BYTES,
      halve=("bn",),
  )


def choose(config: TileConfig, kind: str, *args, **kwargs) -> Tiles:
  """The caller's tiles for `kind` if `config` sets them, else the heuristic's.

  Args:
    config: the caller's tiles per kernel.
    kind: "fwd", "dgrad" or "wgrad".
    *args: the rest of `heuristic`'s arguments (m, c, n, num_groups, dtype).
    **kwargs: `heuristic`'s keyword arguments (interpret, num_operands).
  """
  tiles = config.get(kind)
  if tiles is not None:
    return tiles
  return heuristic(kind, *args, **kwargs)


def num_visits(m: int, bm: int, num_groups: int) -> int:
  """Static length of the gmm tile list: row tiles + one per group boundary."""
  return math.ceil(m / bm) + num_groups
