"""Fixed-width text tables for the benchmarks' printed results."""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence


class Column(NamedTuple):
  """One column: its header, width and how a value is formatted.

  `spec` is a format spec without the width (".3f", "d"; "" for text);
  `align` is "<" (text) or ">" (numbers).
  """

  header: str
  width: int
  spec: str = ""
  align: str = ">"


def heading(columns: Sequence[Column]) -> str:
  """The header line and a rule under it, as one string."""
  line = " ".join(f"{c.header:{c.align}{c.width}}" for c in columns)
  return f"{line}\n{'-' * len(line)}"


def row(columns: Sequence[Column], values: Sequence) -> str:
  """One line of `values`, one per column; None prints as "-"."""
  return " ".join(
      f"{'-':{c.align}{c.width}}"
      if v is None
      else f"{v:{c.align}{c.width}{c.spec}}"
      for c, v in zip(columns, values, strict=True)
  )


def print_table(
    columns: Sequence[Column],
    rows: Iterable,
    cells: Callable[..., Sequence],
    legend: str,
) -> None:
  """Prints the heading, a line a row (`cells(row)`: its values, one a
  column) and the legend under them."""
  print(heading(columns))
  for r in rows:
    print(row(columns, cells(r)).rstrip())
  print(legend)
