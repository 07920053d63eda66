"""The MoE layer: route -> dispatch -> expert compute -> combine.

`moe_layer` flattens x [..., D] to [T, D], routes each token to K experts,
sorts the T*K token copies by expert into ragged groups (no padding to
capacity), runs each expert's gated FFN as one grouped GEMM per projection,
and weights and sums each token's K outputs back in token order, adding the
shared expert when there is one (docs/api.md, "The pipeline", draws it).
Every stage is a public function or Backend method and can be used alone; a
backend overrides any of them. With `mesh=`, the same pipeline runs with
expert parallelism (`moe_core/parallel/`: each device routes its tokens,
sends each copy to the device holding its expert and gets the output back).
Out of scope here: attention, the residual and norms around the block, and
optimiser state (see `train/`).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax

from moe_core import backend as backend_lib
from moe_core import config as config_lib
from moe_core import ffn
from moe_core import latent
from moe_core import norms
from moe_core import parallel
from moe_core import registry
from moe_core import router_inputs
from moe_core import routing
from moe_core import validation
from moe_core import zero_experts


def moe_layer(
    params: dict,
    x: jax.Array,
    cfg: config_lib.MoEConfig,
    backend: str | backend_lib.Backend = "auto",
    *,
    mesh: jax.sharding.Mesh | None = None,
    expert_axis: str = "expert",
    data_axes: Sequence[str] = ("data",),
    ep_options: parallel.EPOptions | None = None,
    token_ids: jax.Array | None = None,
) -> tuple[jax.Array, routing.MoEAux]:
  """Applies one MoE block.

  Args:
    params: the dict of `moe_core.param_shapes(cfg)`. Expert and shared
      weights are cast to x's dtype for compute; routing runs in float32.
    x: [..., D] activations (float32 or bfloat16).
    cfg: the block's `MoEConfig`.
    backend: a registered name ("auto", "reference", "xla", ...) or a
      `Backend` instance; its `route` and `routed_experts` compute the
      block. "auto" tries `registry.auto_order()` and falls through a
      backend that raises NotImplementedError.
    mesh: None for one device (or plain jit sharding). A `Mesh` runs the
      block with expert parallelism inside `shard_map`: tokens split over
      data_axes x expert_axis, each device holding E / ep experts (see
      `parallel.moe_layer`). Dropless configs only.
    expert_axis: the mesh axis the experts are split over.
    data_axes: further mesh axes the tokens are split over (() for none).
    ep_options: `parallel.EPOptions` (exchange, bounded buffers, chunks).
    token_ids: [...] int, x's token ids (x.shape[:-1]); required iff
      `cfg.hash_vocab_size` (hash routing; one device only for now).

  Returns:
    y [..., D] in x's dtype, and the `MoEAux` of the routing.
  """
  validation.check_moe_layer(params, x, cfg, token_ids)
  if mesh is not None:
    if token_ids is not None:
      raise NotImplementedError(
          "hash routing (hash_vocab_size="
          f"{cfg.hash_vocab_size}) under expert parallelism (mesh=...) is "
          "not implemented: token_ids would need the tokens' sharding."
      )
    return parallel.moe_layer(
        params,
        x,
        cfg,
        backend,
        mesh=mesh,
        expert_axis=expert_axis,
        data_axes=data_axes,
        options=ep_options,
    )
  if ep_options is not None:
    raise ValueError("ep_options needs a mesh, got mesh=None.")
  tokens = x.reshape(-1, cfg.hidden_size)

  def route_and_compute(b: backend_lib.Backend):
    # One backend for both ("auto" falls through as a whole). The inputs
    # were validated above (params holds the router and correction bias
    # the config names), and route's aux is valid: the unchecked stages.
    with _matmul_precision(b):
      # The router sees the tokens; the experts their own norm, if any.
      expert_tokens = norms.expert_input(tokens, params, cfg)
      # The routed experts' input, at their latent width if any: projected
      # before the dispatch, so that the dispatch moves the narrower rows.
      routed_tokens = latent.project_in(expert_tokens, params, cfg)
      bias = params.get("correction_bias")
      extras = router_inputs.router_extras(params)
      if token_ids is not None:
        extras["token_ids"] = token_ids.reshape(-1)
      aux = b._route(tokens, params["router"], cfg, bias, **extras)
      routed_aux, zero_weights = aux, None
      if cfg.num_zero_experts:
        routed_aux, zero_weights = zero_experts.split_zero_experts(aux, cfg)
      y = b._routed_experts(params, routed_tokens, routed_aux, cfg)
      if zero_weights is not None:
        y = y + zero_experts.zero_expert_output(
            zero_weights, routed_tokens, cfg
        )
      y = latent.project_out(y, params, cfg)
      return ffn.finish_block(y, params, expert_tokens, cfg), aux

  y, aux = registry.call_backend(backend, route_and_compute)
  return y.reshape(x.shape), aux


def _matmul_precision(b: backend_lib.Backend):
  """The scope of `b.matmul_precision` (nothing when None): the products
  traced inside it (the shared expert's and the latent projections'
  included) default to that precision."""
  if b.matmul_precision is None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision(b.matmul_precision)
