"""Block sizes and launch settings of the triton kernels: a table and a fit.

Over 400 lines because it is one job: the per-generation table, the
heuristic and the override rules read one another.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp

from moe_core.kernels import gpu
from moe_core.kernels import tile_settings

#     gmm (gated too) ("fwd", "dgrad", "gated")  [block_m, block_k] @
#                     [block_k, block_n] per step along the contracted width;
#                     one program per (tile-list entry, block_n columns).
#     tgmm            ("wgrad")  dW blocks [block_k, block_n]: each program
#                     steps through its group's rows block_m at a time.
#     permute kernels ("permute")  block_m rows (or tokens) x block_n columns;
#                     block_k is unused.
#
# `choose` takes the caller's `Config` for a kind when given (used as is),
# else the interpreter's tiny `INTERPRET` when interpreting, else the entry of
# `TABLE` for (GPU generation, kind, shape bucket), else `heuristic`; the last
# two are clamped to the problem and fitted to registers and shared memory.

KINDS = ("fwd", "dgrad", "wgrad", "gated", "permute")
# Config table rows by compute capability major (9.x Hopper, 10.x
# Blackwell).
GENERATIONS = {9: "sm90", 10: "sm100"}
# tl.dot's rule for blocks (tile_settings.TRITON_MIN_BLOCK); the permute
# kernels take the same blocks so that one rule covers every kind.
MIN_BLOCK = tile_settings.TRITON_MIN_BLOCK
MAX_BLOCK = 4096
MAX_STAGES = 8
# Shared memory one program may use on Hopper and datacenter Blackwell
# (sm_90, sm_100): 227 KiB. The fit keeps 4 KiB of it for what the estimate
# leaves out (mbarriers, the epilogue's layout conversion).
SMEM_BYTES = 227 * 1024
SMEM_FIT_BYTES = SMEM_BYTES - 4 * 1024
# A thread has 255 registers; the float32 accumulators of a program are
# spread over its 32 * num_warps threads for the whole loop. Operand
# fragments, addresses and masks need the rest: past about half, ptxas
# spills, which costs more than a smaller tile.
ACC_REGS_PER_THREAD = 128
# float32 operands multiply in IEEE float32 ("ieee", not TF32: the
# kernels match the reference), which Triton lowers to FMAs whose operand
# blocks sit in registers too: half the budget for the accumulators, a
# step of at most 32 along the contracted axis, and at most 4 warps
# (smaller tiles instead). (Fitted like bf16, a 128x128 tile compiled to 32
# registers and 17 KB of spills per thread; with 8 warps instead of 4,
# ptxas from triton 3.6 held the gated kernel to 128 registers and
# spilled.)
ACC_REGS_PER_THREAD_F32 = 64
MAX_BLOCK_K_F32 = 32
MAX_WARPS_F32 = 4
# The most warps the register fit raises a program to (two warpgroups, as
# in Triton's own Hopper matmul configurations).
MAX_FIT_WARPS = 8


def _pow2_ceil(value: int) -> int:
  return 1 << max(int(value) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Config:
  """Block sizes and Triton launch settings of one kernel call.

  Attributes:
    block_m: rows per tile. gmm: the tile list's granularity; tgmm: rows
      summed per step; permute: rows (or tokens) per program.
    block_n: output columns per program (tgmm: dW columns; permute: D).
    block_k: gmm: the step along the contracted width; tgmm: dW rows per
      program; permute: unused.
    num_warps: warps per program.
    num_stages: software-pipelining depth (shared-memory buffers per
      operand).
  """

  block_m: int
  block_n: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    tile_settings.check_triton_tiles(
        self,
        ("block_m", "block_n", "block_k"),
        max_block=MAX_BLOCK,
        max_stages=MAX_STAGES,
    )

  def acc_regs_per_thread(self, kind: str) -> int:
    """float32 accumulator registers per thread (0 for "permute")."""
    _check_kind(kind)
    if kind == "permute":
      return 0
    rows = self.block_k if kind == "wgrad" else self.block_m
    accumulators = 2 if kind == "gated" else 1
    threads = 32 * self.num_warps
    return -(-accumulators * rows * self.block_n // threads)

  def smem_bytes(self, kind: str, itemsize: int) -> int:
    """Estimated shared memory of the pipelined operand blocks.

    Args:
      kind: one of KINDS. "gated" loads one x block and two weight blocks
        per step; "wgrad" one [block_m, block_k] and one [block_m, block_n]
        block; "permute" pipelines nothing worth counting.
      itemsize: bytes per operand element.
    """
    _check_kind(kind)
    if kind == "permute":
      return 0
    if kind == "wgrad":
      per_stage = self.block_m * (self.block_k + self.block_n)
    else:
      weights = 2 if kind == "gated" else 1
      per_stage = self.block_k * (self.block_m + weights * self.block_n)
    return per_stage * itemsize * self.num_stages


@dataclasses.dataclass(frozen=True)
class Overrides(
    tile_settings.PerKernel, item=Config, item_name="configs.Config"
):
  """The caller's `Config` per kind; None leaves that kind to `choose`."""

  fwd: Config | None = None
  dgrad: Config | None = None
  wgrad: Config | None = None
  gated: Config | None = None
  permute: Config | None = None


def parse(override) -> Overrides | None:
  """The caller's `configs` option in one hashable form.

  Args:
    override: None (nothing overridden); a `Config` (every kind); an
      `Overrides`; a dict of `Config` fields (every kind); or a dict from
      kinds (KINDS) to a `Config`, a dict of its fields, or None
      (`PerKernel.parse`).

  Returns:
    None for None, else an `Overrides`.
  """
  return None if override is None else Overrides.parse(override, "configs")


# Tiny tiles for Triton's interpreter on the CPU: it pays per program and
# per loop step, but small blocks keep test shapes small while still
# straddling group boundaries and taking several steps along every axis.
INTERPRET = Config(
    block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1
)

# (generation, kind, bucket) -> Config, for bf16 operands (`choose` fits
# float32 ones). Buckets (`bucket`): "few_rows" when groups average under
# 128 rows (a shorter row tile wastes less at each group boundary; for
# wgrad, a short reduction), "many_rows" when they average 1024 or more and
# the output is at least 256 wide (wide tiles pay), else "default";
# "permute" has "default" and "wide" (D >= 2048). The GEMM entries follow
# the shapes Triton's Hopper matmul tutorial and vLLM's tuned fused-MoE
# tables use (128x128x64 or 128x256x64, 4-8 warps, 3-4 stages); they fit
# shared memory and registers with bf16 operands (compile_test checks it)
# but are not yet timed on a GPU. Blackwell (sm_100) has the same 227 KiB
# and 64K registers per block, so it starts from the same entries.
_HOPPER = {
    ("fwd", "few_rows"): Config(64, 128, 64, num_warps=4, num_stages=4),
    ("fwd", "default"): Config(128, 128, 64, num_warps=4, num_stages=4),
    ("fwd", "many_rows"): Config(128, 256, 64, num_warps=8, num_stages=3),
    ("dgrad", "few_rows"): Config(64, 128, 64, num_warps=4, num_stages=4),
    ("dgrad", "default"): Config(128, 128, 64, num_warps=4, num_stages=4),
    ("dgrad", "many_rows"): Config(128, 256, 64, num_warps=8, num_stages=3),
    # Two accumulators share each x block: half-width tiles or 8 warps.
    ("gated", "few_rows"): Config(64, 64, 64, num_warps=4, num_stages=4),
    ("gated", "default"): Config(128, 64, 64, num_warps=4, num_stages=4),
    ("gated", "many_rows"): Config(128, 128, 64, num_warps=8, num_stages=3),
    # dW blocks [block_k, block_n] = 128x128 (or 128x256), rows summed
    # block_m at a time.
    ("wgrad", "few_rows"): Config(32, 128, 128, num_warps=8, num_stages=3),
    ("wgrad", "default"): Config(64, 128, 128, num_warps=8, num_stages=3),
    ("wgrad", "many_rows"): Config(64, 256, 128, num_warps=8, num_stages=3),
    # Row gathers: 32 elements per thread. At 64, permute_bwd (a float32
    # sum over the K copies) took 127 registers and spilled on sm_100; at
    # 32 it takes 70, and more warps fit on an SM to hide memory latency.
    ("permute", "default"): Config(16, 256, 16, num_warps=4, num_stages=1),
    ("permute", "wide"): Config(16, 512, 16, num_warps=8, num_stages=1),
}
TABLE: dict[tuple[str, str, str], Config] = {
    (gen, kind, b): config
    for gen in ("sm90", "sm100")
    for (kind, b), config in _HOPPER.items()
}


def _check_kind(kind):
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}.")


def check_generation(name):
  """`name` if it is None or a generation of GENERATIONS, else ValueError."""
  if name is not None and name not in GENERATIONS.values():
    raise ValueError(
        f"generation must be None or one of {sorted(GENERATIONS.values())}, "
        f"got {name!r}."
    )
  return name


def generation(device=None) -> str | None:
  """ "sm90" or "sm100" for a GPU of compute capability 9.x or 10.x.

  Args:
    device: a jax device; default: the first one (`gpu.probe`'s reading).

  Returns:
    The generation, or None off a GPU and on other GPUs (their kernels use
    `heuristic`).
  """
  info = gpu.probe(device or jax.devices()[0])
  if info is None or info.capability is None:
    return None
  return GENERATIONS.get(info.capability // 10)


def bucket(kind: str, m: int, k: int, n: int, num_groups: int) -> str:
  """The shape bucket of TABLE for one kernel call (see TABLE)."""
  del k  # The contracted width sets no bucket: block_k is 64 everywhere.
  _check_kind(kind)
  if kind == "permute":
    return "wide" if n >= 2048 else "default"
  rows_per_group = m / max(num_groups, 1)
  if rows_per_group < 128:
    return "few_rows"
  if rows_per_group >= 1024 and n >= 256:
    return "many_rows"
  return "default"


def _itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def heuristic(
    kind: str, m: int, k: int, n: int, num_groups: int, dtype
) -> Config:
  """A starting Config for a call TABLE does not cover (another GPU).

  Args:
    kind: one of KINDS.
    m, k, n: the call's rows, contracted width and output width (wgrad: the
      rows summed, dW rows and dW columns; permute: rows and D, k unused).
    num_groups: E.
    dtype: the operands' dtype (4-byte operands get half the k step).

  Returns:
    A Config, before `clamp` and `fit` (which `choose` applies).
  """
  _check_kind(kind)
  if kind == "permute":
    return Config(
        16,
        min(256, _pow2_ceil(max(n, MIN_BLOCK))),
        MIN_BLOCK,
        num_warps=4,
        num_stages=1,
    )
  wide = _itemsize(dtype) >= 4
  if kind == "wgrad":
    return Config(
        32 if wide else 64, 128, 64 if wide else 128, num_warps=8, num_stages=3
    )
  few = m / max(num_groups, 1) < 128
  return Config(
      64 if few else 128,
      64 if kind == "gated" else 128,
      32 if wide else 64,
      num_warps=4,
      num_stages=3,
  )


def clamp(config: Config, kind: str, m: int, k: int, n: int) -> Config:
  """`config` with no block larger than its axis needs (a power of two).

  Fewer warps go with a clamped tile: below 32 accumulator elements per
  thread, more warps only add idle threads.
  """
  _check_kind(kind)

  def cap(block, dim):
    return min(block, max(MIN_BLOCK, _pow2_ceil(dim)))

  block_m = cap(config.block_m, m)
  block_n = cap(config.block_n, n)
  block_k = config.block_k if kind == "permute" else cap(config.block_k, k)
  tile = (block_k if kind == "wgrad" else block_m) * block_n
  num_warps = config.num_warps
  while num_warps > 1 and tile // (32 * num_warps) < 32:
    num_warps //= 2
  return dataclasses.replace(
      config,
      block_m=block_m,
      block_n=block_n,
      block_k=block_k,
      num_warps=num_warps,
  )


def fit(config: Config, kind: str, dtype) -> Config:
  """`config` within registers, then within shared memory.

  4-byte operands first get a contracted step of at most MAX_BLOCK_K_F32
  (block_k for gmm, block_m for tgmm), the smaller accumulator budget and
  at most MAX_WARPS_F32 warps. Registers: more warps (up to MAX_FIT_WARPS;
  bf16), then a narrower block_n, then fewer accumulator rows. Shared
  memory: fewer stages (down to 2), then a narrower block_n, then a shorter
  block_k.
  """
  _check_kind(kind)
  if kind == "permute":
    return config
  itemsize = _itemsize(dtype)
  budget, max_warps = ACC_REGS_PER_THREAD, MAX_FIT_WARPS
  if itemsize >= 4:
    budget, max_warps = ACC_REGS_PER_THREAD_F32, MAX_WARPS_F32
    config = dataclasses.replace(
        config, num_warps=min(config.num_warps, MAX_WARPS_F32)
    )
    step = "block_m" if kind == "wgrad" else "block_k"
    if getattr(config, step) > MAX_BLOCK_K_F32:
      config = dataclasses.replace(config, **{step: MAX_BLOCK_K_F32})
  rows = "block_k" if kind == "wgrad" else "block_m"
  config = tile_settings.fit_triton_registers(
      config,
      lambda c: c.acc_regs_per_thread(kind) > budget,
      max_warps=max_warps,
      halve=("block_n", rows),
  )
  return tile_settings.fit_triton_smem(
      config,
      lambda c: c.smem_bytes(kind, itemsize) > SMEM_FIT_BYTES,
      halve=("block_n", "block_k"),
  )


def choose(
    override,
    generation_name: str | None,
    kind: str,
    m: int,
    k: int,
    n: int,
    num_groups: int,
    dtype,
    *,
    interpret: bool = False,
) -> Config:
  """The Config of one kernel call.

  Args:
    override: the caller's configs (anything `parse` takes); a Config given
      for `kind` wins and is used exactly as given.
    generation_name: "sm90", "sm100" or None (another GPU: `heuristic`).
    kind: one of KINDS.
    m, k, n, num_groups, dtype: the call's shape, as for `heuristic`.
    interpret: the kernel runs in Triton's interpreter: `INTERPRET` unless
      overridden.

  Returns:
    The override's Config for `kind`; else INTERPRET when interpreting;
    else TABLE's entry (or the heuristic's), clamped to the shape and
    fitted to the GPU.
  """
  _check_kind(kind)
  check_generation(generation_name)
  overrides = parse(override)
  given = overrides.get(kind) if overrides is not None else None
  if given is not None:
    return given
  if interpret:
    return INTERPRET
  config = TABLE.get((generation_name, kind, bucket(kind, m, k, n, num_groups)))
  if config is None:
    config = heuristic(kind, m, k, n, num_groups, dtype)
  return fit(clamp(config, kind, m, k, n), kind, dtype)


def block_constexprs(kind: str, config: Config, kernel=None) -> dict:
  """The kernels' block-size constexprs for `config`.

  Args:
    kind: one of KINDS.
    config: the call's Config.
    kernel: optional; a @triton.jit kernel whose parameters filter the
      result (the permute kernels take BLOCK_R or BLOCK_T, not both).

  Returns:
    gmm kinds: BLOCK_M, BLOCK_N, BLOCK_K; "wgrad": BLOCK_M, BLOCK_P
    (= block_k), BLOCK_Q (= block_n); "permute": BLOCK_R and BLOCK_T
    (= block_m), BLOCK_D (= block_n).
  """
  _check_kind(kind)
  if kind == "wgrad":
    values = {
        "BLOCK_M": config.block_m,
        "BLOCK_P": config.block_k,
        "BLOCK_Q": config.block_n,
    }
  elif kind == "permute":
    values = {
        "BLOCK_R": config.block_m,
        "BLOCK_T": config.block_m,
        "BLOCK_D": config.block_n,
    }
  else:
    values = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
    }
  if kernel is not None:
    fn = getattr(kernel, "fn", kernel)
    names = set(inspect.signature(fn).parameters)
    values = {name: v for name, v in values.items() if name in names}
  return values
