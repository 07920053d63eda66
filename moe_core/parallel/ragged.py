"""The ragged exchange: only the real rows move, with ragged_all_to_all.

Each receiver stacks its sources' rows in device order in one buffer of
`capacity` rows; a copy's result comes back to its own row of the send
order. `RaggedExchange` uses `jax.lax.ragged_all_to_all` (GPU, TPU);
`EmulatedRaggedExchange` builds the same collective from an all_gather, to
test this layout on platforms without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_core.parallel import exchange
from moe_core.parallel import options


class RaggedExchange(exchange.Exchange):
  """capacity = receive rows; receive buffer [capacity, D]."""

  name = "ragged"
  platforms = options.RAGGED_PLATFORMS
  needs = "jax.lax.ragged_all_to_all, which XLA implements on"
  instead = (
      "exchange='padded' (what exchange='auto' picks there), or "
      "exchange='ragged_emulated' to test the ragged layout"
  )

  def capacity(self, tokens, top_k, num_experts, ep, buffer_factor):
    sizes = options.buffer_sizes(tokens, top_k, num_experts, ep, buffer_factor)
    return sizes[1]  # The receive rows.

  def describe_capacity(self, capacity):
    return f"{capacity} receive rows"

  def admit(self, wanted, capacity):
    # Receivers stack sources in device order; the rows past the buffer's
    # end are the ones dropped, so later sources lose first.
    ahead = exchange.exclusive_cumsum(wanted, axis=0)
    fits = jnp.clip(capacity - ahead, 0, wanted)
    return fits, exchange.exclusive_cumsum(fits, axis=0)

  def return_slot(self, copy, dest, slot, capacity):
    del dest, slot, capacity  # Results come back to the send order itself.
    return copy

  def send(self, rows, sent, layout, axis_name):
    out = jnp.zeros((layout.capacity, rows.shape[1]), rows.dtype)
    rows = jnp.where(sent[:, None], rows, 0)
    take = (layout.send_offsets, layout.send_sizes)
    land = (layout.peer_recv_offsets, layout.recv_sizes)
    return self._move(rows, out, take, land, axis_name)

  def send_back(self, rows, layout, num_copies, axis_name):
    out = jnp.zeros((num_copies, rows.shape[1]), rows.dtype)
    take = (layout.recv_offsets, layout.recv_sizes)
    land = (layout.peer_send_offsets, layout.send_sizes)
    return self._move(rows, out, take, land, axis_name)

  def _move(self, operand, output, take, land, axis_name):
    """One ragged_all_to_all between the devices of `axis_name`.

    take: (input_offsets, send_sizes), the slice of operand for each peer;
    land: (output_offsets, recv_sizes), where that slice starts in the
    peer's output, and how many rows arrive here from each peer.
    """
    return self._collective(operand, output, *take, *land, axis_name=axis_name)

  @staticmethod
  def _collective(*args, axis_name):
    """The ragged all-to-all itself; `EmulatedRaggedExchange` replaces it."""
    return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)


class EmulatedRaggedExchange(RaggedExchange):
  """The ragged layout over an all_gather: ep times the traffic; tests only."""

  name = "ragged_emulated"
  platforms = None  # An all_gather runs anywhere.

  @staticmethod
  def _collective(*args, axis_name):
    return emulated_ragged_all_to_all(*args, axis_name=axis_name)


def emulated_ragged_all_to_all(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name,
):
  """`jax.lax.ragged_all_to_all` (one slice per peer) from all_gather.

  Same result and gradients, for platforms without the collective; it moves
  every device's whole operand to every device, so use it to test only.
  """
  del recv_sizes  # Implied by the senders' send_sizes.
  me = jax.lax.axis_index(axis_name)
  all_operands = jax.lax.all_gather(operand, axis_name)  # [ep, N, D]
  src_start = jax.lax.all_gather(input_offsets, axis_name)[:, me]
  size = jax.lax.all_gather(send_sizes, axis_name)[:, me]
  dst_start = jax.lax.all_gather(output_offsets, axis_name)[:, me]
  row = jnp.arange(output.shape[0])[:, None]  # [R, 1]
  inside = (row >= dst_start) & (row < dst_start + size)  # [R, ep]
  source = jnp.argmax(inside, axis=1)
  found = jnp.any(inside, axis=1)
  index = jnp.clip(
      src_start[source] + row[:, 0] - dst_start[source], 0, operand.shape[0] - 1
  )
  found = found.reshape((-1,) + (1,) * (output.ndim - 1))
  return jnp.where(found, all_operands[source, index], output)
