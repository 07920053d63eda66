"""The exchange interface: how token copies reach their experts' devices.

An expert-parallel layer moves every token copy to the device that holds its
expert and moves the expert's output back. `stages.dispatch` and
`stages.combine` do everything that does not depend on how the rows travel
(sort the copies by destination, all_gather the per-expert counts, regroup
what arrived, weight and sum per token); an `Exchange` decides which copies
fit its buffers and where they land (`capacity`, `admit`, giving the
`Layout`) and moves the rows there and back (`send`, `send_back`,
`return_slot`), so a new transport is a new class and none of the stages
branches on it (docs/expert_parallel.md, "The exchange interface", says how
to add one). Every method but `capacity` and `describe_capacity` runs inside
`jax.shard_map` over the expert axis, on traced arrays; `ep` is that axis's
size. Rows are [*, D] in the activations' dtype; sizes and offsets int32.
Gradients come from JAX's transpose of the collectives used (the reverse
exchange), so an exchange built from differentiable collectives needs no
custom rule.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
from typing import ClassVar

import jax
from jax.extend import core as jax_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
import jax.numpy as jnp

from moe_core.parallel import options as options_lib


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each peer's rows sit in the send and receive buffers.

  All [ep] int32, seen from this device; "send order" is this device's M
  copies sorted by destination device.

  Attributes:
    send_sizes: rows this device sends each peer (the copies that fit).
    send_offsets: each peer's first copy in the send order.
    recv_sizes: rows each peer sends this device.
    recv_offsets: where each peer's rows start in this device's receive
      buffer.
    peer_recv_offsets: where this device's rows start in each peer's
      receive buffer.
    peer_send_offsets: where each peer's copies for this device start in
      that peer's send order.
    capacity: the exchange's static bound (`Exchange.capacity`).
  """

  send_sizes: jax.Array
  send_offsets: jax.Array
  recv_sizes: jax.Array
  recv_offsets: jax.Array
  peer_recv_offsets: jax.Array
  peer_send_offsets: jax.Array
  capacity: int = dataclasses.field(metadata=dict(static=True))


class Exchange(abc.ABC):
  """Moves rows between the devices of the expert axis, and back.

  Attributes:
    name: the name `EPOptions(exchange=...)` chooses it by.
    platforms: the JAX platforms it runs on, as `jax.default_backend()` or
      a device names them ("cpu", "gpu", "cuda", "rocm", "tpu"; "gpu"
      stands for both "cuda" and "rocm"), or None for every platform.
      `stages.dispatch` refuses a program lowered for any other platform
      (`refuse_other_platforms`).
    needs: what it needs that the other platforms lack, for that error:
      "<what>, which runs on" (the platforms follow).
    instead: what to use on those other platforms, for that error.
  """

  name: ClassVar[str]
  platforms: ClassVar[tuple[str, ...] | None] = None
  needs: ClassVar[str] = "collectives that run on"
  instead: ClassVar[str] = "exchange='padded' (any platform)"

  def runs_on(self, platform: str) -> bool:
    """Whether the exchange runs on `platform` (a JAX platform name)."""
    if self.platforms is None:
      return True
    if platform == "gpu":  # Either GPU platform will do.
      return any(_runs_on(p, self.platforms) for p in _GPU_PLATFORMS)
    return _runs_on(platform, self.platforms)

  def check_platform(self, platform: str) -> None:
    """Raises NotImplementedError if no program for `platform` can be
    traced with this exchange.

    Called at trace time with the mesh's platform, before anything else
    can fail for a reason that would hide this one. By default it never
    raises: a program traced on one platform may be lowered (exported) for
    another, so `refuse_other_platforms` refuses at lowering instead. An
    exchange whose tracing needs its platform overrides it (TE's NCCL-EP
    needs a communicator that only a GPU makes).
    """
    del platform

  def unsupported_platform_message(self, platform: str) -> str:
    """The error for a program of this exchange lowered for `platform`."""
    where = " and ".join(
        dict.fromkeys(
            "gpu" if p in _GPU_PLATFORMS and "gpu" in self.platforms else p
            for p in self.platforms
        )
    )
    return (
        f"exchange {self.name!r} cannot run on platform {platform!r}: it "
        f"needs {self.needs} {where} only. On {platform!r} use "
        f"{self.instead}."
    )

  @abc.abstractmethod
  def capacity(
      self,
      tokens: int,
      top_k: int,
      num_experts: int,
      ep: int,
      buffer_factor: float | None,
  ) -> int:
    """The static size that bounds the buffers (see `options.buffer_sizes`).

    What it counts is the exchange's own (slots per peer, receive rows);
    `admit` and `send` interpret it. Python ints in and out.
    """

  @abc.abstractmethod
  def describe_capacity(self, capacity: int) -> str:
    """The bound in words, for the overflow error ("8 slots per peer")."""

  @abc.abstractmethod
  def admit(
      self, wanted: jax.Array, capacity: int
  ) -> tuple[jax.Array, jax.Array]:
    """Which copies fit the buffers, and where they land.

    Args:
      wanted: [ep, ep] int32, wanted[src, dst]: copies device src has for
        the experts of device dst (the same on every device).
      capacity: `capacity(...)`.

    Returns:
      (fits, dst_first), both [ep, ep] int32: fits[src, dst] <= wanted, the
      first copies of each pair that are sent (the rest are dropped);
      dst_first[src, dst], the row of dst's receive buffer where src's rows
      start. Sources' ranges in one receive buffer must be increasing in
      src, and its first one must start at row 0.
    """

  @abc.abstractmethod
  def return_slot(
      self, copy: jax.Array, dest: jax.Array, slot: jax.Array, capacity: int
  ) -> jax.Array:
    """[M] int32: the row of `send_back`'s result that holds each copy.

    Args:
      copy: [M] int32, the copy's position in the send order.
      dest: [M] int32, its destination device.
      slot: [M] int32, its position among the copies for `dest` (>=
        send_sizes[dest] for a copy that was not sent: any in-range row).
      capacity: `capacity(...)`.
    """

  @abc.abstractmethod
  def send(
      self, rows: jax.Array, sent: jax.Array, layout: Layout, axis_name: str
  ) -> jax.Array:
    """Sends each copy to its destination; returns the receive buffer.

    Args:
      rows: [M, D] this device's copies in the send order.
      sent: [M] bool, the copies that fit (`admit`); the others must not
        arrive anywhere.
      layout: from `admit`.
      axis_name: the expert axis.

    Returns:
      [R, D]: source j's rows at recv_offsets[j] onwards, in its send
      order; every other row zero. R is static.
    """

  @abc.abstractmethod
  def send_back(
      self, rows: jax.Array, layout: Layout, num_copies: int, axis_name: str
  ) -> jax.Array:
    """The reverse of `send`: each received row back to the copy it was.

    Args:
      rows: [R, D] laid out as `send` returned them (now expert outputs).
      layout: as given to `send`.
      num_copies: M.
      axis_name: the expert axis.

    Returns:
      [S, D], S static: the row of copy c at `return_slot` of c, for every
      copy that was sent (other rows are ignored).
    """


def exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
  """int32 sums of the entries before each one along `axis` (first: 0)."""
  return (jnp.cumsum(a, axis=axis) - a).astype(jnp.int32)


# --- Refusing a platform when the program is lowered -------------------------

# The GPU platforms JAX lowers for; "gpu" (a device's or
# jax.default_backend()'s name) stands for either.
_GPU_PLATFORMS = ("cuda", "rocm")


def _runs_on(platform: str, platforms: tuple[str, ...]) -> bool:
  return platform in platforms or (
      platform in _GPU_PLATFORMS and "gpu" in platforms
  )


def refuse_other_platforms(rows: jax.Array, exchange: Exchange) -> jax.Array:
  """rows, unchanged, in a program that cannot be lowered where `exchange`
  does not run.

  An identity whose lowering rule raises NotImplementedError
  (`Exchange.unsupported_platform_message`) when the program is lowered for
  a platform outside `exchange.platforms`: at the first call of a jitted
  function (or `.lower()`, `jax.export`), before XLA compiles, instead of
  XLA's own error at compile time (XLA:CPU's `UNIMPLEMENTED` for
  ragged_all_to_all). It is checked at lowering, not at tracing, because
  only the lowering knows the platform: a program traced on a CPU host may
  be exported for CUDA (`jax.export(..., platforms=["cuda"])`).
  """
  if exchange.platforms is None:
    return rows
  return _platform_guard_p.bind(
      rows,
      exchange=exchange.name,
      messages=tuple(
          (p, exchange.unsupported_platform_message(p))
          for p in _LOWERING_PLATFORMS
          if not exchange.runs_on(p)
      ),
  )


# The platforms JAX lowers for (jax.export's `platforms`).
_LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_platform_guard_p = jax_core.Primitive("dropless_exchange_platform_guard")


def _guard_impl(rows, *, exchange, messages):
  # Eagerly: lower it for the platform the rows live on, as jit would.
  return jax.jit(
      lambda r: _platform_guard_p.bind(r, exchange=exchange, messages=messages)
  )(rows)


def _guard_lowering(platform):
  def lower(ctx, rows, *, exchange, messages):
    del ctx, exchange
    refused = dict(messages)
    if platform in refused:
      raise NotImplementedError(refused[platform])
    return [rows]

  return lower


_platform_guard_p.def_impl(_guard_impl)
_platform_guard_p.def_abstract_eval(lambda rows, **_: rows)
for _platform in _LOWERING_PLATFORMS:
  mlir.register_lowering(
      _platform_guard_p, _guard_lowering(_platform), platform=_platform
  )
# Linear: its tangent and its transpose are the guard again, so gradients
# (the reverse exchange) are refused alike.
ad.deflinear2(
    _platform_guard_p,
    lambda cotangent, rows, **params: [
        _platform_guard_p.bind(cotangent, **params)
    ],
)
batching.primitive_batchers[_platform_guard_p] = lambda args, dims, **params: (
    _platform_guard_p.bind(*args, **params),
    dims[0],
)


@functools.cache
def get_exchange(name: str) -> Exchange:
  """The exchange called `name` (not "auto": see `resolve_exchange`)."""
  target = options_lib.EXCHANGE_CLASSES.get(name)
  if target is None:
    raise ValueError(
        f"exchange must be one of {tuple(options_lib.EXCHANGE_CLASSES)} "
        f"here (resolve 'auto' first; a package registers its own "
        f"exchanges when imported), got {name!r}."
    )
  module, cls = target.split(":")
  return getattr(importlib.import_module(module), cls)()
