"""The tile table of the example kernel backend: block sizes per shape."""

from __future__ import annotations

import dataclasses

# Triton's dot needs blocks of at least 16 on each side.
_MIN_BLOCK = 16


def _next_power_of_2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


def _clip(block: int, dim: int) -> int:
  """`block`, or less for a small dim: the least power of two >= dim (16 at
  least), so a small operand is one block padded a little, not a lot."""
  return min(block, max(_MIN_BLOCK, _next_power_of_2(dim)))


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Block sizes of one kernel call, each a power of two >= 16.

  bm: rows per tile (gmm's row tiles, tgmm's row steps).
  bc: the contracted width per step (gmm); tgmm's lhs columns per tile.
  bn: output columns per tile.
  """

  bm: int
  bc: int
  bn: int


@dataclasses.dataclass(frozen=True)
class TileTable:
  """The largest blocks to use; `choose` clips them to a call's shape.

  Powers of two >= 16 (the Triton lowering's rule; the interpreter takes
  any). Hashable: the kernels, and so these, are a static part of jit's
  cache key.
  """

  bm: int = 64
  bc: int = 64
  bn: int = 64

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value < _MIN_BLOCK or value != _next_power_of_2(value):
        raise ValueError(
            f"{field.name} must be a power of two >= {_MIN_BLOCK}, got "
            f"{value}."
        )

  def choose(self, m: int, c: int, n: int) -> Tiles:
    """Tiles for rows [m, c] x weights [c, n] (tgmm: [m, c] x [m, n])."""
    return Tiles(
        bm=_clip(self.bm, m), bc=_clip(self.bc, c), bn=_clip(self.bn, n)
    )
