"""Independent float64 numpy versions of the MoE math, written from the spec."""

# Nothing here calls moe_core or a backend, so the checks built on these also
# test the reference backend.

from __future__ import annotations

import math

import numpy as np


def f64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


# --- Grouped GEMM -----------------------------------------------------------


def group_of_rows(group_sizes, num_rows: int) -> np.ndarray:
  """[num_rows] int: each row's group, or -1 for rows past the last group."""
  owner = np.full(num_rows, -1)
  start = 0
  for g, size in enumerate(np.asarray(group_sizes).tolist()):
    owner[start : start + size] = g
    start += size
  return owner


def grouped_gemm(rows, weights, group_sizes, transpose_rhs=False):
  """out[r] = rows[r] @ W[g(r)] (W[g].T if transposed); 0 for padding rows."""
  rows, weights = f64(rows), f64(weights)
  if transpose_rhs:
    weights = weights.transpose(0, 2, 1)
  owner = group_of_rows(group_sizes, rows.shape[0])
  out = np.zeros((rows.shape[0], weights.shape[2]))
  for r, g in enumerate(owner):
    if g >= 0:
      out[r] = rows[r] @ weights[g]
  return out


def grouped_gemm_with_offset(rows, local_weights, group_sizes, offset: int):
  """Groups [offset, offset + E) of G only: out[r] = rows[r] @
  local_weights[g(r) - offset] for those groups' rows, 0 for the others."""
  local = f64(local_weights)
  weights = np.zeros((len(group_sizes),) + local.shape[1:])
  weights[offset : offset + local.shape[0]] = local
  return grouped_gemm(rows, weights, group_sizes)


def grouped_gemm_grads(
    rows, weights, group_sizes, cotangent, transpose_rhs=False
):
  """(d_rows, d_weights) of sum(cotangent * grouped_gemm(...)).

  d_rows[r] = cotangent[r] @ W[g]^T; dW[g] = sum over g's rows of
  rows[r]^T cotangent[r] (transposed for the [E, N, C] layout). Padding rows
  take no part: their d_rows is 0 and they add nothing to dW.
  """
  rows, weights, cotangent = f64(rows), f64(weights), f64(cotangent)
  w = weights.transpose(0, 2, 1) if transpose_rhs else weights  # [E, C, N]
  owner = group_of_rows(group_sizes, rows.shape[0])
  d_rows = np.zeros_like(rows)
  d_w = np.zeros_like(w)
  for r, g in enumerate(owner):
    if g >= 0:
      d_rows[r] = w[g] @ cotangent[r]
      d_w[g] += np.outer(rows[r], cotangent[r])
  if transpose_rhs:
    d_w = d_w.transpose(0, 2, 1)
  return d_rows, d_w


# --- Routing ----------------------------------------------------------------


def _softmax(logits):
  z = np.exp(logits - logits.max(axis=-1, keepdims=True))
  return z / z.sum(axis=-1, keepdims=True)


def _log_sigmoid(z):
  return -np.logaddexp(0.0, -z)


def _sigmoid(z):
  # Through the log: 1 / (1 + exp(-z)) overflows (and warns) for z < -709.
  return np.exp(_log_sigmoid(z))


def _log_sqrt_softplus(z):
  # log(sqrt(log(1 + e^z))); log1p(e^z) is e^z (to float64) for z < -40,
  # whose log is z, and e^z underflows below -745.
  return 0.5 * np.where(
      z < -40.0, z, np.log(np.logaddexp(0.0, np.maximum(z, -40.0)))
  )


def _log_scores(logits, score_func: str) -> np.ndarray:
  """[T, E] float64 logs of the elementwise scores (sigmoid, sqrtsoftplus)."""
  if score_func == "sigmoid":
    return _log_sigmoid(logits)
  if score_func == "sqrtsoftplus":
    return _log_sqrt_softplus(logits)
  raise ValueError(f"no elementwise score function {score_func!r}")


def score(logits, score_func: str) -> np.ndarray:
  """[T, E] float64 scores of the logits: softmax (also what sparsemixer
  chooses by), sigmoid, or sqrtsoftplus = sqrt(log(1 + e^l))."""
  logits = f64(logits)
  if score_func in ("softmax", "sparsemixer"):
    return _softmax(logits)
  return np.exp(_log_scores(logits, score_func))


def sparsemixer_weights(logits, ids, epsilon: float) -> np.ndarray:
  """[T, K] Phi-MoE's inference-time weights, one token and step at a time.

  Step k: m = the k-th chosen logit; the experts not chosen before and with
  (m - l_j) / max(|l_j|, m) <= 2 epsilon share a softmax, and the k-th
  chosen expert's share is its weight.
  """
  logits = f64(logits)
  t, k = ids.shape
  weights = np.zeros((t, k))
  for i in range(t):
    row = logits[i]
    taken = []
    for step in range(k):
      chosen = ids[i, step]
      m = row[chosen]
      with np.errstate(invalid="ignore", divide="ignore"):
        far = (m - row) / np.maximum(np.abs(row), m) > 2.0 * epsilon
      near = [j for j in range(row.size) if not far[j] and j not in taken]
      z = np.exp(row[near] - row[near].max())
      weights[i, step] = z[near.index(chosen)] / z.sum()
      taken.append(chosen)
  return weights


def renormalised(logits, ids, cfg) -> np.ndarray:
  """[T, K] w_k / (sum_j w_j + norm_epsilon) of the scores w of `ids`
  (w_k / (sum_j w_j^p)^(1/p) with p = cfg.norm_topk_p != 1).

  From float64 logs of the scores, which stay finite where the scores
  underflow (sigmoid(-1e4) is 0 even in float64): finite logits, finite
  weights (docs/api.md, "Guarantees").
  """
  logits = f64(logits)
  if cfg.score_func == "softmax":
    m = logits.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    log_w = np.take_along_axis(logits, ids, axis=1) - lse
  else:
    log_w = _log_scores(np.take_along_axis(logits, ids, axis=1), cfg.score_func)
  p = getattr(cfg, "norm_topk_p", 1.0)
  if p != 1:  # DBRX: w / ||w||_p, no epsilon.
    log_norm = np.logaddexp.reduce(p * log_w, axis=1, keepdims=True) / p
    return np.exp(log_w - log_norm)
  log_total = np.logaddexp.reduce(log_w, axis=1, keepdims=True)
  if cfg.norm_epsilon:
    log_total = np.logaddexp(log_total, np.log(cfg.norm_epsilon))
  return np.exp(log_w - log_total)


def router_logits(x, params, cfg) -> np.ndarray:
  """[T, E] float64 logits of tokens x [T, D]: the router input (RMS-norm
  with its learned scale, the fixed scale), @ router, + router bias, then
  the soft-cap."""
  x = f64(x)
  if cfg.router_input_norm:
    rms = np.sqrt(
        np.mean(x**2, axis=-1, keepdims=True) + cfg.input_norm_epsilon
    )
    x = x / rms * f64(params["router_norm_scale"])
  x = x * cfg.router_input_scale
  logits = x @ f64(params["router"])
  if cfg.router_bias:
    logits = logits + f64(params["router_bias"])
  if cfg.router_logit_softcap:
    cap = cfg.router_logit_softcap
    logits = cap * np.tanh(logits / cap)
  return logits


def route(logits, cfg, correction_bias=None, expert_scale=None) -> dict:
  """The router of `cfg`, from float32 logits [T, E], one token at a time.

  The correction bias is added to the scores, or to the logits where
  `cfg.correction_bias_on == "logits"`, to choose; expert_scale [E]
  multiplies each chosen expert's weight.

  Returns a dict with expert_ids [T, K] (best first, lower index on ties),
  combine_weights [T, K] (0 where dropped), kept [T, K], router_probs,
  tokens_per_expert [E], dropped_tokens, load_balancing_loss and
  router_z_loss.
  """
  logits = f64(logits)
  t, e = logits.shape
  scores = score(logits, cfg.score_func)
  if cfg.score_func in ("softmax", "sparsemixer"):
    probs = scores
  else:
    # scores / sum(scores) from their logs, finite where they underflow.
    log_scores = _log_scores(logits, cfg.score_func)
    probs = np.exp(
        log_scores - np.logaddexp.reduce(log_scores, axis=-1, keepdims=True)
    )
  bias = np.zeros(e) if correction_bias is None else f64(correction_bias)
  size = e // cfg.n_group
  ids = np.zeros((t, cfg.top_k), np.int64)
  for i in range(t):
    base = logits[i] if cfg.correction_bias_on == "logits" else scores[i]
    choice = base + bias
    eligible = np.ones(e, bool)
    if cfg.n_group > 1:
      groups = choice.reshape(cfg.n_group, size)
      if cfg.group_score == "max":
        group_score = groups.max(axis=1)
      else:
        group_score = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
      best = np.argsort(-group_score, kind="stable")[: cfg.topk_group]
      eligible = np.repeat(np.isin(np.arange(cfg.n_group), best), size)
    # Inkling: the last S experts always, after the top K - S of the rest.
    s = getattr(cfg, "num_always_on_experts", 0)
    candidates = [j for j in range(e - s) if eligible[j]]
    candidates.sort(key=lambda j: (-choice[j], j))
    ids[i] = candidates[: cfg.top_k - s] + list(range(e - s, e))
  if cfg.score_func == "sparsemixer":
    weights = sparsemixer_weights(logits, ids, cfg.sparsemixer_epsilon)
  elif cfg.norm_topk_prob:
    weights = renormalised(logits, ids, cfg)
  else:
    weights = np.take_along_axis(scores, ids, axis=1)
  weights = weights * cfg.routed_scaling_factor
  if expert_scale is not None:
    weights = weights * f64(expert_scale)[ids]
  kept = np.ones(ids.shape, bool)
  capacity = None
  if cfg.capacity_factor is not None:
    capacity = max(1, math.ceil(cfg.capacity_factor * t * cfg.top_k / e))
    kept = gshard_keep(ids, e, capacity)
  weights = np.where(kept, weights, 0.0)
  tokens_per_expert = np.bincount(ids.reshape(-1), minlength=e)
  fraction = tokens_per_expert / (t * cfg.top_k)
  lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + (
      logits.max(1)
  )
  return dict(
      expert_ids=ids,
      combine_weights=weights,
      kept=kept,
      router_probs=probs,
      tokens_per_expert=tokens_per_expert,
      dropped_tokens=int((~kept).sum()),
      capacity=capacity,
      load_balancing_loss=e * np.sum(fraction * probs.mean(axis=0)),
      router_z_loss=np.mean(lse**2),
  )


def gshard_keep(expert_ids, num_experts: int, capacity: int) -> np.ndarray:
  """[T, K] bool: kept assignments, filling slots by GShard priority.

  Every token's first choice is served before any second choice, and within
  one choice rank tokens go in order; an expert refuses once it holds
  `capacity` assignments.
  """
  t, k = expert_ids.shape
  load = np.zeros(num_experts, np.int64)
  kept = np.zeros((t, k), bool)
  for choice in range(k):
    for token in range(t):
      e = expert_ids[token, choice]
      if load[e] < capacity:
        load[e] += 1
        kept[token, choice] = True
  return kept


# --- Expert FFNs -------------------------------------------------------------


def activation(name: str, z):
  """A plain GLU's elementwise function of the gate, in float64."""
  if name == "silu":
    return z * _sigmoid(z)
  if name == "gelu":  # Exact, erf-based.
    return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
  if name == "gelu_tanh":
    return (
        0.5
        * z
        * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    )
  raise ValueError(f"unknown activation {name!r}")


NON_GATED = ("relu", "relu2")


def hidden(gate, up, cfg):
  """h of an expert FFN from float64 products (gate None when not gated),
  with cfg's activation, clamp and options, written from the model cards'
  formulas."""
  name = cfg.activation
  if name == "relu":
    return np.maximum(up, 0.0)
  if name == "relu2":
    return np.maximum(up, 0.0) ** 2
  limit = getattr(cfg, "swiglu_limit", None)
  if limit is not None:
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
  if name == "gpt_oss_glu":
    return (up + 1.0) * gate * _sigmoid(cfg.swiglu_alpha * gate)
  if name == "softcapped_silu":
    cg, cu = cfg.gate_softcap, cfg.up_softcap
    return cg * np.tanh(gate / cg) * _sigmoid(gate) * cu * np.tanh(up / cu)
  return activation(name, gate) * up


def expert_ffn(x, params, expert: int, cfg):
  """Expert `expert`'s FFN on rows x [N, D] -> [N, D], biases included.

  `cfg` is a MoEConfig, or an activation name (a plain GLU, no biases).
  """
  if isinstance(cfg, str):
    cfg = _PlainGlu(cfg)
  x = f64(x)

  def linear(lhs, weight, bias):
    out = lhs @ f64(params[weight][expert])
    if bias in params:
      out = out + f64(params[bias][expert])
    return out

  gate = None if cfg.activation in NON_GATED else linear(x, "w_gate", "b_gate")
  h = hidden(gate, linear(x, "w_up", "b_up"), cfg)
  return linear(h, "w_down", "b_down")


class _PlainGlu:
  """An activation name as the config `hidden` reads."""

  def __init__(self, name):
    self.activation = name


def shared_expert(x, params, cfg):
  x = f64(x)
  if not getattr(cfg, "shared_swiglu_clamp", True):  # HY-V4: not clamped.
    cfg = cfg.replace(swiglu_limit=None, shared_swiglu_clamp=True)

  def bias(name):  # DeepSeek-V4's, Nemotron-H's mlp_bias; 0 without.
    return f64(params[name]) if name in params else 0.0

  gate = None
  if cfg.activation not in NON_GATED:
    gate = x @ f64(params["shared_w_gate"]) + bias("shared_b_gate")
  h = hidden(gate, x @ f64(params["shared_w_up"]) + bias("shared_b_up"), cfg)
  y = h @ f64(params["shared_w_down"]) + bias("shared_b_down")
  if cfg.shared_expert_gate:
    y = _sigmoid(x @ f64(params["shared_gate"])) * y
  return y


def layer_from_routing(params, x, expert_ids, combine_weights, cfg):
  """y[t] = sum_k w[t, k] * FFN_{ids[t, k]}(x[t]) (+ shared expert(x[t]))
  (+ output_bias), RMS-normed where `cfg.output_norm`,
  x the experts' input (RMS-normed where `cfg.expert_input_norm`); with
  `cfg.expert_latent_size` the routed sum is taken over x @ latent_in
  (RMS-normed where `cfg.latent_norm`) and goes back @ latent_out, and
  with `cfg.post_expert_norm` each FFN output is normed before its weight.

  With cfg.routing_weights_on_input, sum_k FFN_{ids[t, k]}(w[t, k] * x[t]).

  Each token and each of its choices is computed on its own: no sorting,
  no grouping, no padding. x: [T, D]; returns [T, D] float64.
  """
  x = f64(x)
  if cfg.expert_input_norm:  # The experts' own input norm.
    rms = np.sqrt(
        np.mean(x**2, axis=-1, keepdims=True) + cfg.input_norm_epsilon
    )
    x = x / rms * f64(params["expert_norm_scale"])
  ids = np.asarray(expert_ids)
  w = f64(combine_weights)
  # Nemotron-H, Muse Spark: the routed experts work on x @ latent_in,
  # RMS-normed where cfg.latent_norm; their sum goes back @ latent_out.
  latent = getattr(cfg, "expert_latent_size", 0)
  routed_in = x @ f64(params["latent_in"]) if latent else x
  if getattr(cfg, "latent_bias", False):  # Nemotron-H's mlp_bias.
    routed_in = routed_in + f64(params["latent_in_bias"])
  if getattr(cfg, "latent_norm", False):
    rms = np.sqrt(
        np.mean(routed_in**2, axis=-1, keepdims=True) + cfg.latent_norm_epsilon
    )
    routed_in = routed_in / rms * f64(params["latent_norm_scale"])
  routed = np.zeros_like(routed_in)
  for t in range(x.shape[0]):
    for k in range(ids.shape[1]):
      if ids[t, k] >= cfg.num_experts:  # A zero expert: x itself, or 0.
        if cfg.zero_expert_output == "identity":
          routed[t] += w[t, k] * routed_in[t]
        continue
      if w[t, k] == 0.0:  # A dropped copy has weight 0 and adds nothing.
        continue
      row = routed_in[t : t + 1]
      if getattr(cfg, "routing_weights_on_input", False):
        routed[t] += expert_ffn(w[t, k] * row, params, ids[t, k], cfg)[0]
      else:
        out = expert_ffn(row, params, ids[t, k], cfg)[0]
        if getattr(cfg, "post_expert_norm", False):
          # Muse Spark: scaled first, then normalised, no scale after.
          z = out * f64(params["post_expert_norm_scale"])
          out = z / np.sqrt(np.mean(z**2) + cfg.post_expert_norm_epsilon)
        routed[t] += w[t, k] * out
  y = routed @ f64(params["latent_out"]) if latent else routed
  if getattr(cfg, "latent_bias", False):
    y = y + f64(params["latent_out_bias"])
  if cfg.shared_ffn_size:
    y += shared_expert(x, params, cfg)
    if getattr(cfg, "shared_combine", "sum") == "mean":  # Cohere 2 MoE.
      y /= 2
  if getattr(cfg, "output_bias", False):  # JetMoE: after the combine.
    y += f64(params["output_bias"])
  if getattr(cfg, "output_norm", False):  # A.X-K1: an RMS norm of y.
    rms = np.sqrt(
        np.mean(y**2, axis=-1, keepdims=True) + cfg.output_norm_epsilon
    )
    y = y / rms * f64(params["output_norm_scale"])
  return y
