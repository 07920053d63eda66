"""Routing through TE's fused router, where it computes the config's routing."""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
from jax.interpreters import ad
import jax.numpy as jnp
import numpy as np

from backends.te import _te
from moe_core import config as config_lib
from moe_core import routing
from moe_core import routing_aux
from moe_core.kernels import primitive

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
    * score functions: softmax and sigmoid only (not "sqrtsoftplus" nor
      "sparsemixer"); the expert bias is added to the scores
      (correction_bias_on="scores" only).
  The rest is equal or the backend's: TE takes the library's logits, so
  the router input norm and scale, the router bias and the logit soft-cap
  are in them; the per-expert output scale multiplies TE's weights
  (`routing_aux.aux_from_choice`); routed_scaling_factor is TE's
  scaling_factor, the correction bias is its expert_bias (selection only),
  capacity is applied after TE's top-k (`routing_aux.capacity_keep_mask`), and
  tokens with non-finite logits or scores are marked invalid as
  `routing.route` marks them.
  """
  k = cfg.top_k
  if cfg.score_func not in ("softmax", "sigmoid"):
    return False, (
        "TE's fused router scores with softmax or sigmoid only, not "
        f"score_func={cfg.score_func!r}"
    )
  if cfg.norm_topk_p != 1:
    return False, (
        "the fused router normalises by the sum, not a p-norm "
        f"(norm_topk_p={cfg.norm_topk_p})"
    )
  if cfg.num_always_on_experts:
    return False, (
        "the fused router chooses all top_k, not top_k - S beside S "
        f"always-on experts (num_always_on_experts="
        f"{cfg.num_always_on_experts})"
    )
  if cfg.hash_vocab_size:
    return False, (
        "the fused router chooses by top-k, not from a hash table "
        f"(hash_vocab_size={cfg.hash_vocab_size})"
    )
  if cfg.num_zero_experts:
    return False, (
        "the fused router is not wired for zero experts "
        f"(num_zero_experts={cfg.num_zero_experts})"
    )
  if cfg.correction_bias_on != "scores":
    return False, (
        "TE's fused router adds its expert bias to the scores, not to the "
        f"logits (correction_bias_on={cfg.correction_bias_on!r})"
    )
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
    **extras: jax.Array | None,
) -> routing.MoEAux:
  """`routing.route` with TE's fused router choosing and weighting experts.

  Only for configs where `choice(cfg)` is True. The logits, the scores the
  losses use and the statistics are the library's own (so every `MoEAux`
  field has `routing.route`'s meaning); TE's kernel picks the K experts and
  computes their weights, differentiably (its VJP gives the logits'
  gradient). TE returns the choice as a [T, E] map: the K chosen ids are
  ordered best first by the selection scores, ties to the lower id, as
  `jax.lax.top_k` orders them.

  The arguments are `routing.route`'s, validated by the caller
  (`TEBackend.route`, `moe_layer`).

  Returns:
    `MoEAux` as `routing.route` defines it.
  """
  scored = routing.router_scores_unchecked(
      x, router, cfg, correction_bias, **extras
  )
  expressible, why = choice(cfg)
  if not expressible:
    raise NotImplementedError(f"te: fused router: {why}.")
  grouped = cfg.n_group > 1
  te_weights, chosen = fused_topk(
      scored.logits,
      scored.bias,
      TopK(
          topk=cfg.top_k,
          use_pre_softmax=not cfg.norm_topk_prob,
          num_groups=cfg.n_group if grouped else -1,
          group_topk=cfg.topk_group if grouped else -1,
          scaling_factor=float(cfg.routed_scaling_factor),
          score_function=cfg.score_func,
      ),
  )
  # Best first among TE's K: a token with non-finite scores may have fewer
  # than K marked; top_k still returns K distinct ids (it is invalid).
  ranked = jnp.where(chosen, scored.choice, -jnp.inf)
  _, expert_ids = jax.lax.top_k(ranked, cfg.top_k)
  expert_ids = expert_ids.astype(jnp.int32)
  weights = jnp.take_along_axis(
      te_weights.astype(jnp.float32), expert_ids, axis=-1
  )
  # From here on, what routing.route does with its choice.
  return routing_aux.aux_from_choice(scored, expert_ids, weights, cfg)


# --- TE's fused top-k, differentiable in both directions ---------------------


@dataclasses.dataclass(frozen=True)
class TopK:
  """The static arguments of TE's `fused_topk_with_score_function`, named
  as its parameters (`_te_fused_topk` passes them by name)."""

  topk: int
  use_pre_softmax: bool
  num_groups: int
  group_topk: int
  scaling_factor: float
  score_function: str  # "softmax" or "sigmoid".


def fused_topk(
    logits: jax.Array, bias: jax.Array | None, spec: TopK
) -> tuple[jax.Array, jax.Array]:
  """TE's fused top-k: (probs [T, E] float32, routing_map [T, E] bool).

  probs holds the chosen experts' weights and zeros elsewhere. TE wraps its
  kernels in a custom VJP, which forward mode cannot go through; here the
  forward kernel is the primal of a custom JVP whose tangent is a linear
  primitive (`_tangent_p`) with TE's backward kernel as its transpose
  (`_cotangent_p`). So reverse mode runs TE's forward and backward kernels
  as before, and jvp, linearize, Hessians and vmap work too. The
  primitives' own derivatives (forward mode's tangent, the Hessian's
  second-order terms) are those of `_chosen_weights`, the weights as a
  function of the logits given the choice, in plain JAX.

  Args:
    logits: [T, E] float32.
    bias: [E] float32 expert bias (selection only, no derivative), or None.
    spec: TE's static arguments.
  """
  if bias is None:
    bias = jnp.zeros((0,), jnp.float32)
  return _fused_topk(logits, jax.lax.stop_gradient(bias), spec)


def _te_fused_topk(logits, bias, spec: TopK):
  """TE's public fused top-k (its custom VJP, evaluated only)."""
  return _router_module().fused_topk_with_score_function(
      logits,
      **dataclasses.asdict(spec),
      expert_bias=bias if bias.size else None,
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _fused_topk(logits, bias, spec):
  return _te_fused_topk(logits, bias, spec)


@_fused_topk.defjvp
def _fused_topk_jvp(spec, primals, tangents):
  logits, bias = primals
  d_logits, _ = tangents
  # The primal from _fused_topk itself, so a derivative of this rule goes
  # through the rule again and never through TE's custom VJP.
  probs, routing_map = _fused_topk(logits, bias, spec)
  d_probs = _bind(_tangent_p, d_logits, logits, bias, routing_map, spec)
  # (float0, typed like the map: inside shard_map it varies as the map.)
  d_map = jax.custom_derivatives.zero_from_primal(routing_map)
  return (probs, routing_map), (d_probs, d_map)


def _chosen_weights(logits, routing_map, spec: TopK):
  """probs [T, E] from the logits, given TE's choice: TE's weights.

  transformer_engine/jax/router.py's pipeline after the top-k: softmax
  over every expert before the top-k (`use_pre_softmax`) or over the K
  chosen logits after it; sigmoid scores divided by their sum + 1e-20 when
  topk > 1; times scaling_factor. The bias only chooses. Only derivatives
  are taken from this: the values are TE's kernel's.
  """
  zero = jnp.zeros((), jnp.float32)
  if spec.score_function == "softmax":
    if spec.use_pre_softmax:
      weights = jnp.where(routing_map, jax.nn.softmax(logits, axis=-1), zero)
    else:
      top = jax.lax.stop_gradient(
          jnp.max(jnp.where(routing_map, logits, -jnp.inf), -1, keepdims=True)
      )
      e = jnp.where(routing_map, jnp.exp(logits - top), zero)
      weights = e / jnp.sum(e, axis=-1, keepdims=True)
  elif spec.score_function == "sigmoid":
    weights = jnp.where(routing_map, jax.nn.sigmoid(logits), zero)
    if spec.topk > 1:
      total = jnp.sum(weights, axis=-1, keepdims=True)
      weights = weights / (total + TE_SIGMOID_EPSILON)
  else:
    raise NotImplementedError(
        f"te: score function {spec.score_function!r} in the fused router."
    )
  return weights * jnp.float32(spec.scaling_factor)


def _tangent(d_logits, logits, bias, routing_map, *, spec):
  """[d_probs]: the weights' derivative along d_logits (plain JAX)."""
  del bias
  _, d_probs = jax.jvp(
      lambda l: _chosen_weights(l, routing_map, spec), (logits,), (d_logits,)
  )
  return [d_probs]


def _cotangent(ct, logits, bias, routing_map, *, spec):
  """[d_logits]: TE's backward kernel on the probs' cotangent ct."""
  del routing_map  # te_backward recomputes it from the same inputs.
  return [te_backward(ct, logits, bias, spec).astype(jnp.float32)]


def te_backward(ct, logits, bias, spec: TopK) -> jax.Array:
  """d_logits [T, E] from TE's backward kernel, given probs' cotangent ct.

  Its forward kernel runs again for the scores it saves (a [T, E]
  elementwise pass, which XLA may share with the forward's identical
  call), and for the routing map (the same as the forward's).
  """
  extensions = _router_extensions()
  score_function = getattr(
      extensions.ScoreFunction, spec.score_function.upper()
  )
  _, routing_map, saved_scores = extensions.fused_topk_with_score_function_fwd(
      logits,
      spec.topk,
      spec.use_pre_softmax,
      spec.num_groups,
      spec.group_topk,
      spec.scaling_factor,
      score_function,
      bias,
  )
  return extensions.fused_topk_with_score_function_bwd(
      routing_map,
      saved_scores,
      ct,
      spec.topk,
      spec.use_pre_softmax,
      spec.scaling_factor,
      score_function,
  )


def _router_extensions():
  _te.import_te()
  _te.lowering_needs_devices(_cotangent_p)
  return importlib.import_module("transformer_engine.jax.cpp_extensions.router")


def _logits_shape(avals, *, spec):
  del spec
  return [(avals[1].shape, jnp.dtype(jnp.float32))]


# Both linear in their first operand, each the other's transpose.
_tangent_p = primitive.kernel_primitive(
    "te_router_tangent", _tangent, _logits_shape
)
_cotangent_p = primitive.kernel_primitive(
    "te_router_cotangent", _cotangent, _logits_shape
)
_OTHER = {_tangent_p: _cotangent_p, _cotangent_p: _tangent_p}


def _bind(prim, linear, logits, bias, routing_map, spec):
  operands = primitive.match_variance(
      (linear.astype(jnp.float32), logits, bias, routing_map)
  )
  (out,) = prim.bind(*operands, spec=spec)
  return out


def _plain_cotangent(ct, logits, bias, routing_map, *, spec):
  """`_cotangent` in plain JAX: the transpose of `_tangent`."""
  del bias
  _, vjp = jax.vjp(lambda l: _chosen_weights(l, routing_map, spec), logits)
  return list(vjp(ct))


# Each primitive's computation in plain JAX, whose derivative along the
# logits is the primitive's (TE's backward kernel has none of its own).
_PLAIN = {_tangent_p: _tangent, _cotangent_p: _plain_cotangent}


def _primitive_jvp(prim, primals, tangents, *, spec):
  linear, logits, bias, routing_map = primals
  d_linear, d_logits = tangents[:2]
  out = _bind(prim, linear, logits, bias, routing_map, spec)
  terms = []
  if type(d_linear) is not ad.Zero:
    terms.append(_bind(prim, d_linear, logits, bias, routing_map, spec))
  if type(d_logits) is not ad.Zero:
    # Through the logits: the plain-JAX second derivative of the weights.
    plain = _PLAIN[prim]
    _, term = jax.jvp(
        lambda l: plain(linear, l, bias, routing_map, spec=spec)[0],
        (logits,),
        (d_logits,),
    )
    terms.append(term)
  if not terms:
    return [out], [ad.Zero(jax.typeof(out).to_tangent_aval())]
  return [out], [functools.reduce(jnp.add, terms)]


def _primitive_transpose(
    prim, cotangents, linear, logits, bias, routing_map, *, spec
):
  (ct,) = cotangents
  if not ad.is_undefined_primal(linear) or ad.is_undefined_primal(logits):
    raise ValueError(
        f"{prim.name} is linear in its first operand only, and is transposed "
        "with respect to it."
    )
  if type(ct) is ad.Zero:
    return [None] * 4
  return [
      _bind(_OTHER[prim], ct, logits, bias, routing_map, spec),
      None,
      None,
      None,
  ]


for _prim in (_tangent_p, _cotangent_p):
  ad.primitive_jvps[_prim] = functools.partial(_primitive_jvp, _prim)
  ad.primitive_transposes[_prim] = functools.partial(
      _primitive_transpose, _prim
  )
