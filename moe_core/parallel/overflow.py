"""Buffer overflow of the expert-parallel exchange: the error and its check.

With a bounded buffer (`EPOptions.buffer_factor` set) some token copies may
not fit, and overflow="error" makes that fail the run: `overflow_message`
words the error (`overflow_bound` the buffer), `BufferOverflowError` is what
is raised, from Python on concrete arrays or, in a traced program, from the
host callback of `raise_on_overflow`, which orders the check after and
before the collectives around it. Importing the module filters JAX's
per-device logs of that callback's error (`_DropOverflowLogs`).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from moe_core.parallel import exchange as exchange_lib


def overflow_bound(
    mover: exchange_lib.Exchange, capacity: int, buffer_factor: float
) -> str:
  """The bounded buffer in words, for `overflow_message`."""
  return (
      f"buffer_factor={buffer_factor}, {mover.describe_capacity(capacity)}, "
      f"exchange={mover.name!r}"
  )


def overflow_message(count: int, bound: str) -> str:
  """The error of overflow="error" when `count` copies did not fit."""
  return (
      f"expert-parallel receive buffer overflow: {count} token copies did "
      f"not fit the bounded buffer ({bound}). Raise buffer_factor, use "
      "buffer_factor=None (drop-free worst-case buffers) or "
      "overflow='drop' (dropped copies counted in aux.dropped_tokens)."
  )


class BufferOverflowError(RuntimeError):
  """overflow="error": token copies did not fit a bounded EP buffer."""


class _DropOverflowLogs(logging.Filter):
  """Drops JAX's log of a host callback that raised `BufferOverflowError`.

  JAX logs every failing callback with its traceback ("jax.pure_callback
  failed"), once per device, before it raises the run's error; that error
  holds the same message, so the logs only repeat it.
  """

  def filter(self, record):
    error = record.exc_info[1] if record.exc_info else None
    return not isinstance(error, BufferOverflowError)


# The logger of jax/_src/callback.py (jax 0.10 to 0.12).
logging.getLogger("jax._src.callback").addFilter(_DropOverflowLogs())


def raise_on_overflow(values, dropped, bound: str):
  """values (a pytree), made to depend on a host check that raises when
  dropped > 0, forward and backward.

  For a traced program, where nothing else can stop the run: a host
  callback raises `BufferOverflowError(overflow_message(...))`, which JAX
  reports wrapped (a `JaxRuntimeError`, "INTERNAL: CpuCallback error ...",
  the callback's traceback with the message last; docs/expert_parallel.md),
  when the result is read. JAX's per-device logs of the error are dropped
  (`_DropOverflowLogs`), so the message shows once.

  Every device raises, and none may do so while a peer waits for it in a
  collective: XLA:CPU aborts the process when a rendezvous times out. So
  the check runs after every collective that `values` depend on, and every
  collective that depends on `values`, forward or in their gradient, runs
  after the check. Both orders are data dependencies, the only order every
  XLA backend keeps (XLA:CPU schedules by buffers, and sees through an
  optimization barrier): the callback takes a scalar reduction of every
  leaf (one pass over them, read only), and each returned leaf is
  leaf * (1 + zero) (floats; ints add zero, bools `or` it) with zero the
  callback's result, which also keeps the callback from being pruned. The
  product, not a sum, puts the check in the backward pass too: its
  derivative is (1 + zero). Collectives that neither feed nor follow
  `values` are the caller's to order.

  Args:
    values: a pytree of arrays the program goes on to use: every output of
      the code whose collectives the check must not overlap.
    dropped: scalar int32, the copies that did not fit (the same on every
      device).
    bound: `overflow_bound`.

  Returns:
    values, equal leaf for leaf, now after the check.
  """

  def check(count, witness):
    del witness  # Only there to be waited for.
    if int(count) > 0:
      raise BufferOverflowError(overflow_message(int(count), bound))
    return np.zeros((), np.float32)

  # The callback has no derivative and zero is a constant; pure_callback
  # refuses even a zero tangent (the witness has one), so it is stated.
  @jax.custom_jvp
  def checked_zero(count, witness):
    return jax.pure_callback(
        check,
        jax.ShapeDtypeStruct((), jnp.float32),
        count,
        witness,
        vmap_method="sequential",
    )

  @checked_zero.defjvp
  def _(primals, tangents):
    del tangents
    zero = checked_zero(*primals)
    return zero, jnp.zeros_like(zero)

  witness = sum(
      jnp.sum(leaf, dtype=jnp.float32)
      for leaf in jax.tree_util.tree_leaves(values)
  )
  zero = checked_zero(dropped, witness)

  def after_check(leaf):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      return leaf * (1 + zero).astype(leaf.dtype)
    if leaf.dtype == jnp.bool_:
      return leaf | (zero != 0)
    return leaf + zero.astype(leaf.dtype)

  return jax.tree_util.tree_map(after_check, values)
