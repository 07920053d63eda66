"""Transformer Engine's NCCL-EP as an expert-parallel exchange: "te_nccl_ep".

`NcclEpExchange` implements `moe_core.parallel.exchange.Exchange` with TE's
NCCL-EP kernels (`transformer_engine.jax.ep`, high-throughput mode), chosen
by `EPOptions(exchange="te_nccl_ep")`; `"auto"` never picks it. Its layout is
the ragged exchange's (a receive buffer of `capacity` rows, each source's
rows stacked in device order, results back in the send order), so the
stages run unchanged; docs/te.md ("The NCCL-EP exchange") says how NCCL-EP
is made to fit that interface. It needs a communicator created outside jit,
once per process, for the layer's sizes (`bootstrap`; tracing without it
raises NotImplementedError), bfloat16 rows (other dtypes raise
NotImplementedError naming the dtype), at least 2 devices on the expert axis
and, checked when `bootstrap` runs (by TE and NCCL-EP, not here), SM90 or
newer GPUs joined by NVLink, one GPU per process unless TE was built with
XLA's borrowed communicator.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from backends.te import _te
from backends.te import nccl_ep_ops
from moe_core import compat
from moe_core import config as config_lib
from moe_core import validation
from moe_core.parallel import options as options_lib
from moe_core.parallel import ragged

# The receive slab's alignment (nccl_ep_ops): the communicator's receive
# capacity is a multiple of it.
ALIGNMENT = nccl_ep_ops.ALIGNMENT
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
        hidden_dim=cfg.expert_width,  # The rows it moves: [L] if latent.
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
    dest = nccl_ep_ops.owner(layout.send_offsets, copy)
    slot = copy - layout.send_offsets[dest]
    # Each copy's row in its receiver's buffer travels as its tag.
    tag = layout.peer_recv_offsets[dest] + slot
    received, tags = self._dispatch(
        rows, jnp.where(sent, dest, -1), tag, recv_rows, axis_name
    )
    arrived = jnp.sum(layout.recv_sizes)
    return nccl_ep_ops.place(received, tags, arrived, layout.capacity)

  def send_back(self, rows, layout, num_copies, axis_name):
    num_rows, hidden = rows.shape
    recv_rows = self._receive_rows(
        rows.dtype, axis_name, num_copies, num_rows, hidden
    )
    row = jnp.arange(num_rows, dtype=jnp.int32)
    source = nccl_ep_ops.owner(layout.recv_offsets, row)
    slot = row - layout.recv_offsets[source]
    real = slot < layout.recv_sizes[source]
    # The copy's place in its source's send order travels as its tag.
    tag = layout.peer_send_offsets[source] + slot
    received, tags = self._dispatch(
        rows, jnp.where(real, source, -1), tag, recv_rows, axis_name
    )
    arrived = jnp.sum(layout.send_sizes)
    return nccl_ep_ops.place(received, tags, arrived, num_copies)

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
      have = nccl_ep_ops.ep_ops().get_ep_config()
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
    return nccl_ep_ops.dispatch(rows.shape[0], recv_rows, rows, dest, tags)


def _platform() -> str:
  """JAX's default platform ("cpu", "gpu", "tpu"); tests replace it."""
  return jax.default_backend()


def _communicator_made() -> bool:
  """Whether TE imports here and holds an NCCL-EP communicator."""
  try:
    nccl_ep_ops.ep_ops().get_ep_config()
  except (ImportError, RuntimeError):
    return False
  return True
