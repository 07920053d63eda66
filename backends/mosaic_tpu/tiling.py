"""Tiles of the mosaic_tpu kernels as data: one table per TPU generation.

A `Tiles` is one kernel launch's block sizes; `TileConfig` the caller's
choice per kernel kind (fwd, dgrad, wgrad); `Generation` a TPU's VMEM and
MXU; `TABLE` the tiles each generation starts from, and `choose` fits them
to one call's shape and to the generation's VMEM. The v5e rows were picked
by a sweep on the chip (bench/on_device/tpu_check.py --phases=sweep,
committed under bench/results/); the other generations start from their
published VMEM and MXU figures and are marked as not measured.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_core.kernels import gpu
from moe_core.kernels import tile_settings

KINDS = ("fwd", "dgrad", "wgrad")
# A TPU vector register is 8 sublanes x 128 lanes; Mosaic needs the last
# two dimensions of every block to be multiples of (8, 128), or the whole
# dimension. Every block here is a multiple of 128 on both (bf16 packs two
# rows per sublane, so its row blocks need 16; 128 covers both).
LANE = 128
_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Generation:
  """One TPU generation, as the kernels see it.

  Attributes:
    name: "v5e", "v5p", "v6e" or "tpu7x".
    vmem_bytes: VMEM per TensorCore.
    mxu: the MXU's width (128 on v5e/v5p, 256 on v6e/tpu7x).
    peak_bf16_flops: the chip's bf16 peak, FLOP/s (for reports).
    measured: whether this generation's table was swept on the chip.
  """

  name: str
  vmem_bytes: int
  mxu: int
  peak_bf16_flops: float
  measured: bool

  @property
  def vmem_limit_bytes(self) -> int:
    """The scoped VMEM a kernel asks Mosaic for: most of the VMEM, with room
    for Mosaic's own internal scratch (the default scoped limit, 16-32 MiB,
    is what makes megablox's favourite tiles fail to compile)."""
    return self.vmem_bytes - 16 * _MIB

  @property
  def tile_budget_bytes(self) -> int:
    """What `choose` lets one launch's blocks, buffers and temporaries take:
    `vmem_limit_bytes` less a margin for Mosaic's relayouts."""
    return int(self.vmem_limit_bytes * 0.8)


# Published figures (jax/_src/tpu_info.py, Google's pages); v5e measured.
GENERATIONS = {
    g.name: g
    for g in (
        Generation("v5e", 128 * _MIB, 128, 197e12, measured=True),
        Generation("v5p", 64 * _MIB, 128, 459e12, measured=False),
        Generation("v6e", 128 * _MIB, 256, 918e12, measured=False),
        Generation("tpu7x", 64 * _MIB, 256, 2307e12, measured=False),
    )
}
DEFAULT_GENERATION = "v5e"
# device_kind fragments -> generation, longest first ("TPU v5 lite" is a
# v5e; "TPU v5" alone a v5p; "TPU7x" a tpu7x).
_KINDS = (
    ("v5 lite", "v5e"),
    ("v5litepod", "v5e"),
    ("v5e", "v5e"),
    ("v5p", "v5p"),
    ("v6 lite", "v6e"),
    ("v6e", "v6e"),
    ("7x", "tpu7x"),
    ("v5", "v5p"),
)


def generation_of_kind(device_kind: str) -> str | None:
  """The generation of a TPU `device_kind`, or None for another device."""
  kind = device_kind.lower()
  if "tpu" not in kind:
    return None
  for fragment, name in _KINDS:
    if fragment in kind:
      return name
  return None


def lowering_tpu_kind() -> str | None:
  """The device_kind of the TPU being lowered for, None off a TPU.

  The abstract mesh's device where one is set (`moe_core.aot` lowers for a
  topology whose chips need not be here), else the first local device.
  """
  device = gpu.lowering_device()
  if getattr(device, "platform", None) != "tpu":
    device = jax.devices()[0]
  if getattr(device, "platform", None) != "tpu":
    return None
  return getattr(device, "device_kind", "") or ""


def unknown_tpu(kind: str | None) -> str | None:
  """Why the kernels cannot be compiled for a TPU of `kind`, or None (a
  known generation, or not a TPU)."""
  if kind is None or generation_of_kind(kind) is not None:
    return None
  # Another generation's tiles would not fit (a v4 has 16 MiB of VMEM)
  # or not compile (v2 and v3 lack the kernels' matmul types).
  return (
      "mosaic_tpu: the TPU lowered for must be of a generation its tile "
      f"table has ({', '.join(GENERATIONS)}), got device_kind {kind!r}; "
      "backend 'xla' runs there."
  )


def generation(*, compiled: bool = True) -> str:
  """The generation of the TPU being lowered for (`lowering_tpu_kind`).

  `DEFAULT_GENERATION` off a TPU (interpreted kernels), and for a TPU the
  table does not know (v2, v3, v4) when not `compiled`: the interpreter
  has no VMEM to fit.

  Raises:
    NotImplementedError: `compiled`, for a TPU the table does not know.
  """
  kind = lowering_tpu_kind()
  problem = unknown_tpu(kind)
  if problem and compiled:
    raise NotImplementedError(problem)
  return generation_of_kind(kind or "") or DEFAULT_GENERATION


def check_generation(name) -> None:
  if name not in GENERATIONS:
    raise ValueError(
        f"generation must be one of {sorted(GENERATIONS)}, got {name!r}."
    )


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Block sizes of one kernel launch.

  Attributes:
    bm: rows per tile: gmm's tile list granularity; tgmm's step over a
      group's rows. A multiple of 128.
    bk: gmm: the contracted width per step, None for the whole width (one
      step: a tile's rows and a group's weight block then stay in VMEM
      across consecutive visits, read from HBM once). tgmm: dW rows per
      program (the lhs columns). A multiple of 128, or None.
    bn: output columns per program. A multiple of 128.
    chunk: rows per MXU pass inside a tile; a visit computes only the
      chunks that hold rows of its group, so a tile shared by several small
      groups costs about one tile, not one per group. A multiple of 128
      dividing bm; None for bm (the whole tile at once).
  """

  bm: int = 512
  bk: int | None = None
  bn: int = 1024
  chunk: int | None = None

  def __post_init__(self):
    multiple = lambda v: v >= LANE and v % LANE == 0
    words = f"a positive multiple of {LANE}"
    tile_settings.check_int_field(self, "bm", multiple, words)
    tile_settings.check_int_field(self, "bn", multiple, words)
    if self.bk is not None:
      tile_settings.check_int_field(self, "bk", multiple, words + " or None")
    if self.chunk is not None:
      tile_settings.check_int_field(
          self,
          "chunk",
          lambda c: multiple(c) and self.bm % c == 0,
          f"{words} dividing bm={self.bm}, or None",
      )

  @property
  def rows_per_pass(self) -> int:
    return self.chunk or self.bm


@dataclasses.dataclass(frozen=True)
class TileConfig(tile_settings.PerKernel, item=Tiles):
  """The caller's tiles per kernel kind; None leaves a kind to the table."""

  fwd: Tiles | None = None
  dgrad: Tiles | None = None
  wgrad: Tiles | None = None


@dataclasses.dataclass(frozen=True)
class Call:
  """One kernel call's shape, what the tiles are fitted to.

  Attributes:
    kind: "fwd"/"dgrad" (gmm: [m, k] x [E, k, n]) or "wgrad" (tgmm: [m, k]
      x [m, n] -> [E, k, n]).
    m, k, n: as above.
    num_groups: E.
    itemsize: bytes per operand element.
    out_itemsize: bytes per output element.
    num_lhs, num_rhs: operands per step (2 rhs for the fused gate/up).
    num_accs: float32 accumulators.
    num_outputs: outputs written (3 for the fused gate/up with residuals).
  """

  kind: str
  m: int
  k: int
  n: int
  num_groups: int
  itemsize: int
  out_itemsize: int
  num_lhs: int = 1
  num_rhs: int = 1
  num_accs: int = 1
  num_outputs: int = 1


def vmem_bytes(tiles: Tiles, call: Call) -> int:
  """What one launch of `tiles` keeps in VMEM: double-buffered operand and
  output blocks, the float32 accumulators and the products' temporaries."""
  bm, bn = tiles.bm, min(tiles.bn, _round_up(call.n, LANE))
  acc = 4
  if call.kind == "wgrad":
    ba = min(tiles.bk or call.k, _round_up(call.k, LANE))
    operands = (bm * ba + call.num_rhs * bm * bn) * call.itemsize
    outputs = call.num_rhs * ba * bn * call.out_itemsize
    scratch = call.num_rhs * ba * bn * acc
    # The masked operands and the product of one step.
    temporaries = (bm * ba + call.num_rhs * bm * bn) * call.itemsize
    temporaries += ba * bn * acc
    return 2 * operands + 2 * outputs + scratch + temporaries
  bk = call.k if tiles.bk is None else min(tiles.bk, call.k)
  operands = (call.num_lhs * bm * bk + call.num_rhs * bk * bn) * call.itemsize
  outputs = call.num_outputs * bm * bn * call.out_itemsize
  scratch = call.num_accs * bm * bn * acc if bk < call.k else 0
  # Each product's float32 result and the epilogue's values.
  temporaries = (call.num_accs + call.num_outputs) * bm * bn * acc
  return 2 * operands + 2 * outputs + scratch + temporaries


def _round_up(x: int, b: int) -> int:
  return -(-x // b) * b


def _row_block(m: int, want: int) -> int:
  """bm for m rows: `want`, or less (a multiple of 128, at least 128) when
  m is small, so that few rows are not padded to a large tile."""
  return max(LANE, min(want, _round_up(m, LANE)))


def _col_block(n: int, want: int | None) -> int:
  """bn (or a tgmm's bk) for n columns: the whole width (rounded up to 128;
  128 for n = 0, whose call launches nothing) when `want` is None or the
  whole width fits in it, else the largest multiple of 128 up to `want`
  that divides n (no padding), else `want`."""
  whole = max(LANE, _round_up(n, LANE))
  if want is None or whole <= want:
    return whole
  for block in range(want, LANE - 1, -LANE):
    if n % block == 0:
      return block
  return want


def _table_row(wgrad_bk: int) -> dict[str, Tiles]:
  """One generation's tiles: v5e's gmm tiles for fwd and dgrad, a
  wgrad_bk x 1024 dW block for wgrad."""
  gmm = Tiles(bm=512, bk=None, bn=1024, chunk=256)
  return {
      "fwd": gmm,
      "dgrad": gmm,
      "wgrad": Tiles(bm=512, bk=wgrad_bk, bn=1024, chunk=256),
  }


# The tiles each generation starts from, per kind. v5e's are the sweep's
# winners on a v5e (bench/results/tpu_sweep_v5e.json: Mixtral, DeepSeek-V3
# EP slice, Qwen3-30B and OLMoE shapes, even and Zipf routing): gmm takes
# the whole K (bk=None: each group's weights cross HBM once per column
# block) in 256-row chunks (at Zipf routing 1.1-1.3x the unchunked tile,
# even routing the same), tgmm a 2048 x 1024 dW block. v5p, v6e and tpu7x
# are not measured: v6e (VMEM as v5e's) starts from v5e's rows, v5p and
# tpu7x (half the VMEM) from a 1024-row dW block; `fit` shrinks any row to
# the VMEM budget.
TABLE: dict[str, dict[str, Tiles]] = {
    "v5e": _table_row(wgrad_bk=2048),
    "v5p": _table_row(wgrad_bk=1024),
    "v6e": _table_row(wgrad_bk=2048),
    "tpu7x": _table_row(wgrad_bk=1024),
}


def fit(tiles: Tiles, call: Call, gen: Generation) -> Tiles:
  """`tiles` fitted to `call`: blocks no larger than the shape needs, then
  smaller until the launch fits the generation's VMEM budget (bn halved to
  512, then the whole K split into steps, then bn and bm halved)."""
  bm = _row_block(call.m, tiles.bm)
  bn = _col_block(call.n, tiles.bn)
  if call.kind == "wgrad":
    bk = _col_block(call.k, tiles.bk)
  else:
    bk = None if tiles.bk is None or tiles.bk >= call.k else tiles.bk
  chunk = tiles.chunk if tiles.chunk and bm % tiles.chunk == 0 else None
  fitted = Tiles(bm=bm, bk=bk, bn=bn, chunk=chunk)
  budget = gen.tile_budget_bytes
  while vmem_bytes(fitted, call) > budget:
    # Narrower columns first, down to 512 (still past v5e's ridge point:
    # 512 x 512 / (512 + 512) = 256 FLOP per byte), so the whole K stays one
    # step and a group's weights are read once per column block; then K in
    # steps; then narrower still; then fewer rows.
    if fitted.bn > 512:
      fitted = dataclasses.replace(fitted, bn=fitted.bn // 2)
    elif call.kind != "wgrad" and fitted.bk is None and call.k > 2048:
      fitted = dataclasses.replace(fitted, bk=_col_block(call.k, 2048))
    elif fitted.bn > 256:
      fitted = dataclasses.replace(fitted, bn=fitted.bn // 2)
    elif call.kind == "wgrad" and fitted.bk > 256:
      fitted = dataclasses.replace(fitted, bk=fitted.bk // 2)
    elif fitted.bm > 256:
      bm = fitted.bm // 2
      chunk = fitted.chunk if fitted.chunk and bm % fitted.chunk == 0 else None
      fitted = dataclasses.replace(fitted, bm=bm, chunk=chunk)
    else:
      break
  return fitted


# The multiply-adds one gmm grid step should do: the table's row at K =
# 2048 (512 x 2048 x 1024). A step costs a fixed ~0.35 us besides its work;
# at a thin K (a narrow expert's down projection, the dX of its gate/up)
# 1024 columns leave the step a few microseconds of work, and columns as
# wide as N do better: tokamax's v5e entry [262144, 256] x [256, 256, 7168]
# ran at 88 TF/s with 512 x 1024 tiles and 115 with 128 x 7168.
STEP_MACS = 512 * 2048 * 1024
# The chunk of a widened row: with wide columns a chunk's pass is long, and
# what a visit computes past its group's rows (half a chunk at each group
# boundary, on average) costs more than the extra passes of a finer chunk.
# On a v5e (bench/results/tokamax_compare_v5e_20261207_finer_rows.json) the
# widened rows ran 1.03-1.06x faster at 128-row chunks than at 256 on the
# three tokamax entries they apply to; unwidened rows (the Mixtral layer,
# the training step) were neutral, and keep the table's chunk.
WIDENED_CHUNK = LANE


def widened(tiles: Tiles, call: Call) -> Tiles:
  """A gmm table row with bn widened, where the whole K is one step and a
  step of bm x K x bn would do fewer than STEP_MACS multiply-adds, to the
  columns that reach it (the whole N when that is fewer), in chunks of
  WIDENED_CHUNK rows; `fit` then sizes it to the shape and the VMEM.
  wgrad's tiles, and K in steps, as given."""
  if call.kind == "wgrad" or tiles.bk is not None or call.k <= 0:
    return tiles
  want = _round_up(-(-STEP_MACS // (tiles.bm * call.k)), LANE)
  if want <= tiles.bn:
    return tiles
  # WIDENED_CHUNK (one LANE) divides every bm; an unchunked row stays so.
  chunk = None if tiles.chunk is None else min(tiles.chunk, WIDENED_CHUNK)
  return dataclasses.replace(tiles, bn=want, chunk=chunk)


def choose(
    config: TileConfig, call: Call, generation_name: str | None = None
) -> Tiles:
  """The tiles of one kernel call: the caller's for its kind where given
  (fitted to the shape only), else the generation's table row (`widened`
  at a thin K), fitted to the shape and the VMEM budget."""
  gen = GENERATIONS[generation_name or generation()]
  given = config.get(call.kind)
  if given is not None:
    return fit(given, call, dataclasses.replace(gen, vmem_bytes=2**62))
  return fit(widened(TABLE[gen.name][call.kind], call), call, gen)


def candidates(
    kind: str, m: int, k: int, n: int, num_groups: int, dtype=jnp.bfloat16
) -> tuple[Tiles, ...]:
  """The tiles a sweep tries for one call (bench/on_device/tpu_check.py
  --phases=sweep): the v5e table's row first, then its neighbours (whole tile or
  128-row chunks, narrower and wider blocks, K in steps), each fitted to
  the call and the v5e's VMEM, without repeats."""
  if kind == "wgrad":
    shapes = (
        (512, 2048, 1024, 256),
        (512, 1024, 1024, 256),
        (512, 2048, 1024, None),
        (512, 2048, 1024, 128),
        (1024, 2048, 1024, 256),
        (256, 2048, 1024, 128),
        (512, 1024, 2048, 256),
    )
  else:
    shapes = (
        (512, None, 1024, 256),
        (512, None, 1024, None),
        (512, None, 1024, 128),
        (256, None, 1024, 128),
        (1024, None, 1024, 256),
        (512, None, 2048, 256),
        (512, None, 512, 128),
        (512, 2048, 1024, 256),
    )
  itemsize = jnp.dtype(dtype).itemsize
  call = Call(kind, m, k, n, num_groups, itemsize, itemsize)
  found = []
  for bm, bk, bn, chunk in shapes:
    tiles = fit(Tiles(bm, bk, bn, chunk), call, GENERATIONS["v5e"])
    if tiles not in found:
      found.append(tiles)
  return tuple(found)
