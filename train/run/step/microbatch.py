"""Gradient accumulation: one step's loss and gradients over N microbatches.

The step's batch [B, T+1] splits into N microbatches of B/N rows
(`split`: interleaved rows, so no data moves between devices), which run
one after the other under `jax.lax.scan`, so only one microbatch's
activations are live at a time; `value_and_grad` adds up their losses,
gradients and statistics in float32, giving the whole batch's loss and
gradients.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

P = jax.sharding.PartitionSpec


def split(
    batch: jax.Array, n: int, mesh: jax.sharding.Mesh | None, axes
) -> jax.Array:
  """[B, T+1] -> [N, B/N, T+1], microbatch i holding rows i, i + N, ...

  Each device's rows of the batch then hold B/(N D) rows of every
  microbatch, so the split moves no data between devices (D: the
  data-parallel devices, which must divide B/N).

  Args:
    batch: the step's batch, rows split over the mesh axes `axes`.
    n: N, which divides B.
    mesh: the mesh, or None on one device.
    axes: the mesh axes the rows are split over.
  """
  rows = batch.shape[0]
  micro = batch.reshape(rows // n, n, *batch.shape[1:]).swapaxes(0, 1)
  if mesh is not None:
    micro = jax.lax.with_sharding_constraint(
        micro, jax.sharding.NamedSharding(mesh, P(None, axes))
    )
  return micro


def _combine(total, n: int):
  """Sums of the microbatches' outputs -> the step's: means of floats
  (divided by N), sums of integers (as they are)."""
  return jax.tree.map(
      lambda x: x / n if jnp.issubdtype(x.dtype, jnp.inexact) else x, total
  )


def value_and_grad(
    loss_fn: Callable,
    params,
    *args,
    batch: jax.Array,
    microbatches: int,
    mesh: jax.sharding.Mesh | None = None,
    axes=(),
):
  """`jax.value_and_grad(loss_fn, has_aux=True)` over N microbatches.

  The microbatches run one after the other under `jax.lax.scan`, and their
  outputs are added up in float32:

  * the loss and the gradients are means over equal microbatches, so they
    equal those of the whole batch (up to the order of float32 sums);
  * integer statistics (tokens_per_expert, dropped and invalid counts) are
    summed, so the correction-bias rule sees the whole batch's loads;
  * the other float statistics are averaged: the router z-loss, a mean
    over tokens, is the whole batch's; the load-balancing loss, a product
    of two means, is the mean of the microbatches' (as Megatron and
    MaxText report it), not the whole batch's.

  Args:
    loss_fn: (params, *args, batch) -> (loss, aux), aux a pytree of arrays.
    params: differentiated.
    *args: passed through, not differentiated.
    batch: [B, T+1].
    microbatches: N >= 1 dividing B; 1 calls the gradient once, on the
      whole batch (no scan).
    mesh, axes: where the batch's rows live (see `split`).

  Returns:
    ((loss, aux), grads): the loss, the float leaves of aux and the
    gradients averaged over the microbatches, aux's integer leaves summed.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if microbatches == 1:
    return grad_fn(params, *args, batch)
  micro = split(batch, microbatches, mesh, axes)

  def body(total, one):
    out = grad_fn(params, *args, one)
    return jax.tree.map(jnp.add, total, out), None

  shapes = jax.eval_shape(grad_fn, params, *args, micro[0])
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  total, _ = jax.lax.scan(body, zeros, micro)
  return _combine(total, microbatches)
