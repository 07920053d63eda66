"""The Backend interface: a grouped GEMM, plus overridable MoE stages."""

from __future__ import annotations

import abc
from typing import ClassVar

import jax
from jax import ad_checkpoint
import jax.numpy as jnp

from moe_core import config as config_lib
from moe_core import permute
from moe_core import ffn
from moe_core import routing
from moe_core import validation

# Names of the expert GEMM outputs, for jax.checkpoint policies
# (save_only_these_names, save_and_offload_only_these_names, ...).
GATE_NAME = "moe_gate"
UP_NAME = "moe_up"
DOWN_NAME = "moe_down"
CHECKPOINT_NAMES = (GATE_NAME, UP_NAME, DOWN_NAME)


class Backend(abc.ABC):
  """A way to compute the expert stage of an MoE block.

  A backend implements `_grouped_gemm`; everything else has a sort-based
  default built on it and may be overridden (a fused FFN, a fused
  dispatch/combine, a whole routed block). Inputs are validated once, by the
  public methods here, before a backend sees them. A backend raises only
  `NotImplementedError`, for valid inputs it cannot handle; `backend="auto"`
  then falls through to the next backend.
  """

  name: ClassVar[str]

  def availability(self) -> tuple[bool, str]:
    """(True, "") if this backend can run here, else (False, why not)."""
    return True, ""

  def __repr__(self) -> str:
    return f"{type(self).__name__}(name={self.name!r})"

  # --- Expert compute -------------------------------------------------------

  def grouped_gemm(
      self,
      rows: jax.Array,
      weights: jax.Array,
      group_sizes: jax.Array,
      *,
      transpose_rhs: bool = False,
      out_dtype=None,
  ) -> jax.Array:
    """Ragged GEMM: rows [M, K] x weights [E, K, N] -> [M, N].

    Rows are sorted by group: group e owns rows [sum(gs[:e]), sum(gs[:e+1])).
    Rows at or past sum(group_sizes) come out as zeros and receive zero
    gradient, whatever they hold (NaN included). Differentiable in rows and
    weights under jax.grad and jax.jit.

    Args:
      rows: [M, K] float32 or bfloat16.
      weights: [E, K, N] of rows' dtype; [E, N, K] if `transpose_rhs`.
      group_sizes: [E] int32 on device, sum <= M.
      transpose_rhs: contract with weights[e].T (the dgrad layout).
      out_dtype: output dtype; rows' dtype by default. Accumulation is f32.
    """
    validation.check_grouped_gemm(
        rows, weights, group_sizes, transpose_rhs=transpose_rhs
    )
    if weights.dtype != rows.dtype:
      raise TypeError(
          "grouped_gemm needs rows and weights of one dtype, got "
          f"rows {rows.dtype}, weights {weights.dtype}."
      )
    out_dtype = jnp.dtype(out_dtype or rows.dtype)
    return self._grouped_gemm(
        rows,
        weights,
        group_sizes.astype(jnp.int32),
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
    )

  @abc.abstractmethod
  def _grouped_gemm(
      self, rows, weights, group_sizes, *, transpose_rhs, out_dtype
  ) -> jax.Array:
    """`grouped_gemm` on validated inputs."""

  def expert_ffn(
      self,
      rows: jax.Array,
      group_sizes: jax.Array,
      params: dict,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    """Each row through its expert's gated FFN: [M, D] -> [M, D].

    Rows past sum(group_sizes) come out as zeros. The GEMM outputs carry
    the checkpoint names in `CHECKPOINT_NAMES`; an override keeps them.
    """
    validation.check_expert_ffn(rows, group_sizes, params, cfg)
    w_gate, w_up, w_down = (
        params[n].astype(rows.dtype) for n in ("w_gate", "w_up", "w_down")
    )
    gate = ad_checkpoint.checkpoint_name(
        self.grouped_gemm(rows, w_gate, group_sizes), GATE_NAME
    )
    up = ad_checkpoint.checkpoint_name(
        self.grouped_gemm(rows, w_up, group_sizes), UP_NAME
    )
    out = self.grouped_gemm(
        ffn.gated(gate, up, cfg.activation), w_down, group_sizes
    )
    return ad_checkpoint.checkpoint_name(out, DOWN_NAME)

  # --- Dispatch and combine -------------------------------------------------

  def dispatch(
      self, x: jax.Array, aux: routing.MoEAux, cfg: config_lib.MoEConfig
  ) -> permute.Dispatched:
    kept = None if cfg.dropless else aux.kept
    return permute.dispatch(x, aux.expert_ids, cfg.num_experts, kept)

  def combine(
      self,
      expert_out: jax.Array,
      dispatched: permute.Dispatched,
      aux: routing.MoEAux,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    kept = None if cfg.dropless else aux.kept
    return permute.combine(expert_out, dispatched, aux.combine_weights, kept)

  # --- The routed block -----------------------------------------------------

  def routed_experts(
      self,
      params: dict,
      x: jax.Array,
      aux: routing.MoEAux,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    """The routed experts' weighted output: x [T, D] -> [T, D]."""
    validation.check_routed_experts(x, aux, cfg)
    dispatched = self.dispatch(x, aux, cfg)
    out = self.expert_ffn(dispatched.rows, dispatched.group_sizes, params, cfg)
    return self.combine(out, dispatched, aux, cfg)
