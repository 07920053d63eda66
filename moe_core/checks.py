"""Values known only on the device: NaN-and-count by default, errors if checked.

The run-time policy (docs/api.md, "Guarantees"). A value that only the device
knows (expert ids, group sizes, token counts, a rate under jit) cannot raise
without a host sync, which a training step must not pay, so by default a bad
value makes the outputs it touches NaN and routing counts it in
`MoEAux.invalid_assignments` (concrete values in eager calls raise
ValueError where they are given, in `moe_core.validation`); the same
conditions are also written as `debug_check`s, which fail only under
`checked`. Names say which kind a check is: `moe_core.validation.check_*`
raise now (on shapes, dtypes and concrete values); the `flag_*` here return
a traced mask of what is bad and never raise.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.experimental import checkify
import jax.numpy as jnp

from moe_core import compat

# True while `checked` traces: JAX's trace caches key on it, so a function
# jitted before (without the checks) is traced anew under `checked`.
_TRACING_CHECKED = compat.trace_context_flag(
    "dropless_tracing_checked",
    "Internal to moe_core.checks: whether moe_core.checked is tracing, so "
    "that the run-time value checks are emitted.",
)


def tracing_checked() -> bool:
  """Whether the function being traced runs under `checked`."""
  return bool(_TRACING_CHECKED.value)


def debug_check(ok: jax.Array, message: str, *values: jax.Array) -> None:
  """Fails a `checked` call if `ok` is False; traces nothing otherwise.

  `message` has one "{}" per value; the values are formatted on the device.
  Outside `checked` the check is not traced at all: a checkify check left
  in a plain program would carry an effect that `jax.export` cannot
  serialise (`Exported.serialize`), and would cost a little in every jitted
  call. Under `checked` it fails with the eager error's words.
  """
  if tracing_checked():
    checkify.debug_check(ok, message, *values)


def checked(fn: Callable) -> Callable:
  """`fn` with the run-time value checks of moe_core turned into errors.

  Traces `fn` (jitted or not) with the checks emitted and runs it under
  `checkify.checkify` with the user checks only, so its cost is one boolean
  per check; the first failed check raises `checkify.JaxRuntimeError`, a
  ValueError whose message is the check's (the same words as the eager
  ValueError). Arguments and results are `fn`'s. A `checked` function may
  itself be jitted; its program then carries checkify's error outputs.

  Example:
    y, aux = moe_core.checked(jax.jit(layer))(params, x)  # raises on bad ids
  """
  checkified = checkify.checkify(fn, errors=checkify.user_checks)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with _TRACING_CHECKED(True):
      error, out = checkified(*args, **kwargs)
    error.throw()
    return out

  return run


def nan_rows(bad_rows: jax.Array, x: jax.Array) -> jax.Array:
  """x [N, ...] with the rows where bad_rows [N] is True set to NaN.

  bad_rows may have several leading dims ([T, K] for x [T, K, D]).
  """
  bad = bad_rows.reshape(bad_rows.shape + (1,) * (x.ndim - bad_rows.ndim))
  return jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x)


def nan_if(bad: jax.Array, out: jax.Array) -> jax.Array:
  """out, or all NaN if the scalar `bad`; the same for out's cotangent.

  `out * (NaN if bad else 1)`: a product, not a select, so that its
  transpose multiplies the cotangent by the same factor. A bad call's
  backward then carries NaN into whatever the kernels compute from the
  cotangent (`Backend` hands them every row in group 0, so dX and the first
  expert's dW are NaN) without any pass over the weight gradients. When
  not bad, out and its cotangent pass through bit for bit (x * 1 == x).
  """
  factor = jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(1))
  return out * factor.astype(out.dtype)


def poison_if(bad: jax.Array, out: jax.Array, *inputs: jax.Array) -> jax.Array:
  """out, or all NaN if the scalar `bad`; then NaN reaches `inputs`' grads too.

  For a call whose kernels cannot carry `nan_if`'s NaN cotangent to the
  inputs (no rows: nothing flows back through them). The output is `out`
  bit for bit when not bad. When bad, the cotangent of `out` is dropped and
  the first element of each input gets a NaN gradient instead (a select,
  not a product, so a NaN cotangent in the valid case adds nothing). It
  costs one select over `out`, and in the backward a pass over each
  input's gradient (the one-element slice's transpose is a pad to the full
  shape, added to it).
  """
  witness = sum(
      (x.reshape(-1)[:1].astype(jnp.float32).sum() for x in inputs),
      jnp.float32(0),
  )
  # Both factors are selects on `bad`, so when not bad the transpose
  # multiplies zeros by zero: no NaN leaks into a valid call's gradient.
  nan_when_bad = jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(0))
  poison = jnp.where(bad, witness * nan_when_bad, jnp.float32(0))
  return jnp.where(bad, poison.astype(out.dtype), out)


def bad_group_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """Scalar bool: a negative size, or sizes summing past `num_rows`.

  The int32 sum could wrap around for huge sizes; a float32 sum, which
  cannot, catches that (a wrapped sum is past 2**31 > 2 * num_rows).
  """
  total = jnp.sum(group_sizes)
  approx_total = jnp.sum(group_sizes.astype(jnp.float32))
  return (
      jnp.any(group_sizes < 0)
      | (total > num_rows)
      | (approx_total > 2.0 * num_rows + 1.0)
  )


def flag_bad_group_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """`debug_check`s for `bad_group_sizes`; returns that scalar bool."""
  debug_check(
      jnp.all(group_sizes >= 0),
      "group_sizes must be >= 0, got {}.",
      group_sizes,
  )
  bad = bad_group_sizes(group_sizes, num_rows)
  debug_check(
      jnp.any(group_sizes < 0) | ~bad,
      f"sum(group_sizes) must be <= the {num_rows} rows, got sum={{}} "
      "(group_sizes={}).",
      jnp.sum(group_sizes),
      group_sizes,
  )
  return bad


def out_of_range(ids: jax.Array, num_experts: int) -> jax.Array:
  """Bool of ids' shape: True where an id is outside [0, num_experts)."""
  return (ids < 0) | (ids >= num_experts)


def flag_bad_expert_ids(ids: jax.Array, num_experts: int) -> jax.Array:
  """`debug_check` that ids lie in [0, E); returns `out_of_range(ids, E)`."""
  return _flag_out_of_range(
      ids,
      num_experts,
      f"expert_ids must lie in [0, num_experts={num_experts})",
  )


def flag_bad_hash_table(table: jax.Array, num_experts: int) -> jax.Array:
  """`debug_check` that a hash table's ids lie in [0, E + Z); returns
  `out_of_range(table, num_experts)` ([V, K] bool), num_experts being the
  router's width E + Z."""
  return _flag_out_of_range(
      table,
      num_experts,
      f"hash_table must hold expert ids in [0, {num_experts})",
  )


def _flag_out_of_range(
    ids: jax.Array, num_experts: int, requirement: str
) -> jax.Array:
  """`out_of_range(ids, num_experts)`, after a `debug_check` whose message
  is `requirement`, then the values found."""
  bad = out_of_range(ids, num_experts)
  if ids.size:
    debug_check(
        ~jnp.any(bad),
        requirement + ", got values in [{}, {}].",
        jnp.min(ids),
        jnp.max(ids),
    )
  return bad
