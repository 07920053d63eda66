"""Stage 1, route: router logits -> chosen experts, combine weights and aux."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
      output (normalised and scaled as the config says); 0 where dropped.
    kept: [T, K] bool, False where capacity dropped the assignment (all True
      when dropless).
    tokens_per_expert: [E] int32, assignments the router made per expert,
      before any capacity drop; sums to T*K.
    load_balancing_loss: scalar float32, Switch-style E * sum_e f_e * P_e
      with f_e = tokens_per_expert / (T*K) and P_e = mean router_probs; 1.0
      at perfect balance.
    router_z_loss: scalar float32, mean over tokens of logsumexp(logits)^2.
    dropped_tokens: scalar int32, assignments dropped by capacity; always 0
      when dropless.
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
    expert_ids: jax.Array, num_experts: int, capacity: int
) -> jax.Array:
  """[T, K] bool: which assignments fit in `capacity` slots per expert.

  Priority follows GShard: every token's first choice before any second
  choice, and earlier tokens first within a choice.
  """
  t, k = expert_ids.shape
  by_choice = expert_ids.T.reshape(-1)  # [K*T], choice-major priority order.
  order = jnp.argsort(by_choice, stable=True)
  counts = jnp.bincount(by_choice, length=num_experts)
  starts = jnp.cumsum(counts) - counts
  rank_sorted = (jnp.arange(t * k) - starts[by_choice[order]]).astype(jnp.int32)
  rank = jnp.zeros(t * k, jnp.int32).at[order].set(rank_sorted)
  return (rank < capacity).reshape(k, t).T


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
  validation.check_route(x, router, cfg, correction_bias)
  if cfg.correction_bias != (correction_bias is not None):
    raise ValueError(
        "correction_bias must be given iff cfg.correction_bias is True, got "
        f"cfg.correction_bias={cfg.correction_bias}, correction_bias="
        f"{'None' if correction_bias is None else 'an array'}."
    )
  num_tokens = x.shape[0]
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
  expert_ids = select_experts(scores, cfg, bias)
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (weights.sum(axis=-1, keepdims=True) + cfg.norm_epsilon)
  weights = weights * cfg.routed_scaling_factor

  capacity = cfg.expert_capacity(num_tokens)
  if capacity is None:
    kept = jnp.ones(expert_ids.shape, bool)
  else:
    kept = capacity_keep_mask(expert_ids, cfg.num_experts, capacity)
  weights = jnp.where(kept, weights, 0.0)

  tokens_per_expert = jnp.bincount(
      expert_ids.reshape(-1), length=cfg.num_experts
  ).astype(jnp.int32)
  fraction = tokens_per_expert.astype(jnp.float32) / (num_tokens * cfg.top_k)
  load_balancing_loss = cfg.num_experts * jnp.sum(fraction * probs.mean(axis=0))
  router_z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
  dropped = (expert_ids.size - kept.sum()).astype(jnp.int32)
  return MoEAux(
      router_logits=logits,
      router_probs=probs,
      expert_ids=expert_ids,
      combine_weights=weights,
      kept=kept,
      tokens_per_expert=tokens_per_expert,
      load_balancing_loss=load_balancing_loss,
      router_z_loss=router_z_loss,
      dropped_tokens=dropped,
  )


def update_correction_bias(
    correction_bias: jax.Array, tokens_per_expert: jax.Array, rate: float = 1e-3
) -> jax.Array:
  """DeepSeek-V3's aux-loss-free update: bias += rate * sign(mean - load).

  Underloaded experts get a larger bias (chosen more often), overloaded ones
  a smaller one.

  Args:
    correction_bias: [E] float32.
    tokens_per_expert: [E] (or [..., E], summed over leading axes, e.g. the
      layers or micro-batches of a step) counts.
    rate: the update speed (gamma in the paper, 1e-3 for DeepSeek-V3).
  """
  if correction_bias.ndim != 1:
    raise ValueError(
        "correction_bias must be 1-D [E], got shape "
        f"{correction_bias.shape}."
    )
  load = tokens_per_expert.astype(jnp.float32)
  if load.shape[-1:] != correction_bias.shape:
    raise ValueError(
        "tokens_per_expert must end in E="
        f"{correction_bias.shape[0]}, got "
        f"shape {tokens_per_expert.shape}."
    )
  load = load.reshape(-1, load.shape[-1]).sum(axis=0)
  return correction_bias + rate * jnp.sign(load.mean() - load)
