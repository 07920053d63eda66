"""Routing through TE's fused router, where it computes the config's routing."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from backends.te import _te
from moe_core import config as config_lib
from moe_core import routing

# The epsilon TE's fused router adds to the sum of the chosen sigmoid
# scores (transformer_engine/common/fused_router/utils.h), in float32.
TE_SIGMOID_EPSILON = np.float32(1e-20)
# An epsilon added to a float32 sum s leaves it unchanged when it is below
# half an ulp of s, which is at least s * 2^-25. The K best softmax
# probabilities sum to at least 1/E (the best alone is >= 1/E).
_HALF_ULP = 2.0**-25


def choice(cfg: config_lib.MoEConfig) -> tuple[bool, str]:
  """(TE's fused router computes `cfg`'s routing, why not).

  TE's `fused_topk_with_score_function` (2.20) differs from `routing.route`
  in ways a config may or may not reach:
    * softmax: with `use_pre_softmax` it takes the top-k of softmax(logits)
      (norm_topk_prob=False); without, the top-k of the logits and a
      softmax over those K, which is the renormalised weight with no
      epsilon (norm_topk_prob=True; equal when norm_epsilon cannot change
      the float32 sum, i.e. norm_epsilon * E < 2^-25). No expert bias.
    * sigmoid: it always renormalises the K weights when K > 1, dividing by
      (sum + 1e-20), and never when K = 1: norm_topk_prob must be K > 1,
      and then norm_epsilon 1e-20 (DeepSeek-V3's).
    * groups: a group scores as the sum of its top (top_k // topk_group)
      (biased) scores: group_score "max" needs top_k // topk_group == 1,
      "sum_top2" needs 2. Without use_pre_softmax the groups are scored on
      the logits, which picks the same groups as the probabilities for
      "max" only.
  The rest is equal or the backend's: routed_scaling_factor is TE's
  scaling_factor, the correction bias is its expert_bias (selection only),
  capacity is applied after TE's top-k (`routing.capacity_keep_mask`), and
  tokens with non-finite logits or scores are marked invalid as
  `routing.route` marks them.
  """
  k = cfg.top_k
  if cfg.score_func == "softmax":
    if cfg.correction_bias:
      return False, (
          "TE's fused router takes an expert bias only with sigmoid scores "
          "(correction_bias=True with score_func='softmax')"
      )
    if cfg.norm_topk_prob and cfg.norm_epsilon * cfg.num_experts >= _HALF_ULP:
      return False, (
          "TE's fused router renormalises softmax weights without an "
          f"epsilon; norm_epsilon={cfg.norm_epsilon} can change the float32 "
          f"sum (it must be < 2^-25 / num_experts)"
      )
  else:
    if cfg.norm_topk_prob != (k > 1):
      return False, (
          "TE's fused router renormalises sigmoid weights exactly when "
          f"top_k > 1; the config has top_k={k}, "
          f"norm_topk_prob={cfg.norm_topk_prob}"
      )
    if k > 1 and np.float32(cfg.norm_epsilon) != TE_SIGMOID_EPSILON:
      return False, (
          "TE's fused router divides sigmoid weights by (sum + 1e-20); "
          f"norm_epsilon={cfg.norm_epsilon} differs"
      )
  if cfg.n_group > 1:
    per_group = k // cfg.topk_group
    wanted = {"max": 1, "sum_top2": 2}[cfg.group_score]
    if per_group != wanted:
      return False, (
          "TE's fused router scores a group by the sum of its top "
          f"(top_k // topk_group) = {per_group} scores; group_score="
          f"{cfg.group_score!r} needs {wanted}"
      )
    if (
        cfg.score_func == "softmax"
        and cfg.norm_topk_prob
        and cfg.group_score != "max"
    ):
      return False, (
          "TE's fused router scores groups on the logits when it "
          "renormalises softmax weights (norm_topk_prob=True), which picks "
          f"other groups than the probabilities for {cfg.group_score!r}"
      )
  return True, ""


def _router_module():
  _te.import_te()
  return importlib.import_module("transformer_engine.jax.router")


def route(
    x: jax.Array,
    router: jax.Array,
    cfg: config_lib.MoEConfig,
    correction_bias: jax.Array | None = None,
) -> routing.MoEAux:
  """`routing.route` with TE's fused router choosing and weighting experts.

  Only for configs where `choice(cfg)` is True. The logits, the scores the
  losses use and the statistics are the library's own (so every `MoEAux`
  field has `routing.route`'s meaning); TE's kernel picks the K experts and
  computes their weights, differentiably (its VJP gives the logits'
  gradient). TE returns the choice as a [T, E] map: the K chosen ids are
  ordered best first by the selection scores, ties to the lower id, as
  `jax.lax.top_k` orders them.

  Args:
    x: [T, D] activations, any float dtype.
    router: [D, E] router weights.
    cfg: the block's config.
    correction_bias: [E] float32, required iff `cfg.correction_bias`.

  Returns:
    `MoEAux` as `routing.route` defines it.
  """
  scored = routing.router_scores(x, router, cfg, correction_bias)
  expressible, why = choice(cfg)
  if not expressible:
    raise NotImplementedError(f"te: fused router: {why}.")
  te_router = _router_module()
  grouped = cfg.n_group > 1
  te_weights, chosen = te_router.fused_topk_with_score_function(
      scored.logits,
      cfg.top_k,
      use_pre_softmax=not cfg.norm_topk_prob,
      num_groups=cfg.n_group if grouped else -1,
      group_topk=cfg.topk_group if grouped else -1,
      scaling_factor=float(cfg.routed_scaling_factor),
      score_function=cfg.score_func,
      expert_bias=scored.bias,
  )
  # Best first among TE's K: a token with non-finite scores may have fewer
  # than K marked; top_k still returns K distinct ids (it is invalid).
  selection = scored.scores
  if scored.bias is not None:
    selection = selection + scored.bias
  ranked = jnp.where(chosen, jax.lax.stop_gradient(selection), -jnp.inf)
  _, expert_ids = jax.lax.top_k(ranked, cfg.top_k)
  expert_ids = expert_ids.astype(jnp.int32)
  weights = jnp.take_along_axis(
      te_weights.astype(jnp.float32), expert_ids, axis=-1
  )
  # From here on, what routing.route does with its choice.
  return routing.aux_from_choice(scored, expert_ids, weights, cfg)
