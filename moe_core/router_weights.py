"""The combine weights of the chosen experts, renormalised from their logs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_core import config as config_lib
from moe_core import index_ops
from moe_core import score_functions


def renormalised_weights(
    logits: jax.Array, expert_ids: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array:
  """[T, K] w_k / (sum_j w_j + norm_epsilon) of the chosen scores w.

  Computed from the logits, never from scores that underflowed
  (`renormalise`). Softmax scores share the token's normaliser
  lse = logsumexp(logits): w = exp(l - lse), so the chosen logits
  themselves are renormalised and lse moves into the epsilon term,
  e^l / (sum e^l + epsilon * e^lse); that is a softmax over the K chosen
  logits when epsilon is 0, as exact as the logits are. Sigmoid scores have
  log w = log_sigmoid(l), which is l itself for l << 0; other elementwise
  scores have their registry's `log_scores`.
  """
  chosen = index_ops.pick(logits, expert_ids)
  if cfg.norm_topk_p != 1:
    return p_normalised(chosen, cfg)
  log_epsilon = None
  if cfg.norm_epsilon > 0:
    log_epsilon = math.log(cfg.norm_epsilon)
  if cfg.score_func == "softmax":
    if log_epsilon is not None:
      log_epsilon = log_epsilon + jax.nn.logsumexp(
          logits, axis=-1, keepdims=True
      )
    return renormalise(chosen, log_epsilon)
  log_scores = score_functions.SCORE_FUNCTIONS[cfg.score_func].log_scores
  return renormalise(log_scores(chosen), log_epsilon)


def p_normalised(chosen: jax.Array, cfg: config_lib.MoEConfig) -> jax.Array:
  """[T, K] w_k / (sum_j w_j^p)^(1/p) of the chosen scores w, p =
  cfg.norm_topk_p (DBRX), from their logits [T, K]: exp(log w_k - lse(p
  log w) / p), finite where the scores underflow. Softmax scores' common
  log-normaliser cancels (the quotient is scale-free), so their chosen
  logits serve as log w."""
  p = cfg.norm_topk_p
  if cfg.score_func == "softmax":
    log_w = chosen
  else:
    log_w = score_functions.SCORE_FUNCTIONS[cfg.score_func].log_scores(chosen)
  log_norm = jax.nn.logsumexp(p * log_w, axis=-1, keepdims=True) / p
  return jnp.exp(log_w - log_norm)


def renormalise(
    log_weights: jax.Array, log_epsilon: jax.Array | float | None = None
) -> jax.Array:
  """[T, K] log w -> [T, K] w_k / (sum_j w_j + epsilon), never 0/0.

  The `norm_topk_prob` renormalisation, from the logs of the K chosen
  scores, in the max-subtracted form: with m = max_j log w_j,
  exp(log w_k - m) / (sum_j exp(log w_j - m) + exp(log epsilon - m)). It is
  the same quotient, but its denominator is at least 1 (the best term is
  exp(0)), so it stays finite where every chosen score underflows to 0 in
  float32 and the plain quotient is 0/0: sigmoid logits all below about
  -104, or softmax scores that a correction bias chose over the best
  expert. Such a token gets the exact ratios of its scores (about a
  softmax over its K chosen logits); with epsilon > 0 its weights shrink
  towards 0, as w / (sum + epsilon) does.

  Args:
    log_weights: [T, K] float32 logs of the chosen scores, each row with a
      finite maximum (a token with NaN or -inf logits is invalid, and
      `routing_aux.aux_from_choice` makes its weights NaN).
    log_epsilon: log(epsilon), a float or a [T, 1] array; None for
      epsilon = 0.

  Returns:
    [T, K] float32 weights in [0, 1]; each row sums to 1 (to float32
    rounding) when epsilon is 0.
  """
  # The quotient does not depend on m, so no gradient need flow into it
  # (jax.nn.logsumexp stops it too).
  m = jax.lax.stop_gradient(jnp.max(log_weights, axis=-1, keepdims=True))
  # log w - m is exact where the logs are close (which is where it
  # matters), so the ratios keep float32 precision at any magnitude.
  terms = jnp.exp(log_weights - m)
  total = terms.sum(axis=-1, keepdims=True)
  if log_epsilon is None:
    return terms / total
  # Divide by exp(log(total + epsilon * exp(-m))), added in log space: the
  # epsilon term overflows float32 once m < log(epsilon) - 88, and its
  # infinite derivative would make the gradient NaN.
  return terms * jnp.exp(-jnp.logaddexp(jnp.log(total), log_epsilon - m))
