"""A JAX primitive over a backend's kernels: everything but its derivatives.

`kernel_primitive` makes the primitive that `grouped_matmul` and
`permutation` build on: given a function that calls the kernels and one that
gives the output shapes, it supplies the eager implementation, abstract
evaluation (with the kernels' own effects), the lowering as one device's
computation and the vmap rule that every such primitive needs; the caller
registers the jvp and transpose rules.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
from jax import extend as jex
from jax.interpreters import batching
from jax.interpreters import mlir

from moe_core import compat

# (*operands, **params) -> list of outputs: the kernels' call.
KernelCall = Callable[..., Sequence[jax.Array]]
# (avals, **params) -> [(shape, dtype)] of the outputs.
OutShapes = Callable[..., Sequence[tuple[tuple[int, ...], object]]]


def kernel_primitive(
    name: str, call: KernelCall, out_shapes: OutShapes
) -> jex.core.Primitive:
  """A multiple-results primitive computing `call`.

  What it supplies:

    impl        eager calls run the kernels jitted, as lax's primitives do;
    abstract    the outputs' shapes and dtypes, with the first operand's mesh
    eval        and mesh variance, and the kernels' own effects (none for
                compiled kernels; an interpreter's ordered host callbacks);
    lowering    the kernels traced as one device's computation (inside
                shard_map their operands carry no mesh variance, so loop
                carries and pallas_call out_shapes type-check), threading
                the callbacks' token when there is one;
    vmap        a loop over the batch (`lax.map`), each step the primitive
                unbatched: ragged groups differ per batch element, so there
                is no one bigger call to fold the batch into.

  The caller registers the jvp and transpose rules. Every parameter of a
  bind must be hashable (it keys jit caches and the effects cache), and the
  operands must share their mesh variance (`match_variance`).
  """
  prim = jex.core.Primitive(name)
  prim.multiple_results = True

  @functools.lru_cache(maxsize=None)
  def jitted(**params):
    return jax.jit(functools.partial(call, **params))

  def impl(*operands, **params):
    return jitted(**params)(*operands)

  @functools.lru_cache(maxsize=None)
  def effects(avals, **params):
    with compat.per_device_tracing():
      jaxpr = jax.make_jaxpr(functools.partial(call, **params))(
          *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals)
      )
    return jaxpr.effects

  def abstract_eval(*avals, **params):
    # Mesh variance and mesh of the first operand (all operands match),
    # with no partitioning of their own.
    template = avals[0]
    replicated = template.sharding.update(spec=jax.sharding.PartitionSpec())
    out = [
        template.update(
            shape=tuple(shape),
            dtype=dtype,
            weak_type=False,
            sharding=replicated,
        )
        for shape, dtype in out_shapes(avals, **params)
    ]
    return out, effects(tuple(_unvarying(a) for a in avals), **params)

  lower_call = mlir.lower_fun(call, multiple_results=True)

  def lower(ctx, *operands, **params):
    local = ctx.replace(
        avals_in=[_unvarying(a) for a in ctx.avals_in],
        avals_out=[_unvarying(a) for a in ctx.avals_out],
    )
    with compat.per_device_tracing():
      out = lower_call(local, *operands, **params)
    if local.tokens_out is not None:  # An interpreter's ordered callbacks.
      ctx.set_tokens_out(local.tokens_out)
    return out

  def batch(operands, dims, **params):
    batched = [
        jax.numpy.moveaxis(x, d, 0)
        for x, d in zip(operands, dims)
        if d is not None
    ]

    def step(sliced):
      sliced = iter(sliced)
      full = [
          next(sliced) if d is not None else x for x, d in zip(operands, dims)
      ]
      return prim.bind(*full, **params)

    outs = jax.lax.map(step, batched)
    return list(outs), [0] * len(outs)

  _CALLS[prim] = call
  prim.def_impl(impl)
  prim.def_effectful_abstract_eval(abstract_eval)
  mlir.register_lowering(prim, lower)
  batching.primitive_batchers[prim] = batch
  return prim


# Every kernel primitive -> the function that calls its kernels.
_CALLS: dict[jex.core.Primitive, KernelCall] = {}


def trace_kernel_calls(fn: Callable, *args) -> None:
  """Traces the kernels that `fn(*args)` calls, one by one, in order.

  Kernels run at lowering (and their trace at abstract evaluation is
  cached), so `jax.eval_shape(fn)` alone need not call them: this finds
  every kernel primitive in fn's jaxpr (sub-jaxprs included) and traces its
  kernels abstractly, so a test can see each call (its launcher's
  recorder, a spy) without a device to lower for.
  """

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      call = _CALLS.get(eqn.primitive)
      if call is not None:
        jax.eval_shape(
            functools.partial(call, **eqn.params),
            *(
                jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                for v in eqn.invars
            ),
        )
      for sub in jex.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)


def _unvarying(aval):
  """aval without mesh variance (what one device's kernel sees)."""
  mat = getattr(aval, "manual_axis_type", None)
  if mat is None or not getattr(mat, "varying", None):
    return aval
  return aval.update(manual_axis_type=type(mat)())


def _varying(x) -> frozenset:
  """The manual mesh axes x varies over (inside shard_map), else empty."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def match_variance(operands: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
  """The operands made to vary over the same manual mesh axes (the union).

  Inside `shard_map(check_vma=True)` a replicated weight and per-device rows
  differ in type; a kernel primitive's outputs vary like all its inputs.
  """
  operands = tuple(operands)
  axes = frozenset().union(*(_varying(x) for x in operands))
  if not axes:
    return operands
  return tuple(
      x
      if _varying(x) == axes
      else jax.lax.pcast(x, tuple(sorted(axes - _varying(x))), to="varying")
      for x in operands
  )


# --- An opaque kernel call --------------------------------------------------


def _call_opaque(*operands, fn, static):
  return list(fn(*operands, **dict(static)))


def _opaque_shapes(avals, *, fn, static):
  # Traced as one device's kernels, as `effects` and the lowering trace
  # them: inside shard_map(check_vma=True) a pallas_call traced with the
  # mesh's typing on wants each out_shape to say how it varies.
  with compat.per_device_tracing():
    outs = jax.eval_shape(
        functools.partial(fn, **dict(static)),
        *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals),
    )
  return [(o.shape, o.dtype) for o in outs]


opaque_kernel_p = kernel_primitive(
    "dropless_kernel_call", _call_opaque, _opaque_shapes
)


def call_kernel(fn: Callable, *operands: jax.Array, **static) -> tuple:
  """fn(*operands, **static), a tuple of arrays, as one device's kernel.

  For a fused kernel whose derivatives a `jax.custom_jvp` around this call
  gives: the primitive has no rules of its own besides vmap. Inside
  `shard_map(check_vma=True)` its outputs vary like its operands, which a
  kernel called directly (a pallas_call, a host callback) cannot say.
  `fn` and the values of `static` must be hashable, by value where the
  call repeats (a frozen dataclass, a module-level function).
  """
  operands = match_variance(operands)
  return tuple(
      opaque_kernel_p.bind(
          *operands, fn=fn, static=tuple(sorted(static.items()))
      )
  )
