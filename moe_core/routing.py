"""Stage 1, route: router logits -> chosen experts, combine weights and aux."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_core import checks
from moe_core import config as config_lib
from moe_core import validation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEAux:
  """What the router decided and the statistics training code logs.

  Attributes:
    router_logits: [T, E] float32, x @ router.
    router_probs: [T, E] float32, the scores the load-balancing loss uses:
      softmax of the logits, or sigmoid scores normalised per token.
    expert_ids: [T, K] int32, the experts chosen for each token (best first).
    combine_weights: [T, K] float32, the weight of each chosen expert's
      output (normalised and scaled as the config says); 0 where dropped,
      NaN where invalid.
    kept: [T, K] bool, False where capacity dropped the assignment or it is
      invalid (all True when dropless and every score is finite).
    tokens_per_expert: [E] int32, valid assignments the router made per
      expert, before any capacity drop; sums to T*K - invalid_assignments.
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
      (README, "Guarantees"). sum(kept) + dropped_tokens +
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


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
  """[T, D] x [D, E] -> [T, E] float32, whatever the activation dtype."""
  return jnp.dot(
      x.astype(jnp.float32),
      router.astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
  )


def select_experts(
    scores: jax.Array,
    cfg: config_lib.MoEConfig,
    correction_bias: jax.Array | None = None,
) -> jax.Array:
  """Chooses K experts per token: [T, E] scores -> [T, K] int32 ids.

  The correction bias shifts the scores used for choosing (groups included)
  and nothing else. With groups, only experts in the `topk_group` best groups
  are eligible; the others are set to -inf, not 0, so a negative biased score
  never loses to an excluded expert.
  """
  choice = scores if correction_bias is None else scores + correction_bias
  if cfg.n_group > 1:
    t = choice.shape[0]
    grouped = choice.reshape(t, cfg.n_group, cfg.experts_per_group)
    if cfg.group_score == "max":
      group_scores = grouped.max(axis=-1)
    else:  # "sum_top2", DeepSeek-V3.
      group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
    _, best_groups = jax.lax.top_k(group_scores, cfg.topk_group)
    eligible = (
        jnp.zeros((t, cfg.n_group), bool)
        .at[jnp.arange(t)[:, None], best_groups]
        .set(True)
    )
    eligible = jnp.repeat(eligible, cfg.experts_per_group, axis=1)
    choice = jnp.where(eligible, choice, -jnp.inf)
  _, expert_ids = jax.lax.top_k(choice, cfg.top_k)
  return expert_ids.astype(jnp.int32)


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
  counts = jnp.bincount(by_choice, length=num_experts + 1)
  starts = jnp.cumsum(counts) - counts
  rank_sorted = (jnp.arange(t * k) - starts[by_choice[order]]).astype(jnp.int32)
  rank = jnp.zeros(t * k, jnp.int32).at[order].set(rank_sorted)
  return ((rank < capacity) & (by_choice < num_experts)).reshape(k, t).T


@dataclasses.dataclass(frozen=True)
class RouterScores:
  """The router's float32 scores of T tokens over E experts, before a choice.

  Attributes:
    logits: [T, E], x @ router.
    scores: [T, E], softmax of the logits or their sigmoid: what experts are
      chosen by (plus the bias) and weighted with.
    probs: [T, E], `MoEAux.router_probs`: the softmax, or the sigmoid scores
      normalised per token.
    bias: [E] correction bias (no gradient flows into it), or None.
  """

  logits: jax.Array
  scores: jax.Array
  probs: jax.Array
  bias: jax.Array | None


def router_scores(
    x: jax.Array,
    router: jax.Array,
    cfg: config_lib.MoEConfig,
    correction_bias: jax.Array | None = None,
) -> RouterScores:
  """Checks the routing inputs and scores x [T, D] with router [D, E].

  Args:
    x: [T, D] activations, any float dtype.
    router: [D, E] router weights.
    cfg: the block's config.
    correction_bias: [E] float32, required iff `cfg.correction_bias`.
  """
  validation.check_route(x, router, cfg, correction_bias)
  if cfg.correction_bias != (correction_bias is not None):
    raise ValueError(
        "correction_bias must be given iff cfg.correction_bias is True, got "
        f"cfg.correction_bias={cfg.correction_bias}, correction_bias="
        f"{'None' if correction_bias is None else 'an array'}."
    )
  logits = router_logits(x, router)
  if cfg.score_func == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / scores.sum(axis=-1, keepdims=True)
  bias = None
  if correction_bias is not None:
    # The bias steers selection only; no gradient flows into it.
    bias = jax.lax.stop_gradient(correction_bias.astype(jnp.float32))
  return RouterScores(logits=logits, scores=scores, probs=probs, bias=bias)


def route(
    x: jax.Array,
    router: jax.Array,
    cfg: config_lib.MoEConfig,
    correction_bias: jax.Array | None = None,
) -> MoEAux:
  """Routes tokens: x [T, D], router [D, E] -> `MoEAux`, all in float32.

  Args:
    x: [T, D] activations, any float dtype.
    router: [D, E] router weights.
    cfg: the block's config.
    correction_bias: [E] float32, required iff `cfg.correction_bias`.
  """
  scored = router_scores(x, router, cfg, correction_bias)
  expert_ids = select_experts(scored.scores, cfg, scored.bias)
  weights = jnp.take_along_axis(scored.scores, expert_ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (weights.sum(axis=-1, keepdims=True) + cfg.norm_epsilon)
  weights = weights * cfg.routed_scaling_factor
  return aux_from_choice(scored, expert_ids, weights, cfg)


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
    scored: `router_scores` of the T tokens.
    expert_ids: [T, K] int32, the chosen experts, best first.
    weights: [T, K] float32, their combine weights, normalised and scaled
      as the config says.
    cfg: the block's config.
  """
  num_tokens = scored.logits.shape[0]
  valid = _finite_selection(scored.logits, scored.scores, scored.bias)
  capacity = cfg.expert_capacity(num_tokens)
  if capacity is None:
    kept = jnp.broadcast_to(valid[:, None], expert_ids.shape)
  else:
    kept = capacity_keep_mask(expert_ids, cfg.num_experts, capacity, valid)
  # Dropped: weight 0. Invalid: NaN, which no mask downstream can hide.
  weights = jnp.where(kept, weights, 0.0)
  weights = checks.nan_rows(~valid, weights)

  valid_ids = jnp.where(valid[:, None], expert_ids, cfg.num_experts)
  tokens_per_expert = jnp.bincount(
      valid_ids.reshape(-1), length=cfg.num_experts
  ).astype(jnp.int32)
  fraction = tokens_per_expert.astype(jnp.float32) / (num_tokens * cfg.top_k)
  load_balancing_loss = cfg.num_experts * jnp.sum(
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


def _finite_selection(
    logits: jax.Array, scores: jax.Array, bias: jax.Array | None
) -> jax.Array:
  """[T] bool: the token's logits and selection scores are all finite.

  A NaN or Inf there (from x, the router or the bias) makes top-k pick
  arbitrary experts with finite-looking weights (a sigmoid even maps an
  infinite logit to 0 or 1): such tokens are invalid. Under
  `checks.checked` the first one raises instead.
  """
  choice = scores if bias is None else scores + bias
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


def update_correction_bias(
    correction_bias: jax.Array, tokens_per_expert: jax.Array, rate: float = 1e-3
) -> jax.Array:
  """DeepSeek-V3's aux-loss-free update: bias += rate * sign(mean - load).

  Underloaded experts get a larger bias (chosen more often), overloaded ones
  a smaller one.

  Args:
    correction_bias: [E] float32.
    tokens_per_expert: [E] (or [..., E], summed over leading axes, e.g. the
      layers or micro-batches of a step) counts, >= 0.
    rate: the update speed (gamma in the paper, 1e-3 for DeepSeek-V3): a
      finite number >= 0, or a scalar array.

  Returns:
    The new [E] bias. Concrete bad counts (negative, NaN, Inf) or a bad
    Python rate raise ValueError; under jit, a bad count or a traced rate
    that is negative, NaN or Inf gives an all-NaN bias (the next `route`
    then marks every token invalid: README, "Guarantees"). NaN in
    correction_bias stays where it is.
  """
  validation.check_correction_bias_update(
      correction_bias, tokens_per_expert, rate
  )
  load = tokens_per_expert.astype(jnp.float32)
  rate = jnp.asarray(rate, jnp.float32)
  bad_load = jnp.any(load < 0) | ~jnp.all(jnp.isfinite(load))
  checks.debug_check(
      ~bad_load,
      "tokens_per_expert must be finite counts >= 0, got {}.",
      tokens_per_expert,
  )
  checks.debug_check(jnp.isfinite(rate), "rate must be finite, got {}.", rate)
  checks.debug_check(rate >= 0, "rate must be >= 0, got {}.", rate)
  bad = bad_load | ~jnp.isfinite(rate) | (rate < 0)
  load = load.reshape(-1, load.shape[-1]).sum(axis=0)
  step = rate * jnp.sign(load.mean() - load)
  new_bias = (correction_bias + step).astype(correction_bias.dtype)
  return jnp.where(bad, jnp.asarray(jnp.nan, new_bias.dtype), new_bias)
