"""Expert parallelism: dropless dispatch and combine across a device mesh.

    device i (of ep on the expert axis) holds T_l tokens and experts
    [i*E_l, (i+1)*E_l), E_l = E / ep.

    route        locally (router replicated); counts, losses summed over
      |          every token shard, so aux equals the single-device aux
      v
    dispatch     sort the T_l*K copies by expert (so by destination),
      |          all_gather the per-expert counts, send each peer its rows
      |          (ragged_all_to_all, or all_to_all of a padded buffer),
      |          regroup the received rows by local expert
      v
    expert FFN   backend.expert_ffn on [R, D] rows, group_sizes [E_l]
      v
    combine      the reverse exchange, then the single-device weighted sum
                 back in token order

The stage functions run inside `jax.shard_map` over a mesh with an expert
axis; `moe_layer` wraps them for a whole block. Gradients need no custom
rule: the transpose of an all_to_all (or ragged_all_to_all) is the reverse
exchange, which JAX derives.

Buffers. A token's K experts are distinct, so it sends at most min(K, E_l)
copies to one device. A device therefore receives at most
ep * T_l * min(K, E_l) rows: that is the static, drop-free receive buffer
(ep * min(K, E_l) / K times the T_l*K rows it receives on average). The padded
exchange also sends that many rows (T_l * min(K, E_l) per peer, zeros past
the real ones). `EPOptions.buffer_factor` bounds the buffers instead; copies
that do not fit are counted, and either raise (`overflow="error"`) or are
dropped with their count in `MoEAux.dropped_tokens` and `kept` False
(`overflow="drop"`). Never silently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moe_core import backend as backend_lib
from moe_core import compat
from moe_core import config as config_lib
from moe_core import ffn
from moe_core import params as params_lib
from moe_core import permute
from moe_core import registry
from moe_core import routing

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding

EXCHANGES = ("auto", "ragged", "padded", "ragged_emulated")
OVERFLOW_POLICIES = ("error", "drop")
# Platforms whose XLA implements ragged_all_to_all. XLA:CPU does not
# (jax 0.10.2: UNIMPLEMENTED in its thunk emitter).
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")

# Version shims, moved to moe_core.compat; the old names stay importable.
_axis_size = compat.axis_size
_is_explicit = compat.is_explicit
_reshard = compat.reshard

# Per-token MoEAux fields: sharded like the tokens. The rest are global.
_PER_TOKEN_AUX = (
    "router_logits",
    "router_probs",
    "expert_ids",
    "combine_weights",
    "kept",
)


@dataclasses.dataclass(frozen=True)
class EPOptions:
  """How the expert-parallel exchange is done.

  Attributes:
    exchange: "ragged" moves only the real rows with
      `jax.lax.ragged_all_to_all` (GPU, TPU); "padded" moves a static
      [ep, slots, D] buffer with `jax.lax.all_to_all` (any platform);
      "auto" picks "ragged" on GPU/TPU and "padded" elsewhere;
      "ragged_emulated" is the ragged layout with the exchange emulated by an
      all_gather (ep times the traffic): a test aid for platforms without
      ragged_all_to_all.
    buffer_factor: None for the drop-free worst-case buffers. A number f
      bounds them: ceil(f * T_l*K / ep) slots per peer ("padded"), or
      ceil(f * T_l*K) receive rows (ragged), each capped at the worst case.
      f = 1 is the average load; MaxText's `ragged_buffer_factor` is alike.
    overflow: what a bounded buffer does with copies that do not fit:
      "error" raises at run time (a host callback, so it syncs), "drop"
      gives them zero weight, marks them `kept=False` and counts them in
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
    if self.exchange not in EXCHANGES:
      raise ValueError(
          f"exchange must be one of {EXCHANGES}, got " f"{self.exchange!r}."
      )
    if self.overflow not in OVERFLOW_POLICIES:
      raise ValueError(
          f"overflow must be one of {OVERFLOW_POLICIES}, got "
          f"{self.overflow!r}."
      )
    if self.buffer_factor is not None and not (
        isinstance(self.buffer_factor, (int, float))
        and not isinstance(self.buffer_factor, bool)
        and math.isfinite(self.buffer_factor)
        and self.buffer_factor > 0
    ):
      raise ValueError(
          "buffer_factor must be None (drop-free) or a finite "
          f"number > 0, got {self.buffer_factor!r}."
      )
    if (
        isinstance(self.num_chunks, bool)
        or not isinstance(self.num_chunks, int)
        or self.num_chunks < 1
    ):
      raise ValueError(
          f"num_chunks must be a positive int, got " f"{self.num_chunks!r}."
      )


def resolve_exchange(exchange: str, platform: str) -> str:
  """The concrete exchange ("ragged", "padded", ...) for `platform`."""
  if exchange != "auto":
    return exchange
  return "ragged" if platform in RAGGED_PLATFORMS else "padded"


# --- Buffer sizes -----------------------------------------------------------


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


# --- Stage 1: route ---------------------------------------------------------


def route(
    x: jax.Array,
    router: jax.Array,
    cfg: config_lib.MoEConfig,
    correction_bias: jax.Array | None = None,
    *,
    token_axes: Sequence[str],
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
  """
  if not cfg.dropless:
    raise NotImplementedError(
        "expert parallelism supports dropless configs only (capacity_factor="
        f"None), got capacity_factor={cfg.capacity_factor}."
    )
  token_axes = tuple(token_axes)
  aux = routing.route(x, router, cfg, correction_bias)
  num_local = x.shape[0]
  num_tokens = num_local * _axes_size(token_axes)
  tokens_per_expert = _psum(aux.tokens_per_expert, token_axes)
  fraction = tokens_per_expert.astype(jnp.float32) / (num_tokens * cfg.top_k)
  mean_probs = _psum(aux.router_probs.sum(axis=0), token_axes) / num_tokens
  load_balancing_loss = cfg.num_experts * jnp.sum(fraction * mean_probs)
  lse = jax.nn.logsumexp(aux.router_logits, axis=-1)
  router_z_loss = _psum(jnp.sum(lse**2), token_axes) / num_tokens
  return dataclasses.replace(
      aux,
      tokens_per_expert=tokens_per_expert,
      load_balancing_loss=load_balancing_loss,
      router_z_loss=router_z_loss,
      dropped_tokens=_psum(aux.dropped_tokens, token_axes),
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
    send_sizes, send_offsets, recv_sizes, recv_offsets: [ep] int32, rows and
      first row per peer in the send and receive buffers (ragged layout).
    peer_recv_offsets: [ep] int32, where this device's rows land in each
      peer's receive buffer.
    peer_send_offsets: [ep] int32, where each peer's rows for this device
      start in that peer's send order.
    dropped: scalar int32, this device's copies that did not fit.
    exchange: "padded", "ragged" or "ragged_emulated".
    slots: padded slots per peer (padded) or receive rows (ragged).
  """

  rows: jax.Array
  group_sizes: jax.Array
  local: permute.Dispatched
  sent: jax.Array
  return_slot: jax.Array
  regroup: jax.Array
  send_sizes: jax.Array
  send_offsets: jax.Array
  recv_sizes: jax.Array
  recv_offsets: jax.Array
  peer_recv_offsets: jax.Array
  peer_send_offsets: jax.Array
  dropped: jax.Array
  exchange: str = dataclasses.field(metadata=dict(static=True))
  slots: int = dataclasses.field(metadata=dict(static=True))


def dispatch(
    x: jax.Array,
    expert_ids: jax.Array,
    cfg: config_lib.MoEConfig,
    *,
    expert_axis: str,
    exchange: str = "padded",
    buffer_factor: float | None = None,
    overflow: str = "error",
) -> EPDispatched:
  """Sends each token copy to the device of its expert; call in shard_map.

  Args:
    x: [T_l, D] this device's tokens.
    expert_ids: [T_l, K] int32 global expert ids, distinct within a row (as
      `routing.route` makes them; the drop-free bound relies on it).
    cfg: the block's config (E, K).
    expert_axis: the mesh axis the experts are split over; device i holds
      experts [i*E_l, (i+1)*E_l).
    exchange: "padded", "ragged" or "ragged_emulated" (not "auto": see
      `resolve_exchange`).
    buffer_factor: see `EPOptions`.
    overflow: see `EPOptions`.

  Returns:
    `EPDispatched`: rows [R, D] for `backend.expert_ffn` with group_sizes
    [E_l], and what `combine` needs.
  """
  if exchange not in ("padded", "ragged", "ragged_emulated"):
    raise ValueError(
        "dispatch needs exchange 'padded', 'ragged' or "
        f"'ragged_emulated', got {exchange!r}."
    )
  ep = _axis_size(expert_axis)
  if cfg.num_experts % ep:
    raise ValueError(
        f"num_experts={cfg.num_experts} must be divisible by the size of "
        f"expert axis {expert_axis!r}, got {ep}."
    )
  num_local_experts = cfg.num_experts // ep
  num_tokens, top_k = expert_ids.shape
  num_copies = num_tokens * top_k
  me = jax.lax.axis_index(expert_axis)
  slots, recv_rows = buffer_sizes(
      num_tokens, top_k, cfg.num_experts, ep, buffer_factor
  )
  padded = exchange == "padded"

  # Send order: copies sorted by global expert, hence by destination device.
  local = permute.dispatch(x, expert_ids, cfg.num_experts)
  # counts[i, j, e]: copies device i sends to local expert e of device j.
  counts = jax.lax.all_gather(local.group_sizes, expert_axis).reshape(
      ep, ep, num_local_experts
  )
  wanted = counts.sum(axis=-1)  # [src, dst]
  src_first = _exclusive_cumsum(wanted, axis=1)  # Row of dst's first copy.
  if padded:
    fits = jnp.minimum(wanted, slots)
    dst_first = None
  else:
    # Receivers stack sources in device order; the rows past the buffer's
    # end are the ones dropped, so later sources lose first.
    ahead = _exclusive_cumsum(wanted, axis=0)
    fits = jnp.clip(recv_rows - ahead, 0, wanted)
    dst_first = _exclusive_cumsum(fits, axis=0)
  send_sizes = fits[me]
  recv_sizes = fits[:, me]

  copy = jnp.arange(num_copies, dtype=jnp.int32)
  dest = jnp.clip(
      jnp.searchsorted(jnp.cumsum(wanted[me]), copy, side="right"), 0, ep - 1
  ).astype(jnp.int32)
  slot_in_peer = copy - src_first[me][dest]
  sent = slot_in_peer < send_sizes[dest]
  dropped = (num_copies - jnp.sum(sent)).astype(jnp.int32)
  if buffer_factor is not None and overflow == "error":
    local = dataclasses.replace(
        local,
        rows=_raise_on_overflow(
            local.rows,
            jax.lax.psum(dropped, expert_axis),
            buffer_factor,
            exchange,
            slots,
            recv_rows,
        ),
    )

  if padded:
    return_slot = dest * slots + jnp.clip(slot_in_peer, 0, slots - 1)
    # send[j, c] is copy src_first[j] + c, zero past the copies that fit.
    c = jnp.arange(slots, dtype=jnp.int32)[None, :]
    source = src_first[me][:, None] + c
    valid = c < send_sizes[:, None]
    send = jnp.where(
        valid[..., None], local.rows[jnp.clip(source, 0, num_copies - 1)], 0
    )
    received = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)
    received = received.reshape(ep * slots, -1)
    row = jnp.arange(ep * slots, dtype=jnp.int32)
    source_dev, slot = row // slots, row % slots
    valid_row = slot < recv_sizes[source_dev]
    send_offsets = src_first[me]
    recv_offsets = jnp.arange(ep, dtype=jnp.int32) * slots
    peer_recv = me * slots * jnp.ones(ep, jnp.int32)
  else:
    return_slot = copy
    send_offsets = src_first[me]
    recv_offsets = dst_first[:, me]
    peer_recv = dst_first[me]
    rows = jnp.where(sent[:, None], local.rows, 0)
    received = _ragged_exchange(
        exchange,
        rows,
        jnp.zeros((recv_rows, x.shape[1]), x.dtype),
        send_offsets,
        send_sizes,
        peer_recv,
        recv_sizes,
        expert_axis,
    )
    row = jnp.arange(recv_rows, dtype=jnp.int32)
    ends = recv_offsets + recv_sizes
    source_dev = jnp.clip(
        jnp.searchsorted(ends, row, side="right"), 0, ep - 1
    ).astype(jnp.int32)
    slot = row - recv_offsets[source_dev]
    valid_row = row < jnp.sum(recv_sizes)

  # A received row's expert: the sender sorted by expert, so slot c of
  # source j belongs to the expert whose cumulative count first exceeds c.
  ends_by_expert = jnp.cumsum(counts[:, me, :], axis=1)  # [src, E_l]
  expert_of = jnp.sum(ends_by_expert[source_dev] <= slot[:, None], axis=1)
  key = jnp.where(valid_row, expert_of, num_local_experts).astype(jnp.int32)
  regroup = jnp.argsort(key, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(key, length=num_local_experts + 1)[
      :num_local_experts
  ].astype(jnp.int32)
  grouped = jnp.where(valid_row[regroup][:, None], received[regroup], 0)
  return EPDispatched(
      rows=grouped,
      group_sizes=group_sizes,
      local=local,
      sent=sent,
      return_slot=return_slot.astype(jnp.int32),
      regroup=regroup,
      send_sizes=send_sizes,
      send_offsets=send_offsets,
      recv_sizes=recv_sizes,
      recv_offsets=recv_offsets,
      peer_recv_offsets=peer_recv,
      peer_send_offsets=src_first[:, me],
      dropped=dropped,
      exchange=exchange,
      slots=slots if padded else recv_rows,
  )


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
  if d.exchange == "padded":
    ep = _axis_size(expert_axis)
    back = jax.lax.all_to_all(
        received.reshape(ep, d.slots, -1), expert_axis, 0, 0, tiled=True
    )
    back = back.reshape(ep * d.slots, -1)
  else:
    back = _ragged_exchange(
        d.exchange,
        received,
        jnp.zeros((num_copies, received.shape[1]), received.dtype),
        d.recv_offsets,
        d.recv_sizes,
        d.peer_send_offsets,
        d.send_sizes,
        expert_axis,
    )
  per_copy = jnp.where(d.sent[:, None], back[d.return_slot], 0)
  kept = d.sent[d.local.position].reshape(combine_weights.shape)
  return permute.combine(per_copy, d.local, combine_weights, kept)


# --- The routed block -------------------------------------------------------


def routed_experts(
    backend: str | backend_lib.Backend,
    params: dict,
    x: jax.Array,
    aux: routing.MoEAux,
    cfg: config_lib.MoEConfig,
    *,
    expert_axis: str,
    token_axes: Sequence[str],
    options: EPOptions = EPOptions(),
    platform: str | None = None,
) -> tuple[jax.Array, routing.MoEAux]:
  """dispatch -> backend.expert_ffn -> combine; call inside shard_map.

  Args:
    backend: a name or `Backend`; "auto" tries `registry.auto_candidates()`
      in order. Only its `expert_ffn` is used (on the local experts).
    params: this device's params: w_gate, w_up [E_l, D, F], w_down [E_l, F, D].
    x: [T_l, D] this device's tokens.
    aux: `route`'s output for them.
    cfg: the block's config.
    expert_axis: the mesh axis the experts are split over.
    token_axes: every mesh axis the tokens are split over (for the counts).
    options: `EPOptions`.
    platform: for `exchange="auto"`; JAX's default backend if None.

  Returns:
    ([T_l, D] in x's dtype, aux with kept, combine_weights and dropped_tokens
    updated for copies dropped by a bounded buffer with overflow="drop").
  """
  exchange = resolve_exchange(
      options.exchange, platform or jax.default_backend()
  )
  num_tokens = x.shape[0]
  chunks = options.num_chunks
  if num_tokens % chunks:
    raise ValueError(
        f"num_chunks={chunks} must divide the tokens per device, got "
        f"{num_tokens} tokens per device."
    )
  size = num_tokens // chunks
  ys, kept = [], []
  # A Python loop, so the chunks are independent ops the scheduler may
  # overlap (one chunk's exchange with another's expert compute).
  for i in range(chunks):
    part = slice(i * size, (i + 1) * size)
    d = dispatch(
        x[part],
        aux.expert_ids[part],
        cfg,
        expert_axis=expert_axis,
        exchange=exchange,
        buffer_factor=options.buffer_factor,
        overflow=options.overflow,
    )
    out = registry.call_backend(
        backend, lambda b, d=d: b.expert_ffn(d.rows, d.group_sizes, params, cfg)
    )
    ys.append(
        combine(out, d, aux.combine_weights[part], expert_axis=expert_axis)
    )
    kept.append(d.sent[d.local.position].reshape(size, cfg.top_k))
  y = jnp.concatenate(ys) if chunks > 1 else ys[0]
  kept = jnp.concatenate(kept) if chunks > 1 else kept[0]
  if options.buffer_factor is not None:
    dropped = (kept.size - jnp.sum(kept)).astype(jnp.int32)
    aux = dataclasses.replace(
        aux,
        kept=kept,
        combine_weights=jnp.where(kept, aux.combine_weights, 0.0),
        dropped_tokens=aux.dropped_tokens + _psum(dropped, tuple(token_axes)),
    )
  return y.astype(x.dtype), aux


# --- The whole layer under a mesh -------------------------------------------


def param_specs(
    cfg: config_lib.MoEConfig,
    expert_axis: str = "expert",
) -> dict[str, P]:
  """PartitionSpec of each parameter: experts split, the rest replicated."""
  return {
      name: P(expert_axis) if name in ("w_gate", "w_up", "w_down") else P()
      for name in params_lib.param_shapes(cfg)
  }


def shard_params(
    params: dict,
    cfg: config_lib.MoEConfig,
    mesh: jax.sharding.Mesh,
    expert_axis: str = "expert",
) -> dict[str, jax.Array]:
  """Places `params` on `mesh` as `moe_layer(..., mesh=mesh)` expects them.

  Each device then holds E / ep experts' weights. In a multi-process run,
  every process must pass the same full values (e.g. from one seed).
  """
  specs = param_specs(cfg, expert_axis)
  return {
      name: jax.device_put(value, NamedSharding(mesh, specs[name]))
      for name, value in params.items()
  }


def check_mesh(
    mesh, cfg: config_lib.MoEConfig, expert_axis: str, data_axes: Sequence[str]
) -> tuple[str, ...]:
  """Validates the mesh arguments; returns the token axes."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh)}.")
  if isinstance(data_axes, str):
    raise TypeError(
        "data_axes must be a sequence of axis names, got the "
        f"string {data_axes!r}; write ({data_axes!r},)."
    )
  data_axes = tuple(data_axes)
  names = tuple(mesh.axis_names)
  if expert_axis not in names:
    raise ValueError(
        f"expert_axis={expert_axis!r} is not an axis of the "
        f"mesh; mesh axes are {names}."
    )
  missing = [a for a in data_axes if a not in names]
  if missing:
    raise ValueError(
        f"data_axes={data_axes} names axes {missing} the mesh "
        f"lacks; mesh axes are {names} (data_axes=() for none)."
    )
  if expert_axis in data_axes or len(set(data_axes)) != len(data_axes):
    raise ValueError(
        "data_axes must be distinct and exclude expert_axis, got "
        f"data_axes={data_axes}, expert_axis={expert_axis!r}."
    )
  ep = mesh.shape[expert_axis]
  if cfg.num_experts % ep:
    raise ValueError(
        f"num_experts={cfg.num_experts} must be divisible by the expert axis "
        f"size, got mesh.shape[{expert_axis!r}]={ep}."
    )
  return (*data_axes, expert_axis)


def moe_layer(
    params: dict,
    x: jax.Array,
    cfg: config_lib.MoEConfig,
    backend: str | backend_lib.Backend = "auto",
    *,
    mesh: jax.sharding.Mesh,
    expert_axis: str = "expert",
    data_axes: Sequence[str] = ("data",),
    options: EPOptions | None = None,
) -> tuple[jax.Array, routing.MoEAux]:
  """`api.moe_layer` with expert parallelism over `mesh`.

  Tokens (x flattened to [T, D]) are split over data_axes x expert_axis;
  w_gate, w_up, w_down over expert_axis; the router and shared expert are
  replicated. Works under jit and grad, single- or multi-process (x and
  params are then global arrays). Mesh axes not named here replicate the
  computation.

  Returns:
    y [..., D] in x's dtype; `MoEAux` whose per-token fields are [T, ...]
    sharded like the tokens and whose statistics are global.
  """
  options = options or EPOptions()
  token_axes = check_mesh(mesh, cfg, expert_axis, data_axes)
  shards = math.prod(mesh.shape[a] for a in token_axes)
  num_tokens = math.prod(x.shape[:-1])
  if num_tokens % (shards * options.num_chunks):
    raise ValueError(
        f"the {num_tokens} tokens of x (shape {tuple(x.shape)}) must split "
        f"evenly over the {shards} devices of axes {token_axes}"
        + (
            f" and num_chunks={options.num_chunks}"
            if options.num_chunks > 1
            else ""
        )
        + "."
    )
  platform = mesh.devices.flat[0].platform
  exchange = resolve_exchange(options.exchange, platform)
  options = dataclasses.replace(options, exchange=exchange)
  explicit = _is_explicit(mesh)
  token_spec = P(token_axes)
  tokens = _reshape(
      x,
      (num_tokens, cfg.hidden_size),
      NamedSharding(mesh, token_spec) if explicit else None,
  )
  specs = param_specs(cfg, expert_axis)
  if explicit:
    tokens = _reshard(tokens, NamedSharding(mesh, token_spec))
    params = {
        k: _reshard(v, NamedSharding(mesh, specs[k])) for k, v in params.items()
    }

  def body(params, tokens):
    aux = route(
        tokens,
        params["router"],
        cfg,
        params.get("correction_bias"),
        token_axes=token_axes,
    )
    y, aux = routed_experts(
        backend,
        params,
        tokens,
        aux,
        cfg,
        expert_axis=expert_axis,
        token_axes=token_axes,
        options=options,
        platform=platform,
    )
    if cfg.shared_ffn_size:
      shared = ffn.shared_expert(params, tokens, cfg)
      y = (y.astype(jnp.float32) + shared.astype(jnp.float32)).astype(
          tokens.dtype
      )
    return y, aux

  aux_specs = routing.MoEAux(
      **{
          f.name: token_spec if f.name in _PER_TOKEN_AUX else P()
          for f in dataclasses.fields(routing.MoEAux)
      }
  )
  # check_vma=False: backends build loop carries (zeros) without the
  # varying-axis types that check_vma demands of every value in the body.
  y, aux = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(specs, token_spec),
      out_specs=(token_spec, aux_specs),
      check_vma=False,
  )(params, tokens)
  out_sharding = None
  if explicit:
    out_sharding = _output_sharding(x, mesh, token_spec, shards)
  return _reshape(y, x.shape, out_sharding), aux


# --- Helpers ----------------------------------------------------------------


def _raise_on_overflow(x, dropped, buffer_factor, exchange, slots, rows):
  """x, made to depend on a host check that raises when dropped > 0.

  The check's (zero) result is added to x so it runs before the exchange and
  is never pruned; it fails the computation with the count.
  """
  bound = (
      f"{slots} slots per peer"
      if exchange == "padded"
      else f"{rows} receive rows"
  )

  def check(count):
    if int(count) > 0:
      raise RuntimeError(
          f"expert-parallel receive buffer overflow: {int(count)} token "
          f"copies did not fit the bounded buffer (buffer_factor="
          f"{buffer_factor}, {bound}, exchange={exchange!r}). Raise "
          "buffer_factor, use buffer_factor=None (drop-free worst-case "
          "buffers) or overflow='drop' (dropped copies counted in "
          "aux.dropped_tokens)."
      )
    return np.zeros((), np.float32)

  zero = jax.pure_callback(
      check, jax.ShapeDtypeStruct((), jnp.float32), dropped
  )
  return x + zero.astype(x.dtype)


def _ragged_exchange(
    exchange,
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    axis_name,
):
  if exchange == "ragged":
    return jax.lax.ragged_all_to_all(
        operand,
        output,
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis_name,
    )
  return emulated_ragged_all_to_all(
      operand,
      output,
      input_offsets,
      send_sizes,
      output_offsets,
      recv_sizes,
      axis_name=axis_name,
  )


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


def _exclusive_cumsum(a, axis):
  return (jnp.cumsum(a, axis=axis) - a).astype(jnp.int32)


def _axes_size(axes) -> int:
  return math.prod(_axis_size(a) for a in axes)


def _psum(value, axes):
  return jax.lax.psum(value, tuple(axes)) if axes else value


def _output_sharding(x, mesh, token_spec, shards):
  """y's sharding on an explicit mesh: x's own if x has one there, else the
  tokens' split on the leading dim where it divides, else replicated."""
  sharding = compat.sharding_of(x)
  if sharding is not None and not sharding.mesh.empty and any(sharding.spec):
    return NamedSharding(mesh, sharding.spec)
  if x.shape[0] % shards == 0:
    return NamedSharding(mesh, token_spec)
  return NamedSharding(mesh, P())


def _reshape(x, shape, out_sharding):
  if out_sharding is None:
    return jnp.reshape(x, shape)
  return jnp.reshape(x, shape, out_sharding=out_sharding)
