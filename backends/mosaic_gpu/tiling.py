"""Block sizes and pipeline depth of the Mosaic GPU kernels: a table and a fit.

gmm (forward, dX) runs persistent programs over (tile-list visits x N / bn),
each pipelining C in steps of bk through shared memory ([bm, bk] @ [bk, bn]
per step, `stages` steps in flight). `TABLE` holds the shipped tiles per
(GPU generation, kernel kind, shape bucket); `choose` takes the caller's
tiles if given, else the table's entry, else `heuristic`, and always fits
the result to registers and shared memory (`fit`). dW does not run here: it
stays on the Pallas Triton kernel (`backends/pallas`), which tokamax's H100
data shows 4-6x faster than a Mosaic GPU dW.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from moe_core.kernels import gpu
from moe_core.kernels import tile_settings

KINDS = ("fwd", "dgrad")
# Shared memory per block on Hopper (sm_90): 227 KiB.
SMEM_BYTES = 227 * 1024
# One warpgroup (128 threads) holds the float32 accumulators in registers;
# a thread has 255. Past about two thirds of them ptxas spills.
ACC_REGS_PER_THREAD = 168
WARPGROUP_THREADS = 128
# A warpgroup MMA is 64 rows tall; TMA and the 128-byte swizzle want 64-wide
# bf16 blocks along C and N.
ROW_QUANTUM = 64
COL_QUANTUM = 64
# SMs of the GPU the kernels are built for when no GPU is attached (H100 and
# H200 have 132).
DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Block sizes and pipeline depth of one gmm call.

  Attributes:
    bm: rows per tile (the tile list's granularity); a multiple of 64.
    bk: the step along the contracted width C; 32 or 64 (64 bf16 elements
      are one 128-byte swizzle row).
    bn: output columns per work item; a multiple of 64, at most 256.
    stages: pipeline steps in flight (shared-memory buffers per operand).
  """

  bm: int = 128
  bk: int = 64
  bn: int = 128
  stages: int = 4

  def __post_init__(self):
    quantum = "a multiple of 64 in [64, 256]"
    for name, ok, expected in (
        ("bm", lambda v: v % ROW_QUANTUM == 0 and 0 < v <= 256, quantum),
        ("bk", lambda v: v in (32, 64), "32 or 64"),
        ("bn", lambda v: v % COL_QUANTUM == 0 and 0 < v <= 256, quantum),
        ("stages", lambda v: 1 <= v <= 8, "an int in [1, 8]"),
    ):
      tile_settings.check_int_field(self, name, ok, expected)

  def acc_regs_per_thread(self, num_accs: int) -> int:
    """float32 accumulator registers per thread of the one warpgroup."""
    return num_accs * self.bm * self.bn // WARPGROUP_THREADS

  def smem_bytes(self, dtype, num_lhs=1, num_rhs=1, num_outputs=1) -> int:
    """Shared memory of a program: pipeline buffers plus output tiles."""
    item = jnp.dtype(dtype).itemsize
    per_step = (
        num_lhs * self.bm * self.bk + num_rhs * self.bk * self.bn
    ) * item
    return self.stages * per_step + num_outputs * self.bm * self.bn * item


@dataclasses.dataclass(frozen=True)
class TileConfig(tile_settings.PerKernel, item=Tiles):
  """The caller's tiles per kernel kind; None leaves it to the table.

  `TileConfig.parse` reads the backend's `tiles` option (`PerKernel.parse`).
  """

  fwd: Tiles | None = None
  dgrad: Tiles | None = None


# (generation, kind, bucket) -> Tiles. Buckets (`bucket`): "few_rows" when
# groups average under 128 rows (half-height tiles waste less on the rows a
# visit does not own), "two_acc" for the fused gate+up pass (two
# accumulators: half-width tiles keep them in registers), else "default".
# Starting points from JAX's Hopper ragged-dot sweep space (bm, bn in 64..192,
# bk 64, 2-6 stages); `bench/on_device/gpu_check.py` times them on an H200.
TABLE: dict[tuple[str, str, str], Tiles] = {
    ("sm90", "fwd", "default"): Tiles(bm=128, bk=64, bn=128, stages=4),
    ("sm90", "fwd", "few_rows"): Tiles(bm=64, bk=64, bn=128, stages=4),
    ("sm90", "fwd", "two_acc"): Tiles(bm=128, bk=64, bn=64, stages=4),
    ("sm90", "dgrad", "default"): Tiles(bm=128, bk=64, bn=128, stages=4),
    ("sm90", "dgrad", "few_rows"): Tiles(bm=64, bk=64, bn=128, stages=4),
    # Blackwell (tcgen05, accumulators in tensor memory): the same shapes
    # to start with; the epilogue still brings each accumulator row block
    # into registers, so the register fit applies too. Not yet timed.
    ("sm100", "fwd", "default"): Tiles(bm=128, bk=64, bn=128, stages=4),
    ("sm100", "fwd", "few_rows"): Tiles(bm=64, bk=64, bn=128, stages=4),
    ("sm100", "fwd", "two_acc"): Tiles(bm=128, bk=64, bn=64, stages=4),
    ("sm100", "dgrad", "default"): Tiles(bm=128, bk=64, bn=128, stages=4),
    ("sm100", "dgrad", "few_rows"): Tiles(bm=64, bk=64, bn=128, stages=4),
}
# Kernel generations: "sm90" (Hopper, wgmma: kernels.py) and "sm100"
# (Blackwell, tcgen05: kernels_sm100.py), by compute capability
# (`moe_core.kernels.gpu`). Blackwell Ultra (sm_103) has tcgen05 too: a
# B300 target gets the sm100 kernels (the backend supports only the
# capabilities it is tested on: backend.SUPPORTED_CAPABILITIES).
GENERATIONS = {90: "sm90", 100: "sm100", 103: "sm100"}


def bucket(m: int, num_groups: int, num_accs: int) -> str:
  if num_accs > 1:
    return "two_acc"
  if m < 128 * max(num_groups, 1):
    return "few_rows"
  return "default"


def generation(device=None) -> str | None:
  """ "sm90" or "sm100" for a GPU `device`; by default the target's.

  Without a device: the GPU the program is lowered for (`gpu.probe`: the
  AOT target's abstract GPU, else the first local device). None for a GPU
  of another compute capability; "sm90" off a GPU (what the interpreter
  and a CPU-host export run unless told otherwise).
  """
  info = gpu.probe(device)
  return "sm90" if info is None else GENERATIONS.get(info.capability)


def num_sms(device=None) -> int:
  """SMs of the target GPU (or `device`, or the local one), else an H100's."""
  info = gpu.probe(device)
  return info.sm_count if info and info.sm_count else DEFAULT_NUM_SMS


def padded(dim: int, block: int) -> int:
  return math.ceil(dim / block) * block


def check_generation(name) -> str:
  if name not in GENERATIONS.values():
    raise ValueError(
        f"generation must be one of {sorted(set(GENERATIONS.values()))}, got "
        f"{name!r}."
    )
  return name


def heuristic(kind: str, m: int, num_groups: int, num_accs: int) -> Tiles:
  """Tiles for a shape the table does not hold (another generation)."""
  del kind
  bm = 64 if m < 128 * max(num_groups, 1) else 128
  return Tiles(bm=bm, bk=64, bn=64 if num_accs > 1 else 128, stages=4)


def fit(
    tiles: Tiles,
    dtype,
    num_lhs: int,
    num_rhs: int,
    num_accs: int,
    num_outputs: int,
) -> Tiles:
  """`tiles` narrowed until the accumulators and the buffers fit.

  Registers first (narrower bn, then shorter bm), then shared memory
  (fewer stages, then narrower bn).
  """
  while tiles.acc_regs_per_thread(num_accs) > ACC_REGS_PER_THREAD:
    if tiles.bn > COL_QUANTUM:
      tiles = dataclasses.replace(tiles, bn=tiles.bn - COL_QUANTUM)
    elif tiles.bm > ROW_QUANTUM:
      tiles = dataclasses.replace(tiles, bm=tiles.bm - ROW_QUANTUM)
    else:
      break
  while tiles.smem_bytes(dtype, num_lhs, num_rhs, num_outputs) > SMEM_BYTES:
    if tiles.stages > 2:
      tiles = dataclasses.replace(tiles, stages=tiles.stages - 1)
    elif tiles.bn > COL_QUANTUM:
      tiles = dataclasses.replace(tiles, bn=tiles.bn - COL_QUANTUM)
    else:
      break
  return tiles


def choose(
    config: TileConfig,
    kind: str,
    m: int,
    num_groups: int,
    dtype,
    *,
    num_lhs: int = 1,
    num_rhs: int = 1,
    num_accs: int = 1,
    num_outputs: int = 1,
    generation_name: str = "sm90",
) -> Tiles:
  """The tiles of one gmm call: the caller's, the table's or the heuristic's.

  A caller's tiles are used as given (an explicit choice; the kernels check
  nothing more); the table's and the heuristic's are fitted (`fit`).
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  given = getattr(config, kind)
  if given is not None:
    return given
  key = (generation_name, kind, bucket(m, num_groups, num_accs))
  tiles = TABLE.get(key) or heuristic(kind, m, num_groups, num_accs)
  return fit(tiles, dtype, num_lhs, num_rhs, num_accs, num_outputs)
