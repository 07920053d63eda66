"""Collective bytes and matmul FLOPs of one execution of a compiled module,
loops counted.

`moe_core.aot.collective_bytes` counts each collective instruction once (the
exchange of a scanned layer once, not once per layer); this module weights
each collective and matmul by how often it runs per execution of the module:
the product of the known trip counts of the while loops around it (XLA:GPU
records `known_trip_count` in a loop's backend_config; XLA:TPU does not,
and a loop whose condition is `counter < N` runs N times, as jax's scans
do; a loop without either counts once, and the results say how many
instructions sit in such loops).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

# The package's `compile` is the function: import the module's names.
from moe_core.aot.compile import COLLECTIVES
from moe_core.aot.compile import _SHAPE  # pylint: disable=protected-access
from moe_core.aot.compile import _shape_bytes  # pylint: disable=protected-access

# "%name = <type> op(operands), attributes": one instruction of HLO text.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$")
# The header of a computation: "%name (params) -> type {" or "ENTRY %name ...".
_COMPUTATION = re.compile(r"^(ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$")
# Computations an instruction calls, and how (a while's body is the loop).
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|"
    r"branch_computations|called_computations)=\{?(%[\w.\-]+(?:,\s*%[\w.\-]+)*)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPERAND = re.compile(r"%[\w.\-]+")


@dataclasses.dataclass(frozen=True)
class PerStep:
  """Collective bytes per execution of a module (per device).

  Attributes:
    bytes: collective op -> operand bytes, each instruction times the
      trip counts of the loops around it.
    unknown_loops: collective instructions inside a loop whose trip count
      XLA does not know (counted once per enclosing execution).
  """

  bytes: dict[str, int]
  unknown_loops: int


def per_step_collective_bytes(hlo_text: str) -> PerStep:
  """Operand bytes of each collective kind per execution of `hlo_text`, a
  compiled module's text (`Compiled.as_text()`).

  It counts what a device hands to each collective: the bytes of its
  operands (for an all-to-all the rows it sends, its own chunk included; for
  a ragged-all-to-all the smaller of its send and receive buffers: the exact
  side, where XLA sizes the other for the worst case). `unknown_loops` says
  how many collectives sit in loops without a known trip count.
  """
  types, executed = _executed_instructions(hlo_text)
  totals = collections.Counter()
  unknown_loops = 0
  for times, under_unknown_loop, _, rest in executed:
    op = _collective(rest)
    if op is None:
      continue
    totals[op] += times * _operand_bytes(rest, op, types)
    unknown_loops += under_unknown_loop
  return PerStep(dict(totals), unknown_loops)


def _executed_instructions(hlo_text: str):
  """(result types by instruction name, [(runs per execution, whether under
  a loop of unknown trip count, result type text, rest of line)] for every
  instruction of a computation that runs)."""
  computations, entry = _computations(hlo_text)
  types = {
      name: result
      for lines in computations.values()
      for name, result, _ in lines
  }
  runs, unknown = _runs_per_execution(computations, entry)
  executed = [
      (runs[comp], comp in unknown, result, rest)
      for comp, lines in computations.items()
      if runs.get(comp, 0)
      for _, result, rest in lines
  ]
  return types, executed


def _computations(hlo_text: str):
  """({computation: [(name, result type text, rest of line)]}, entry)."""
  computations: dict[str, list] = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and "=" not in line.split("(", 1)[0]:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    match = _INSTRUCTION.match(line)
    if match and current is not None:
      name, rhs = match.groups()
      op = re.search(r"\s([a-z][\w\-]*)\(", " " + rhs)
      result = rhs[: op.start()] if op else rhs
      computations[current].append((name, result, rhs))
  return computations, entry


def _runs_per_execution(computations, entry):
  """({computation: runs per execution of the entry}, {under an unknown loop}).

  HLO text defines each computation before its callers, so walking the
  computations backwards from the entry visits every caller before its
  callees.
  """
  runs = collections.Counter({entry: 1})
  unknown: set[str] = set()
  for comp in reversed(list(computations)):
    if not runs.get(comp):
      continue
    for _, _, rest in computations[comp]:
      trip = _TRIP_COUNT.search(rest)
      trips = (
          int(trip.group(1)) if trip else _inferred_trips(computations, rest)
      )
      for kind, names in _CALLEE.findall(rest):
        factor = 1
        if kind == "body":
          factor = trips or 1
        for callee in _OPERAND.findall(names):
          runs[callee] += runs[comp] * factor
          if comp in unknown or (kind == "body" and trips is None):
            unknown.add(callee)
  return runs, unknown


_CONDITION = re.compile(r"\bcondition=(%[\w.\-]+)")
_CONSTANT = re.compile(r"\bconstant\((\d+)\)")
_LESS_THAN = re.compile(
    r"\scompare\((%[\w.\-]+),\s*(%[\w.\-]+)\),\s*direction=LT\b"
)


def _inferred_trips(computations, rest: str) -> int | None:
  """A while loop's trip count from its condition, where XLA records none
  (XLA:TPU does not): `counter < N` with N a constant, the counter from 0
  (jax's scan and fori_loop)."""
  condition = _CONDITION.search(rest)
  if condition is None or condition.group(1) not in computations:
    return None
  lines = computations[condition.group(1)]
  constants = {}
  for name, _, line in lines:
    value = _CONSTANT.search(line)
    if value and re.search(r"\s?constant\(", line):
      constants[name] = int(value.group(1))
  compares = [_LESS_THAN.search(" " + line) for _, _, line in lines]
  compares = [c for c in compares if c]
  if len(compares) != 1 or compares[0].group(2) not in constants:
    return None
  return constants[compares[0].group(2)]


def _collective(rhs: str) -> str | None:
  """The collective op of an instruction (its "-start" half counts)."""
  for op in COLLECTIVES:
    if re.search(rf"\s{op}(-start)?\(", " " + rhs):
      return op
  return None


def _operand_bytes(rhs: str, op: str, types: dict[str, str]) -> int:
  """Bytes of the data operands of a collective (for a ragged-all-to-all,
  the smaller of its send and receive buffers)."""
  inside = re.split(rf"\s{op}(?:-start)?\(", " " + rhs, maxsplit=1)[1]
  operands = _OPERAND.findall(inside.split(")", 1)[0])
  sizes = [_shape_bytes(types.get(o, "")) for o in operands]
  if op == "ragged-all-to-all":
    # (input, output, offsets and sizes...): the rows that travel are as
    # many, over all devices, as the rows received. One of the two buffers
    # is exact (every token's rows: the dispatch's input, the combine's
    # output); XLA sizes the other for the worst case. The smaller is
    # the exact one.
    return min(sizes[:2])
  return sum(sizes)


# GEMM library calls XLA:GPU emits for dots, with the dot's dimension
# numbers in their backend_config.
GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_LHS_CONTRACTING_JSON = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_LHS_RAGGED = re.compile(r"lhs_ragged_dims=\{([0-9,]*)\}")


@dataclasses.dataclass(frozen=True)
class MatmulFlops:
  """Matmul FLOPs per execution of a module (per device).

  Attributes:
    flops: 2 x output elements x contracted size of each dot, ragged dot,
      GEMM call and convolution that is a dot (XLA:TPU's dots), times the
      trip counts of the loops around it.
    kernel_launches: custom-call target -> launches per execution, for the
      calls whose FLOPs this cannot see (Pallas, Mosaic GPU and TPU, Triton
      kernels; GEMM calls excluded).
    unknown_loops: matmuls inside a loop whose trip count XLA does not know
      (counted once per enclosing execution).
  """

  flops: float
  kernel_launches: dict[str, int]
  unknown_loops: int


def per_step_matmul_flops(hlo_text: str) -> MatmulFlops:
  """Matmul FLOPs of one execution of `hlo_text`, a compiled module's text
  (`Compiled.as_text()`), loops counted.

  It counts what XLA's cost analysis counts once per loop body, 2 x (output
  elements) x (contracted size) of every dot, ragged dot and cuBLAS GEMM
  call, times the runs of its computation. Custom kernels (Pallas, Mosaic
  GPU, Triton) are opaque to it: their launches per step are counted instead.
  """
  types, executed = _executed_instructions(hlo_text)
  flops = 0.0
  launches = collections.Counter()
  unknown_loops = 0
  for times, under_unknown_loop, result, rest in executed:
    found = _matmul_flops(result, rest, types)
    if found is None:
      call = _CUSTOM_CALL_TARGET.search(rest)
      if call and re.search(r"\scustom-call\(", " " + rest):
        launches[call.group(1)] += times
      continue
    flops += times * found
    unknown_loops += under_unknown_loop
  return MatmulFlops(flops, dict(launches), unknown_loops)


def _dims(shape_text: str) -> list[int] | None:
  """The dimensions of the first array shape in `shape_text`."""
  match = _SHAPE.search(shape_text)
  if match is None:
    return None
  return [int(d) for d in match.group(2).split(",") if d]


def _lhs_dims(rhs: str, op: str, types: dict[str, str]) -> list[int] | None:
  """The first operand's dimensions: its inline type ("dot(bf16[8,4]{1,0}
  %a, ...") or, without one, its definition's."""
  inside = re.split(rf"\s{re.escape(op)}\(", " " + rhs, maxsplit=1)[1]
  before_name, _, _ = inside.partition("%")
  if "[" in before_name:
    return _dims(before_name)
  name = _OPERAND.search(inside)
  return _dims(types.get(name.group(0), "")) if name else None


_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")


def _convolution_flops(result: str, rhs: str, types: dict[str, str]):
  """FLOPs of a convolution that is a dot, XLA:TPU's form of every dot:
  2 x output elements x the lhs's feature ("f") dimension. A batch of
  products is a spatial dimension whose window meets one element, so it
  adds no factor (a true convolution's window would: none is counted)."""
  labels = _DIM_LABELS.search(rhs)
  out = _dims(result)
  lhs = _lhs_dims(rhs, "convolution", types)
  if labels is None or out is None or lhs is None:
    return None
  contracted = math.prod(
      n for n, label in zip(lhs, labels.group(1)) if label == "f"
  )
  return 2.0 * math.prod(out) * contracted


def _matmul_flops(result: str, rhs: str, types: dict[str, str]):
  """FLOPs of one dot / ragged-dot / GEMM call instruction, else None."""
  if re.search(r"\sconvolution\(", " " + rhs):
    return _convolution_flops(result, rhs, types)
  if re.search(r"\sdot\(", " " + rhs):
    op, contracting = "dot", _LHS_CONTRACTING.search(rhs)
  elif re.search(r"\sragged-dot\(", " " + rhs):
    op, contracting = "ragged-dot", _LHS_CONTRACTING.search(rhs)
  else:
    call = _CUSTOM_CALL_TARGET.search(rhs)
    if not (call and call.group(1) in GEMM_CALLS):
      return None
    op, contracting = "custom-call", _LHS_CONTRACTING_JSON.search(rhs)
  out = _dims(result)
  lhs = _lhs_dims(rhs, op, types)
  if out is None or lhs is None:
    return None
  axes = [
      int(a.strip('" '))
      for a in (contracting.group(1) if contracting else "").split(",")
      if a.strip('" ')
  ]
  contracted = math.prod(lhs[a] for a in axes)
  flops = 2.0 * math.prod(out) * contracted
  ragged = _LHS_RAGGED.search(rhs) if op == "ragged-dot" else None
  if ragged and any(int(a) in axes for a in ragged.group(1).split(",") if a):
    # Rows are the contracted (ragged) dimension: each row meets one group,
    # not all of the output's leading group dimension.
    flops /= out[0]
  return flops
