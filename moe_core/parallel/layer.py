"""The expert-parallel layer: the routed block per device, under shard_map.

`routed_experts` is what one device runs between `route` and the shared
expert (dispatch -> backend.expert_ffn -> combine, per chunk); `moe_layer`
runs route, it and the shared expert on every device of a mesh.
`param_specs` and `shard_params` place the parameters the way it expects.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from moe_core import backend as backend_lib
from moe_core import compat
from moe_core import config as config_lib
from moe_core import ffn
from moe_core import latent
from moe_core import norms
from moe_core import params as params_lib
from moe_core import registry
from moe_core import router_inputs
from moe_core import routing
from moe_core import validation
from moe_core import zero_experts
from moe_core.parallel import exchange as exchange_lib
from moe_core.parallel import options as options_lib
from moe_core.parallel import overflow as overflow_lib
from moe_core.parallel import stages

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding

# Per-token MoEAux fields: sharded like the tokens. The rest are global.
_PER_TOKEN_AUX = (
    "router_logits",
    "router_probs",
    "expert_ids",
    "combine_weights",
    "kept",
)


def routed_experts(
    backend: str | backend_lib.Backend,
    params: dict,
    x: jax.Array,
    aux: routing.MoEAux,
    cfg: config_lib.MoEConfig,
    *,
    expert_axis: str,
    token_axes: Sequence[str],
    options: options_lib.EPOptions = options_lib.EPOptions(),
    platform: str | None = None,
) -> tuple[jax.Array, routing.MoEAux]:
  """dispatch -> backend.expert_ffn -> combine; call inside shard_map.

  Args:
    backend: a name or `Backend`; "auto" tries `registry.auto_candidates()`
      in order. Only its `expert_ffn` is used (on the local experts).
    params: this device's params: w_gate, w_up [E_l, W, F], w_down
      [E_l, F, W], W = cfg.expert_width (D, or the latent L).
    x: [T_l, W] this device's tokens (`latent.project_in`'s, with a latent
      width: the exchange then moves [L] rows).
    aux: `route`'s output for them.
    cfg: the block's config.
    expert_axis: the mesh axis the experts are split over.
    token_axes: every mesh axis the tokens are split over (for the counts).
    options: `EPOptions`.
    platform: for `exchange="auto"`; JAX's default backend if None.

  Returns:
    ([T_l, W] in x's dtype, aux with kept, combine_weights and dropped_tokens
    updated for copies dropped by a bounded buffer with overflow="drop").
    With overflow="error", copies that do not fit make the run fail: the
    devices raise `parallel.BufferOverflowError` from a host callback
    (`overflow.raise_on_overflow`), which JAX reports wrapped.
  """
  exchange = options_lib.resolve_exchange(
      options.exchange, platform or jax.default_backend()
  )
  num_tokens = x.shape[0]
  chunks = options.num_chunks
  validation.check_chunks(num_tokens, chunks)
  size = num_tokens // chunks
  # Dispatch drops what does not fit and counts it; "error" then raises
  # below, once, on the global count.
  overflow = "drop" if options.overflow == "error" else options.overflow
  ys, kept = [], []
  # A Python loop, so the chunks are independent ops the scheduler may
  # overlap (one chunk's exchange with another's expert compute).
  for i in range(chunks):
    part = slice(i * size, (i + 1) * size)
    weights = aux.combine_weights[part]
    on_input = cfg.routing_weights_on_input
    d = stages.dispatch(
        x[part],
        aux.expert_ids[part],
        cfg,
        expert_axis=expert_axis,
        exchange=exchange,
        buffer_factor=options.buffer_factor,
        overflow=overflow,
        # Llama 4: the copies travel scaled and are summed unweighted.
        input_weights=weights if on_input else None,
    )
    out = registry.call_backend(
        backend, lambda b, d=d: b.expert_ffn(d.rows, d.group_sizes, params, cfg)
    )
    # Muse Spark's norm of each expert's output, before its weight.
    out = norms.post_expert(out, params, cfg)
    if on_input:
      weights = jnp.ones_like(weights)
    ys.append(stages.combine(out, d, weights, expert_axis=expert_axis))
    kept.append(stages.kept_copies(d, cfg.top_k))
  y = jnp.concatenate(ys) if chunks > 1 else ys[0]
  kept = jnp.concatenate(kept) if chunks > 1 else kept[0]
  if options.buffer_factor is not None:
    # Invalid tokens' copies travel (their NaN weights make them visible)
    # but were never kept: count only valid copies the buffer dropped.
    dropped = jnp.sum(aux.kept & ~kept).astype(jnp.int32)
    kept = kept & aux.kept
    dropped = stages.psum(dropped, token_axes)
    aux = dataclasses.replace(
        aux,
        kept=kept,
        combine_weights=jnp.where(kept | ~aux.kept, aux.combine_weights, 0.0),
        dropped_tokens=aux.dropped_tokens + dropped,
    )
    if options.overflow == "error":
      bound = _overflow_bound(
          exchange, size, cfg, compat.axis_size(expert_axis), options
      )
      # Every output, so that no collective of this layer (the exchanges,
      # the statistics' psums, their transposes) overlaps the check.
      y, aux = overflow_lib.raise_on_overflow((y, aux), dropped, bound)
  return y.astype(x.dtype), aux


def _overflow_bound(exchange, tokens_per_chunk, cfg, ep, options) -> str:
  """`overflow.overflow_bound` of the layer's buffers, in Python."""
  mover = exchange_lib.get_exchange(exchange)
  capacity = mover.capacity(
      tokens_per_chunk, cfg.top_k, cfg.num_experts, ep, options.buffer_factor
  )
  return overflow_lib.overflow_bound(mover, capacity, options.buffer_factor)


# The routed experts' parameters, split over the expert axis.
_PER_EXPERT = ("w_gate", "w_up", "w_down") + params_lib.BIAS_NAMES


def param_specs(
    cfg: config_lib.MoEConfig,
    expert_axis: str = "expert",
) -> dict[str, P]:
  """PartitionSpec of each parameter: experts split, the rest replicated."""
  return {
      name: P(expert_axis) if name in _PER_EXPERT else P()
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


def moe_layer(
    params: dict,
    x: jax.Array,
    cfg: config_lib.MoEConfig,
    backend: str | backend_lib.Backend = "auto",
    *,
    mesh: jax.sharding.Mesh,
    expert_axis: str = "expert",
    data_axes: Sequence[str] = ("data",),
    options: options_lib.EPOptions | None = None,
) -> tuple[jax.Array, routing.MoEAux]:
  """`api.moe_layer` with expert parallelism over `mesh`.

  Tokens (x flattened to [T, D]) are split over data_axes x expert_axis;
  w_gate, w_up, w_down (and the expert biases) over expert_axis; the
  router and shared expert are replicated. Works under jit and grad,
  single- or multi-process (x and params are then global arrays). Mesh
  axes not named here replicate the computation.

  Returns:
    y [..., D] in x's dtype; `MoEAux` whose per-token fields are [T, ...]
    sharded like the tokens and whose statistics are global.

  Raises:
    parallel.BufferOverflowError: (a RuntimeError) overflow="error" and
      copies did not fit a bounded buffer,
      when called on concrete arrays (outside jit and grad): the library's
      message alone, after the run. Under a transformation the run fails
      from a host callback instead (`routed_experts`).
    NotImplementedError: when the program is lowered for a platform the
      exchange does not run on (`exchange.refuse_other_platforms`).
  """
  options = options or options_lib.EPOptions()
  token_axes = validation.check_mesh(mesh, cfg, expert_axis, data_axes)
  validation.check_token_split(x, mesh, token_axes, options.num_chunks)
  shards = math.prod(mesh.shape[a] for a in token_axes)
  num_tokens = math.prod(x.shape[:-1])
  platform = mesh.devices.flat[0].platform
  exchange = options_lib.resolve_exchange(options.exchange, platform)
  options = dataclasses.replace(options, exchange=exchange)
  # Called on concrete arrays, the layer runs now, on the mesh's devices;
  # traced, it may be lowered (exported) for another platform.
  concrete = not any(
      isinstance(leaf, jax.core.Tracer)
      for leaf in jax.tree_util.tree_leaves((params, x))
  )
  # The exchange's platform, checked before the backends run: "auto" would
  # take a NotImplementedError from inside for theirs and try the next one.
  mover = exchange_lib.get_exchange(exchange)
  mover.check_platform(platform)
  if concrete and not mover.runs_on(platform):
    raise NotImplementedError(mover.unsupported_platform_message(platform))
  # overflow="error" on concrete arrays: run with "drop", then raise from
  # Python on the count. Only a traced program needs the host callback,
  # whose error JAX wraps.
  raise_after = (
      concrete
      and options.buffer_factor is not None
      and options.overflow == "error"
  )
  inner_options = options
  if raise_after:
    inner_options = dataclasses.replace(options, overflow="drop")
  explicit = compat.is_explicit(mesh)
  token_spec = P(token_axes)
  tokens = _reshape(
      x,
      (num_tokens, cfg.hidden_size),
      NamedSharding(mesh, token_spec) if explicit else None,
  )
  specs = param_specs(cfg, expert_axis)
  if explicit:
    tokens = compat.reshard(tokens, NamedSharding(mesh, token_spec))
    params = {
        k: compat.reshard(v, NamedSharding(mesh, specs[k]))
        for k, v in params.items()
    }

  def route_and_compute(b: backend_lib.Backend, params, tokens, routed_tokens):
    aux = stages.route(
        tokens,
        params["router"],
        cfg,
        params.get("correction_bias"),
        token_axes=token_axes,
        local_route=b.route,
        **router_inputs.router_extras(params),
    )
    routed_aux, zero_weights = aux, None
    if cfg.num_zero_experts:
      # The zero experts' copies still travel (to expert id mod E, weight
      # 0): the exchange has no per-copy mask.
      routed_aux, zero_weights = zero_experts.split_zero_experts(aux, cfg)
    y, routed_aux = routed_experts(
        b,
        params,
        routed_tokens,
        routed_aux,
        cfg,
        expert_axis=expert_axis,
        token_axes=token_axes,
        options=inner_options,
        platform=platform,
    )
    if zero_weights is None:
      return latent.project_out(y, params, cfg), routed_aux
    y = y + zero_experts.zero_expert_output(zero_weights, routed_tokens, cfg)
    y = latent.project_out(y, params, cfg)
    return y, zero_experts.rejoin_zero_experts(aux, routed_aux, cfg)

  def body(params, tokens):
    # The router sees the tokens; the experts their own norm, if any.
    expert_tokens = norms.expert_input(tokens, params, cfg)
    # At the experts' latent width, if any: the exchange moves [L] rows.
    routed_tokens = latent.project_in(expert_tokens, params, cfg)
    # One backend routes and computes ("auto" falls through as a whole).
    y, aux = registry.call_backend(
        backend,
        lambda b: route_and_compute(b, params, tokens, routed_tokens),
    )
    return ffn.finish_block(y, params, expert_tokens, cfg), aux

  aux_specs = routing.MoEAux(
      **{
          f.name: token_spec if f.name in _PER_TOKEN_AUX else P()
          for f in dataclasses.fields(routing.MoEAux)
      }
  )
  # check_vma=False: backends build loop carries (zeros) without the
  # varying-axis types that check_vma demands of every value in the body.
  sharded = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(specs, token_spec),
      out_specs=(token_spec, aux_specs),
      check_vma=False,
  )
  if concrete:
    # Called on arrays, shard_map would run the body op by op on every
    # device: about 27 s against 3 s for one compile and run (ep = 8 CPU
    # devices, jax 0.12). Traced, the body is already part of the caller's
    # program.
    sharded = jax.jit(sharded)
  y, aux = sharded(params, tokens)
  if raise_after and int(aux.dropped_tokens) > 0:
    tokens_per_chunk = num_tokens // shards // options.num_chunks
    ep = mesh.shape[expert_axis]
    bound = _overflow_bound(exchange, tokens_per_chunk, cfg, ep, options)
    raise overflow_lib.BufferOverflowError(
        overflow_lib.overflow_message(int(aux.dropped_tokens), bound)
    )
  out_sharding = None
  if explicit:
    out_sharding = _output_sharding(x, mesh, token_spec, shards)
  return _reshape(y, x.shape, out_sharding), aux


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
