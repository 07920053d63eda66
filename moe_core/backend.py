"""The Backend interface: a grouped GEMM, plus overridable MoE stages.

The contract every backend keeps, whatever it overrides:

  * `grouped_gemm` and `expert_ffn` are template methods: they validate the
    inputs (`moe_core.validation`), refuse dtypes outside `Backend.dtypes`
    with NotImplementedError, cast the weights, and only then call the
    backend's hooks (`_grouped_gemm`, `_gate_up`, `_gated_gate_up`,
    `_down`). A hook sees validated inputs only.
  * Rows past sum(group_sizes) come out as zeros and get zero gradient,
    whatever they hold (NaN included).
  * Values only the device knows follow the run-time policy (docs/api.md,
    "Guarantees"; `moe_core.checks`), in the templates, so every backend
    gives the same answer: group sizes with a negative entry or a sum past
    the rows make the whole GEMM/FFN output NaN (and NaN reaches the
    gradients of rows and weights); expert ids out of range make their
    token's output NaN. Hooks see sanitised sizes (zeros, then).
  * The expert GEMM outputs carry the checkpoint names of `CHECKPOINT_NAMES`
    (GATE_NAME, UP_NAME, DOWN_NAME), which the remat policies of
    `moe_core.remat` key on. A backend that fuses the activation into the
    gate/up kernel has no gate or up array to name: it emits DOWN_NAME only,
    and says so through `checkpoint_names`. The conformance suite
    `conformance/checkpoint_names_suite.py` checks what is saved.
  * A backend raises NotImplementedError only for valid inputs it cannot
    handle; `backend="auto"` then falls through to the next backend.

Over 400 lines because it is one job: the template every backend fills,
its template methods and its hooks.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
from jax import ad_checkpoint
import jax.numpy as jnp

from moe_core import checks
from moe_core import config as config_lib
from moe_core import ffn
from moe_core import operands
from moe_core import permute
from moe_core import precision as precision_lib
from moe_core import quantized_gemm
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
  default built on it and may be overridden. The expert FFN is a template:
  `expert_ffn` validates, casts and names the GEMM outputs, and calls hooks
  that a backend may replace by faster kernels:

    _gate_up        rows [M, D] -> (gate, up), each [M, F]; default: two
                    grouped GEMMs.
    _gated_gate_up  rows [M, D] -> act(gate) * up [M, F] in one op, used
                    when `_fuses_activation(activation)` is True.
    _down           h [M, F] -> [M, D]; default: one grouped GEMM.

  Each hook takes one record of validated operands (`moe_core.operands`:
  `GemmOperands` for `_grouped_gemm`, `FfnOperands` for the FFN hooks).

  `dispatch` and `combine` check the config and aux and call the hooks
  `_permute` and `_unpermute` (`moe_core.permute`'s sort-gather and weighted
  un-permute by default), which a backend with permutation kernels replaces.
  Larger stages (`route`, `dispatch`, `combine`, the whole
  `routed_experts`) may be overridden too; a `routed_experts` that does not
  call `expert_ffn` (the reference oracle) emits no checkpoint names.

  Attributes:
    name: the registry name, also the prefix of the backend's errors.
    dtypes: the operand dtypes the backend computes in; None for every
      floating dtype the validation admits. Others raise NotImplementedError
      in `grouped_gemm` and `expert_ffn`.
    precisions: the GEMM recipes (`moe_core.precision`) the backend
      multiplies quantised operands for, through `_quantized_grouped_gemm`;
      others raise NotImplementedError naming the recipe.

  Adding a backend (conformance/example_backend/ is the folder to copy;
  conformance/example_kernel_backend/ for a backend that is its gmm and
  tgmm kernels, see docs/backends.md):
    1. Copy conformance/example_backend/ to backends/<name>/ and rename its
       BUILD.template to BUILD.
    2. In backend.py: rename the class, set `name = "<name>"` and `dtypes`,
       and implement `_grouped_gemm` (rows [M, C] x weights [E, C, N] ->
       [M, N] on validated inputs; rows at or past sum(group_sizes) give
       zeros and zero gradient) and, if it cannot run everywhere,
       `availability()`. Optionally override the expert-FFN hooks above.
       Import hardware-only packages inside the module and raise ImportError
       naming what to install.
    3. Register it: one line in moe_core/registry.py's `_REGISTRY`,
       "<name>": "backends.<name>.backend:<Name>Backend" (out of tree:
       `moe_core.register_backend("<name>", "pkg.backend:Class")`); add it
       to `AUTO_ORDER` if "auto" should pick it.
    4. One line in `//backends:all` (backends/BUILD): "//backends/<name>".
    5. In the folder, replace "example" by <name> in BUILD (keep its
       `moe_conformance_test` line) and in conformance_test.py (the class
       names, BACKEND, and BACKEND_OPTIONS with a comment saying why).
    6. `bazel test //backends/<name>:all` runs the conformance suite on one
       device (`conformance_test`) and on 8 (`conformance_test_ep`); plain
       `python -m pytest backends/<name>/conformance_test.py` runs both.
  """

  name: ClassVar[str]
  dtypes: ClassVar[tuple[jnp.dtype, ...] | None] = None
  precisions: ClassVar[tuple[str, ...]] = ("bf16",)

  def availability(self) -> tuple[bool, str]:
    """(True, "") if this backend can run here, else (False, why not)."""
    return True, ""

  def __repr__(self) -> str:
    return f"{type(self).__name__}(name={self.name!r})"

  def _check_dtype(self, dtype) -> None:
    """NotImplementedError unless `dtype` is one of `self.dtypes`."""
    dtype = jnp.dtype(dtype)
    if self.dtypes is not None and dtype not in self.dtypes:
      raise NotImplementedError(
          f"{self.name}: {dtype.name} operands are not supported "
          f"(supported: {[jnp.dtype(d).name for d in self.dtypes]})."
      )

  def _check_precision(self, recipe) -> str:
    """The recipe, checked: ValueError if unknown, NotImplementedError if
    this backend has no quantised GEMM for it."""
    recipe = precision_lib.check_recipe(recipe)
    if recipe not in self.precisions:
      raise NotImplementedError(
          f"{self.name}: precision {recipe!r} is not supported (supported: "
          f"{list(self.precisions)})."
      )
    return recipe

  # --- The grouped GEMM -----------------------------------------------------

  def grouped_gemm(
      self,
      rows: jax.Array,
      weights: jax.Array,
      group_sizes: jax.Array,
      *,
      transpose_rhs: bool = False,
      out_dtype=None,
      precision: str = "bf16",
  ) -> jax.Array:
    """Ragged GEMM: rows [M, C] x weights [E, C, N] -> [M, N].

    C is the contracted width, N the output width. Rows are sorted by group:
    group e owns rows [sum(gs[:e]), sum(gs[:e+1])). Rows at or past
    sum(group_sizes) come out as zeros and receive zero gradient, whatever
    they hold (NaN included). Differentiable in rows and weights under
    jax.grad and jax.jit.

    Args:
      rows: [M, C] float32 or bfloat16.
      weights: [E, C, N] of rows' dtype; [E, N, C] if `transpose_rhs`.
      group_sizes: [E] int32 on device, sum <= M.
      transpose_rhs: contract with weights[e].T (the dgrad layout).
      out_dtype: output dtype; rows' dtype by default. Accumulation is f32.
      precision: a recipe of `moe_core.precision`. Other than "bf16" (no
        quantisation), the forward product is of rows quantised per group
        and weights per expert (`quantized_gemm`); gradients are
        straight-through, those of the unquantised GEMM.
    """
    validation.check_grouped_gemm(
        rows, weights, group_sizes, transpose_rhs=transpose_rhs
    )
    recipe = self._check_precision(precision)
    if weights.dtype != rows.dtype:
      raise TypeError(
          "grouped_gemm needs rows and weights of one dtype, got "
          f"rows {rows.dtype}, weights {weights.dtype}."
      )
    out_dtype = validation.check_out_dtype(out_dtype, rows.dtype)
    self._check_dtype(rows.dtype)
    if weights.shape[0] == 0:
      # No groups: every row is past sum(group_sizes) = 0, so all zeros
      # (and zero gradients), the same on every backend without asking
      # one's kernels to handle an empty grid.
      n = weights.shape[1] if transpose_rhs else weights.shape[2]
      return jnp.zeros((rows.shape[0], n), out_dtype)
    group_sizes, bad = _sanitised_group_sizes(group_sizes, rows.shape[0])
    gemm = operands.GemmOperands(
        rows=rows,
        weights=weights,
        group_sizes=group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
    )
    if recipe == "bf16":
      out = self._grouped_gemm(gemm)
    else:
      out = self._quantized_gemm(gemm, recipe)
    return checks.poison_if(bad, out, rows, weights)

  @abc.abstractmethod
  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    """`grouped_gemm` on validated operands: [M, C] x [E, C, N] -> [M, N].

    Returns [M, N] of `gemm.out_dtype`, zeros in the rows at or past
    sum(gemm.group_sizes); see `operands.GemmOperands` for the layouts.
    """

  def _quantized_gemm(
      self, gemm: operands.GemmOperands, recipe: str
  ) -> jax.Array:
    """`gemm` with both operands quantised by `recipe`: [M, N] out_dtype.

    Rows are quantised per group, weights per expert, here for every
    backend alike; the backend multiplies (`_quantized_grouped_gemm`).
    Gradients are the unquantised `_grouped_gemm`'s (straight-through).
    """
    contract_axis = 2 if gemm.transpose_rhs else 1

    def forward(rows, weights, group_sizes):
      q = operands.QuantizedGemmOperands(
          rows=precision_lib.quantize_grouped_rows(rows, group_sizes, recipe),
          weights=precision_lib.quantize_grouped_weights(
              weights, recipe, contract_axis=contract_axis
          ),
          group_sizes=group_sizes,
          transpose_rhs=gemm.transpose_rhs,
          out_dtype=gemm.out_dtype,
          recipe=recipe,
      )
      return self._quantized_grouped_gemm(q).astype(gemm.out_dtype)

    def unquantized(rows, weights, group_sizes):
      return self._grouped_gemm(
          dataclasses.replace(
              gemm, rows=rows, weights=weights, group_sizes=group_sizes
          )
      )

    return quantized_gemm.straight_through(
        forward, unquantized, gemm.rows, gemm.weights, gemm.group_sizes
    )

  def _quantized_grouped_gemm(
      self, q: operands.QuantizedGemmOperands
  ) -> jax.Array:
    """The product of quantised operands: [M, N] (float32 or out_dtype).

    Rows at or past sum(q.group_sizes) hold zeros and must give zeros. Only
    called for recipes in `precisions`; see `moe_core.quantized_gemm` for
    the shared ways of computing it.
    """
    raise NotImplementedError(
        f"{self.name}: no quantised grouped GEMM (recipe {q.recipe!r})."
    )

  # --- The expert FFN (a template over the hooks below) ---------------------

  def expert_ffn(
      self,
      rows: jax.Array,
      group_sizes: jax.Array,
      params: dict,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    """Each row through its expert's gated FFN: [M, D] -> [M, D].

    Rows past sum(group_sizes) come out as zeros. The GEMM outputs carry
    the names `checkpoint_names(cfg.activation)` lists; backends override
    the hooks, not this method, so that they keep them.
    """
    validation.check_expert_ffn(rows, group_sizes, params, cfg)
    self._check_dtype(rows.dtype)
    recipe = self._check_precision(cfg.precision)
    group_sizes, bad = _sanitised_group_sizes(group_sizes, rows.shape[0])
    w_gate, w_up, w_down = (
        params[n].astype(rows.dtype) for n in ("w_gate", "w_up", "w_down")
    )
    ffn_in = operands.FfnOperands(
        rows=rows,
        group_sizes=group_sizes,  # int32, sanitised above.
        w_gate=w_gate,
        w_up=w_up,
        w_down=w_down,
        activation=cfg.activation,
    )
    if recipe != "bf16":
      out = self._quantized_ffn(ffn_in, recipe)
    elif self._fuses_activation(cfg.activation):
      # Gate and up never leave the fused op: there is nothing to name.
      h = self._gated_gate_up(ffn_in)
      out = self._down(h, ffn_in)
    else:
      gate, up = self._gate_up(ffn_in)
      h = ffn.gated(
          ad_checkpoint.checkpoint_name(gate, GATE_NAME),
          ad_checkpoint.checkpoint_name(up, UP_NAME),
          cfg.activation,
      )
      out = self._down(h, ffn_in)
    out = checks.poison_if(bad, out, rows, w_gate, w_up, w_down)
    return ad_checkpoint.checkpoint_name(out, DOWN_NAME)

  def _quantized_ffn(self, ffn_in: operands.FfnOperands, recipe: str):
    """The expert FFN with each GEMM's operands quantised: [M, D].

    Three quantised GEMMs (the input of down, act(gate) * up, is quantised
    per group like the rows); never fused, so every name is emitted.
    """

    def gemm(lhs, weights):
      return self._quantized_gemm(_projection(lhs, weights, ffn_in), recipe)

    h = ffn.gated(
        ad_checkpoint.checkpoint_name(
            gemm(ffn_in.rows, ffn_in.w_gate), GATE_NAME
        ),
        ad_checkpoint.checkpoint_name(gemm(ffn_in.rows, ffn_in.w_up), UP_NAME),
        ffn_in.activation,
    )
    return gemm(h, ffn_in.w_down)

  def checkpoint_names(
      self, activation: str, precision: str = "bf16"
  ) -> tuple[str, ...]:
    """The checkpoint names `expert_ffn` gives its outputs for `activation`.

    All of `CHECKPOINT_NAMES`, or only DOWN_NAME where the backend fuses the
    activation into the gate/up op (a remat policy then cannot keep gate and
    up: "save_moe" saves the down output and recomputes the fused op). A
    quantised `precision` never fuses: all of them.
    """
    if precision == "bf16" and self._fuses_activation(activation):
      return (DOWN_NAME,)
    return CHECKPOINT_NAMES

  def _fuses_activation(self, activation: str) -> bool:
    """Whether `expert_ffn` runs `_gated_gate_up` for `activation`."""
    del activation
    return False

  def _gate_up(
      self, ffn_in: operands.FfnOperands
  ) -> tuple[jax.Array, jax.Array]:
    """The gate and up projections: rows [M, D] -> (gate, up), each [M, F]."""
    return (
        self._prevalidated_gemm(ffn_in.rows, ffn_in.w_gate, ffn_in),
        self._prevalidated_gemm(ffn_in.rows, ffn_in.w_up, ffn_in),
    )

  def _gated_gate_up(self, ffn_in: operands.FfnOperands) -> jax.Array:
    """act(rows @ w_gate[e]) * (rows @ w_up[e]): [M, D] -> h [M, F].

    Called instead of `_gate_up` when `_fuses_activation(activation)`; a
    backend overriding one overrides the other. This default composes the
    unfused pieces (and names nothing).
    """
    gate, up = self._gate_up(ffn_in)
    return ffn.gated(gate, up, ffn_in.activation)

  def _down(self, h: jax.Array, ffn_in: operands.FfnOperands) -> jax.Array:
    """The down projection: h [M, F] x w_down [E, F, D] -> [M, D].

    h is act(gate) * up, of rows' dtype.
    """
    return self._prevalidated_gemm(h, ffn_in.w_down, ffn_in)

  def _prevalidated_gemm(
      self, lhs: jax.Array, weights: jax.Array, ffn_in: operands.FfnOperands
  ) -> jax.Array:
    """`_grouped_gemm` of lhs [M, C] x weights [E, C, N] inside expert_ffn.

    expert_ffn has already validated, cast and sanitised these operands
    (and poisons its own output): going through `grouped_gemm` again would
    repeat every check and poison on each projection.
    """
    return self._grouped_gemm(_projection(lhs, weights, ffn_in))

  # --- Routing --------------------------------------------------------------

  def route(
      self,
      x: jax.Array,
      router: jax.Array,
      cfg: config_lib.MoEConfig,
      correction_bias: jax.Array | None = None,
  ) -> routing.MoEAux:
    """Routes tokens: x [T, D], router [D, E] -> `MoEAux` (float32).

    `routing.route` by default. A backend with its own router overrides
    this and returns the same `MoEAux` fields with `routing.route`'s
    meaning (or falls back to it). `moe_layer` and the expert-parallel
    layer call the backend's `route`, from the same backend that computes
    the routed experts.
    """
    return routing.route(x, router, cfg, correction_bias)

  # --- Dispatch and combine -------------------------------------------------

  def dispatch(
      self, x: jax.Array, aux: routing.MoEAux, cfg: config_lib.MoEConfig
  ) -> permute.Dispatched:
    """Token copies sorted by expert: x [T, D] -> rows [T*K, D]."""
    validation.check_config(cfg)
    validation.check_aux(aux)
    kept = None if cfg.dropless else aux.kept
    return self._permute(x, aux.expert_ids, cfg.num_experts, kept)

  def combine(
      self,
      expert_out: jax.Array,
      dispatched: permute.Dispatched,
      aux: routing.MoEAux,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    """Undoes `dispatch`, weighting each copy: [T*K, D] -> [T, D]."""
    validation.check_config(cfg)
    validation.check_aux(aux)
    kept = None if cfg.dropless else aux.kept
    return self._unpermute(expert_out, dispatched, aux.combine_weights, kept)

  def _permute(
      self,
      x: jax.Array,
      expert_ids: jax.Array,
      num_experts: int,
      kept: jax.Array | None,
  ) -> permute.Dispatched:
    """`dispatch`'s sort and gather: `permute.dispatch`'s contract.

    x [T, D], expert_ids [T, K], kept [T, K] bool or None (dropless) ->
    `Dispatched` with rows [T*K, D]. A backend with its own permutation
    kernel overrides this, not `dispatch`, which checked the config and aux.
    """
    return permute.dispatch(x, expert_ids, num_experts, kept)

  def _unpermute(
      self,
      expert_out: jax.Array,
      dispatched: permute.Dispatched,
      combine_weights: jax.Array,
      kept: jax.Array | None,
  ) -> jax.Array:
    """`combine`'s weighted un-permute: `permute.combine`'s contract.

    expert_out [T*K, D], combine_weights [T, K] -> [T, D]. Overridden like
    `_permute`.
    """
    return permute.combine(expert_out, dispatched, combine_weights, kept)

  # --- The routed block -----------------------------------------------------

  def routed_experts(
      self,
      params: dict,
      x: jax.Array,
      aux: routing.MoEAux,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    """The routed experts' weighted output: x [T, D] -> [T, D].

    A token whose aux.expert_ids hold an id outside [0, E) (traced; concrete
    ones raise) or whose combine weights hold NaN comes out as NaN.
    """
    validation.check_routed_experts(x, aux, cfg, params)
    dispatched = self.dispatch(x, aux, cfg)
    out = self.expert_ffn(dispatched.rows, dispatched.group_sizes, params, cfg)
    return self.combine(out, dispatched, aux, cfg)


def _sanitised_group_sizes(
    group_sizes: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
  """(int32 sizes for the hooks, scalar bool: the given sizes were bad).

  Bad sizes (a negative entry, or a sum past num_rows; only traced ones get
  here) are replaced by zeros, so no kernel reads rows that do not exist;
  the caller then poisons its output with `checks.poison_if`.
  """
  group_sizes = group_sizes.astype(jnp.int32)
  bad = checks.check_group_sizes(group_sizes, num_rows)
  return jnp.where(bad, 0, group_sizes), bad


def _projection(
    lhs: jax.Array, weights: jax.Array, ffn_in: operands.FfnOperands
) -> operands.GemmOperands:
  """One FFN projection: lhs [M, C] x weights [E, C, N] over ffn_in's groups,
  out in lhs's dtype."""
  return operands.GemmOperands(
      rows=lhs,
      weights=weights,
      group_sizes=ffn_in.group_sizes,
      transpose_rhs=False,
      out_dtype=jnp.dtype(lhs.dtype),
  )
