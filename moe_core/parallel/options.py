"""How the expert-parallel exchange runs, and how big its buffers are.

Pure Python: nothing here traces or needs a device, so the sizing can be
tested (and reasoned about) on its own. A token's K experts are distinct, so
it sends at most min(K, E_l) copies to one device, and a device receives at
most ep * T_l * min(K, E_l) rows: the static, drop-free receive buffer (ep *
min(K, E_l) / K times the average; the padded exchange sends that many rows
too). `EPOptions.buffer_factor` bounds the buffers instead; copies that do
not fit are counted, and either raise (`overflow="error"`) or are dropped
with their count in `MoEAux.dropped_tokens` and `kept` False
(`overflow="drop"`), never silently (docs/expert_parallel.md, "What the
drop-free fallback costs in memory").
"""

from __future__ import annotations

import dataclasses
import math

from moe_core import validation

# Every concrete exchange: its name and the "module:Class" that implements
# it (an `exchange.Exchange`). The class is imported on first use, so an
# exchange may need a package that `import moe_core` must not load. The
# core's own are here; another package adds its own when it is imported
# (`register_exchange`: `backends.te` registers Transformer Engine's
# NCCL-EP, "te_nccl_ep"), and "auto" picks only the core's.
EXCHANGE_CLASSES = {
    "ragged": "moe_core.parallel.ragged:RaggedExchange",
    "padded": "moe_core.parallel.padded:PaddedExchange",
    "ragged_emulated": "moe_core.parallel.ragged:EmulatedRaggedExchange",
}
# The core's names, "auto" first; `exchange_names()` adds the registered.
EXCHANGES = ("auto", *EXCHANGE_CLASSES)


def register_exchange(name: str, target: str, *, overwrite: bool = False):
  """Makes `EPOptions(exchange=name)` use the exchange at `target`.

  Args:
    name: the exchange's name (not "auto").
    target: "module:Class" of an `exchange.Exchange` subclass, imported on
      first use.
    overwrite: replace a registered name (else ValueError).
  """
  if not isinstance(name, str) or not name or name == "auto":
    raise ValueError(
        f"exchange name must be a non-empty str, not 'auto'; got {name!r}."
    )
  if not isinstance(target, str) or target.count(":") != 1:
    raise ValueError(f"exchange target must be 'module:Class', got {target!r}.")
  if (
      name in EXCHANGE_CLASSES
      and not overwrite
      and EXCHANGE_CLASSES[name] != target
  ):
    raise ValueError(
        f"exchange {name!r} is already registered as "
        f"{EXCHANGE_CLASSES[name]!r}; pass overwrite=True to replace it."
    )
  EXCHANGE_CLASSES[name] = target


def exchange_names() -> tuple[str, ...]:
  """ "auto" and every registered exchange, the core's first."""
  return ("auto", *EXCHANGE_CLASSES)


OVERFLOW_POLICIES = ("error", "drop")
# Platforms whose XLA implements ragged_all_to_all. XLA:CPU does not
# (jax 0.10.2: UNIMPLEMENTED in its thunk emitter).
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class EPOptions:
  """How the expert-parallel exchange is done.

  Attributes:
    exchange: "ragged" moves only the real rows with
      `jax.lax.ragged_all_to_all` (GPU, TPU); "padded" moves a static
      [ep, slots, D] buffer with `jax.lax.all_to_all` (any platform);
      "auto" picks "ragged" on GPU/TPU and "padded" elsewhere (a program
      with "ragged" lowered for the CPU raises NotImplementedError naming
      the platform);
      "ragged_emulated" is the ragged layout with the exchange emulated by an
      all_gather (ep times the traffic): a test aid for platforms without
      ragged_all_to_all; other packages register theirs on import
      (`register_exchange`; `backends.te`: "te_nccl_ep").
    buffer_factor: None for the drop-free worst-case buffers. A number f
      bounds them: ceil(f * T_l*K / ep) slots per peer ("padded"), or
      ceil(f * T_l*K) receive rows (ragged), each capped at the worst case.
      f = 1 is the average load; MaxText's `ragged_buffer_factor` is alike.
    overflow: what a bounded buffer does with copies that do not fit:
      "error" raises `overflow.BufferOverflowError` (from Python after the
      run when the layer is called on arrays; from a host callback, which
      syncs and which JAX wraps, in a traced program), "drop" gives them
      zero weight, marks them `kept=False` and counts them in
      `MoEAux.dropped_tokens`.
    num_chunks: split each device's tokens into this many chunks, each
      dispatched, computed and combined on its own, so the scheduler may
      overlap one chunk's exchange with another's expert compute.
  """

  exchange: str = "auto"
  buffer_factor: float | None = None
  overflow: str = "error"
  num_chunks: int = 1

  def __post_init__(self):
    validation.check_ep_options(
        self, exchanges=exchange_names(), overflow_policies=OVERFLOW_POLICIES
    )


def resolve_exchange(exchange: str, platform: str) -> str:
  """The concrete exchange ("ragged", "padded", ...) for `platform`."""
  if exchange != "auto":
    return exchange
  return "ragged" if platform in RAGGED_PLATFORMS else "padded"


def safe_slots_per_peer(tokens: int, top_k: int, local_experts: int) -> int:
  """Most copies T_l tokens can send one device: T_l * min(K, E_l).

  A token's K experts are distinct and a device holds E_l of them, so one
  token sends it at most min(K, E_l) copies.
  """
  return tokens * min(top_k, local_experts)


def buffer_sizes(
    tokens: int,
    top_k: int,
    num_experts: int,
    ep: int,
    buffer_factor: float | None,
) -> tuple[int, int]:
  """(slots per peer of the padded buffer, rows of the ragged receive buffer).

  Args:
    tokens: T_l, tokens on one device (per chunk).
    top_k: K.
    num_experts: E.
    ep: devices on the expert axis.
    buffer_factor: None for the drop-free bounds, else the bound's factor
      over the average load (T_l*K/ep per peer, T_l*K received).
  """
  local = num_experts // ep
  safe_slots = safe_slots_per_peer(tokens, top_k, local)
  safe_rows = ep * safe_slots
  if buffer_factor is None:
    return safe_slots, safe_rows
  slots = math.ceil(buffer_factor * tokens * top_k / ep)
  rows = math.ceil(buffer_factor * tokens * top_k)
  return max(1, min(safe_slots, slots)), max(1, min(safe_rows, rows))
