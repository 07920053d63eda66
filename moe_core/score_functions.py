"""The router's score functions: name -> how logits become expert scores."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

# Below this logit softplus(l) is exp(l) to float32 precision, and its log
# is l itself: the log is taken of no smaller softplus, so no 0 reaches it.
_LOG_SOFTPLUS_LINEAR_BELOW = -30.0


@dataclasses.dataclass(frozen=True)
class ScoreFunction:
  """How one `MoEConfig.score_func` turns [T, E] float32 logits into scores.

  Attributes:
    scores: logits -> [T, E] scores: what experts are chosen by (plus the
      correction bias) and, unless `chosen_weights` is set, weighted with.
    log_scores: logits -> [T, E] log(scores), finite where the scores
      underflow to 0: the `norm_topk_prob` renormalisation works from these
      (`router_weights.renormalise`).
    probs: logits -> [T, E] `MoEAux.router_probs`, the distribution the
      load-balancing loss uses.
    chosen_weights: None, or (logits [T, E], expert_ids [T, K], cfg) ->
      [T, K] weights, for a function whose weights are not the chosen
      scores (sparsemixer); `norm_topk_prob` must then be False.
    families: the model families that use it, for the docs.
  """

  scores: Callable[[jax.Array], jax.Array]
  log_scores: Callable[[jax.Array], jax.Array]
  probs: Callable[[jax.Array], jax.Array]
  chosen_weights: Callable | None = None
  families: str = ""


def _per_token_normalised(log_scores):
  """scores / sum(scores) per token, from their logs (max-subtracted, so
  finite where every score underflows)."""

  def probs(logits):
    return jax.nn.softmax(log_scores(logits), axis=-1)

  return probs


def sqrt_softplus(logits: jax.Array) -> jax.Array:
  """DeepSeek-V4's score: sqrt(softplus(l)) = sqrt(log(1 + e^l))."""
  return jnp.sqrt(jax.nn.softplus(logits))


def log_sqrt_softplus(logits: jax.Array) -> jax.Array:
  """log(sqrt(softplus(l))) = log(softplus(l)) / 2, finite for every finite
  l: softplus(l) underflows to 0 for l below about -104, where its log is
  l to float32 precision."""
  linear = logits < _LOG_SOFTPLUS_LINEAR_BELOW
  # Both branches are evaluated: the log's argument is kept away from 0 so
  # that its derivative is finite where the other branch is taken.
  safe = jnp.where(linear, _LOG_SOFTPLUS_LINEAR_BELOW, logits)
  return 0.5 * jnp.where(linear, logits, jnp.log(jax.nn.softplus(safe)))


def sparsemixer_weights(logits, expert_ids, cfg) -> jax.Array:
  """Phi-MoE's sparsemixer weights at inference: [T, K] float32.

  The k-th chosen expert (k-th best logit m_k) weighs
  softmax(logits over the eligible experts)[its id]; an expert j is
  eligible at step k if no earlier step chose it and it lies within the
  jitter threshold of m_k: (m_k - l_j) / max(|l_j|, m_k) <= 2 * epsilon
  (`cfg.sparsemixer_epsilon`, Phi's router_jitter_noise). Phi-MoE's K = 2
  is two such steps; more steps continue the same rule.

  Args:
    logits: [T, E] float32 router logits.
    expert_ids: [T, K] int32, the top-k of the logits, best first.
    cfg: the block's config.
  """
  t, e = logits.shape
  token = jnp.arange(t)[:, None]
  taken = jnp.zeros((t, e), bool)
  weights = []
  for k in range(expert_ids.shape[1]):
    ids = expert_ids[:, k : k + 1]
    best = jnp.take_along_axis(logits, ids, axis=-1)  # [T, 1], m_k.
    # The mask is no function of the weights' inputs (Phi computes it
    # without gradient): only the softmax below is differentiated.
    best_c = jax.lax.stop_gradient(best)
    plain = jax.lax.stop_gradient(logits)
    far = (best_c - plain) / jnp.maximum(jnp.abs(plain), best_c) > (
        2.0 * cfg.sparsemixer_epsilon
    )
    masked = jnp.where(far | taken, -jnp.inf, logits)
    weights.append(jnp.take_along_axis(jax.nn.softmax(masked), ids, axis=-1))
    taken = taken.at[token, ids].set(True)
  return jnp.concatenate(weights, axis=-1)


def _softmax_probs(logits):
  return jax.nn.softmax(logits, axis=-1)


# Adding a score function: one entry here (and its numpy formula in
# conformance/oracles.py, `score`); `MoEConfig.score_func` accepts every key.
SCORE_FUNCTIONS: dict[str, ScoreFunction] = {
    "softmax": ScoreFunction(
        scores=_softmax_probs,
        log_scores=lambda logits: jax.nn.log_softmax(logits, axis=-1),
        probs=_softmax_probs,
        families="Mixtral, Qwen, OLMoE, DeepSeek-V2, GPT-OSS, Gemma 4",
    ),
    "sigmoid": ScoreFunction(
        scores=jax.nn.sigmoid,
        log_scores=jax.nn.log_sigmoid,
        probs=_per_token_normalised(jax.nn.log_sigmoid),
        families="DeepSeek-V3, GLM-4.5, Kolibri, Laguna",
    ),
    "sqrtsoftplus": ScoreFunction(
        scores=sqrt_softplus,
        log_scores=log_sqrt_softplus,
        probs=_per_token_normalised(log_sqrt_softplus),
        families="DeepSeek-V4",
    ),
    # Chooses by the logits (the softmax's order) and weighs each choice
    # by sparsemixer_weights.
    "sparsemixer": ScoreFunction(
        scores=_softmax_probs,
        log_scores=lambda logits: jax.nn.log_softmax(logits, axis=-1),
        probs=_softmax_probs,
        chosen_weights=sparsemixer_weights,
        families="Phi-MoE (inference-time routing)",
    ),
}
