"""TritonBackend: raw Triton kernels over a tile list, through jax-triton."""

from __future__ import annotations

import dataclasses
import types
from typing import ClassVar

import jax
import jax.numpy as jnp

from backends.triton import configs as configs_lib
from backends.triton import launch
from backends.triton import ops
from moe_core import config as config_lib
from moe_core import operands
from moe_core import permute
from moe_core import routing
from moe_core import validation
from moe_core.kernels import permutation
from moe_core.kernels import tile_backend


class TritonBackend(tile_backend.TileKernelBackend):
  """Grouped GEMMs and the permutation as raw Triton kernels; no host sync.

  Forward and dX run one tile-list gmm kernel, dW a tgmm kernel looping over
  each group's rows; dispatch and combine are gather kernels
  (`permute_kernels`). On NVIDIA GPUs the kernels go through jax-triton; with
  `interpret=True` every kernel runs in Triton's interpreter on the CPU.

  Args:
    configs: tile sizes and launch settings: None (the table of
      `configs.TABLE` with its heuristic fallback), a `configs.Config` for
      every kernel, or a dict kind -> Config (see `configs.choose`).
    interpret: False compiles for the GPU (unavailable elsewhere); True runs
      every kernel in Triton's interpreter through a host callback (CPU,
      slow: for tests at small shapes; needs torch and triton).
    fuse_activation: compute act(gate) * up in the gated kernel's epilogue
      (every activation of `ops.GATED_ACTIVATIONS`); gate and up then exist
      only inside that op, so only the "moe_down" checkpoint name is emitted
      (`checkpoint_names`), as for pallas.
    generation: "sm90" or "sm100", the config table's rows; None picks by
      the first device's compute capability ("sm90" off a GPU).
    fuse_routing_weights: in `routed_experts`, multiply each row by its
      combine weight in the down GEMM's epilogue and un-permute with unit
      weights (dropless configs with the "bf16" precision; others run the
      unfused path).
  """

  name: ClassVar[str] = "triton"
  ops: ClassVar[types.ModuleType] = ops
  dtypes: ClassVar[tuple[jnp.dtype, ...]] = tuple(
      jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)
  )

  def __init__(
      self,
      *,
      configs=None,
      interpret: bool = False,
      fuse_activation: bool = True,
      generation: str | None = None,
      fuse_routing_weights: bool = False,
  ):
    for option, value in (
        ("interpret", interpret),
        ("fuse_activation", fuse_activation),
        ("fuse_routing_weights", fuse_routing_weights),
    ):
      if not isinstance(value, bool):
        raise TypeError(f"{option} must be a bool, got {type(value).__name__}.")
    if generation is None:
      generation = configs_lib.generation() or "sm90"
    self.runner = launch.Runner(
        mode="interpret" if interpret else "gpu",
        configs=configs,
        generation=generation,
    )
    self.fuse_activation = fuse_activation
    self.fuse_routing_weights = fuse_routing_weights
    self.permutation_kernels = ops.TritonPermutationKernels(self.runner)

  @property
  def interpret(self) -> bool:
    return self.runner.mode == "interpret"

  def __repr__(self) -> str:
    return (
        f"TritonBackend(interpret={self.interpret}, "
        f"configs={self.runner.configs!r}, "
        f"fuse_activation={self.fuse_activation}, "
        f"generation={self.runner.generation!r}, "
        f"fuse_routing_weights={self.fuse_routing_weights})"
    )

  def availability(self) -> tuple[bool, str]:
    return launch.availability(self.runner)

  @property
  def launch(self) -> launch.Runner:
    """The runner, which every `ops` function takes last."""
    return self.runner

  # --- Dispatch and combine ---------------------------------------------------

  def _gathers(self, dtype) -> bool:
    """Whether the permute kernels take `dtype` (else the XLA gather)."""
    return jnp.dtype(dtype) in self.dtypes

  def _permute(self, x, expert_ids, num_experts, kept):
    """`permute.dispatch` (same validation) with the permute kernel's gather.

    The sort is `moe_core.permute.dispatch`'s own; only the row gather is
    the permute kernel.
    """
    validation.check_dispatch(x, expert_ids, num_experts, kept)
    if not self._gathers(x.dtype):
      return permute.dispatch(x, expert_ids, num_experts, kept)
    # A zero-width view of x: dispatch validates and sorts exactly as it
    # does for x, and its gather has no data to move.
    sorted_meta = permute.dispatch(x[:, :0], expert_ids, num_experts, kept)
    rows = permutation.gather(
        self.permutation_kernels,
        x,
        _plan(sorted_meta, kept),
        top_k=sorted_meta.top_k,
    )
    return dataclasses.replace(sorted_meta, rows=rows)

  def _unpermute(self, expert_out, dispatched, combine_weights, kept):
    """`permute.combine` (same validation) on the unpermute kernel."""
    validation.check_combine(expert_out, dispatched, combine_weights, kept)
    if not self._gathers(expert_out.dtype):
      return permute.combine(expert_out, dispatched, combine_weights, kept)
    return permutation.combine(
        self.permutation_kernels,
        expert_out,
        combine_weights,
        _plan(dispatched, kept),
        top_k=dispatched.top_k,
    )

  # --- The routed block, with the weights in the down GEMM --------------------

  def _fuses_routing_weights(self, cfg: config_lib.MoEConfig, x_dtype) -> bool:
    # Only dropless bf16-precision blocks of a dtype the kernels take: a
    # capacity config's dropped copies, the quantised FFN (which never
    # fuses) and other dtypes (NotImplementedError) keep the plain path.
    return (
        self.fuse_routing_weights
        and cfg.dropless
        and cfg.precision == "bf16"
        and self._gathers(x_dtype)
    )

  def routed_experts(
      self,
      params: dict,
      x: jax.Array,
      aux: routing.MoEAux,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    """The routed experts' weighted output: x [T, D] -> [T, D].

    With `fuse_routing_weights` (dropless, "bf16" precision), each sorted
    row's combine weight multiplies the down GEMM's float32 accumulator and
    the combine sums with unit weights; a NaN weight still makes its token
    NaN (through the scaled row), and an invalid id too (through combine).
    """
    if not self.fuse_routing_weights:
      return super().routed_experts(params, x, aux, cfg)
    validation.check_routed_experts(x, aux, cfg, params)
    if not self._fuses_routing_weights(cfg, x.dtype):
      return super().routed_experts(params, x, aux, cfg)
    dispatched = self.dispatch(x, aux, cfg)
    row_weights = aux.combine_weights.astype(jnp.float32).reshape(-1)[
        dispatched.assignment
    ]
    out = self._weighted_expert_ffn(
        dispatched.rows, dispatched.group_sizes, params, cfg, row_weights
    )
    return self._unpermute(
        out, dispatched, jnp.ones_like(aux.combine_weights), None
    )

  def _weighted_expert_ffn(self, rows, group_sizes, params, cfg, row_weights):
    """`Backend.expert_ffn` with out[r] scaled by row_weights[r] [M] float32.

    The template itself (its checks, casts, names and poisoning) on a
    `_RowWeighted` view of this backend, whose `_down` is
    `ops.down_weighted`.
    """
    return _RowWeighted(self, row_weights).expert_ffn(
        rows, group_sizes, params, cfg
    )


class _RowWeighted(TritonBackend):
  """A TritonBackend whose down GEMM scales row r by row_weights[r].

  A view of one backend for one `expert_ffn` call: that backend's runner
  and options, and row_weights [M] float32, multiplied into the float32
  accumulator of the down GEMM's epilogue (`ops.down_weighted`).
  """

  # pylint: disable-next=super-init-not-called
  def __init__(self, base: TritonBackend, row_weights: jax.Array):
    # The base's runner and options as they are, not a second runner.
    vars(self).update(vars(base))
    self.row_weights = row_weights

  def _down(self, h: jax.Array, ffn_in: operands.FfnOperands) -> jax.Array:
    return ops.down_weighted(
        h, ffn_in.w_down, ffn_in.group_sizes, self.row_weights, self.runner
    )


def _plan(dispatched: permute.Dispatched, kept) -> permutation.Plan:
  """The permutation kernels' plan: `dispatched`'s arrays, int8 flags."""
  num_copies = dispatched.position.shape[0]
  kept_flags = (
      jnp.ones((num_copies,), jnp.int8)
      if kept is None
      else kept.reshape(-1).astype(jnp.int8)
  )
  return permutation.Plan(
      assignment=dispatched.assignment,
      position=dispatched.position,
      kept=kept_flags,
      invalid=dispatched.invalid.astype(jnp.int8),
  )
