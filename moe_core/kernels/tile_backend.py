"""The expert-FFN hooks of a backend built on a tile-list kernel module.

`pallas` and `mosaic_gpu` (and a new kernel backend written like them)
expose the same functions in their `ops` module, each taking the backend's
launch settings last:

    grouped_gemm(rows, weights, group_sizes, transpose_rhs, out_dtype, launch)
    gate_up(rows, w_gate, w_up, group_sizes, launch)
    gated_gate_up(rows, w_gate, w_up, group_sizes, activation, launch)
    EPILOGUE_ACTIVATIONS   the activations its fused epilogue computes

`TileOps` writes those functions from the module's `GroupedKernels` (whose
`fused_gmm` takes an epilogue; `LaunchKernels` when its launch settings
own the gmm and tgmm calls), and `TileKernelBackend` maps
`moe_core.Backend`'s hooks onto them, so such a backend writes its kernels,
its tile table, `availability()` and its options, not this glue again;
`parse_tile_config` reads its `tiles` option into its TileConfig, and
`check_int_field` (`check_triton_tiles` for a Triton launch's) checks the
fields of its Tiles.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Callable, ClassVar

import jax

from moe_core import backend
from moe_core import operands
from moe_core.kernels import expert_ops
from moe_core.kernels import grouped_matmul


@dataclasses.dataclass(frozen=True)
class LaunchKernels(grouped_matmul.GroupedKernels):
  """`GroupedKernels` whose fused kernels are the methods of `launch`.

  `launch` (frozen, hashable: the module's launch settings) has

      gmm(kind, lhs, rhs, group_sizes, *, products, transpose_rhs,
          num_outputs, out_dtype[, epilogue]) -> num_outputs arrays [M, N]
      tgmm(lhs, rhs, group_sizes, *, num_groups, out_dtype)
          -> one [E, C, N] per rhs

  with kind "fwd" (weights [E, C, N]) or "dgrad" (transposed), the key of
  the tiles it picks; lhs and rhs come as lists. `fused_gmm`'s `epilogue`
  (float32 accumulators -> outputs) fuses an activation.
  """

  launch: Any

  def fused_gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, **options):
    return self.launch.gmm(
        "dgrad" if transpose_rhs else "fwd",
        list(lhs),
        list(rhs),
        group_sizes,
        transpose_rhs=transpose_rhs,
        **options,
    )

  def fused_tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    return self.launch.tgmm(
        lhs, list(rhs), group_sizes, num_groups=num_groups, out_dtype=out_dtype
    )


@dataclasses.dataclass(frozen=True)
class TileOps:
  """An ops module's differentiable ops, each taking the launch settings last.

  An ops module binds its functions from one of these:
  `grouped_gemm, gate_up, gated_gate_up = TileOps(...).functions()`.

  Attributes:
    kernels: launch -> the module's `GroupedKernels` (a frozen dataclass);
      its `fused_gmm` also takes `epilogue`, for `gated_gate_up`.
    epilogue_activations: the activations that epilogue computes (the
      module's EPILOGUE_ACTIVATIONS).
  """

  kernels: Callable[[Any], grouped_matmul.GroupedKernels]
  epilogue_activations: tuple[str, ...]

  def functions(self) -> tuple[Callable, Callable, Callable]:
    """(grouped_gemm, gate_up, gated_gate_up), for the ops module."""
    return self.grouped_gemm, self.gate_up, self.gated_gate_up

  def grouped_gemm(
      self, rows, weights, group_sizes, transpose_rhs: bool, out_dtype, launch
  ):
    """rows [M, C] x weights [E, C, N] ([E, N, C] transposed) -> [M, N].

    Rows past sum(group_sizes) come out as zeros and get zero gradient;
    differentiable in both directions (`moe_core.kernels.grouped_matmul`).
    """
    return grouped_matmul.gmm(
        self.kernels(launch),
        rows,
        weights,
        group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
    )

  def gate_up(self, rows, w_gate, w_up, group_sizes, launch):
    """(rows @ w_gate[g], rows @ w_up[g]), each [M, F], in one pass over rows.

    dX is one kernel summing both products, dW one tgmm with two outputs.

    Args:
      rows: [M, D] sorted by group.
      w_gate, w_up: [E, D, F] of rows' dtype.
      group_sizes: [E] int32.
      launch: tiles and interpret mode.
    """
    return expert_ops.gate_up(
        self.kernels(launch), rows, w_gate, w_up, group_sizes
    )

  def gated_gate_up(
      self, rows, w_gate, w_up, group_sizes, activation: str, launch
  ):
    """act(rows @ w_gate[g]) * (rows @ w_up[g]): [M, D] -> [M, F], one pass.

    The activation runs on the float32 accumulators in the kernel's
    epilogue; only h is written. Under differentiation the kernel also
    writes gate and up, the residuals of the activation's derivative, and
    the tangent goes through `gate_up`'s kernels
    (`moe_core.kernels.expert_ops`).

    Args:
      rows, w_gate, w_up, group_sizes, launch: as for `gate_up`.
      activation: one of `epilogue_activations`.
    """
    expert_ops.check_epilogue_activation(activation, self.epilogue_activations)
    kernels = self.kernels(launch)
    return expert_ops.gated_gate_up(
        kernels,
        expert_ops.EpilogueGatedKernel(kernels),
        rows,
        w_gate,
        w_up,
        group_sizes,
        activation,
    )


class PerKernel:
  """Base of a frozen dataclass holding one optional setting per kernel
  kind: its fields are the kinds, each an `ITEM` or None (None leaves that
  kernel to the backend's heuristic). The backends' tile vocabularies
  (pallas' and mosaic_gpu's TileConfig, triton's Overrides) are these.
  """

  ITEM: ClassVar[type]
  ITEM_NAME: ClassVar[str]  # How errors name an ITEM.

  def __post_init__(self):
    for kind in self.kinds():
      value = getattr(self, kind)
      if value is not None and not isinstance(value, self.ITEM):
        raise TypeError(
            f"{type(self).__name__}.{kind} must be a {self.ITEM_NAME} or "
            f"None, got {type(value).__name__}."
        )

  @classmethod
  def kinds(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))

  def get(self, kind: str):
    """The setting of `kind` (one of `kinds()`), or None."""
    if kind not in self.kinds():
      raise ValueError(f"kind must be one of {self.kinds()}, got {kind!r}.")
    return getattr(self, kind)


# Triton's tl.dot needs every block dimension to be a power of two >= 16.
TRITON_MIN_BLOCK = 16
# A Triton program is one CUDA block: at most 1024 threads, 32 warps.
TRITON_MAX_WARPS = 32


def is_pow2(value) -> bool:
  """Whether `value` is an int (a bool is not) and a power of two."""
  return (
      isinstance(value, int)
      and not isinstance(value, bool)
      and value > 0
      and value & (value - 1) == 0
  )


def check_int_field(
    tiles, name: str, ok: Callable[[int], bool], expected: str
) -> None:
  """Raises ValueError unless field `name` of `tiles` is an int `ok` accepts.

  Args:
    tiles: a backend's tile settings (a dataclass); errors name its class.
    name: the field.
    ok: the field's rule, called only on ints (a bool is not one here).
    expected: what the field must be, in words ("32 or 64").
  """
  value = getattr(tiles, name)
  if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
    raise ValueError(
        f"{type(tiles).__name__}.{name} must be {expected}, got "
        f"{name}={value!r}."
    )


def check_triton_tiles(
    tiles, blocks: tuple[str, ...], *, max_block=None, max_stages=None
) -> None:
  """Checks the fields of one Triton launch's tiles (`check_int_field`).

  Args:
    tiles: the settings, with the fields `blocks`, num_warps (a power of two
      <= TRITON_MAX_WARPS) and num_stages (the pipelining depth, >= 1).
    blocks: the block-size fields: powers of two >= TRITON_MIN_BLOCK.
    max_block: the largest block, or None for no bound.
    max_stages: the largest num_stages, or None for no bound.
  """
  low = TRITON_MIN_BLOCK
  for name in blocks:
    check_int_field(
        tiles,
        name,
        lambda b: is_pow2(b)
        and low <= b
        and (max_block is None or b <= max_block),
        f"a power of two {_bounds(low, max_block)} (a Triton block)",
    )
  check_int_field(
      tiles,
      "num_warps",
      lambda w: is_pow2(w) and w <= TRITON_MAX_WARPS,
      f"a power of two <= {TRITON_MAX_WARPS}",
  )
  check_int_field(
      tiles,
      "num_stages",
      lambda s: 1 <= s and (max_stages is None or s <= max_stages),
      f"an int {_bounds(1, max_stages)}",
  )


def _bounds(low: int, high: int | None) -> str:
  return f">= {low}" if high is None else f"in [{low}, {high}]"


def fit_triton_registers(
    tiles, too_big: Callable[[Any], bool], *, max_warps: int, halve
):
  """`tiles` with more warps, then smaller blocks, until not `too_big`.

  The float32 accumulators are spread over a program's 32 * num_warps
  threads: doubling num_warps (up to `max_warps`) halves each thread's
  share. Past that, the first block field of `halve` is halved down to
  TRITON_MIN_BLOCK, then the next. Returns the last tiles when nothing is
  left to shrink.
  """
  return _shrink(
      tiles,
      too_big,
      (("num_warps", lambda w: 2 * w if w < max_warps else None),)
      + _halvings(halve),
  )


def fit_triton_smem(tiles, too_big: Callable[[Any], bool], *, halve):
  """`tiles` with fewer stages, then smaller blocks, until not `too_big`.

  Each stage holds one buffer per operand block in shared memory: stages go
  down to 2 (pipelining needs two), then `halve` is halved as in
  `fit_triton_registers`.
  """
  return _shrink(
      tiles,
      too_big,
      (("num_stages", lambda s: s - 1 if s > 2 else None),) + _halvings(halve),
  )


def _halvings(fields) -> tuple:
  low = TRITON_MIN_BLOCK
  return tuple((f, lambda b: b // 2 if b > low else None) for f in fields)


def _shrink(tiles, too_big, steps):
  """`tiles` changed by its first applicable step while `too_big`.

  Each step is (field, change): change maps the field's value to the next,
  smaller setting, or None when the field can go no further.
  """
  while too_big(tiles):
    for field, change in steps:
      value = change(getattr(tiles, field))
      if value is not None:
        tiles = dataclasses.replace(tiles, **{field: value})
        break
    else:
      break
  return tiles


def parse_tile_config(config_cls: type, tiles_cls: type, kinds, tiles):
  """A `config_cls` (one `tiles_cls` or None per kernel kind) from `tiles`.

  Args:
    config_cls: the backend's TileConfig, a dataclass with one field per
      kind.
    tiles_cls: its Tiles, the dataclass of one kernel's tiles.
    kinds: the kernel kinds, `config_cls`' fields.
    tiles: None (no kind set), a `tiles_cls` (every kind), a `config_cls`
      (as it is) or the dict form of either (the JSON form, e.g. from a
      Bazel target's backend options): `tiles_cls` fields ({"bm": 16, ...},
      every kind) or per-kind dicts ({"fwd": {...}, ...}).
  """
  if tiles is None:
    return config_cls()
  if isinstance(tiles, config_cls):
    return tiles
  if isinstance(tiles, tiles_cls):
    return config_cls(**{kind: tiles for kind in kinds})
  if isinstance(tiles, dict):
    if set(tiles) <= set(kinds):
      return config_cls(
          **{k: None if v is None else tiles_cls(**v) for k, v in tiles.items()}
      )
    fields = {f.name for f in dataclasses.fields(tiles_cls)}
    if set(tiles) <= fields:
      return parse_tile_config(config_cls, tiles_cls, kinds, tiles_cls(**tiles))
    raise ValueError(
        f"tiles dict must have keys from {sorted(fields)} or "
        f"from {list(kinds)}, got {sorted(tiles)}."
    )
  raise TypeError(
      "tiles must be None, a Tiles, a TileConfig or a dict, "
      f"got {type(tiles).__name__}."
  )


class TileKernelBackend(backend.Backend):
  """`Backend` whose grouped GEMM and expert-FFN hooks are `ops`' kernels.

  Subclasses set `ops` (the module) and, in __init__, `self.launch` (what
  every ops function takes last, with `tiles`, `interpret`: the option's
  setting, `moe_core.kernels.interpret`, and `kernel_interpret`: that
  setting for the program traced now, auto resolved) and
  `self.fuse_activation` (bool: act(gate) * up in the gate/up kernel's
  epilogue, for `ops.EPILOGUE_ACTIVATIONS`; `check_fuse_activation` first;
  the option's default is False in every such backend: the epilogue is
  opt-in until a GPU measurement shows it faster).
  """

  ops: ClassVar[ModuleType]
  launch: Any
  fuse_activation: bool

  @staticmethod
  def check_fuse_activation(fuse_activation) -> None:
    """Raises TypeError unless the `fuse_activation` option is a bool."""
    if not isinstance(fuse_activation, bool):
      raise TypeError(
          "fuse_activation must be a bool, got "
          f"{type(fuse_activation).__name__}."
      )

  @property
  def interpret(self):
    """False (compiled) or the interpreter's setting, for the program
    traced now: auto (None) resolved (`moe_core.kernels.interpret`)."""
    return self.launch.kernel_interpret

  def _repr_options(self) -> dict[str, str]:
    """The options `repr` shows: name -> the text of its value."""
    return {
        # As given: None for auto.
        "interpret": repr(self.launch.interpret),
        "tiles": repr(self.launch.tiles),
        "fuse_activation": str(self.fuse_activation),
    }

  def __repr__(self) -> str:
    options = ", ".join(f"{k}={v}" for k, v in self._repr_options().items())
    return f"{type(self).__name__}({options})"

  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    return self.ops.grouped_gemm(
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
        gemm.transpose_rhs,
        gemm.out_dtype,
        self.launch,
    )

  def _gate_up(
      self, ffn_in: operands.FfnOperands
  ) -> tuple[jax.Array, jax.Array]:
    """Gate and up in one kernel pass over the rows: two [M, F] outputs."""
    return self.ops.gate_up(*_gate_up_operands(ffn_in), self.launch)

  def _fuses_activation(self, activation: str) -> bool:
    return self.fuse_activation and activation in self.ops.EPILOGUE_ACTIVATIONS

  def _gated_gate_up(self, ffn_in: operands.FfnOperands) -> jax.Array:
    """act(gate) * up in the gate/up kernel's epilogue: one [M, F] output."""
    return self.ops.gated_gate_up(
        *_gate_up_operands(ffn_in), ffn_in.activation, self.launch
    )


def _gate_up_operands(ffn_in: operands.FfnOperands) -> tuple[jax.Array, ...]:
  """(rows, w_gate, w_up, group_sizes): the gate/up kernels' operands."""
  return ffn_in.rows, ffn_in.w_gate, ffn_in.w_up, ffn_in.group_sizes
