"""Stage 1, route: router logits -> chosen experts, combine weights and aux."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from moe_core import checks
from moe_core import config as config_lib
from moe_core import norms
from moe_core import score_functions
from moe_core import validation


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
      renormalises from the logs of the scores (`renormalise`), so a
      token whose chosen scores all underflow to 0 (sigmoid logits below
      about -104) keeps their exact ratios instead of 0/0.
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


# The router's optional parameters besides `router` and `correction_bias`,
# each present iff the config field of the same role says so: name -> that
# field (`MoEConfig`).
ROUTER_EXTRAS = {
    "router_bias": "router_bias",
    "router_norm_scale": "router_input_norm",
    "expert_output_scale": "expert_output_scale",
    "hash_table": "hash_vocab_size",
}


def router_extras(params: dict) -> dict:
  """The `ROUTER_EXTRAS` that a block's params hold, as route's keywords."""
  return {name: params[name] for name in ROUTER_EXTRAS if name in params}


@dataclasses.dataclass(frozen=True)
class RouterScores:
  """The router's float32 scores of T tokens over E experts, before a choice.

  Attributes:
    logits: [T, E], the router's logits: `router_input(x) @ router`, plus
      the router bias, soft-capped (`MoEConfig.router_logit_softcap`).
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


def router_input(
    x: jax.Array,
    cfg: config_lib.MoEConfig,
    router_norm_scale: jax.Array | None = None,
) -> jax.Array:
  """The router's input, float32 [T, D]: x, RMS-normalised and scaled.

  With `cfg.router_input_norm`, x / sqrt(mean(x^2) + input_norm_epsilon)
  * router_norm_scale [D] (Gemma 4's router norm, its own, not the
  experts'); then times the fixed `cfg.router_input_scale`.
  """
  x = x.astype(jnp.float32)
  if cfg.router_input_norm:
    x = norms.rms_norm(x, router_norm_scale, cfg.input_norm_epsilon)
  if cfg.router_input_scale != 1.0:
    x = x * jnp.float32(cfg.router_input_scale)
  return x


def router_scores(
    x: jax.Array,
    router: jax.Array,
    cfg: config_lib.MoEConfig,
    correction_bias: jax.Array | None = None,
    *,
    router_bias: jax.Array | None = None,
    router_norm_scale: jax.Array | None = None,
    expert_output_scale: jax.Array | None = None,
    hash_table: jax.Array | None = None,
    token_ids: jax.Array | None = None,
) -> RouterScores:
  """Checks the routing inputs and scores x [T, D] with router [D, E].

  Args:
    x: [T, D] activations, any float dtype.
    router: [D, E] router weights.
    cfg: the block's config.
    correction_bias: [E] float32, required iff `cfg.correction_bias`.
    router_bias: [E], added to the logits; required iff `cfg.router_bias`.
    router_norm_scale: [D], the router input norm's learned scale; required
      iff `cfg.router_input_norm`.
    expert_output_scale: [E], multiplies each chosen expert's combine
      weight; required iff `cfg.expert_output_scale`.
    hash_table: [V, K] int32 expert ids per token id; required iff
      `cfg.hash_vocab_size` (the choice's, not used for the scores).
    token_ids: [T] int token ids; required iff `cfg.hash_vocab_size`.
  """
  extras = dict(
      router_bias=router_bias,
      router_norm_scale=router_norm_scale,
      expert_output_scale=expert_output_scale,
      hash_table=hash_table,
      token_ids=token_ids,
  )
  validation.check_route(x, router, cfg, correction_bias, **extras)
  return router_scores_unchecked(x, router, cfg, correction_bias, **extras)


def router_scores_unchecked(
    x,
    router,
    cfg,
    correction_bias,
    *,
    router_bias=None,
    router_norm_scale=None,
    expert_output_scale=None,
    hash_table=None,
    token_ids=None,
) -> RouterScores:
  """`router_scores` on validated arguments (of its types)."""
  del hash_table, token_ids  # They choose experts; the scores are x's.
  logits = router_logits(router_input(x, cfg, router_norm_scale), router)
  if router_bias is not None:
    logits = logits + router_bias.astype(jnp.float32)
  cap = cfg.router_logit_softcap
  if cap:
    logits = jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))
  score_function = score_functions.SCORE_FUNCTIONS[cfg.score_func]
  scores = score_function.scores(logits)
  # Per-token normalised scores come from their logs (max-subtracted): a
  # sigmoid of a logit below about -104 underflows to 0 in float32, and
  # the plain quotient is then 0/0.
  probs = score_function.probs(logits)
  bias = None
  choice = scores
  if correction_bias is not None:
    # The bias steers selection only; no gradient flows into it.
    bias = jax.lax.stop_gradient(correction_bias.astype(jnp.float32))
    if cfg.correction_bias_on == "logits":
      # Kolibri: the choice is top-k of logits + bias (the order of the
      # score function of it, without its float32 saturation).
      choice = logits + bias
    else:
      choice = scores + bias
  expert_scale = None
  if expert_output_scale is not None:
    expert_scale = expert_output_scale.astype(jnp.float32)
  return RouterScores(
      logits=logits,
      scores=scores,
      probs=probs,
      bias=bias,
      choice=jax.lax.stop_gradient(choice),
      expert_scale=expert_scale,
  )


def route(
    x: jax.Array,
    router: jax.Array,
    cfg: config_lib.MoEConfig,
    correction_bias: jax.Array | None = None,
    *,
    router_bias: jax.Array | None = None,
    router_norm_scale: jax.Array | None = None,
    expert_output_scale: jax.Array | None = None,
    hash_table: jax.Array | None = None,
    token_ids: jax.Array | None = None,
) -> MoEAux:
  """Routes tokens: x [T, D], router [D, E] -> `MoEAux`, all in float32.

  The arguments are `router_scores`'s, checked as there. With hash
  routing (`cfg.hash_vocab_size`), token t's experts are
  hash_table[token_ids[t]]; a token id outside [0, V) makes the token
  invalid (NaN weights, counted), as a NaN in x does.
  """
  extras = dict(
      router_bias=router_bias,
      router_norm_scale=router_norm_scale,
      expert_output_scale=expert_output_scale,
      hash_table=hash_table,
      token_ids=token_ids,
  )
  validation.check_route(x, router, cfg, correction_bias, **extras)
  return route_unchecked(x, router, cfg, correction_bias, **extras)


def route_unchecked(x, router, cfg, correction_bias, **extras) -> MoEAux:
  """`route` on validated arguments (of its types); `extras` are
  `router_scores`' keywords."""
  scored = router_scores_unchecked(x, router, cfg, correction_bias, **extras)
  if cfg.hash_vocab_size:
    scored, expert_ids = _hashed_choice(
        scored, extras["hash_table"], extras["token_ids"], cfg
    )
  elif cfg.num_always_on_experts:
    expert_ids = _with_always_on_experts(scored.choice, cfg)
  else:
    expert_ids = select_experts(scored.choice, cfg)
  chosen_weights = score_functions.SCORE_FUNCTIONS[
      cfg.score_func
  ].chosen_weights
  if chosen_weights is not None:
    weights = chosen_weights(scored.logits, expert_ids, cfg)
  elif cfg.norm_topk_prob:
    weights = _renormalised_weights(scored.logits, expert_ids, cfg)
  else:
    weights = jnp.take_along_axis(scored.scores, expert_ids, axis=-1)
  weights = weights * cfg.routed_scaling_factor
  return aux_from_choice(scored, expert_ids, weights, cfg)


def _with_always_on_experts(
    choice: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array:
  """[T, K] int32 ids: the top K - S of the first E - S experts' choice
  scores, best first, then the S always-on experts E - S .. E - 1 (Inkling's
  router-weighted shared experts). Validated config: no groups."""
  e, s = cfg.num_experts, cfg.num_always_on_experts
  _, routed = jax.lax.top_k(choice[:, : e - s], cfg.top_k - s)
  always_on = jnp.broadcast_to(
      jnp.arange(e - s, e, dtype=jnp.int32), (choice.shape[0], s)
  )
  return jnp.concatenate([routed.astype(jnp.int32), always_on], axis=-1)


def _hashed_choice(scored, hash_table, token_ids, cfg):
  """(scored, [T, K] int32 ids) of DeepSeek-V4's hash routing: each token's
  row of the fixed table. A token id outside [0, V), or a row holding an
  expert id outside [0, E + Z) (a traced table: a concrete one was refused
  by `validation.check_hash_table`), makes the token's choice NaN, so the
  token is invalid: NaN weights, counted, in no expert's count."""
  token_ids = token_ids.reshape(-1)
  in_range = (token_ids >= 0) & (token_ids < cfg.hash_vocab_size)
  rows = jnp.clip(token_ids, 0, cfg.hash_vocab_size - 1)
  # Checked before the int32 cast, which would wrap a wider id into range.
  bad_ids = checks.flag_bad_hash_table(hash_table, cfg.num_router_experts)
  expert_ids = hash_table.astype(jnp.int32)[rows]
  valid = in_range & ~jnp.any(bad_ids[rows], axis=-1)
  choice = jnp.where(valid[:, None], scored.choice, jnp.nan)
  return dataclasses.replace(scored, choice=choice), expert_ids


def _renormalised_weights(
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
  chosen = jnp.take_along_axis(logits, expert_ids, axis=-1)
  if cfg.norm_topk_p != 1:
    return _p_normalised(chosen, cfg)
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


def _p_normalised(chosen: jax.Array, cfg: config_lib.MoEConfig) -> jax.Array:
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
      `aux_from_choice` makes its weights NaN).
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
  tokens_per_expert = jnp.bincount(
      valid_ids.reshape(-1), length=num_router_experts
  ).astype(jnp.int32)
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


def split_zero_experts(
    aux: MoEAux, cfg: config_lib.MoEConfig
) -> tuple[MoEAux, jax.Array]:
  """(the choice of the E routed experts, [T, K] zero-expert weights).

  With `cfg.num_zero_experts`, ids E..E+Z-1 are experts that run no FFN.
  The first result is `aux` with those copies not kept (their ids folded
  into [0, E), their weights 0), for `Backend.routed_experts`; the second
  holds their combine weights (0 for the other copies, NaN where the token
  is invalid), with which `zero_expert_output` adds the experts' input
  ("identity") or nothing ("zero").
  """
  zero = aux.expert_ids >= cfg.num_experts
  routed = dataclasses.replace(
      aux,
      expert_ids=jnp.where(
          zero, aux.expert_ids % cfg.num_experts, aux.expert_ids
      ),
      combine_weights=jnp.where(zero, 0.0, aux.combine_weights),
      kept=aux.kept & ~zero,
  )
  return routed, jnp.where(zero, aux.combine_weights, 0.0)


def rejoin_zero_experts(
    aux: MoEAux, routed: MoEAux, cfg: config_lib.MoEConfig
) -> MoEAux:
  """`routed` (`split_zero_experts`' first result, as the expert stage
  returned it) with `aux`'s zero-expert copies put back: their ids, weights
  and kept."""
  zero = aux.expert_ids >= cfg.num_experts
  return dataclasses.replace(
      routed,
      expert_ids=aux.expert_ids,
      combine_weights=jnp.where(
          zero, aux.combine_weights, routed.combine_weights
      ),
      kept=jnp.where(zero, aux.kept, routed.kept),
  )


def zero_expert_output(
    zero_weights: jax.Array, expert_tokens: jax.Array, cfg: config_lib.MoEConfig
) -> jax.Array | None:
  """[T, D] what the zero experts add (in the tokens' dtype), or None.

  "identity": sum_k zero_weights[:, k] * tokens (float32 sum); "zero":
  nothing, except that a NaN weight (an invalid token) still makes its
  row NaN.
  """
  if not cfg.num_zero_experts:
    return None
  total = jnp.sum(zero_weights, axis=-1, keepdims=True)
  if cfg.zero_expert_output == "identity":
    out = total * expert_tokens.astype(jnp.float32)
  else:
    out = jnp.broadcast_to(total * 0.0, expert_tokens.shape)
  return out.astype(expert_tokens.dtype)


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
    then marks every token invalid: docs/api.md, "Guarantees"). NaN in
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
