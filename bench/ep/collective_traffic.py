"""Counting what an expert-parallel exchange moves: from HLO and from routing.

Shared by the traffic benchmarks (`bench/ep/ep_bench.py`, one layer;
`bench/ep/train_traffic.py`, a training step): `collective_bytes` reads the
collectives' result sizes out of compiled HLO text (what the padded
exchange really moves); `exchange_rows` and `ragged_traffic` count, from
the routing, the token copies that leave their device (what
`ragged_all_to_all` sends: exactly those rows).
"""

from __future__ import annotations

import math
import re

import numpy as np

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "ragged-all-to-all")

_SHAPE = re.compile(r"(bf16|f32|f16|s32|u32|pred)\[([\d,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1}


def _shapes(text: str):
  """(dtype, elements) of each array shape in a line of HLO."""
  for dtype, dims in _SHAPE.findall(text):
    yield dtype, math.prod(int(d) for d in dims.split(",") if d)


def collective_bytes(hlo: str) -> dict[str, tuple[int, int]]:
  """(bytes, elements) of each collective kind's results in the entry.

  Args:
    hlo: compiled HLO text (`jit(f).lower(...).compile().as_text()`); under
      SPMD its shapes are one device's, so the counts are per device.

  Returns:
    {kind: (bytes, elements)} for the kinds of `COLLECTIVES` that occur in
    the entry computation (tuple results summed).
  """
  entry = hlo[hlo.index("ENTRY") :]
  out = {}
  for line in entry.splitlines():
    for op in COLLECTIVES:
      m = re.search(rf"= (.*?) {op}\(", line)
      if m:
        nbytes, elems = out.get(op, (0, 0))
        for dtype, n in _shapes(m.group(1)):
          nbytes, elems = nbytes + _BYTES[dtype] * n, elems + n
        out[op] = (nbytes, elems)
  return out


def collective_ops(hlo: str) -> dict[str, int]:
  """How many ops of each collective kind the entry computation runs."""
  entry = hlo[hlo.index("ENTRY") :]
  return {
      op: n
      for op in COLLECTIVES
      if (n := len(re.findall(rf"= .*? {op}\(", entry)))
  }


def exchange_rows(
    expert_ids: np.ndarray,
    *,
    ep: int,
    experts_per_device: int,
    groups: int = 1,
) -> np.ndarray:
  """Token copies each device sends each device of its exchange group.

  Tokens are split over (data..., expert) in order, the expert axis minor
  (as `moe_layer(..., mesh=...)` splits them): shard s of the groups * ep
  shards holds the s-th block of T / (groups * ep) tokens, sits at index
  s % ep of the expert axis and exchanges within its group s // ep (the
  devices sharing its data index). Expert e lives at index
  e // experts_per_device.

  Args:
    expert_ids: [T, K] the experts each token chose, tokens in global order.
    ep: devices on the expert axis.
    experts_per_device: E / ep.
    groups: the product of the data axes' sizes (one exchange per group).

  Returns:
    [groups, ep, ep] int: [g, src, dst] copies from src to dst in group g;
    the diagonal stays on its device.
  """
  expert_ids = np.asarray(expert_ids)
  tokens, top_k = expert_ids.shape
  shards = groups * ep
  if tokens % shards:
    raise ValueError(
        f"expert_ids must hold a multiple of groups*ep={shards} tokens, got "
        f"{tokens}."
    )
  shard = np.repeat(np.arange(shards), tokens // shards * top_k)
  dest = expert_ids.ravel() // experts_per_device
  flat = shard * ep + dest  # = (group * ep + src) * ep + dst.
  counts = np.bincount(flat, minlength=shards * ep)
  return counts.reshape(groups, ep, ep)


def ragged_traffic(rows: np.ndarray, row_bytes: int) -> dict[str, float]:
  """Off-device bytes of one ragged dispatch + combine, per device.

  Device i sends its off-device copies in dispatch (off[g, i, :]) and gets
  the outputs of the copies it received back to their owners in combine
  (off[g, :, i]). A phase lasts as long as its busiest link direction: the
  most rows any device sends or receives.

  Args:
    rows: [groups, ep, ep] from `exchange_rows`.
    row_bytes: bytes of one row (D * itemsize).

  Returns:
    mean_sent_bytes, max_sent_bytes (over devices, both phases),
    busiest_link_bytes (both phases, at the busiest direction's rate) and
    max_received_rows (the most rows a device's experts receive).
  """
  ep = rows.shape[-1]
  off = rows * (1 - np.eye(ep, dtype=rows.dtype))
  sent = off.sum(axis=2) + off.sum(axis=1)  # [groups, ep], both phases.
  busiest = max(off.sum(axis=1).max(), off.sum(axis=2).max())
  return {
      "mean_sent_bytes": float(np.mean(sent) * row_bytes),
      "max_sent_bytes": float(np.max(sent) * row_bytes),
      "busiest_link_bytes": float(2 * busiest * row_bytes),
      "max_received_rows": int(rows.sum(axis=1).max()),
  }
