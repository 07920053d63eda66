"""The padded exchange: `jax.lax.all_to_all` of a static [ep, slots, D] buffer.

Runs on any platform (XLA:CPU has no ragged_all_to_all). Each device sends
every peer `slots` rows, its real copies first and zeros after them, so it
moves the whole buffer whatever the routing: ep * slots rows each way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_core.parallel import exchange
from moe_core.parallel import options


class PaddedExchange(exchange.Exchange):
  """capacity = slots per peer; receive buffer [ep * slots, D]."""

  name = "padded"

  def capacity(self, tokens, top_k, num_experts, ep, buffer_factor):
    sizes = options.buffer_sizes(tokens, top_k, num_experts, ep, buffer_factor)
    return sizes[0]  # The slots per peer.

  def describe_capacity(self, capacity):
    return f"{capacity} slots per peer"

  def admit(self, wanted, capacity):
    # Each (src, dst) pair has its own slots: keep its first copies.
    ep = wanted.shape[0]
    block_start = jnp.arange(ep, dtype=jnp.int32) * capacity
    dst_first = jnp.broadcast_to(block_start[:, None], (ep, ep))
    return jnp.minimum(wanted, capacity), dst_first

  def return_slot(self, copy, dest, slot, capacity):
    # Results come back in the send buffer's own layout.
    del copy
    return dest * capacity + jnp.clip(slot, 0, capacity - 1)

  def send(self, rows, sent, layout, axis_name):
    del sent  # Past send_sizes, the slots are zero anyway.
    num_copies = rows.shape[0]
    slots = layout.capacity
    # buffer[j, c] is copy send_offsets[j] + c, zero past the copies sent.
    c = jnp.arange(slots, dtype=jnp.int32)[None, :]
    source = jnp.clip(layout.send_offsets[:, None] + c, 0, num_copies - 1)
    valid = c < layout.send_sizes[:, None]
    buffer = jnp.where(valid[..., None], rows[source], 0)
    return self._all_to_all(buffer, axis_name)

  def send_back(self, rows, layout, num_copies, axis_name):
    del num_copies  # The result has the send buffer's ep * slots rows.
    ep = layout.send_sizes.shape[0]
    return self._all_to_all(rows.reshape(ep, layout.capacity, -1), axis_name)

  def _all_to_all(self, buffer, axis_name):
    """[ep, slots, D] -> [ep * slots, D]: block j to device j, and back."""
    ep, slots = buffer.shape[:2]
    moved = jax.lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)
    return moved.reshape(ep * slots, -1)
