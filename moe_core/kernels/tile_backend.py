"""The expert-FFN hooks of a backend built on a tile-list kernel module.

`pallas` and `mosaic_gpu` (and a new kernel backend written like them)
expose the same functions in their `ops` module, each taking the backend's
launch settings last (`TileKernelBackend` lists them). `TileOps` writes those
functions from the module's `GroupedKernels` (whose `fused_gmm` takes an
epilogue; `LaunchKernels` when its launch settings own the gmm and tgmm
calls), and `TileKernelBackend` maps `moe_core.Backend`'s hooks onto them,
so such a backend writes its kernels, its tile table, `availability()` and
its options, not this glue again; its tile settings come from
`moe_core.kernels.tile_settings`. `PermutingTileBackend` adds the hooks of
a backend that also has permutation kernels and a routing-weighted down
GEMM (`mosaic_tpu`, `triton`).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp

from moe_core import activations
from moe_core import backend
from moe_core import operands
from moe_core import permute
from moe_core import precision
from moe_core.kernels import expert_ops
from moe_core.kernels import grouped_matmul
from moe_core.kernels import permutation


@dataclasses.dataclass(frozen=True)
class LaunchKernels(grouped_matmul.GroupedKernels):
  """`GroupedKernels` whose fused kernels are the methods of `launch`.

  `launch` (frozen, hashable: the module's launch settings) has

      gmm(kind, lhs, rhs, group_sizes, *, products, transpose_rhs,
          num_outputs, out_dtype[, epilogue]) -> num_outputs arrays [M, N]
      tgmm(lhs, rhs, group_sizes, *, num_groups, out_dtype)
          -> one [E, C, N] per rhs

  with kind "fwd" (weights [E, C, N]) or "dgrad" (transposed), the key of
  the tiles it picks; lhs and rhs come as lists. `fused_gmm`'s `epilogue`
  (float32 accumulators -> outputs) fuses an activation; where the
  subclass sets `takes_poison`, both also take `poison`.
  """

  launch: Any

  def fused_gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, **options):
    return self.launch.gmm(
        "dgrad" if transpose_rhs else "fwd",
        list(lhs),
        list(rhs),
        group_sizes,
        transpose_rhs=transpose_rhs,
        **options,
    )

  def fused_tgmm(
      self, lhs, rhs, group_sizes, *, num_groups, out_dtype, **options
  ):
    return self.launch.tgmm(
        lhs,
        list(rhs),
        group_sizes,
        num_groups=num_groups,
        out_dtype=out_dtype,
        **options,
    )


# The built-in gated activations a Pallas kernel's epilogue computes on its
# float32 accumulators, each with any clamp: the Triton, Mosaic GPU and
# Mosaic TPU lowerings all have exp, logistic, tanh, min and max. The exact
# "gelu" is out: jax.nn.gelu's erf form calls erfc, which none of them
# lowers (jax 0.10 and 0.12; Mosaic TPU: "Unimplemented primitive ...
# erfc", compiling for a v5e). Registered activations are arbitrary JAX:
# they run unfused. The pallas, mosaic_gpu and mosaic_tpu ops modules'
# EPILOGUE_ACTIVATIONS.
PALLAS_EPILOGUE_ACTIVATIONS = (
    "silu",
    "gelu_tanh",
    "gpt_oss_glu",
    "softcapped_silu",
)


@dataclasses.dataclass(frozen=True)
class TileOps:
  """An ops module's differentiable ops, each taking the launch settings last.

  An ops module binds its functions from one of these:
  `grouped_gemm, gate_up, gated_gate_up = TileOps(...).functions()`.

  Attributes:
    kernels: launch -> the module's `GroupedKernels` (a frozen dataclass);
      its `fused_gmm` also takes `epilogue`, for `gated_gate_up`.
    epilogue_activations: the gated activations that epilogue computes, each
      with any clamp and its options (the module's EPILOGUE_ACTIVATIONS).
  """

  kernels: Callable[[Any], grouped_matmul.GroupedKernels]
  epilogue_activations: tuple[str, ...]

  def functions(self) -> tuple[Callable, Callable, Callable]:
    """(grouped_gemm, gate_up, gated_gate_up), for the ops module."""
    return self.grouped_gemm, self.gate_up, self.gated_gate_up

  def grouped_gemm(
      self,
      rows,
      weights,
      group_sizes,
      transpose_rhs: bool,
      out_dtype,
      launch,
      poison=None,
  ):
    """rows [M, C] x weights [E, C, N] ([E, N, C] transposed) -> [M, N].

    Rows past sum(group_sizes) come out as zeros and get zero gradient;
    differentiable in both directions (`moe_core.kernels.grouped_matmul`).
    `poison`: a bool scalar making the output and the gradients NaN, or
    None.
    """
    return grouped_matmul.gmm(
        self.kernels(launch),
        rows,
        weights,
        group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        poison=poison,
    )

  def gate_up(self, rows, w_gate, w_up, group_sizes, launch):
    """(rows @ w_gate[g], rows @ w_up[g]), each [M, F], in one pass over rows.

    dX is one kernel summing both products, dW one tgmm with two outputs.

    Args:
      rows: [M, D] sorted by group.
      w_gate, w_up: [E, D, F] of rows' dtype.
      group_sizes: [E] int32.
      launch: tiles and interpret mode.
    """
    return expert_ops.gate_up(
        self.kernels(launch), rows, w_gate, w_up, group_sizes
    )

  def gated_gate_up(
      self,
      rows,
      w_gate,
      w_up,
      group_sizes,
      activation: str | activations.Settings,
      launch,
  ):
    """act(rows @ w_gate[g]) * (rows @ w_up[g]): [M, D] -> [M, F], one pass.

    The activation runs on the float32 accumulators in the kernel's
    epilogue; only h is written. Under differentiation the kernel also
    writes gate and up, the residuals of the activation's derivative, and
    the tangent goes through `gate_up`'s kernels
    (`moe_core.kernels.expert_ops`).

    Args:
      rows, w_gate, w_up, group_sizes, launch: as for `gate_up`.
      activation: one of `epilogue_activations`, a name or its
        `activations.Settings` (clamp and options).
    """
    settings = expert_ops.check_epilogue_activation(
        activation, self.epilogue_activations
    )
    kernels = self.kernels(launch)
    return expert_ops.gated_gate_up(
        kernels,
        expert_ops.EpilogueGatedKernel(kernels),
        rows,
        w_gate,
        w_up,
        group_sizes,
        settings,
    )


def check_bool_options(**options) -> None:
  """Raises TypeError for the first of the boolean `options` that is not a
  bool (in the order given)."""
  for name, value in options.items():
    if not isinstance(value, bool):
      raise TypeError(f"{name} must be a bool, got {type(value).__name__}.")


def epilogue_computes(
    settings: activations.Settings, epilogue_activations
) -> bool:
  """Whether a kernel epilogue that lists `epilogue_activations` (an ops
  module's EPILOGUE_ACTIVATIONS) computes `settings`: the one decision of
  every `TileKernelBackend` (pallas, mosaic_gpu, triton).

  Each listed activation runs there with its options and with or without
  the clamp of `swiglu_limit` (a min and a clip, which every lowering has);
  a registered or unlisted one (the exact gelu where the lowering lacks
  erfc) runs unfused. Biases are the template's: it never asks with them.
  """
  return settings.activation.gated and settings.name in epilogue_activations


class TileKernelBackend(backend.Backend):
  """`Backend` whose grouped GEMM and expert-FFN hooks are `ops`' kernels.

  Subclasses set `ops` (the module) and, in __init__, `self.launch` (what
  every ops function takes last, with `tiles`, `interpret`: the option's
  setting, `moe_core.kernels.interpret`, and `kernel_interpret`: that
  setting for the program traced now, auto resolved) and
  `self.fuse_activation` (bool: the gated activation in the gate/up
  kernel's epilogue where `epilogue_computes` says so;
  `check_fuse_activation` first; the option's default is False on the GPU
  backends, where the epilogue is opt-in until a GPU measurement shows it
  faster, and True in `mosaic_tpu`, where the chip showed it saves writing
  and reading gate and up).

  `ops` has, each taking the launch settings last:

      grouped_gemm(rows, weights, group_sizes, transpose_rhs, out_dtype,
                   launch)
      gate_up(rows, w_gate, w_up, group_sizes, launch)
      gated_gate_up(rows, w_gate, w_up, group_sizes, settings, launch)
      EPILOGUE_ACTIVATIONS   the gated activations its fused epilogue
                             computes, with their clamp and options
  """

  ops: ClassVar[ModuleType]
  launch: Any
  fuse_activation: bool
  # `ops.gated_gate_up` runs `expert_ops.EpilogueGatedKernel`, which keeps
  # gate and up from the forward and names them and h.
  fused_checkpoint_names = backend.FUSED_CHECKPOINT_NAMES

  @staticmethod
  def check_fuse_activation(fuse_activation) -> None:
    """Raises TypeError unless the `fuse_activation` option is a bool."""
    check_bool_options(fuse_activation=fuse_activation)

  @property
  def interpret(self):
    """False (compiled) or the interpreter's setting, for the program
    traced now: auto (None) resolved (`moe_core.kernels.interpret`)."""
    return self.launch.kernel_interpret

  def _repr_options(self) -> dict[str, str]:
    """The options `repr` shows: name -> the text of its value."""
    return {
        # As given: None for auto.
        "interpret": repr(self.launch.interpret),
        "tiles": repr(self.launch.tiles),
        "fuse_activation": str(self.fuse_activation),
    }

  def __repr__(self) -> str:
    options = ", ".join(f"{k}={v}" for k, v in self._repr_options().items())
    return f"{type(self).__name__}({options})"

  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    # Only a backend whose `poisons_in_kernels` is given a poison flag.
    poison = {} if gemm.poison is None else {"poison": gemm.poison}
    return self.ops.grouped_gemm(
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
        gemm.transpose_rhs,
        gemm.out_dtype,
        self.launch,
        **poison,
    )

  def _gate_up(
      self, ffn_in: operands.FfnOperands
  ) -> tuple[jax.Array, jax.Array]:
    """Gate and up in one kernel pass over the rows: two [M, F] outputs."""
    return self.ops.gate_up(*_gate_up_operands(ffn_in), self.launch)

  def _fuses_activation(self, settings: activations.Settings) -> bool:
    return self.fuse_activation and epilogue_computes(
        settings, self.ops.EPILOGUE_ACTIVATIONS
    )

  def _gated_gate_up(self, ffn_in: operands.FfnOperands) -> jax.Array:
    """h = f(gate, up) in the gate/up kernel's epilogue (clamp and options
    included): one [M, F] output."""
    return self.ops.gated_gate_up(
        *_gate_up_operands(ffn_in), ffn_in.activation_settings, self.launch
    )


class PermutingTileBackend(TileKernelBackend):
  """`TileKernelBackend` that also moves the data on its own kernels.

  Dispatch and combine are the library's plan (`moe_core.permute`) with
  the gathers of `self.permutation_kernels` (a
  `moe_core.kernels.permutation.PermutationKernels`), and, with the
  `fuse_routing_weights` option, the routing weights scale each row in the
  down GEMM's epilogue (`ops.down_weighted`, taking the launch settings
  last) and the combine sums with unit weights. `mosaic_tpu` and `triton`
  are such backends.

  Subclasses set, besides `TileKernelBackend`'s, `self.permutation_kernels`
  and `self.fuse_routing_weights` (bool, `check_bool_options`), and
  override `_permutes` where the permutation kernels take only some
  dtypes: dispatch and combine take any floating dtype, and the others go
  through the template's XLA gather and combine.
  """

  permutation_kernels: permutation.PermutationKernels
  fuse_routing_weights: bool

  def _permutes(self, dtype) -> bool:
    """Whether the permutation kernels move `dtype` rows (else the
    template's XLA gather and combine do): every dtype by default."""
    del dtype
    return True

  def _gather(self, x, plan: permute.DispatchPlan) -> permute.Dispatched:
    """The rows of `dispatch` through the permutation kernels' gather."""
    if not self._permutes(x.dtype):
      return super()._gather(x, plan)
    rows = permutation.gather(
        self.permutation_kernels,
        x,
        permutation.Plan.of(plan, None),
        top_k=plan.top_k,
    )
    return permute.Dispatched.of(rows, plan)

  def _combine(self, expert_out, dispatched, combine_weights, kept):
    """`combine` on the permutation kernels' weighted un-permute."""
    if not self._permutes(expert_out.dtype):
      return super()._combine(expert_out, dispatched, combine_weights, kept)
    return permutation.combine(
        self.permutation_kernels,
        expert_out,
        combine_weights,
        permutation.Plan.of(dispatched, kept),
        top_k=dispatched.top_k,
    )

  def _routing_weights_in_down(self, cfg, dtype) -> bool:
    # With `fuse_routing_weights`, only blocks that compute every copy, of
    # the unquantised recipe and of a dtype the kernels take: a capacity
    # config's dropped copies and zero experts' copies (masks_copies), the
    # quantised FFN (which never fuses) and other dtypes keep the plain
    # path.
    return (
        self.fuse_routing_weights
        and not cfg.masks_copies
        and cfg.precision == precision.UNQUANTIZED
        and jnp.dtype(dtype) in self.dtypes
    )

  def _down(self, h: jax.Array, ffn_in: operands.FfnOperands) -> jax.Array:
    """The down GEMM; with the routing weights, row r's float32 accumulator
    is scaled by ffn_in.row_weights[r] in the epilogue."""
    if ffn_in.row_weights is None:
      return super()._down(h, ffn_in)
    return self.ops.down_weighted(
        h, ffn_in.w_down, ffn_in.group_sizes, ffn_in.row_weights, self.launch
    )


def _gate_up_operands(ffn_in: operands.FfnOperands) -> tuple[jax.Array, ...]:
  """(rows, w_gate, w_up, group_sizes): the gate/up kernels' operands."""
  return ffn_in.rows, ffn_in.w_gate, ffn_in.w_up, ffn_in.group_sizes
