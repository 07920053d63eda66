"""What the grouped-GEMM benchmarks share: group sizes and the baselines.

grouped_gemm_bench and gpu_check time rows [M, C] x weights [E, C, N] over
ragged groups against two baselines of the same useful FLOPs: a dense
`jnp.dot` of every row with one expert's [C, N] weights, and
`jax.lax.ragged_dot`. No absl: gpu_check imports this on the GPU machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SKEWS = ("even", "random", "zipf")


def skewed_group_sizes(
    skew: str,
    rows: int,
    experts: int,
    seed: int = 0,
    zipf_exponent: float = 1.2,
) -> np.ndarray:
  """[E] int32 group sizes summing to `rows`.

  Args:
    skew: "even" (sizes differ by at most one), "random" (a multinomial of
      equal probabilities) or "zipf" (a multinomial with p(rank r) ~
      r^-zipf_exponent, the ranks shuffled over the experts).
    rows: M, the rows to share out.
    experts: E.
    seed: of the numpy generator (random and zipf).
    zipf_exponent: s in r^-s.
  """
  rng = np.random.default_rng(seed)
  if skew == "even":
    sizes = np.full(experts, rows // experts)
    sizes[: rows % experts] += 1
  elif skew == "random":
    sizes = rng.multinomial(rows, np.full(experts, 1.0 / experts))
  elif skew == "zipf":
    p = 1.0 / np.arange(1, experts + 1) ** zipf_exponent
    sizes = rng.multinomial(rows, rng.permutation(p / p.sum()))
  else:
    raise ValueError(f"skew must be one of {SKEWS}, got {skew!r}.")
  return sizes.astype(np.int32)


def dense_gemm(rows, weights, group_sizes):
  """[M, C] x [C, N] -> [M, N]: every row times one expert's weights.

  The same useful FLOPs as the grouped GEMM; the caller passes one expert's
  weights (`one_expert`). Accumulates in float32 like the grouped GEMMs.
  """
  del group_sizes  # One group: all rows.
  return jnp.dot(rows, weights, preferred_element_type=jnp.float32).astype(
      rows.dtype
  )


def ragged_dot_gemm(rows, weights, group_sizes):
  """[M, C] x [E, C, N] -> [M, N] by `jax.lax.ragged_dot`, float32 sums."""
  return jax.lax.ragged_dot(
      rows, weights, group_sizes, preferred_element_type=jnp.float32
  ).astype(rows.dtype)


def one_expert(weights):
  """Expert 0's weights (arrays or ShapeDtypeStructs): the dense baseline's.

  Dense then has a [C, N] dW like a real dense layer, not a mostly-zero
  [E, C, N] one.
  """

  def first(a):
    if isinstance(a, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[0]

  return jax.tree.map(first, weights)
