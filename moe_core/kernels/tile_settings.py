"""A kernel backend's tile settings: one per kernel kind, checked and fitted.

A tile-list backend (pallas, mosaic_gpu, triton) describes one kernel
launch by a frozen dataclass of block sizes and launch options (its Tiles
or Config), and the caller's choice per kernel kind by a `PerKernel`
(`PerKernel.parse` reads the backend's option into it). The helpers here
check those fields (`check_int_field`; `check_triton_tiles` for a Triton
launch's) and shrink tiles until they fit a GPU program's registers and
shared memory (`fit_triton_registers`, `fit_triton_smem`); each backend
keeps its own table, heuristic and limits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar


class PerKernel:
  """Base of a frozen dataclass holding one optional setting per kernel
  kind: its fields are the kinds, each an `ITEM` or None (None leaves that
  kernel to the backend's heuristic). The backends' tile vocabularies
  (pallas' and mosaic_gpu's TileConfig, triton's Overrides) are these; a
  subclass names its ITEM (a dataclass) as a class keyword:

      @dataclasses.dataclass(frozen=True)
      class TileConfig(tile_settings.PerKernel, item=Tiles):
        fwd: Tiles | None = None
        dgrad: Tiles | None = None

  and `item_name`, how errors name an ITEM, where its class name alone
  would not do.
  """

  ITEM: ClassVar[type]
  ITEM_NAME: ClassVar[str]

  def __init_subclass__(cls, item=None, item_name=None, **kwargs):
    super().__init_subclass__(**kwargs)
    if item is not None:
      cls.ITEM = item
      cls.ITEM_NAME = item_name or item.__name__

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

  @classmethod
  def parse(cls, value, option: str = "tiles"):
    """One of these from the value of a backend's option.

    Args:
      value: None (no kind set); an ITEM (every kind); one of these (as it
        is); or the JSON form (e.g. from a Bazel target's backend options):
        a dict of ITEM's fields (every kind), or a dict from kinds to an
        ITEM, a dict of its fields, or None. An empty dict, which could be
        either, is refused.
      option: the option's name, for errors.
    """
    if value is None:
      return cls()
    if isinstance(value, cls):
      return value
    if isinstance(value, cls.ITEM):
      return cls(**dict.fromkeys(cls.kinds(), value))
    if not isinstance(value, dict):
      raise TypeError(
          f"{option} must be None, a dict, {cls.ITEM_NAME} or "
          f"{cls.__name__}, got {type(value).__name__}."
      )
    keys = set(value)
    fields = [f.name for f in dataclasses.fields(cls.ITEM)]
    if keys and keys <= set(cls.kinds()):
      return cls(
          **{
              kind: None if v is None else cls._item(v, f"{option}[{kind!r}]")
              for kind, v in value.items()
          }
      )
    if keys and keys <= set(fields):
      return cls.parse(cls._item(value, option), option)
    raise ValueError(
        f"{option} as a dict must map each of the kinds {list(cls.kinds())} "
        f"to a {cls.ITEM_NAME}, or hold the fields of one {cls.ITEM_NAME} "
        f"{fields}; got keys {sorted(map(str, keys))}."
    )

  @classmethod
  def _item(cls, value, where: str):
    """An ITEM from an ITEM or a dict of its fields; `where` names it."""
    if isinstance(value, cls.ITEM):
      return value
    if not isinstance(value, dict):
      raise TypeError(
          f"{where} must be a {cls.ITEM_NAME} or a dict of its fields, got "
          f"{type(value).__name__}."
      )
    fields = dataclasses.fields(cls.ITEM)
    required = [f.name for f in fields if _required(f)]
    optional = [f.name for f in fields if not _required(f)]
    given = sorted(map(str, value))
    unknown = sorted(set(given) - set(required) - set(optional))
    missing = [f for f in required if f not in value]
    if unknown or missing:
      keys = (
          f"the keys {required} and optionally {', '.join(optional)}"
          if required
          else f"only the keys {optional}"
      )
      raise ValueError(
          f"{where} must have {keys}; got {given}"
          + (f" (unknown: {unknown})" if unknown else "")
          + (f" (missing: {missing})" if missing else "")
          + "."
      )
    return cls.ITEM(**value)


def _required(field: dataclasses.Field) -> bool:
  return (
      field.default is dataclasses.MISSING
      and field.default_factory is dataclasses.MISSING
  )


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
