"""The expert-parallel stages: route, dispatch, combine; call in shard_map.

Device i (of ep on the expert axis) holds T_l tokens and experts
[i*E_l, (i+1)*E_l), E_l = E / ep. `route` runs locally (router replicated;
counts and losses summed over every token shard, so aux equals the
single-device aux); `dispatch` sorts the T_l*K copies by expert (so by
destination), all_gathers the per-expert counts, sends each peer its rows
through an `exchange.Exchange` and regroups the received rows [R, D] by
local expert (group_sizes [E_l]) for `backend.expert_ffn`; `combine` runs
the reverse exchange, then the single-device weighted sum back in token
order (docs/expert_parallel.md draws it). Nothing here depends on how rows
travel: that is the exchange's. Gradients need no custom rule: the
transpose of each collective is the reverse exchange, which JAX derives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from moe_core import compat
from moe_core import config as config_lib
from moe_core import permute
from moe_core import routing
from moe_core import validation
from moe_core.parallel import exchange as exchange_lib
from moe_core.parallel import overflow as overflow_lib

# --- Stage 1: route ---------------------------------------------------------


def route(
    x: jax.Array,
    router: jax.Array,
    cfg: config_lib.MoEConfig,
    correction_bias: jax.Array | None = None,
    *,
    token_axes: Sequence[str],
    local_route: Callable[..., routing.MoEAux] = routing.route,
    **extras: jax.Array | None,
) -> routing.MoEAux:
  """`routing.route` on this shard's tokens, with global statistics.

  Call inside `shard_map`. Per-token fields are this shard's; the counts and
  losses are those of `routing.route` over all tokens of all shards of
  `token_axes`: tokens_per_expert is summed, the load-balancing loss is
  E * sum_e f_e * P_e with f_e and P_e (mean router_probs) over all tokens,
  and the z-loss is the mean over all tokens.

  Args:
    x: [T_l, D] this shard's tokens.
    router: [D, E], replicated.
    cfg: the block's config; must be dropless (capacity needs a global token
      order that shards do not share).
    correction_bias: [E], replicated; iff `cfg.correction_bias`.
    token_axes: the mesh axes the tokens are sharded over.
    local_route: what routes this shard's tokens, (x, router, cfg,
      correction_bias, **extras) -> `MoEAux` of `routing.route`'s meaning
      (a backend's `route`); the statistics are then made global here.
    **extras: `routing.route`'s optional router params, replicated.
  """
  validation.check_dropless(cfg)
  token_axes = tuple(token_axes)
  aux = local_route(x, router, cfg, correction_bias, **extras)
  num_local = x.shape[0]
  num_tokens = num_local * math.prod(compat.axis_size(a) for a in token_axes)
  tokens_per_expert = psum(aux.tokens_per_expert, token_axes)
  fraction = tokens_per_expert.astype(jnp.float32) / (num_tokens * cfg.top_k)
  mean_probs = psum(aux.router_probs.sum(axis=0), token_axes) / num_tokens
  load_balancing_loss = cfg.num_router_experts * jnp.sum(fraction * mean_probs)
  lse = jax.nn.logsumexp(aux.router_logits, axis=-1)
  router_z_loss = psum(jnp.sum(lse**2), token_axes) / num_tokens
  return dataclasses.replace(
      aux,
      tokens_per_expert=tokens_per_expert,
      load_balancing_loss=load_balancing_loss,
      router_z_loss=router_z_loss,
      dropped_tokens=psum(aux.dropped_tokens, token_axes),
      invalid_assignments=psum(aux.invalid_assignments, token_axes),
  )


# --- Stage 2: dispatch ------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EPDispatched:
  """Rows received for this device's experts, and how to send results back.

  With T_l local tokens and K choices, M = T_l*K copies; R receive rows.

  Attributes:
    rows: [R, D] received copies grouped by local expert (stable: by source
      device, then by token); rows past sum(group_sizes) are zero.
    group_sizes: [E_l] int32 rows per local expert.
    local: `permute.Dispatched` of this device's copies sorted by global
      expert (so by destination device): the send order.
    sent: [M] bool in send order: the copy reached its expert (always True
      with drop-free buffers).
    return_slot: [M] int32 in send order: the row of the returned buffer that
      holds the copy's expert output.
    regroup: [R] int32, rows = received[regroup].
    layout: the exchange's `exchange.Layout`: [ep] int32 sizes and offsets
      of each peer's rows in the send and receive buffers, and the buffers'
      static bound. Its fields read through too: `d.send_sizes` is
      `d.layout.send_sizes`, and `d.slots` is `d.layout.capacity` (padded
      slots per peer, or ragged receive rows).
    dropped: scalar int32, this device's copies that did not fit.
    exchange: the exchange's name ("padded", "ragged", ...).
  """

  rows: jax.Array
  group_sizes: jax.Array
  local: permute.Dispatched
  sent: jax.Array
  return_slot: jax.Array
  regroup: jax.Array
  layout: exchange_lib.Layout
  dropped: jax.Array
  exchange: str = dataclasses.field(metadata=dict(static=True))

  def __getattr__(self, name):
    # Only reached for names the dataclass lacks: the layout's fields.
    if name == "slots":
      name = "capacity"
    if name in _LAYOUT_FIELDS:
      return getattr(self.layout, name)
    raise AttributeError(
        f"{type(self).__name__!r} object has no attribute {name!r}"
    )


_LAYOUT_FIELDS = frozenset(
    f.name for f in dataclasses.fields(exchange_lib.Layout)
)


def dispatch(
    x: jax.Array,
    expert_ids: jax.Array,
    cfg: config_lib.MoEConfig,
    *,
    expert_axis: str,
    exchange: str = "padded",
    buffer_factor: float | None = None,
    overflow: str = "error",
    input_weights: jax.Array | None = None,
) -> EPDispatched:
  """Sends each token copy to the device of its expert; call in shard_map.

  Args:
    x: [T_l, D] this device's tokens.
    expert_ids: [T_l, K] int32 global expert ids, distinct within a row (as
      `routing.route` makes them; the drop-free bound relies on it).
    cfg: the block's config (E, K).
    expert_axis: the mesh axis the experts are split over; device i holds
      experts [i*E_l, (i+1)*E_l).
    exchange: a concrete exchange name, "padded", "ragged" or
      "ragged_emulated" (not "auto": see `resolve_exchange`).
    buffer_factor: see `EPOptions`.
    overflow: see `EPOptions`.
    input_weights: None, or [T_l, K] float32 routing weights that scale
      each copy before it is sent (cfg.routing_weights_on_input; the
      combine then takes unit weights).

  Returns:
    `EPDispatched`: rows [R, D] for `backend.expert_ffn` with group_sizes
    [E_l], and what `combine` needs.
  """
  mover = exchange_lib.get_exchange(exchange)
  ep = compat.axis_size(expert_axis)
  validation.check_experts_divide(
      cfg.num_experts, ep, f"axis_size({expert_axis!r})={ep}"
  )
  num_local_experts = cfg.num_experts // ep
  num_tokens, top_k = expert_ids.shape
  num_copies = num_tokens * top_k
  me = jax.lax.axis_index(expert_axis)
  capacity = mover.capacity(
      num_tokens, top_k, cfg.num_experts, ep, buffer_factor
  )

  # Send order: copies sorted by global expert, hence by destination device.
  local = permute.dispatch(x, expert_ids, cfg.num_experts)
  if input_weights is not None:
    flat = input_weights.astype(jnp.float32).reshape(-1)[local.assignment]
    scaled = local.rows.astype(jnp.float32) * flat[:, None]
    local = dataclasses.replace(local, rows=scaled.astype(local.rows.dtype))
  # counts[i, j, e]: copies device i sends to local expert e of device j.
  counts = jax.lax.all_gather(local.group_sizes, expert_axis).reshape(
      ep, ep, num_local_experts
  )
  wanted = counts.sum(axis=-1)  # [src, dst]
  src_first = exchange_lib.exclusive_cumsum(
      wanted, axis=1
  )  # Row of dst's first copy.
  fits, dst_first = mover.admit(wanted, capacity)
  layout = exchange_lib.Layout(
      send_sizes=fits[me],
      send_offsets=src_first[me],
      recv_sizes=fits[:, me],
      recv_offsets=dst_first[:, me],
      peer_recv_offsets=dst_first[me],
      peer_send_offsets=src_first[:, me],
      capacity=capacity,
  )

  copy = jnp.arange(num_copies, dtype=jnp.int32)
  dest = jnp.clip(
      jnp.searchsorted(jnp.cumsum(wanted[me]), copy, side="right"), 0, ep - 1
  ).astype(jnp.int32)
  slot_in_peer = copy - layout.send_offsets[dest]
  sent = slot_in_peer < layout.send_sizes[dest]
  dropped = (num_copies - jnp.sum(sent)).astype(jnp.int32)
  if buffer_factor is not None and overflow == "error":
    total = jax.lax.psum(dropped, expert_axis)
    local = dataclasses.replace(
        local,
        rows=overflow_lib.raise_on_overflow(
            local.rows,
            total,
            overflow_lib.overflow_bound(mover, capacity, buffer_factor),
        ),
    )
  # Where the exchange cannot run, refused when the program is lowered.
  rows = exchange_lib.refuse_other_platforms(local.rows, mover)
  received = mover.send(rows, sent, layout, expert_axis)
  grouped, group_sizes, regroup = _group_by_expert(
      received, layout, counts[:, me, :]
  )
  return_slot = mover.return_slot(copy, dest, slot_in_peer, capacity)
  return EPDispatched(
      rows=grouped,
      group_sizes=group_sizes,
      local=local,
      sent=sent,
      return_slot=return_slot.astype(jnp.int32),
      regroup=regroup,
      layout=layout,
      dropped=dropped,
      exchange=exchange,
  )


def kept_copies(dispatched: EPDispatched, top_k: int) -> jax.Array:
  """[T_l, K] bool in token order: whether each copy reached its expert."""
  d = dispatched
  return d.sent[d.local.position].reshape(-1, top_k)


# --- Stage 4: combine -------------------------------------------------------


def combine(
    expert_out: jax.Array,
    dispatched: EPDispatched,
    combine_weights: jax.Array,
    *,
    expert_axis: str,
) -> jax.Array:
  """Returns expert outputs to their tokens; call inside shard_map.

  Args:
    expert_out: [R, D] `backend.expert_ffn(dispatched.rows, ...)`.
    dispatched: this device's `EPDispatched`.
    combine_weights: [T_l, K] float32 weights of this device's tokens.
    expert_axis: the mesh axis of `dispatch`.

  Returns:
    [T_l, D] in expert_out's dtype: y[t] = sum_k w[t, k] * out(t, k), summed
    as `permute.combine` does, so it matches the single-device layer.
    Copies that were not sent contribute zero.
  """
  d = dispatched
  # Undo the regrouping: received[regroup] = rows, so received = rows[inv].
  inverse = (
      jnp.zeros_like(d.regroup)
      .at[d.regroup]
      .set(jnp.arange(d.regroup.shape[0], dtype=jnp.int32))
  )
  received = expert_out[inverse]
  num_copies = d.sent.shape[0]
  mover = exchange_lib.get_exchange(d.exchange)
  back = mover.send_back(received, d.layout, num_copies, expert_axis)
  per_copy = jnp.where(d.sent[:, None], back[d.return_slot], 0)
  kept = kept_copies(d, combine_weights.shape[1])
  return permute.combine(per_copy, d.local, combine_weights, kept)


# --- Helpers ----------------------------------------------------------------


def psum(value, axes):
  """psum over `axes`; the value itself when there are none."""
  return jax.lax.psum(value, tuple(axes)) if axes else value


def _group_by_expert(received, layout, counts_to_me):
  """The receive buffer regrouped by local expert.

  Args:
    received: [R, D] `Exchange.send`'s result.
    layout: its `Layout`.
    counts_to_me: [ep, E_l] int32, copies each source sent each local
      expert (before the buffer bound).

  Returns:
    (rows [R, D] grouped by local expert, stable, zeros past the groups;
    group_sizes [E_l] int32; regroup [R] int32 with rows = received[regroup]).
  """
  ep, num_local_experts = counts_to_me.shape
  # Received row r comes from the last source whose rows start at or
  # before it; past that source's rows it is padding.
  row = jnp.arange(received.shape[0], dtype=jnp.int32)
  source_dev = jnp.clip(
      jnp.searchsorted(layout.recv_offsets, row, side="right") - 1, 0, ep - 1
  ).astype(jnp.int32)
  slot = row - layout.recv_offsets[source_dev]
  valid_row = slot < layout.recv_sizes[source_dev]
  # A received row's expert: the sender sorted by expert, so slot c of
  # source j belongs to the expert whose cumulative count first exceeds c.
  ends_by_expert = jnp.cumsum(counts_to_me, axis=1)  # [src, E_l]
  expert_of = jnp.sum(ends_by_expert[source_dev] <= slot[:, None], axis=1)
  key = jnp.where(valid_row, expert_of, num_local_experts).astype(jnp.int32)
  regroup = jnp.argsort(key, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(key, length=num_local_experts + 1)[
      :num_local_experts
  ].astype(jnp.int32)
  grouped = jnp.where(valid_row[regroup][:, None], received[regroup], 0)
  return grouped, group_sizes, regroup
