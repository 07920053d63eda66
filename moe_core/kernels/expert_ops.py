"""The expert FFN's fused ops, on a backend's `GroupedKernels`.

gate_up         (rows @ w_gate[g], rows @ w_up[g]): one `grouped_products`
                call, so a backend whose kernel reads the rows once for
                both products does; its dX sums both products in one call
                and its dW is one tgmm with two outputs (the transposes).
gated_epilogue  the fused kernel's epilogue, h = f(gate, up) on the float32
                accumulators: any gated activation of
                `moe_core.activations` with its clamp and options
                (`check_epilogue_activation`: the ones a backend's
                epilogue computes).
EpilogueGatedKernel
                that fused kernel from a `fused_gmm` taking an epilogue: the
                gate and up products into two accumulators, then
                `gated_epilogue` on them.
gated_gate_up   act(rows @ w_gate[g]) * (rows @ w_up[g]) from a backend's
                fused kernel (the activation in its epilogue). A custom JVP:
                the primal is the fused kernel; the tangent is gate_up's on
                the tangents, through the activation's derivative, so
                reverse mode transposes it into gate_up's fused dX and dW
                kernels, and forward mode works too.
row_scaled_gmm  out[r] = scale[r] * (lhs[r] @ rhs[g]) from a kernel that
                applies the scale in its epilogue (the routing weights in
                the down projection); a custom JVP the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import jax
from jax import ad_checkpoint
import jax.numpy as jnp

from moe_core import activations
from moe_core import backend
from moe_core.kernels import grouped_matmul as gm
from moe_core.kernels import primitive

# (rows, w_gate, w_up, group_sizes, *, activation: activations.Settings,
# with_inputs) -> (h,) or (h, gate, up); hashable by value, with a
# `keeps_inputs` attribute that says whether it can be asked for gate and up.
FusedGatedKernel = Callable[..., tuple[jax.Array, ...]]


def gate_up(
    kernels: gm.GroupedKernels,
    rows: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    group_sizes: jax.Array,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
  """rows [M, D] x (w_gate, w_up) [E, D, F] -> (gate, up), each [M, F].

  Both outputs are of `out_dtype`, by default rows' dtype.
  """
  out_dtype = rows.dtype if out_dtype is None else out_dtype
  return gm.grouped_products(
      kernels,
      "gmm",
      (rows,),
      (w_gate, w_up),
      group_sizes,
      products=((0, 0, 0), (0, 1, 1)),
      out_dtypes=(out_dtype, out_dtype),
  )


def _gate_up_tangent(kernels, rows, w_gate, w_up, group_sizes, tangents):
  """(dgate, dup) in float32 from the tangents of rows, w_gate and w_up.

  One call: dgate = drows @ wg + rows @ dwg (and dup alike), so the
  transpose gives dX as one gmm summing both products and dW as one tgmm.
  """
  d_rows, d_w_gate, d_w_up = tangents
  f32 = jnp.dtype(jnp.float32)
  return gm.grouped_products(
      kernels,
      "gmm",
      (d_rows, rows),
      (w_gate, w_up, d_w_gate, d_w_up),
      group_sizes,
      products=((0, 0, 0), (1, 2, 0), (0, 1, 1), (1, 3, 1)),
      out_dtypes=(f32, f32),
  )


def epilogue_settings(
    activation: str | activations.Settings,
) -> activations.Settings:
  """`activation` as `activations.Settings`: a bare name has no options."""
  if isinstance(activation, activations.Settings):
    return activation
  return activations.Settings(activation)


def gated_epilogue(
    activation: str | activations.Settings, with_inputs: bool
) -> Callable:
  """A fused gate/up kernel's epilogue on its float32 accumulators:
  (gate, up) -> (h,), or (h, gate, up) with `with_inputs`, h the activation
  of `activation` (its clamp and options included,
  `moe_core.activations.hidden`), all float32 [bm, bn]."""
  settings = epilogue_settings(activation)

  def epilogue(accs):
    gate, up = accs
    h = activations.hidden(settings, gate, up)  # float32 in, float32 out.
    return (h, gate, up) if with_inputs else (h,)

  return epilogue


def check_epilogue_activation(
    activation: str | activations.Settings, supported
) -> activations.Settings:
  """`activation`'s settings if a kernel epilogue computes them; else raises.

  An epilogue computes the gated activations its backend lists, with or
  without `swiglu_limit` (a min and a clip, which every lowering has), given
  every option the activation reads.

  Args:
    activation: the gated activation asked for, a name or its settings.
    supported: the backend's epilogue activations (its ops module's
      EPILOGUE_ACTIVATIONS).

  Raises:
    ValueError: the activation is not in `supported`, or an option it reads
      is None.
  """
  settings = epilogue_settings(activation)
  if settings.name not in supported:
    raise ValueError(
        f"activation must be one of {tuple(supported)} to run in the "
        f"kernel epilogue, got {settings.name!r}."
    )
  unset = [o for o in settings.activation.reads if getattr(settings, o) is None]
  if unset:
    raise ValueError(
        f"activation {settings.name!r} reads {unset}, which must be set in "
        f"its activations.Settings to run in the kernel epilogue, got None."
    )
  return settings


@dataclasses.dataclass(frozen=True)
class EpilogueGatedKernel:
  """A `FusedGatedKernel` from a backend's `fused_gmm` with an epilogue.

  For a backend whose `fused_gmm` also takes `epilogue` (float32
  accumulators [bm, bn] -> output blocks): one pass over the rows fills the
  gate and up accumulators, and `gated_epilogue` writes h from them (and
  gate and up too, with `with_inputs`).

  Attributes:
    kernels: the backend's grouped matmuls, hashable by value.
  """

  kernels: gm.GroupedKernels
  keeps_inputs: ClassVar[bool] = True

  def __call__(
      self, rows, w_gate, w_up, group_sizes, *, activation, with_inputs
  ):
    """rows [M, D], w_gate, w_up [E, D, F] -> (h,) or (h, gate, up) [M, F]."""
    return self.kernels.fused_gmm(
        (rows,),
        (w_gate, w_up),
        group_sizes,
        products=((0, 0, 0), (0, 1, 1)),
        transpose_rhs=False,
        num_outputs=3 if with_inputs else 1,
        out_dtype=rows.dtype,
        epilogue=gated_epilogue(activation, with_inputs),
    )


def gated_gate_up(
    kernels: gm.GroupedKernels,
    fused: FusedGatedKernel,
    rows: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    group_sizes: jax.Array,
    activation: str | activations.Settings,
) -> jax.Array:
  """act(rows @ w_gate[g]) * (rows @ w_up[g]): [M, D] -> h [M, F].

  Args:
    kernels: the backend's grouped matmuls (the tangent's products).
    fused: the backend's fused kernel, hashable by value (a frozen
      dataclass): fused(rows, w_gate, w_up, group_sizes, *, activation,
      with_inputs) returns (h,), or with `with_inputs` (h, gate, up), the
      residuals of the activation's derivative. A kernel that cannot write
      them says so with `keeps_inputs = False`: gate and up are then
      recomputed by `kernels` where the derivative needs them, not kept
      from the forward.
    rows: [M, D] sorted by group; w_gate, w_up: [E, D, F] of rows' dtype.
    group_sizes: [E] int32, valid.
    activation: the gated activation, a name or its `activations.Settings`
      (clamp and options: `fused` gets the settings, hashable, and computes
      `activations.hidden` of them).
  """
  settings = epilogue_settings(activation)
  keeps_inputs = fused.keeps_inputs

  def call(with_inputs, *operands):
    return primitive.call_kernel(
        fused, *operands, activation=settings, with_inputs=with_inputs
    )

  @jax.custom_jvp
  def h_only(rows, w_gate, w_up, group_sizes):
    return call(False, rows, w_gate, w_up, group_sizes)[0]

  @jax.custom_jvp
  def with_inputs(rows, w_gate, w_up, group_sizes):
    return call(True, rows, w_gate, w_up, group_sizes)

  def act_tangent(gate, up, d_gate, d_up):
    # The activation's derivative on the float32 gate and up, as the
    # fused epilogue computed h from them.
    _, d_h = jax.jvp(
        lambda g, u: activations.hidden(settings, g, u),
        (gate.astype(jnp.float32), up.astype(jnp.float32)),
        (d_gate, d_up),
    )
    return d_h

  def recomputed_act_tangent(rows, w_gate, w_up, group_sizes, d_gate, d_up):
    gate, up = gate_up(
        kernels, rows, w_gate, w_up, group_sizes, out_dtype=jnp.float32
    )
    return act_tangent(gate, up, d_gate, d_up)

  # Each rule gets its primal from the custom_jvp function itself, never
  # from the raw kernel, so a derivative of the rule (a Hessian) goes
  # through the rules again.
  @h_only.defjvp
  def h_only_jvp(primals, tangents):
    d_gate, d_up = _gate_up_tangent(kernels, *primals, tangents[:3])
    if keeps_inputs:
      h, gate, up = with_inputs(*primals)
      # The residuals, named as the unfused FFN's outputs are, so that a
      # remat policy keeping the expert outputs ("save_moe") keeps these
      # and does not run the fused op again in the backward.
      gate = ad_checkpoint.checkpoint_name(gate, backend.GATE_NAME)
      up = ad_checkpoint.checkpoint_name(up, backend.UP_NAME)
      h = ad_checkpoint.checkpoint_name(h, backend.HIDDEN_NAME)
      d_h = act_tangent(gate, up, d_gate, d_up)
    else:
      # Recomputed where needed: in the backward pass under reverse mode.
      h = h_only(*primals)
      d_h = jax.checkpoint(recomputed_act_tangent)(*primals, d_gate, d_up)
    return h, d_h.astype(h.dtype)

  @with_inputs.defjvp
  def with_inputs_jvp(primals, tangents):
    h, gate, up = with_inputs(*primals)
    d_gate, d_up = _gate_up_tangent(kernels, *primals, tangents[:3])
    d_h = act_tangent(gate, up, d_gate, d_up)
    return (h, gate, up), (
        d_h.astype(h.dtype),
        d_gate.astype(gate.dtype),
        d_up.astype(up.dtype),
    )

  return h_only(rows, w_gate, w_up, group_sizes)


def row_scaled_gmm(
    kernels: gm.GroupedKernels,
    scaled_kernel: Callable[..., tuple[jax.Array]],
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    row_scale: jax.Array,
) -> jax.Array:
  """out[r] = row_scale[r] * (lhs[r] @ rhs[g]): [M, C] x [E, C, N] -> [M, N].

  Args:
    kernels: the backend's grouped matmuls (the tangent's products).
    scaled_kernel: hashable by value: (lhs, rhs, group_sizes, row_scale) ->
      (out,) in lhs's dtype, the scale applied to the float32 accumulator.
    lhs: [M, C] sorted by group; rhs: [E, C, N] of lhs's dtype.
    group_sizes: [E] int32, valid.
    row_scale: [M] float32. Rows at or past sum(group_sizes) come out zero
      and get zero gradient in lhs and row_scale, whatever they hold.
  """

  @jax.custom_jvp
  def op(lhs, rhs, group_sizes, row_scale):
    (out,) = primitive.call_kernel(
        scaled_kernel, lhs, rhs, group_sizes, row_scale
    )
    return out

  @op.defjvp
  def op_jvp(primals, tangents):
    lhs, rhs, group_sizes, row_scale = primals
    d_lhs, d_rhs, _, d_scale = tangents
    out = op(*primals)
    f32 = jnp.dtype(jnp.float32)
    # Rows past the groups: zero, whatever their scale holds (NaN too).
    used = (jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes))[:, None]
    scale = jnp.where(used, row_scale.astype(f32)[:, None], 0.0)
    d_scale = jnp.where(used, d_scale.astype(f32)[:, None], 0.0)
    # A row scale commutes with the product (s * (x @ W) = (s * x) @ W), so
    # d_out = (s dx + ds x) @ W + (s x) @ dW is one call of two products:
    # its transpose is one dX gmm (whose rows, dotted with x, give ds) and
    # one dW tgmm, and no forward product is recomputed for ds.
    row_tangent = scale * d_lhs.astype(f32) + d_scale * lhs.astype(f32)
    (d_out,) = gm.grouped_products(
        kernels,
        "gmm",
        (row_tangent.astype(lhs.dtype), (scale * lhs).astype(lhs.dtype)),
        (rhs, d_rhs),
        group_sizes,
        products=((0, 0, 0), (1, 1, 0)),
        out_dtypes=(f32,),
    )
    return out, d_out.astype(out.dtype)

  return op(lhs, rhs, group_sizes, row_scale)
