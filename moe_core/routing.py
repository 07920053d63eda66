"""Stage 1, route: router logits -> chosen experts, combine weights and aux.

The scores (`router_scores`) and the choice (`route`) live here; what
follows a choice in their own modules, re-exported here under their old
names: the `MoEAux` and its statistics (`routing_aux`), the renormalised
weights (`router_weights`), the zero experts (`zero_experts`) and the
router's optional inputs (`router_inputs`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_core import checks
from moe_core import config as config_lib
from moe_core import index_ops
from moe_core import norms
from moe_core import router_inputs
from moe_core import router_weights
from moe_core import routing_aux
from moe_core import score_functions
from moe_core import validation
from moe_core import zero_experts

# Re-exported: the public names of this module before the split.
MoEAux = routing_aux.MoEAux
RouterScores = routing_aux.RouterScores
capacity_keep_mask = routing_aux.capacity_keep_mask
aux_from_choice = routing_aux.aux_from_choice
renormalise = router_weights.renormalise
RouterInputs = router_inputs.RouterInputs
ROUTER_EXTRAS = router_inputs.ROUTER_EXTRAS
router_extras = router_inputs.router_extras
split_zero_experts = zero_experts.split_zero_experts
rejoin_zero_experts = zero_experts.rejoin_zero_experts
zero_expert_output = zero_experts.zero_expert_output


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
    eligible = index_ops.one_hot_rows(best_groups, cfg.n_group)
    eligible = jnp.repeat(eligible, cfg.experts_per_group, axis=1)
    choice = jnp.where(eligible, choice, -jnp.inf)
  _, expert_ids = jax.lax.top_k(choice, cfg.top_k)
  return expert_ids.astype(jnp.int32)


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
    **extras: jax.Array | None,
) -> RouterScores:
  """Checks the routing inputs and scores x [T, D] with router [D, E].

  Args:
    x: [T, D] activations, any float dtype.
    router: [D, E] router weights.
    cfg: the block's config.
    correction_bias: [E] float32, required iff `cfg.correction_bias`.
    **extras: the router's optional inputs, each required iff its config
      field says so: router_bias, router_norm_scale, expert_output_scale,
      hash_table and token_ids (`RouterInputs` says what each is).
  """
  validation.check_route(x, router, cfg, correction_bias, **extras)
  return router_scores_unchecked(x, router, cfg, correction_bias, **extras)


def router_scores_unchecked(
    x, router, cfg, correction_bias, **extras
) -> RouterScores:
  """`router_scores` on validated arguments (of its types)."""
  # hash_table and token_ids choose experts; the scores are x's.
  inputs = RouterInputs(**extras)
  logits = router_logits(router_input(x, cfg, inputs.router_norm_scale), router)
  if inputs.router_bias is not None:
    logits = logits + inputs.router_bias.astype(jnp.float32)
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
  if inputs.expert_output_scale is not None:
    expert_scale = inputs.expert_output_scale.astype(jnp.float32)
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
    **extras: jax.Array | None,
) -> MoEAux:
  """Routes tokens: x [T, D], router [D, E] -> `MoEAux`, all in float32.

  The arguments are `router_scores`'s, checked as there. With hash
  routing (`cfg.hash_vocab_size`), token t's experts are
  hash_table[token_ids[t]]; a token id outside [0, V) makes the token
  invalid (NaN weights, counted), as a NaN in x does.
  """
  validation.check_route(x, router, cfg, correction_bias, **extras)
  return route_unchecked(x, router, cfg, correction_bias, **extras)


def route_unchecked(x, router, cfg, correction_bias, **extras) -> MoEAux:
  """`route` on validated arguments (of its types); `extras` are
  `router_scores`' keywords."""
  inputs = RouterInputs(**extras)
  scored = router_scores_unchecked(x, router, cfg, correction_bias, **extras)
  if cfg.hash_vocab_size:
    scored, expert_ids = _hashed_choice(
        scored, inputs.hash_table, inputs.token_ids, cfg
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
    weights = router_weights.renormalised_weights(
        scored.logits, expert_ids, cfg
    )
  else:
    weights = index_ops.pick(scored.scores, expert_ids)
  weights = weights * cfg.routed_scaling_factor
  return routing_aux.aux_from_choice(scored, expert_ids, weights, cfg)


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
