"""After the choice: a router's `MoEAux` (capacity, invalid tokens, losses).

Every router ends here (`routing.route`, and a backend's own, such as TE's
fused one), so that each `MoEAux` field means the same whoever chose.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_core import checks
from moe_core import config as config_lib
from moe_core import index_ops


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEAux:
  """What the router decided and the statistics training code logs.

  Attributes:
    router_logits: [T, E] float32, x @ router.
    router_probs: [T, E] float32, the scores the load-balancing loss uses:
      softmax of the logits, or elementwise (sigmoid, sqrtsoftplus) scores
      normalised per token.
    expert_ids: [T, K] int32, the experts chosen for each token (best first).
    combine_weights: [T, K] float32, the weight of each chosen expert's
      output (normalised and scaled as the config says); 0 where dropped,
      NaN where invalid. Finite for finite logits: `norm_topk_prob`
      renormalises from the logs of the scores
      (`router_weights.renormalise`), so a token whose chosen scores all
      underflow to 0 (sigmoid logits below about -104) keeps their exact
      ratios instead of 0/0.
    kept: [T, K] bool, False where capacity dropped the assignment or it is
      invalid (all True when dropless and every score is finite).
    tokens_per_expert: [E] int32, valid assignments the router made per
      expert, before any capacity drop; sums to T*K - invalid_assignments
      ([E + Z] with Z zero experts, theirs last).
    load_balancing_loss: scalar float32, Switch-style E * sum_e f_e * P_e
      with f_e = tokens_per_expert / (T*K) and P_e = mean router_probs; 1.0
      at perfect balance.
    router_z_loss: scalar float32, mean over tokens of logsumexp(logits)^2.
    dropped_tokens: scalar int32, valid assignments dropped by capacity;
      always 0 when dropless.
    invalid_assignments: scalar int32, assignments of tokens whose logits or
      selection scores (scores + correction bias) hold NaN or Inf: from
      NaN/Inf in the token's x, in the router or in the correction bias.
      Their combine weights are NaN, so those tokens' outputs are NaN
      (docs/api.md, "Guarantees"). sum(kept) + dropped_tokens +
      invalid_assignments = T*K.
  """

  router_logits: jax.Array
  router_probs: jax.Array
  expert_ids: jax.Array
  combine_weights: jax.Array
  kept: jax.Array
  tokens_per_expert: jax.Array
  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  dropped_tokens: jax.Array
  invalid_assignments: jax.Array


@dataclasses.dataclass(frozen=True)
class RouterScores:
  """The router's float32 scores of T tokens over E experts, before a choice.

  Attributes:
    logits: [T, E], the router's logits: `routing.router_input(x) @
      router`, plus the router bias, soft-capped
      (`MoEConfig.router_logit_softcap`).
    scores: [T, E], the config's score function of the logits
      (`score_functions.SCORE_FUNCTIONS`): what experts are weighted with.
    probs: [T, E], `MoEAux.router_probs`: the softmax, or the elementwise
      scores normalised per token.
    bias: [E] correction bias (no gradient flows into it), or None.
    choice: [T, E], what experts (and groups) are chosen by: the scores
      plus the correction bias, or with `correction_bias_on="logits"` the
      logits plus it; no gradient flows through the choice.
    expert_scale: [E] learned per-expert scale of the combine weights
      (`MoEConfig.expert_output_scale`), or None.
  """

  logits: jax.Array
  scores: jax.Array
  probs: jax.Array
  bias: jax.Array | None
  choice: jax.Array | None = None
  expert_scale: jax.Array | None = None

  def __post_init__(self):
    if self.choice is None:  # Built without one: the DeepSeek-V3 choice.
      choice = self.scores if self.bias is None else self.scores + self.bias
      object.__setattr__(self, "choice", choice)


def capacity_keep_mask(
    expert_ids: jax.Array,
    num_experts: int,
    capacity: int,
    valid: jax.Array | None = None,
) -> jax.Array:
  """[T, K] bool: which assignments fit in `capacity` slots per expert.

  Priority follows GShard: every token's first choice before any second
  choice, and earlier tokens first within a choice. Tokens with `valid`
  [T] False take no slot (and are not kept).
  """
  t, k = expert_ids.shape
  if valid is not None:
    # Key E: after every expert, so the invalid never crowd out the valid.
    expert_ids = jnp.where(valid[:, None], expert_ids, num_experts)
  by_choice = expert_ids.T.reshape(-1)  # [K*T], choice-major priority order.
  order = jnp.argsort(by_choice, stable=True)
  counts = index_ops.count(by_choice, num_experts + 1)
  starts = jnp.cumsum(counts) - counts
  rank_sorted = (jnp.arange(t * k) - starts[by_choice[order]]).astype(jnp.int32)
  # rank[order[i]] = rank_sorted[i], as a sort by order (no scatter).
  rank = jax.lax.sort((order.astype(jnp.int32), rank_sorted), num_keys=1)[1]
  return ((rank < capacity) & (by_choice < num_experts)).reshape(k, t).T


def aux_from_choice(
    scored: RouterScores,
    expert_ids: jax.Array,
    weights: jax.Array,
    cfg: config_lib.MoEConfig,
) -> MoEAux:
  """The `MoEAux` of a choice of experts: capacity, invalid tokens, losses.

  What every router shares once it has chosen (a backend's own router, such
  as TE's fused one, ends here too, so its aux means what `route`'s does).

  Args:
    scored: `routing.router_scores` of the T tokens.
    expert_ids: [T, K] int32, the chosen experts, best first.
    weights: [T, K] float32, their combine weights, normalised and scaled
      as the config says; `scored.expert_scale` (if any) is applied here.
    cfg: the block's config.
  """
  num_tokens = scored.logits.shape[0]
  valid = _finite_selection(scored.logits, scored.choice)
  if scored.expert_scale is not None:
    # Gemma 4's per-expert scale, after normalisation and scaling.
    weights = weights * scored.expert_scale[expert_ids]
  capacity = cfg.expert_capacity(num_tokens)
  if capacity is None:
    kept = jnp.broadcast_to(valid[:, None], expert_ids.shape)
  else:
    kept = capacity_keep_mask(
        expert_ids, cfg.num_router_experts, capacity, valid
    )
  # Dropped: weight 0. Invalid: NaN, which no mask downstream can hide.
  weights = jnp.where(kept, weights, 0.0)
  weights = checks.nan_rows(~valid, weights)

  num_router_experts = cfg.num_router_experts  # E, plus any zero experts.
  valid_ids = jnp.where(valid[:, None], expert_ids, num_router_experts)
  tokens_per_expert = index_ops.count(valid_ids, num_router_experts)
  fraction = tokens_per_expert.astype(jnp.float32) / (num_tokens * cfg.top_k)
  load_balancing_loss = num_router_experts * jnp.sum(
      fraction * scored.probs.mean(axis=0)
  )
  router_z_loss = jnp.mean(jax.nn.logsumexp(scored.logits, axis=-1) ** 2)
  invalid = (cfg.top_k * jnp.sum(~valid)).astype(jnp.int32)
  dropped = (expert_ids.size - kept.sum() - invalid).astype(jnp.int32)
  return MoEAux(
      router_logits=scored.logits,
      router_probs=scored.probs,
      expert_ids=expert_ids,
      combine_weights=weights,
      kept=kept,
      tokens_per_expert=tokens_per_expert,
      load_balancing_loss=load_balancing_loss,
      router_z_loss=router_z_loss,
      dropped_tokens=dropped,
      invalid_assignments=invalid,
  )


def _finite_selection(logits: jax.Array, choice: jax.Array) -> jax.Array:
  """[T] bool: the token's logits and selection scores are all finite.

  A NaN or Inf there (from x, the router or the bias) makes top-k pick
  arbitrary experts with finite-looking weights (a sigmoid even maps an
  infinite logit to 0 or 1): such tokens are invalid. Under
  `checks.checked` the first one raises instead.
  """
  valid = jnp.all(jnp.isfinite(logits), axis=-1) & jnp.all(
      jnp.isfinite(choice), axis=-1
  )
  checks.debug_check(
      jnp.all(valid),
      "routing scores must be finite: {} tokens have NaN or Inf in their "
      "scores (from x, router or correction_bias).",
      jnp.sum(~valid),
  )
  return valid
