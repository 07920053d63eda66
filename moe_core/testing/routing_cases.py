"""Routing test helpers: small configs, seeded inputs and a numpy router.

The per-token router of float64 loops (`route_token`) and GShard's
capacity loop (`keep_mask`) are the oracles of moe_core's routing tests
(routing_test, routing_aux_test, router_weights_test, score_functions_test,
zero_experts_test).
"""

import math

import jax.numpy as jnp
import numpy as np

from moe_core import config as config_lib
from moe_core import routing

T, D = 24, 16


def route_token(logits, cfg, bias):
  """One token, float64: (ids best first, combine weights, probs [E])."""
  logits = [float(v) for v in logits]
  if cfg.score_func == "softmax":
    m = max(logits)
    exps = [math.exp(v - m) for v in logits]
    scores = [v / sum(exps) for v in exps]
    probs = scores
  else:
    scores = [1 / (1 + math.exp(-v)) for v in logits]
    probs = [s / sum(scores) for s in scores]
  shift = [0.0] * cfg.num_experts if bias is None else [float(b) for b in bias]
  choice = [s + b for s, b in zip(scores, shift)]
  eligible = list(range(cfg.num_experts))
  if cfg.n_group > 1:
    size = cfg.num_experts // cfg.n_group
    group_score = {}
    for g in range(cfg.n_group):
      members = sorted(choice[g * size : (g + 1) * size], reverse=True)
      group_score[g] = (
          members[0] if cfg.group_score == "max" else members[0] + members[1]
      )
    best = sorted(group_score, key=lambda g: -group_score[g])[: cfg.topk_group]
    eligible = [e for e in eligible if e // size in best]
  ids = sorted(eligible, key=lambda e: -choice[e])[: cfg.top_k]
  weights = [scores[e] for e in ids]
  if cfg.norm_topk_prob:
    total = sum(weights) + cfg.norm_epsilon
    weights = [w / total for w in weights]
  weights = [w * cfg.routed_scaling_factor for w in weights]
  return ids, weights, probs


def keep_mask(ids, num_experts, capacity):
  """GShard priority: all first choices (token order), then all second..."""
  t, k = ids.shape
  used = [0] * num_experts
  kept = np.zeros((t, k), bool)
  for choice in range(k):
    for token in range(t):
      e = ids[token, choice]
      if used[e] < capacity:
        kept[token, choice] = True
        used[e] += 1
  return kept


def inputs(cfg, seed=0, bias_scale=0.0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
  router = (
      0.4 * rng.standard_normal((cfg.hidden_size, cfg.num_experts))
  ).astype(np.float32)
  bias = None
  if cfg.correction_bias:
    bias = (bias_scale * rng.standard_normal(cfg.num_experts)).astype(
        np.float32
    )
  return jnp.asarray(x, dtype), jnp.asarray(router, dtype), bias


def small_cfg(**kw):
  fields = dict(num_experts=8, top_k=2, hidden_size=D, expert_ffn_size=8)
  fields.update(kw)
  return config_lib.MoEConfig(**fields)


def route_logits(logits, cfg, bias=None):
  """routing.route of tokens whose logits are exactly `logits` [T, E]:
  x = logits, router = the identity (so hidden_size = E)."""
  logits = jnp.asarray(logits, jnp.float32)
  e = logits.shape[-1]
  cfg = cfg.replace(hidden_size=e)
  router = jnp.eye(e, dtype=jnp.float32)
  return routing.route(logits, router, cfg, bias)


def float64_logits(cfg, seed):
  """[T, E] float64 logits of `inputs`' x and router (no extras)."""
  x, router, _ = inputs(cfg, seed=seed)
  return np.asarray(x, np.float64) @ np.asarray(router, np.float64)


def plain_top_k(values, k):
  """[T, K] ids of the k largest values per row, lower index on ties."""
  return np.argsort(-values, axis=-1, kind="stable")[:, :k]
