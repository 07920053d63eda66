"""Transformer Engine's NCCL-EP as an expert-parallel exchange: "te_nccl_ep".

`NcclEpExchange` implements `moe_core.parallel.exchange.Exchange` with TE's
NCCL-EP kernels (`transformer_engine.jax.ep`, high-throughput mode), chosen
by `EPOptions(exchange="te_nccl_ep")`; `"auto"` never picks it. Its layout is
the ragged exchange's (a receive buffer of `capacity` rows, each source's
rows stacked in device order, results back in the send order), so the
stages run unchanged. How NCCL-EP is made to fit that interface:

  * NCCL-EP routes tokens to experts. Here every copy is a "token" with one
    choice (top_k = 1), and the "experts" are the devices: the communicator
    is created with one expert per device of the expert axis, so a copy's
    destination device is its expert and the real experts stay the stages'.
  * NCCL-EP lays out what a device receives by expert, in an order of its
    own, padded to 128 rows. Each copy therefore carries its row in the
    interface's buffer as its routing "weight" (float32: exact below 2**24),
    and the receiver scatters the rows there. So no row's place depends on
    NCCL-EP's internal order, and its padding rows (not initialised) are
    never read: only the first sum(recv_sizes) rows of its slab are real.
  * NCCL-EP's combine is the inverse of one dispatch and needs that
    dispatch's routing state (`handle_mem`), which the interface cannot
    carry from `send` to `send_back`, and its order is NCCL-EP's own. So
    `send_back` is a second dispatch, from the experts' devices back to the
    copies' devices, tagged with each copy's place in its send order.
    NCCL-EP's combine (an unweighted sum: the caller must pre-multiply the
    weights) is not used; the stages weight and sum the copies as for every
    exchange.
  * Copies a bounded buffer does not admit are routed to expert -1, which
    NCCL-EP skips.
  * Derivatives: each dispatch is linear in its rows. Its transpose
    (reverse mode) is NCCL-EP's dispatch backward (`te_ep_dispatch_bwd_ffi`)
    on the same routing state; its tangent (forward mode: jvp, linearize,
    Hessians) a second dispatch of the tangent rows on that state, each
    the other's transpose (`_send`). The tags carry none.

What NCCL-EP needs, and what raises otherwise: a communicator created
outside jit, once per process, for the layer's sizes (`bootstrap`; tracing
without it raises NotImplementedError); bfloat16 rows (other dtypes raise
NotImplementedError naming the dtype); at least 2 devices on the expert
axis; and, checked when `bootstrap` runs (by TE and NCCL-EP, not here),
SM90 or newer GPUs joined by NVLink, one GPU per process unless TE was
built with XLA's borrowed communicator. TE's EP primitives are written
for a global-view jit; inside `shard_map` this module binds their
per-device form (TE's `inner_primitive`s, `is_outer=False`), which is what
TE's partitioner binds on each device.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Sequence

import jax
from jax.interpreters import ad
import jax.numpy as jnp

from backends.te import _te
from moe_core import compat
from moe_core import config as config_lib
from moe_core import validation
from moe_core.kernels import primitive
from moe_core.parallel import options as options_lib
from moe_core.parallel import ragged

# NCCL-EP's high-throughput mode pads each expert's receive slab to a
# multiple of this (TE's moe.py uses the same 128: the HT kernels need it).
ALIGNMENT = 128
# float32 holds every integer below this exactly: the bound on a row tag.
_EXACT_FLOAT32_INTS = 2**24
_TOKEN_DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class CommunicatorSizes:
  """The sizes NCCL-EP's communicator is created with (`bootstrap`).

  Attributes:
    num_experts: NCCL-EP's experts: one per device of the expert axis.
    max_tokens_per_rank: most rows one device sends in one dispatch: its
      T_l*K copies (`send`) or its receive rows (`send_back`).
    recv_capacity_per_rank: rows of NCCL-EP's receive buffer, the same for
      both dispatches (NCCL-EP wants it equal to the communicator's): the
      larger of the two, rounded up to `ALIGNMENT`.
  """

  num_experts: int
  max_tokens_per_rank: int
  recv_capacity_per_rank: int


def communicator_sizes(
    tokens: int,
    top_k: int,
    num_experts: int,
    ep: int,
    buffer_factor: float | None,
) -> CommunicatorSizes:
  """NCCL-EP's sizes for T_l tokens per device (per chunk); pure Python.

  Args: as `Exchange.capacity`.
  """
  rows = options_lib.buffer_sizes(
      tokens, top_k, num_experts, ep, buffer_factor
  )[1]
  return _sizes(ep, tokens * top_k, rows)


def _sizes(ep: int, copies: int, rows: int) -> CommunicatorSizes:
  """The sizes for M copies sent and R receive rows on each of ep devices."""
  most = max(copies, rows)
  return CommunicatorSizes(
      num_experts=ep,
      max_tokens_per_rank=most,
      recv_capacity_per_rank=-(-most // ALIGNMENT) * ALIGNMENT,
  )


def bootstrap(
    mesh: jax.sharding.Mesh,
    cfg: config_lib.MoEConfig,
    num_tokens: int,
    *,
    expert_axis: str = "expert",
    data_axes: Sequence[str] = ("data",),
    options: options_lib.EPOptions | None = None,
) -> CommunicatorSizes:
  """Creates NCCL-EP's communicator for `moe_layer(..., mesh=mesh)`.

  Call once per process, eagerly (outside jit), before tracing a layer with
  `EPOptions(exchange="te_nccl_ep")`, with the arguments that layer gets.
  Every layer that uses the exchange must have the same sizes: NCCL-EP
  fixes them when the communicator is made (TE's `ep_finalize` tears it
  down). Needs a GPU machine: NCCL, SM90+, NVLink, one GPU per process.

  Args:
    mesh: the layer's mesh.
    cfg: the layer's config.
    num_tokens: T, the tokens of the layer's input (all of its leading
      dims), over every device.
    expert_axis, data_axes: as `moe_layer`.
    options: the layer's `EPOptions` (buffer_factor and num_chunks size the
      buffers).

  Returns:
    The `CommunicatorSizes` it was created with.
  """
  options = options or options_lib.EPOptions(exchange=NcclEpExchange.name)
  token_axes = validation.check_mesh(mesh, cfg, expert_axis, data_axes)
  shards = math.prod(mesh.shape[a] for a in token_axes)
  per_chunk = shards * options.num_chunks
  if num_tokens % per_chunk:
    raise ValueError(
        f"num_tokens must split evenly over the {shards} token shards and "
        f"{options.num_chunks} chunks, got num_tokens={num_tokens}."
    )
  sizes = communicator_sizes(
      num_tokens // per_chunk,
      cfg.top_k,
      cfg.num_experts,
      mesh.shape[expert_axis],
      options.buffer_factor,
  )
  _te.import_te()
  ep_api = importlib.import_module("transformer_engine.jax.ep")
  sharding = importlib.import_module("transformer_engine.jax.sharding")
  resource = sharding.MeshResource(ep_resource=expert_axis)
  with mesh, sharding.global_shard_guard(resource):
    ep_api.ep_bootstrap(
        world_size=None,
        rank=None,
        num_experts=sizes.num_experts,
        max_tokens_per_rank=sizes.max_tokens_per_rank,
        recv_capacity_per_rank=sizes.recv_capacity_per_rank,
        hidden_dim=cfg.hidden_size,
        max_token_dtype=_TOKEN_DTYPE,
    )
  return sizes


class NcclEpExchange(ragged.RaggedExchange):
  """The ragged exchange's layout and capacity; NCCL-EP moves the rows.

  `capacity`, `describe_capacity`, `admit` and `return_slot` are the ragged
  exchange's (receivers stack sources in device order, results come back to
  the send order); `send` and `send_back` are NCCL-EP dispatches.
  """

  name = "te_nccl_ep"
  platforms = ("cuda",)
  needs = (
      "Transformer Engine's NCCL-EP kernels (SM90+ NVIDIA GPUs joined by "
      "NVLink), which run on"
  )
  instead = "exchange='auto' (ragged on GPU and TPU, padded elsewhere)"

  def send(self, rows, sent, layout, axis_name):
    num_copies, hidden = rows.shape
    recv_rows = self._receive_rows(
        rows.dtype, axis_name, num_copies, layout.capacity, hidden
    )
    copy = jnp.arange(num_copies, dtype=jnp.int32)
    dest = _owner(layout.send_offsets, copy)
    slot = copy - layout.send_offsets[dest]
    # Each copy's row in its receiver's buffer travels as its tag.
    tag = layout.peer_recv_offsets[dest] + slot
    received, tags = self._dispatch(
        rows, jnp.where(sent, dest, -1), tag, recv_rows, axis_name
    )
    arrived = jnp.sum(layout.recv_sizes)
    return _place(received, tags, arrived, layout.capacity)

  def send_back(self, rows, layout, num_copies, axis_name):
    num_rows, hidden = rows.shape
    recv_rows = self._receive_rows(
        rows.dtype, axis_name, num_copies, num_rows, hidden
    )
    row = jnp.arange(num_rows, dtype=jnp.int32)
    source = _owner(layout.recv_offsets, row)
    slot = row - layout.recv_offsets[source]
    real = slot < layout.recv_sizes[source]
    # The copy's place in its source's send order travels as its tag.
    tag = layout.peer_send_offsets[source] + slot
    received, tags = self._dispatch(
        rows, jnp.where(real, source, -1), tag, recv_rows, axis_name
    )
    arrived = jnp.sum(layout.send_sizes)
    return _place(received, tags, arrived, num_copies)

  def _receive_rows(self, dtype, axis_name, copies, rows, hidden):
    """Q, NCCL-EP's receive rows for M `copies` and R receive `rows`.

    Raises NotImplementedError for what NCCL-EP cannot do.
    """
    # Again for code that calls the stages in its own shard_map.
    self.check_platform(_platform())
    if jnp.dtype(dtype) != _TOKEN_DTYPE:
      raise NotImplementedError(
          f"exchange {self.name!r} moves bfloat16 rows only (NCCL-EP's "
          f"token dtype), got {jnp.dtype(dtype).name}; cast the "
          "activations to bfloat16 or use exchange='ragged'."
      )
    ep = compat.axis_size(axis_name)
    if ep < 2:
      raise NotImplementedError(
          f"exchange {self.name!r} needs at least 2 devices on the expert "
          f"axis (NCCL-EP forms no group of one), got {ep}."
      )
    need = _sizes(ep, copies, rows)
    if need.recv_capacity_per_rank >= _EXACT_FLOAT32_INTS:
      raise NotImplementedError(
          f"exchange {self.name!r} tags rows with float32 integers, exact "
          f"below {_EXACT_FLOAT32_INTS}; this layer needs "
          f"{need.recv_capacity_per_rank} receive rows."
      )
    self._check_communicator(need, hidden)
    return need.recv_capacity_per_rank

  def check_platform(self, platform):
    """Raises NotImplementedError, naming `platform`, off NVIDIA GPUs.

    At trace time, before the other checks (which would blame the dtype or
    the missing communicator). A communicator (made by `bootstrap` on a
    GPU, or set by a test to trace a program for CUDA on a CPU host)
    waives it; the program is then refused at lowering instead if it is
    lowered for another platform (`exchange.refuse_other_platforms`).
    """
    if self.runs_on(platform) or _communicator_made():
      return
    raise NotImplementedError(self.unsupported_platform_message(platform))

  def _check_communicator(self, need: CommunicatorSizes, hidden: int):
    """Raises unless NCCL-EP's communicator was made for these sizes."""
    try:
      have = _ep_ops().get_ep_config()
    except RuntimeError as e:
      raise NotImplementedError(
          f"exchange {self.name!r} needs NCCL-EP's communicator, which is "
          "created outside jit: call backends.te.nccl_ep.bootstrap(mesh, "
          "cfg, num_tokens, ...) once per process before tracing the layer."
      ) from e
    if (
        have.ep_size != need.num_experts
        or have.num_experts != need.num_experts
        or have.hidden_dim != hidden
        or have.max_tokens_per_rank < need.max_tokens_per_rank
        or have.recv_capacity_per_rank != need.recv_capacity_per_rank
    ):
      raise ValueError(
          "NCCL-EP's communicator was created for ep_size="
          f"{have.ep_size}, num_experts={have.num_experts}, hidden_dim="
          f"{have.hidden_dim}, max_tokens_per_rank="
          f"{have.max_tokens_per_rank}, recv_capacity_per_rank="
          f"{have.recv_capacity_per_rank}; this layer needs ep_size="
          f"{need.num_experts}, num_experts={need.num_experts}, hidden_dim="
          f"{hidden}, max_tokens_per_rank>={need.max_tokens_per_rank}, "
          f"recv_capacity_per_rank={need.recv_capacity_per_rank}: "
          "bootstrap with this layer's mesh, config, token count and "
          "EPOptions."
      )

  @staticmethod
  def _dispatch(rows, dest, tags, recv_rows, axis_name):
    """One NCCL-EP dispatch: ([Q, D] rows received, [Q] float32 tags).

    The first sum-over-sources rows of the result are the rows sent to this
    device, in NCCL-EP's order; the rest is padding. Tests replace it.
    """
    del axis_name  # The communicator spans the expert axis (`bootstrap`).
    return _dispatch(rows.shape[0], recv_rows, rows, dest, tags)


def _platform() -> str:
  """JAX's default platform ("cpu", "gpu", "tpu"); tests replace it."""
  return jax.default_backend()


def _communicator_made() -> bool:
  """Whether TE imports here and holds an NCCL-EP communicator."""
  try:
    _ep_ops().get_ep_config()
  except (ImportError, RuntimeError):
    return False
  return True


def _owner(starts: jax.Array, index: jax.Array) -> jax.Array:
  """[N] int32: the peer whose range (from `starts` [ep]) holds each index.

  The last peer starting at or before it: empty peers share their start
  with the next one, which owns the rows.
  """
  peer = jnp.searchsorted(starts, index, side="right") - 1
  return jnp.clip(peer, 0, starts.shape[0] - 1).astype(jnp.int32)


def _place(received, tags, arrived, num_rows):
  """[num_rows, D]: each received row at its tag; the rest zero.

  received: [Q, D] NCCL-EP's receive slab; tags: [Q] float32; only its first
  `arrived` rows are real (the rest is padding NCCL-EP leaves unwritten).
  """
  real = jnp.arange(received.shape[0]) < arrived
  row = jnp.where(real, tags, 0.0).astype(jnp.int32)
  row = jnp.where(real, row, num_rows)  # Out of range: dropped.
  out = jnp.zeros((num_rows, received.shape[1]), received.dtype)
  return out.at[row].set(received, mode="drop")


def _ep_ops():
  """TE's EP primitives (transformer_engine.jax.cpp_extensions.ep)."""
  _te.import_te()
  return importlib.import_module("transformer_engine.jax.cpp_extensions.ep")


def _on_collective_stream(fn):
  """fn on XLA's collective stream where TE's JAX supports it, as TE's own
  EP calls run (so XLA orders them with its collectives)."""
  return getattr(_ep_ops(), "_on_collective_stream", lambda f: f)(fn)


def _dispatch(num_rows, recv_rows, rows, dest, tags):
  """NCCL-EP dispatch of each row to device `dest` (-1: nowhere).

  Args:
    num_rows: N, rows.shape[0].
    recv_rows: Q, NCCL-EP's receive rows.
    rows: [N, D] bfloat16.
    dest: [N] int32 destination device, or -1.
    tags: [N] int32 < 2**24, delivered with each row.

  Returns:
    ([Q, D] received rows, [Q] float32 their tags): the rows from every
    source, NCCL-EP's order, padding past them. Differentiable in rows in
    both directions (`_send`).
  """
  received, received_tags, _ = _send(num_rows, recv_rows, rows, dest, tags)
  return received, received_tags


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _send(num_rows, recv_rows, rows, dest, tags):
  """`_dispatch`, and NCCL-EP's routing state (the prepare's handle).

  A custom JVP: the dispatch is linear in the rows, and its tangent is a
  dispatch of the tangent rows on the same routing state (`_redispatch_p`),
  whose transpose is NCCL-EP's dispatch backward on that state
  (`_dispatch_bwd_p`): reverse mode runs prepare, dispatch and dispatch
  backward as a custom VJP would, and forward mode (jvp, linearize,
  Hessians) a second dispatch, with no second prepare.
  """
  del num_rows
  ops = _ep_ops()
  topk_idx = dest[:, None]
  weights = tags.astype(jnp.float32)[:, None]

  def run(topk_idx, rows, weights):
    _, _, handle = ops.EpPreparePrimitive.inner_primitive.bind(
        topk_idx,
        top_k=1,
        dispatch_output_per_expert_alignment=ALIGNMENT,
        is_outer=False,
    )
    received, received_tags = _dispatch_with(
        ops, handle, topk_idx, rows, weights, recv_rows
    )
    return received, received_tags, handle

  return _on_collective_stream(run)(topk_idx, rows, weights)


@_send.defjvp
def _send_jvp(num_rows, recv_rows, primals, tangents):
  rows, dest, tags = primals
  d_rows = tangents[0]
  # The primal from _send itself: a derivative of this rule goes through
  # the rule again.
  out = received, received_tags, handle = _send(
      num_rows, recv_rows, rows, dest, tags
  )
  d_received = _bind_linear(
      _redispatch_p, d_rows, handle, dest, tags, num_rows, recv_rows
  )
  # The tags carry no derivative; the handle's is float0.
  d_tags, d_handle = jax.custom_derivatives.zero_from_primal(
      (received_tags, handle)
  )
  return out, (d_received.astype(received.dtype), d_tags, d_handle)


def _dispatch_with(ops, handle, topk_idx, rows, weights, recv_rows):
  """NCCL-EP's dispatch on a prepared routing state: ([Q, D], [Q])."""
  received, received_tags = ops.EpDispatchPrimitive.inner_primitive.bind(
      handle,
      topk_idx,
      rows,
      weights,
      top_k=1,
      dispatch_output_per_expert_alignment=ALIGNMENT,
      recv_capacity_per_rank=recv_rows,
      is_outer=False,
  )
  return received[0], received_tags[0]


def _redispatch(rows, handle, dest, tags, *, num_rows, recv_rows):
  """[received [Q, D]]: rows dispatched on `handle`'s routing state."""
  del num_rows
  ops = _ep_ops()
  _te.lowering_needs_devices(_redispatch_p, _dispatch_bwd_p)

  def run(handle, topk_idx, rows, weights):
    return _dispatch_with(ops, handle, topk_idx, rows, weights, recv_rows)[0]

  return [
      _on_collective_stream(run)(
          handle, dest[:, None], rows, tags.astype(jnp.float32)[:, None]
      )
  ]


def _dispatch_bwd(g_received, handle, dest, tags, *, num_rows, recv_rows):
  """[g_rows [N, D]]: NCCL-EP's dispatch backward of a [Q, D] cotangent."""
  del dest, tags  # The routing state holds where each row went.
  ops = _ep_ops()
  _te.lowering_needs_devices(_redispatch_p, _dispatch_bwd_p)

  def run(handle, g_received):
    g_rows, _ = ops.EpDispatchBwdPrimitive.inner_primitive.bind(
        handle,
        g_received[None],
        jnp.zeros((1, recv_rows), jnp.float32),
        top_k=1,
        dispatch_output_per_expert_alignment=ALIGNMENT,
        out_leading_shape=(num_rows,),
        out_partition_spec=None,
    )
    return g_rows

  return [_on_collective_stream(run)(handle, g_received)]


def _redispatch_shape(avals, *, num_rows, recv_rows):
  del num_rows
  return [((recv_rows, avals[0].shape[1]), avals[0].dtype)]


def _dispatch_bwd_shape(avals, *, num_rows, recv_rows):
  del recv_rows
  return [((num_rows, avals[0].shape[1]), avals[0].dtype)]


# Both linear in their first operand (rows, or the received rows'
# cotangent), each the other's transpose.
_redispatch_p = primitive.kernel_primitive(
    "te_nccl_ep_redispatch", _redispatch, _redispatch_shape
)
_dispatch_bwd_p = primitive.kernel_primitive(
    "te_nccl_ep_dispatch_bwd", _dispatch_bwd, _dispatch_bwd_shape
)
_TRANSPOSE = {_redispatch_p: _dispatch_bwd_p, _dispatch_bwd_p: _redispatch_p}


def _bind_linear(prim, linear, handle, dest, tags, num_rows, recv_rows):
  operands = primitive.match_variance((linear, handle, dest, tags))
  (out,) = prim.bind(*operands, num_rows=num_rows, recv_rows=recv_rows)
  return out


def _linear_jvp(prim, primals, tangents, **params):
  linear, handle, dest, tags = primals
  (out,) = prim.bind(*primals, **params)
  if type(tangents[0]) is ad.Zero:
    return [out], [ad.Zero(jax.typeof(out).to_tangent_aval())]
  return [out], [_bind_linear(prim, tangents[0], handle, dest, tags, **params)]


def _linear_transpose(prim, cotangents, linear, handle, dest, tags, **params):
  (ct,) = cotangents
  if not ad.is_undefined_primal(linear):
    raise ValueError(f"{prim.name} is linear in its first operand only.")
  if type(ct) is ad.Zero:
    return [None] * 4
  ct = ct.astype(linear.aval.dtype)
  return [
      _bind_linear(_TRANSPOSE[prim], ct, handle, dest, tags, **params),
      None,
      None,
      None,
  ]


for _prim in (_redispatch_p, _dispatch_bwd_p):
  ad.primitive_jvps[_prim] = functools.partial(_linear_jvp, _prim)
  ad.primitive_transposes[_prim] = functools.partial(_linear_transpose, _prim)
