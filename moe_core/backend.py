"""The Backend interface: a grouped GEMM, plus overridable MoE stages.

`Backend`'s public methods are template methods: each validates its inputs
once (`moe_core.validation`), applies the run-time policy for values only
the device knows (`moe_core.checks`), names the expert GEMM outputs for the
remat policies (`CHECKPOINT_NAMES`), and calls the hooks a backend fills, so
every backend keeps the same contract (docs/backends.md, "The contract every
backend keeps"). Over 400 lines because it is one job: the template every
backend fills, its template methods and its hooks.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from typing import Callable, ClassVar
import warnings

import jax
from jax import ad_checkpoint
import jax.numpy as jnp

from moe_core import activations as activations_lib
from moe_core import checks
from moe_core import config as config_lib
from moe_core import ffn
from moe_core import index_ops
from moe_core import norms
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
# h = act(gate) * up where one fused op computes it (`_gated_gate_up`): the
# down GEMM's input, named with gate and up as the op's residuals, so that
# a policy keeping the expert outputs does not run the fused op again.
HIDDEN_NAME = "moe_hidden"
FUSED_CHECKPOINT_NAMES = (GATE_NAME, UP_NAME, HIDDEN_NAME)

# Backend's template methods -> the hooks a backend overrides instead.
_TEMPLATE_HOOKS = {
    "grouped_gemm": "_grouped_gemm (or _quantized_grouped_gemm)",
    "expert_ffn": "_gate_up, _gated_gate_up or _down",
    "route": "_route",
    "dispatch": "_gather",
    "combine": "_combine",
    "routed_experts": "_routed_experts",
}


# The version of the hooks' contract below (docs/backends.md, "The hooks a
# backend fills"). 2: `_grouped_gemm(self, gemm)` takes one
# `operands.GemmOperands`; 1 took `(rows, weights, group_sizes, *,
# transpose_rhs, out_dtype)`, which still works, adapted, with a
# DeprecationWarning. A backend may say which version it was written for
# (`Backend.hooks_version`); one newer than this library's is refused.
HOOKS_VERSION = 2
HOOKS_PAGE = "docs/backends.md#the-hooks-a-backend-fills"

# Each hook -> the arguments after self that the templates pass it (all
# positional; `_expert_ffn` may also get row_weights=, `_route` the
# router's extras as keywords). An override is checked against this where
# its class is defined, so a hook written to another contract fails there
# with the call it must take, not with a TypeError deep in a layer.
HOOK_CALLS = {
    "_grouped_gemm": ("gemm",),
    "_quantized_grouped_gemm": ("q",),
    "_quantized_forward": ("gemm", "recipe"),
    "_expert_ffn": ("rows", "group_sizes", "params", "cfg"),
    "_fuses_activation": ("settings",),
    "_gate_up": ("ffn_in",),
    "_gated_gate_up": ("ffn_in",),
    "_down": ("h", "ffn_in"),
    "_route": ("x", "router", "cfg", "correction_bias"),
    "_gather": ("x", "plan"),
    "_combine": ("expert_out", "dispatched", "combine_weights", "kept"),
    "_routed_experts": ("params", "x", "aux", "cfg"),
    "_routing_weights_in_down": ("cfg", "dtype"),
}
_HOOK_KEYWORDS = {"_expert_ffn": ("row_weights",)}


class Backend(abc.ABC):
  """A way to compute the expert stage of an MoE block.

  A backend implements `_grouped_gemm`; everything else has a sort-based
  default built on it and may be overridden. The expert FFN is a template:
  `expert_ffn` validates, casts and names the GEMM outputs, and calls hooks
  that a backend may replace by faster kernels:

    _gate_up        rows [M, D] -> (gate, up), each [M, F]; default: two
                    grouped GEMMs.
    _gated_gate_up  rows [M, D] -> act(gate) * up [M, F] in one op, used
                    when `_fuses_activation(settings)` is True.
    _down           h [M, F] -> [M, D]; default: one grouped GEMM, its
                    rows scaled by `FfnOperands.row_weights` when
                    `_routing_weights_in_down` says the routing weights
                    go into the down projection (default: in combine).

  Each hook takes one record of validated operands (`moe_core.operands`:
  `GemmOperands` for `_grouped_gemm`, `FfnOperands` for the FFN hooks).

  Dispatch is the library's plan (`moe_core.permute.plan`: the sort, group
  sizes, dropped and invalid copies) and the hook `_gather` (the rows);
  combine is the hook `_combine`. A backend with permutation kernels
  replaces only those two, the data movement. `_route` replaces the router;
  `_routed_experts` the whole block (one that does not call `_expert_ffn`,
  as the reference oracle, emits no checkpoint names).

  Attributes:
    name: the registry name, also the prefix of the backend's errors.
    dtypes: the operand dtypes the backend computes in; None for every
      floating dtype the validation admits. Others raise NotImplementedError
      in `grouped_gemm` and `expert_ffn`.
    precisions: the GEMM recipes (`moe_core.precision`) the backend
      multiplies quantised operands for, through `_quantized_grouped_gemm`;
      others raise NotImplementedError naming the recipe.
    matmul_precision: the `jax_default_matmul_precision` that `moe_layer`
      traces the whole block under with this backend (the shared expert's
      and latent projections' products included; "highest" for the
      reference oracle, so that it multiplies float32 exactly on a TPU,
      whose default is one bfloat16 pass); None (the default) keeps the
      caller's, which the fast backends follow.
    fused_checkpoint_names: the checkpoint names the fused gate/up op
      (`_gated_gate_up`) gives its residuals under differentiation:
      `FUSED_CHECKPOINT_NAMES` where it keeps gate and up from its forward
      (and names them and h), () where it recomputes them.

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
  precisions: ClassVar[tuple[str, ...]] = (precision_lib.UNQUANTIZED,)
  matmul_precision: ClassVar[str | None] = None
  fused_checkpoint_names: ClassVar[tuple[str, ...]] = ()
  # Whether `_grouped_gemm` honours `GemmOperands.poison` (its kernels make
  # the output and gradients NaN); otherwise `grouped_gemm` poisons after.
  poisons_in_kernels: ClassVar[bool] = False
  # The `HOOKS_VERSION` the backend's hooks were written for (None: not
  # said, the current one). A newer one than the library's is refused.
  hooks_version: ClassVar[int | None] = None

  def __init_subclass__(cls, **kwargs):
    # The public methods validate, then call the hooks: a subclass that
    # replaced one would skip the validation, and `moe_layer` (which calls
    # the hooks) would not run it. Refused where the class is defined.
    super().__init_subclass__(**kwargs)
    for method, hooks in _TEMPLATE_HOOKS.items():
      if method in cls.__dict__:
        raise TypeError(
            f"{cls.__qualname__} overrides Backend.{method}, which validates "
            f"its inputs and then calls hooks: override {hooks} instead."
        )
    version = cls.__dict__.get("hooks_version")
    if version is not None and version > HOOKS_VERSION:
      raise TypeError(
          f"{cls.__qualname__} is written for backend hooks version "
          f"{version}; this dropless has version {HOOKS_VERSION} "
          f"({HOOKS_PAGE}): upgrade dropless, or write the hooks to version "
          f"{HOOKS_VERSION}."
      )
    hook = cls.__dict__.get("_grouped_gemm")
    if hook is not None and _takes_separate_operands(hook):
      cls._grouped_gemm = _adapted_grouped_gemm(cls, hook)
    for name, args in HOOK_CALLS.items():
      if name in cls.__dict__:
        _check_hook(cls, name, getattr(cls, name), args)

  def availability(self) -> tuple[bool, str]:
    """(True, "") if this backend can run here, else (False, why not)."""
    return True, ""

  def auto_choice(self) -> tuple[bool, str]:
    """(True, "") if "auto" may pick this backend where it is available, else
    (False, why): it runs, but measurably slower here than the next in the
    order (the cpu backend's portable kernels); named, it still runs."""
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
      precision: str = precision_lib.UNQUANTIZED,
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
      precision: a recipe of `moe_core.precision` (the deprecated alias
        "bf16" warns and means "unquantized"). Other than "unquantized" (no
        quantisation: the GEMM runs in rows' dtype), the forward product
        is of rows quantised per group and weights per expert
        (`quantized_gemm`); gradients are straight-through, those of the
        unquantised GEMM.
    """
    validation.check_grouped_gemm(
        rows, weights, group_sizes, transpose_rhs=transpose_rhs
    )
    # The alias is named here, so that its warning points at the caller.
    recipe = self._check_precision(
        precision_lib.check_recipe(precision, stacklevel=2)
    )
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
    group_sizes, bad = sanitised_group_sizes(group_sizes, rows.shape[0])
    # The kernels write the poison themselves where they can: no pass over
    # the output and its cotangent (10-36% of a grouped GEMM's time
    # on a TPU v5e); with rows, so that the NaN reaches the gradients
    # through them as `_poisoned`'s does.
    in_kernels = (
        self.poisons_in_kernels
        and recipe == precision_lib.UNQUANTIZED
        and rows.shape[0] > 0
    )
    gemm = operands.GemmOperands(
        rows=rows,
        weights=weights,
        group_sizes=group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        poison=bad if in_kernels else None,
    )
    if recipe == precision_lib.UNQUANTIZED:
      out = self._grouped_gemm(gemm)
    else:
      out = self._quantized_gemm(gemm, recipe)
    return out if in_kernels else _poisoned(bad, out, rows, weights)

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

    The forward is `_quantized_forward`'s; the gradients are the
    unquantised `_grouped_gemm`'s (straight-through).
    """

    def unquantized(rows, weights, group_sizes):
      return self._grouped_gemm(
          dataclasses.replace(
              gemm, rows=rows, weights=weights, group_sizes=group_sizes
          )
      )

    return quantized_gemm.straight_through(
        self._quantized_forward(gemm, recipe),
        unquantized,
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
    )

  def _quantized_forward(
      self, gemm: operands.GemmOperands, recipe: str
  ) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The forward of `_quantized_gemm`: (rows, weights, group_sizes) ->
    [M, N] out_dtype. By default moe_core quantises (rows per group,
    weights per expert) and the backend multiplies the quantised operands
    (`_quantized_grouped_gemm`); a backend whose library quantises itself
    overrides this."""
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

    return forward

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
    return self._expert_ffn(rows, group_sizes, params, cfg)

  def _expert_ffn(self, rows, group_sizes, params, cfg, row_weights=None):
    """`expert_ffn` on validated arguments; with row_weights [M] float32,
    each output row r is scaled by row_weights[r] in the down projection
    (`_down`), before the cast to rows' dtype."""
    self._check_dtype(rows.dtype)
    recipe = self._check_precision(cfg.precision)
    group_sizes, bad = sanitised_group_sizes(group_sizes, rows.shape[0])
    settings = activations_lib.Settings.from_config(cfg)
    gated = settings.activation.gated

    def param(name):
      return params[name].astype(rows.dtype) if name in params else None

    # Every path below scales each output row by its row weight, so with
    # weights a bad call's NaN rides in them (the output and every gradient
    # NaN, as `_poisoned` makes them) instead of a pass over the output.
    poison_weights = row_weights is not None and rows.shape[0] > 0
    if poison_weights:
      row_weights = checks.nan_if(bad, row_weights)

    ffn_in = operands.FfnOperands(
        rows=rows,
        group_sizes=group_sizes,  # int32, sanitised above.
        w_gate=param("w_gate") if gated else None,
        w_up=param("w_up"),
        w_down=param("w_down"),
        activation=cfg.activation,
        row_weights=row_weights,
        b_gate=param("b_gate") if cfg.expert_bias and gated else None,
        b_up=param("b_up") if cfg.expert_bias else None,
        b_down=param("b_down") if cfg.expert_bias else None,
        settings=settings,
    )
    if recipe != precision_lib.UNQUANTIZED:
      out = self._quantized_ffn(ffn_in, recipe)
    elif gated and not cfg.expert_bias and self._fuses_activation(settings):
      # Gate and up never leave the fused op: there is nothing to name. The
      # biases go between the products and the activation, so a biased FFN
      # runs unfused.
      h = self._gated_gate_up(ffn_in)
      out = self._down(h, ffn_in)
    else:
      if gated:
        gate, up = self._gate_up(ffn_in)
        gate = ad_checkpoint.checkpoint_name(gate, GATE_NAME)
      else:
        gate, up = None, self._prevalidated_gemm(rows, ffn_in.w_up, ffn_in)
      h = _hidden(gate, ad_checkpoint.checkpoint_name(up, UP_NAME), ffn_in)
      out = self._biased_down(h, ffn_in)
    if not poison_weights:
      weights = [ffn_in.w_gate, ffn_in.w_up, ffn_in.w_down]
      out = _poisoned(bad, out, rows, *(w for w in weights if w is not None))
    return ad_checkpoint.checkpoint_name(out, DOWN_NAME)

  def _biased_down(self, h: jax.Array, ffn_in: operands.FfnOperands):
    """`_down`, with b_down added before the routing weight scales a row:
    then `_down` runs unweighted and the weight comes after the bias."""
    if ffn_in.b_down is None:
      return self._down(h, ffn_in)
    out = self._down(h, dataclasses.replace(ffn_in, row_weights=None))
    out = ffn.add_row_bias(out, ffn_in.b_down, ffn_in.group_sizes)
    return scale_rows(out, ffn_in.row_weights)

  def _quantized_ffn(self, ffn_in: operands.FfnOperands, recipe: str):
    """The expert FFN with each GEMM's operands quantised: [M, D].

    Three quantised GEMMs (two without a gate; the input of down, h, is
    quantised per group like the rows); never fused, so every name is
    emitted. Biases are added unquantised, in float32.
    """

    def gemm(lhs, weights):
      return self._quantized_gemm(_projection(lhs, weights, ffn_in), recipe)

    gate = None
    if ffn_in.w_gate is not None:
      gate = ad_checkpoint.checkpoint_name(
          gemm(ffn_in.rows, ffn_in.w_gate), GATE_NAME
      )
    up = ad_checkpoint.checkpoint_name(gemm(ffn_in.rows, ffn_in.w_up), UP_NAME)
    out = gemm(_hidden(gate, up, ffn_in), ffn_in.w_down)
    out = ffn.add_row_bias(out, ffn_in.b_down, ffn_in.group_sizes)
    return scale_rows(out, ffn_in.row_weights)

  def checkpoint_names(
      self,
      activation: str | config_lib.MoEConfig,
      precision: str = precision_lib.UNQUANTIZED,
  ) -> tuple[str, ...]:
    """The checkpoint names `expert_ffn` gives its outputs for `activation`.

    All of `CHECKPOINT_NAMES`; where the backend fuses the activation into
    the gate/up op, DOWN_NAME and the names its fused op gives its
    residuals under differentiation (`fused_checkpoint_names`: gate, up
    and h where its kernel writes them, so that "save_moe" keeps them and
    does not run the op again; none where it recomputes them). A
    quantised `precision` never fuses: `CHECKPOINT_NAMES`. `precision` is a
    recipe of `moe_core.precision` (or its deprecated alias "bf16"). A
    non-gated activation has no GATE_NAME. Given a `MoEConfig` instead of
    an activation name, its activation settings (clamp and options),
    precision and biases (which no epilogue fuses) decide.
    """
    biased = False
    if isinstance(activation, config_lib.MoEConfig):
      cfg = activation
      settings = activations_lib.Settings.from_config(cfg)
      precision, biased = cfg.precision, cfg.expert_bias
    else:
      settings = activations_lib.Settings(activation)
    precision = precision_lib.check_recipe(precision, stacklevel=2)
    if not settings.activation.gated:
      return (UP_NAME, DOWN_NAME)
    if (
        not biased
        and precision == precision_lib.UNQUANTIZED
        and self._fuses_activation(settings)
    ):
      return (*self.fused_checkpoint_names, DOWN_NAME)
    return CHECKPOINT_NAMES

  def _fuses_activation(self, settings: activations_lib.Settings) -> bool:
    """Whether `expert_ffn` runs `_gated_gate_up` for the gated activation
    of `settings` (with its clamp and options; never asked with biases)."""
    del settings
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

    Called instead of `_gate_up` when `_fuses_activation(settings)`; a
    backend overriding one overrides the other. This default composes the
    unfused pieces (and names nothing).
    """
    gate, up = self._gate_up(ffn_in)
    return ffn.hidden(gate, up, ffn_in.activation_settings)

  def _down(self, h: jax.Array, ffn_in: operands.FfnOperands) -> jax.Array:
    """The down projection: h [M, F] x w_down [E, F, D] -> [M, D].

    h is the activation's output (act(gate) * up for a GLU), of rows'
    dtype. b_down, if any, is the template's (`_biased_down`): this hook
    then gets no row_weights. With `ffn_in.row_weights` (where
    `_routing_weights_in_down` says so), output row r is scaled by
    row_weights[r]; a kernel backend overrides this to scale its float32
    accumulator in the GEMM's epilogue.
    """
    out = self._prevalidated_gemm(h, ffn_in.w_down, ffn_in)
    return scale_rows(out, ffn_in.row_weights)

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
      **extras: jax.Array | None,
  ) -> routing.MoEAux:
    """Routes tokens: x [T, D], router [D, E] -> `MoEAux` (float32).

    Validates, then `_route`. `moe_layer` and the expert-parallel layer
    call the backend's `_route`, from the same backend that computes the
    routed experts. `extras` are `routing.route`'s optional keywords: the
    router params of `router_inputs.ROUTER_EXTRAS` (router_bias,
    router_norm_scale, expert_output_scale, hash_table) and token_ids.
    """
    validation.check_route(x, router, cfg, correction_bias, **extras)
    return self._route(x, router, cfg, correction_bias, **extras)

  def _route(self, x, router, cfg, correction_bias, **extras):
    """`route` on validated arguments (of its types): `routing.route`'s
    by default. A backend with its own router overrides this and returns
    the same `MoEAux` fields with `routing.route`'s meaning (or falls back
    to it)."""
    return routing.route_unchecked(x, router, cfg, correction_bias, **extras)

  # --- Dispatch and combine -------------------------------------------------
  # The plan (the sort by expert, group sizes, the dropped and invalid
  # copies' bookkeeping) is the library's, `permute.plan`; a backend with
  # its own data movement overrides `_gather` and `_combine` only.

  def dispatch(
      self, x: jax.Array, aux: routing.MoEAux, cfg: config_lib.MoEConfig
  ) -> permute.Dispatched:
    """Token copies sorted by expert: x [T, D] -> rows [T*K, D]."""
    validation.check_dispatch_stage(x, aux, cfg)
    return self._dispatch(x, aux, cfg)

  def _dispatch(self, x, aux, cfg) -> permute.Dispatched:
    kept = aux.kept if cfg.masks_copies else None
    plan = permute.plan_unchecked(aux.expert_ids, cfg.num_experts, kept)
    return self._gather(x, plan)

  def combine(
      self,
      expert_out: jax.Array,
      dispatched: permute.Dispatched,
      aux: routing.MoEAux,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    """Undoes `dispatch`, weighting each copy: [T*K, D] -> [T, D]."""
    validation.check_combine_stage(expert_out, dispatched, aux, cfg)
    kept = aux.kept if cfg.masks_copies else None
    return self._combine(expert_out, dispatched, aux.combine_weights, kept)

  def _gather(
      self, x: jax.Array, plan: permute.DispatchPlan
  ) -> permute.Dispatched:
    """The rows of `dispatch`: x [T, D] -> `Dispatched`, rows [T*K, D] in
    the plan's order (`permute.gather_unchecked`'s contract: an invalid
    copy's row is NaN). Validated arguments."""
    return permute.gather_unchecked(x, plan)

  def _combine(
      self,
      expert_out: jax.Array,
      dispatched: permute.Dispatched,
      combine_weights: jax.Array,
      kept: jax.Array | None,
  ) -> jax.Array:
    """`combine`'s weighted un-permute, `permute.combine`'s contract:
    expert_out [T*K, D], combine_weights [T, K] -> [T, D]. Validated
    arguments."""
    return permute.combine_unchecked(
        expert_out, dispatched, combine_weights, kept
    )

  # --- The routed block -----------------------------------------------------

  def routed_experts(
      self,
      params: dict,
      x: jax.Array,
      aux: routing.MoEAux,
      cfg: config_lib.MoEConfig,
  ) -> jax.Array:
    """The routed experts' weighted output: x [T, W] -> [T, W].

    W is cfg.expert_width: D, or the latent L where cfg.expert_latent_size
    is set (x is then the projected input, `moe_core.latent.project_in`,
    and the output is projected back by the caller, as `moe_layer` does).

    A token whose aux.expert_ids hold an id outside [0, E) (traced; concrete
    ones raise) or whose combine weights hold NaN comes out as NaN. With
    zero experts, pass `zero_experts.split_zero_experts(aux, cfg)[0]` (the FFN
    experts' share; `moe_layer` adds the zero experts' own).
    """
    validation.check_routed_experts(x, aux, cfg, params)
    return self._routed_experts(params, x, aux, cfg)

  def _routed_experts(self, params, x, aux, cfg) -> jax.Array:
    """`routed_experts` on validated arguments: dispatch, the expert FFN
    (with the routing weights in its down projection where
    `_routing_weights_in_down`, or on its input rows where
    cfg.routing_weights_on_input), the norm of each output row where
    cfg.post_expert_norm, combine."""
    dispatched = self._dispatch(x, aux, cfg)
    kept = aux.kept if cfg.masks_copies else None
    ones = jnp.ones_like(aux.combine_weights)
    if cfg.routing_weights_on_input:
      # Llama 4: each copy enters its expert scaled by its weight (in
      # float32, then rows' dtype), and the outputs are summed unweighted.
      # A NaN weight makes its row, and so its token, NaN.
      flat_weights = aux.combine_weights.astype(jnp.float32).reshape(-1)
      rows = scale_rows(dispatched.rows, flat_weights[dispatched.assignment])
      out = self._expert_ffn(rows, dispatched.group_sizes, params, cfg)
      return self._combine(out, dispatched, ones, kept)
    # The norm of each expert's output comes between the down projection
    # and the routing weight: then the weight stays out of the down.
    if cfg.post_expert_norm or not self._routing_weights_in_down(cfg, x.dtype):
      out = self._expert_ffn(
          dispatched.rows, dispatched.group_sizes, params, cfg
      )
      out = norms.post_expert(out, params, cfg)
      return self._combine(out, dispatched, aux.combine_weights, kept)
    # Each sorted row's weight scales its down output; the combine then
    # sums with unit weights. A NaN weight still makes its token NaN
    # (through the scaled row), an invalid id too (through combine). The
    # weights reach the sorted order by a sort, not a gather (`index_ops`).
    flat_weights = aux.combine_weights.astype(jnp.float32).reshape(-1)
    out = self._expert_ffn(
        dispatched.rows,
        dispatched.group_sizes,
        params,
        cfg,
        row_weights=index_ops.permute_values(
            flat_weights, dispatched.position, dispatched.assignment
        ),
    )
    return self._combine(out, dispatched, ones, kept)

  def _routing_weights_in_down(
      self, cfg: config_lib.MoEConfig, dtype: jnp.dtype
  ) -> bool:
    """Whether `routed_experts` applies the combine weights in the down
    projection (`_down`) rather than in `combine`: False by default."""
    del cfg, dtype
    return False


def scale_rows(out: jax.Array, row_weights: jax.Array | None) -> jax.Array:
  """out [M, D] with row r scaled by row_weights[r] [M] float32 (None: out),
  in float32, returned in out's dtype."""
  if row_weights is None:
    return out
  return (out.astype(jnp.float32) * row_weights[:, None]).astype(out.dtype)


def _hidden(gate, up, ffn_in: operands.FfnOperands) -> jax.Array:
  """h from the gate (None: not gated) and up products [M, F], with their
  biases gathered per row: `ffn.hidden`, in up's dtype."""

  def bias(b):
    if b is None:
      return None
    return ffn.row_bias(b, ffn_in.group_sizes, up.shape[0])

  return ffn.hidden(
      gate,
      up,
      ffn_in.activation_settings,
      gate_bias=bias(ffn_in.b_gate),
      up_bias=bias(ffn_in.b_up),
  )


# The `_grouped_gemm` hook before it took one `operands.GemmOperands`.
_SEPARATE_OPERANDS = ("rows", "weights", "group_sizes")


def _check_hook(cls, name: str, hook, args: tuple[str, ...]) -> None:
  """TypeError where `cls` is defined unless its `name` can take the call
  the templates make: self and `args` positionally (and the hook's
  keywords, `_HOOK_KEYWORDS`)."""
  if isinstance(inspect.getattr_static(cls, name), (staticmethod, classmethod)):
    raise TypeError(
        f"{cls.__qualname__}.{name} must be a plain method: the templates "
        f"call self.{name}({', '.join(args)}) ({HOOKS_PAGE})."
    )
  try:
    signature = inspect.signature(hook, follow_wrapped=False)
  except (TypeError, ValueError):  # A builtin or C callable: not checked.
    return
  call = ", ".join(("self",) + args)
  keywords = {k: None for k in _HOOK_KEYWORDS.get(name, ())}
  try:
    signature.bind(None, *args, **keywords)
  except TypeError as e:
    raise TypeError(
        f"{cls.__qualname__}.{name}{signature} cannot take the call the "
        f"templates make, {name}({call}"
        + "".join(f", {k}=..." for k in keywords)
        + f") (backend hooks version {HOOKS_VERSION}, {HOOKS_PAGE}): {e}."
    ) from None


def _takes_separate_operands(hook) -> bool:
  """Whether `hook` is written to the earlier `_grouped_gemm(self, rows,
  weights, group_sizes, *, transpose_rhs, out_dtype)`."""
  names = list(inspect.signature(hook).parameters)[1:]
  return tuple(names[:3]) == _SEPARATE_OPERANDS


def _adapted_grouped_gemm(cls, hook):
  """`hook`, written to the earlier signature, behind the current one, with
  a DeprecationWarning (where the class is defined) that names both."""
  warnings.warn(
      f"{cls.__qualname__}._grouped_gemm(self, rows, weights, group_sizes, "
      "*, transpose_rhs, out_dtype) is the earlier hook: it keeps working, "
      "called with the fields of the one argument the hook now takes, "
      "_grouped_gemm(self, gemm: moe_core.operands.GemmOperands) -> "
      "jax.Array (docs/backends.md, 'The hooks a backend fills').",
      DeprecationWarning,
      stacklevel=3,
  )

  @functools.wraps(hook)
  def grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    return hook(
        self,
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
        transpose_rhs=gemm.transpose_rhs,
        out_dtype=gemm.out_dtype,
    )

  return grouped_gemm


def sanitised_group_sizes(
    group_sizes: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
  """(int32 sizes for the hooks, scalar bool: the given sizes were bad).

  Bad sizes (a negative entry, or a sum past num_rows; only traced ones get
  here) are replaced by [num_rows, 0, ..., 0]: every row in the first
  group, so no kernel reads rows that do not exist, and the NaN cotangent
  of `_poisoned` reaches dX and the first expert's dW through the kernels
  themselves. The sizes are checked in their own dtype, before the cast:
  an int64 size (jax_enable_x64) of 2**32 + 4 would wrap to a valid 4.
  """
  bad = checks.flag_bad_group_sizes(group_sizes, num_rows)
  group_sizes = group_sizes.astype(jnp.int32)
  every_row_first = jnp.zeros_like(group_sizes).at[0].set(num_rows)
  return jnp.where(bad, every_row_first, group_sizes), bad


def _poisoned(bad: jax.Array, out: jax.Array, *inputs: jax.Array):
  """out, all NaN if the scalar `bad`, and NaN in the inputs' gradients.

  inputs[0] is the rows: with rows, `checks.nan_if` (the NaN cotangent
  flows back through the kernels, no pass over the weight gradients);
  without (an empty batch, nothing flows back), `checks.poison_if`.
  """
  if inputs[0].shape[0] > 0:
    return checks.nan_if(bad, out)
  return checks.poison_if(bad, out, *inputs)


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
