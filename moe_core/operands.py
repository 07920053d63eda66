"""What a backend's hooks receive: the validated operands of one expert op.

`Backend.grouped_gemm` and `Backend.expert_ffn` validate their inputs, cast
and resolve them, and hand the hooks one record each. A hook's signature is
then one typed argument, the same in every backend, and a new field (a
quantisation recipe, say) reaches every hook without touching them all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_core import activations


@dataclasses.dataclass(frozen=True)
class GemmOperands:
  """One grouped GEMM, rows [M, C] x weights [E, C, N] -> [M, N].

  C is the contracted width and N the output width. Rows are sorted by
  group: group e owns rows [sum(gs[:e]), sum(gs[:e+1])); rows at or past
  sum(group_sizes) must come out as zeros with zero gradient.

  Attributes:
    rows: [M, C], of a dtype in the backend's `dtypes`.
    weights: [E, C, N] of rows' dtype; [E, N, C] if `transpose_rhs`.
    group_sizes: [E] int32, sum <= M.
    transpose_rhs: contract with weights[e].T (the dgrad layout).
    out_dtype: the result's dtype (resolved: never None).
    poison: None, or (for a backend whose `poisons_in_kernels`) a bool
      scalar: the given group sizes were bad, and every output, tangent and
      cotangent of the GEMM must be all NaN (`grouped_matmul`'s `poison`).
  """

  rows: jax.Array
  weights: jax.Array
  group_sizes: jax.Array
  transpose_rhs: bool
  out_dtype: jnp.dtype
  poison: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class FfnOperands:
  """One expert FFN over rows sorted by expert: [M, D] -> [M, D].

  Attributes:
    rows: [M, D], of a dtype in the backend's `dtypes`.
    group_sizes: [E] int32, sum <= M.
    w_gate: [E, D, F] of rows' dtype; None for a non-gated activation.
    w_up: [E, D, F] of rows' dtype.
    w_down: [E, F, D] of rows' dtype.
    activation: a name of the registry `moe_core.activations`.
    row_weights: [M] float32 or None: the routing weight of each row, which
      the down projection applies (`Backend._routing_weights_in_down`).
    b_gate, b_up: [E, F] or None, the biases of gate and up (b_gate None
      when not gated), in rows' dtype.
    b_down: [E, D] or None, the down projection's bias.
    settings: the activation's options (`activations.Settings`); None
      means `activation` with none.
  """

  rows: jax.Array
  group_sizes: jax.Array
  w_gate: jax.Array | None
  w_up: jax.Array
  w_down: jax.Array
  activation: str
  row_weights: jax.Array | None = None
  b_gate: jax.Array | None = None
  b_up: jax.Array | None = None
  b_down: jax.Array | None = None
  settings: activations.Settings | None = None

  @property
  def activation_settings(self) -> activations.Settings:
    return self.settings or activations.Settings(self.activation)


@dataclasses.dataclass(frozen=True)
class QuantizedGemmOperands:
  """One grouped GEMM on quantised operands (`moe_core.precision`).

  `Backend.grouped_gemm` quantises for every backend the same way, so
  backends differ only in how they multiply: rows per group (a per-tensor
  scale covers one group's rows), weights per expert, blocks along the
  contracted width C.

  Attributes:
    rows: QuantizedArray of rows [M, C] (`precision.quantize_grouped_rows`);
      rows at or past sum(group_sizes) quantise to zeros.
    weights: QuantizedArray of weights [E, C, N], or [E, N, C] if
      `transpose_rhs` (`precision.quantize_grouped_weights`).
    group_sizes: [E] int32, sum <= M.
    transpose_rhs: the weights' layout, as in `GemmOperands`.
    out_dtype: the result's dtype.
    recipe: the recipe both operands were quantised with.
  """

  rows: object
  weights: object
  group_sizes: jax.Array
  transpose_rhs: bool
  out_dtype: jnp.dtype
  recipe: str
