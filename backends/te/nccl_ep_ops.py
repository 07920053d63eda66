"""JAX primitives over Transformer Engine's NCCL-EP dispatch, for nccl_ep.py.

`dispatch` sends each row to one device (`dest`; -1: nowhere) with an
integer tag, as NCCL-EP's prepare and dispatch (high-throughput mode,
top_k = 1, the tag as the routing weight); `owner` and `place` are the
index helpers around it. TE's EP primitives are written for a global-view
jit; inside `shard_map` this module binds their per-device form (TE's
`inner_primitive`s, `is_outer=False`), which is what TE's partitioner binds
on each device. Each dispatch is linear in its rows. Its transpose (reverse
mode) is NCCL-EP's dispatch backward (`te_ep_dispatch_bwd_ffi`) on the same
routing state; its tangent (forward mode: jvp, linearize, Hessians) a second
dispatch of the tangent rows on that state, each the other's transpose
(`_send`). The tags carry none. TE is imported on first use.
"""

from __future__ import annotations

import functools
import importlib

import jax
from jax.interpreters import ad
import jax.numpy as jnp

from backends.te import _te
from moe_core.kernels import primitive

# NCCL-EP's high-throughput mode pads each expert's receive slab to a
# multiple of this (TE's moe.py uses the same 128: the HT kernels need it).
ALIGNMENT = 128


def owner(starts: jax.Array, index: jax.Array) -> jax.Array:
  """[N] int32: the peer whose range (from `starts` [ep]) holds each index.

  The last peer starting at or before it: empty peers share their start
  with the next one, which owns the rows.
  """
  peer = jnp.searchsorted(starts, index, side="right") - 1
  return jnp.clip(peer, 0, starts.shape[0] - 1).astype(jnp.int32)


def place(received, tags, arrived, num_rows):
  """[num_rows, D]: each received row at its tag; the rest zero.

  received: [Q, D] NCCL-EP's receive slab; tags: [Q] float32; only its first
  `arrived` rows are real (the rest is padding NCCL-EP leaves unwritten).
  """
  real = jnp.arange(received.shape[0]) < arrived
  row = jnp.where(real, tags, 0.0).astype(jnp.int32)
  row = jnp.where(real, row, num_rows)  # Out of range: dropped.
  out = jnp.zeros((num_rows, received.shape[1]), received.dtype)
  return out.at[row].set(received, mode="drop")


def ep_ops():
  """TE's EP primitives (transformer_engine.jax.cpp_extensions.ep)."""
  _te.import_te()
  return importlib.import_module("transformer_engine.jax.cpp_extensions.ep")


def _on_collective_stream(fn):
  """fn on XLA's collective stream where TE's JAX supports it, as TE's own
  EP calls run (so XLA orders them with its collectives)."""
  return getattr(ep_ops(), "_on_collective_stream", lambda f: f)(fn)


def dispatch(num_rows, recv_rows, rows, dest, tags):
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
  """`dispatch`, and NCCL-EP's routing state (the prepare's handle).

  A custom JVP: the dispatch is linear in the rows, and its tangent is a
  dispatch of the tangent rows on the same routing state (`_redispatch_p`),
  whose transpose is NCCL-EP's dispatch backward on that state
  (`_dispatch_bwd_p`): reverse mode runs prepare, dispatch and dispatch
  backward as a custom VJP would, and forward mode (jvp, linearize,
  Hessians) a second dispatch, with no second prepare.
  """
  del num_rows
  ops = ep_ops()
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
  ops = ep_ops()
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
  ops = ep_ops()
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
