"""Hypothesis strategies for conformance/fuzz_test.py: configs, faults.

Over 400 lines because it is one job: the strategies of valid configs and
inputs, router extremes, run-time faults and static mistakes, which share
the size buckets.
"""

# Shapes come from a few small buckets: under jit every new shape compiles
# anew (about a second on two cores), so the fuzzer explores the routing
# options, dtypes and values more than the sizes. Array contents come from a
# drawn numpy seed (`cases.layer_inputs`), not from hypothesis floats: a
# falsifying example is then a short, printable `cases.LayerCase`.

from __future__ import annotations

import dataclasses
import math

from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import config as config_lib
from conformance import cases

# --- Buckets, simplest first (hypothesis shrinks towards the first) ---------

# Token shapes x[..., D] may have: one token, a few, a batch of two axes.
BATCH_SHAPES = ((1,), (3,), (8,), (2, 3))
# 256 is DeepSeek-V3's routed expert count; with D = F = 8 it stays cheap.
EXPERT_COUNTS = (4, 1, 2, 8, 16, 256)
HIDDEN_SIZES = (8, 16)
FFN_SIZES = (8, 16)
SHARED_FFN_SIZES = (0, 8)
DTYPES = ("float32", "bfloat16", "float16")
NORM_EPSILONS = (0.0, 1e-20, 1e-6)
# Any finite factor is valid, 0 and negative ones included.
SCALING_FACTORS = (1.0, 2.5, 0.5, 0.0, -1.5)
# Expert-FFN activations (moe_core.activations), with the options each
# reads, and the SwiGLU clamps a gated one may take.
ACTIVATIONS = (
    "silu",
    "gelu",
    "gelu_tanh",
    "gpt_oss_glu",
    "softcapped_silu",
    "relu",
    "relu2",
)
SWIGLU_LIMITS = (None, 7.0, 0.5)
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
# Capacity per expert ceil(f * T * K / E): from one slot to none dropped.
CAPACITY_FACTORS = (0.5, 1.0, 1.5, 4.0)
# At most this many groups, as in DeepSeek-V3 (8 groups of 32 experts).
MAX_GROUPS = 8
MAX_TOP_K = 8

# Values a faulty input holds: NaN and both infinities.
NON_FINITE = (math.nan, math.inf, -math.inf)

# --- Valid configurations and layer inputs ----------------------------------


def _divisors(n: int, at_most: int) -> list[int]:
  return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


@st.composite
def expert_ffn_switches(draw) -> dict:
  """`MoEConfig` fields of the expert FFN: a registry activation with the
  options it reads, a clamp (gated ones only) and per-expert biases."""
  activation = draw(st.sampled_from(ACTIVATIONS))
  fields = {"activation": activation, "expert_bias": draw(st.booleans())}
  if activation == "gpt_oss_glu":
    fields["swiglu_alpha"] = draw(st.sampled_from((1.702, 0.5)))
  if activation == "softcapped_silu":
    fields["gate_softcap"] = draw(st.sampled_from((20.0, 1.0)))
    fields["up_softcap"] = draw(st.sampled_from((20.0, 1.0)))
  if activation not in ("relu", "relu2"):
    fields["swiglu_limit"] = draw(st.sampled_from(SWIGLU_LIMITS))
  return fields


@st.composite
def configs(draw, expert_counts=EXPERT_COUNTS) -> moe_core.MoEConfig:
  """A valid `MoEConfig`: every router family, groups, shared expert, gate,
  the expert-FFN switches and capacity, on the small shape buckets. (The
  router-side switches of issue 33, a router bias and the rest, are left
  out: the fuzz test's own numpy router and its stage-by-stage calls do not
  take their parameters; the conformance cases cover them.)"""
  num_experts = draw(st.sampled_from(expert_counts))
  n_group = draw(st.sampled_from(_divisors(num_experts, MAX_GROUPS)))
  per_group = num_experts // n_group
  topk_group, group_score = 1, "max"
  if n_group > 1:
    topk_group = draw(st.integers(1, n_group))
    # sum_top2 adds a group's two best scores: it needs two experts a group.
    group_score = draw(
        st.sampled_from(("max", "sum_top2") if per_group >= 2 else ("max",))
    )
  eligible = topk_group * per_group if n_group > 1 else num_experts
  top_k = draw(st.integers(1, min(eligible, MAX_TOP_K)))
  shared_ffn_size = draw(st.sampled_from(SHARED_FFN_SIZES))
  norm_topk_prob = draw(st.booleans())
  # The epsilon only matters where the weights are renormalised.
  norm_epsilon = draw(st.sampled_from(NORM_EPSILONS)) if norm_topk_prob else 0.0
  return moe_core.MoEConfig(
      num_experts=num_experts,
      top_k=top_k,
      hidden_size=draw(st.sampled_from(HIDDEN_SIZES)),
      expert_ffn_size=draw(st.sampled_from(FFN_SIZES)),
      score_func=draw(st.sampled_from(SCORE_FUNCS)),
      norm_topk_prob=norm_topk_prob,
      norm_epsilon=norm_epsilon,
      routed_scaling_factor=draw(st.sampled_from(SCALING_FACTORS)),
      correction_bias=draw(st.booleans()),
      n_group=n_group,
      topk_group=topk_group,
      group_score=group_score,
      shared_ffn_size=shared_ffn_size,
      shared_expert_gate=draw(st.booleans()) if shared_ffn_size else False,
      **draw(expert_ffn_switches()),
      capacity_factor=draw(
          st.one_of(st.none(), st.sampled_from(CAPACITY_FACTORS))
      ),
  )


@st.composite
def layer_cases(
    draw, expert_counts=EXPERT_COUNTS, dtypes=DTYPES
) -> cases.LayerCase:
  """A `cases.LayerCase` (no gradients): config, token shape, dtype, traced
  (jit=True) or static (jit=False), and optionally an expert that every
  token prefers, which overflows capacity and leaves other experts empty."""
  cfg = draw(configs(expert_counts))
  hot_expert = draw(st.one_of(st.none(), st.integers(0, cfg.num_experts - 1)))
  return cases.LayerCase(
      name="fuzz",
      cfg=cfg,
      batch_shape=draw(st.sampled_from(BATCH_SHAPES)),
      dtype=draw(st.sampled_from(dtypes)),
      jit=draw(st.booleans()),
      hot_expert=hot_expert,
      seed=draw(st.integers(0, 2**16)),
  )


# --- Extreme but finite routing: finite logits give finite outputs --------

# Every token's logits shifted by this: past -104 every sigmoid score is 0
# in float32 (-1e4 even in float64), past +17 it is 1.
LOGIT_OFFSETS = (-1e4, -1e3, -110.0, -104.0, 0.0, 110.0, 1e4)
# The router's other rows scaled by this: 0 makes all logits equal, 1e-6
# near-ties them, 1e3 spreads them over about +-1e3.
LOGIT_SPREADS = (0.0, 1e-6, 1.0, 1e2, 1e3)
# A one-hot row: one expert's logit this much above the others.
ONE_HOT_GAPS = (2e4, 200.0)
# The correction bias scaled by this: 1e4 makes the bias alone choose,
# often experts whose scores are 0; 0 and 1e-30 leave it no say.
BIAS_SCALES = (1.0, 1e4, 0.0, 1e-30)


@dataclasses.dataclass(frozen=True)
class RouterExtreme:
  """Finite routing inputs of extreme size, written over a case's inputs.

  Feature 0 of every token becomes 1, and router row 0 the logits' common
  part: `offset` for every expert, plus `one_hot_gap` for expert `one_hot`.
  The other router rows are scaled by `spread`, the correction bias by
  `bias_scale`. Logits stay within about +-3e4, which float16 and bfloat16
  router weights hold (float16's largest is 65504).
  """

  offset: float
  spread: float
  one_hot: int | None
  one_hot_gap: float
  bias_scale: float


@st.composite
def router_extremes(draw, cfg: moe_core.MoEConfig):
  """None (the case's own inputs) about half the time, else a
  `RouterExtreme` for `cfg`."""
  if draw(st.booleans()):
    return None
  return RouterExtreme(
      offset=draw(st.sampled_from(LOGIT_OFFSETS)),
      spread=draw(st.sampled_from(LOGIT_SPREADS)),
      one_hot=draw(st.one_of(st.none(), st.integers(0, cfg.num_experts - 1))),
      one_hot_gap=draw(st.sampled_from(ONE_HOT_GAPS)),
      bias_scale=draw(st.sampled_from(BIAS_SCALES)),
  )


def layer_cases_with_extremes(**kwargs):
  """(case, RouterExtreme or None): `layer_cases(**kwargs)` and what
  `extreme_inputs` writes over its inputs."""
  return layer_cases(**kwargs).flatmap(
      lambda case: st.tuples(st.just(case), router_extremes(case.cfg))
  )


def extreme_inputs(
    case: cases.LayerCase, extreme: RouterExtreme | None
) -> tuple[dict, jnp.ndarray]:
  """(params, x) of `case`, with `extreme` written in (see RouterExtreme);
  x keeps its batch shape. The case's cached inputs are not changed."""
  params, x, _ = cases.layer_inputs(case)
  if extreme is None:
    return params, x
  arrays = {n: np.array(v).astype(np.float32) for n, v in params.items()}
  tokens = np.array(x).astype(np.float32)
  tokens[..., 0] = 1.0
  router = arrays["router"]
  router *= extreme.spread
  router[0] = extreme.offset
  if extreme.one_hot is not None:
    router[0, extreme.one_hot] += extreme.one_hot_gap
  if "correction_bias" in arrays:
    arrays["correction_bias"] *= extreme.bias_scale
  return (
      {n: jnp.asarray(v, params[n].dtype) for n, v in arrays.items()},
      jnp.asarray(tokens, x.dtype),
  )


# --- Non-finite data (policy R1, R7) -----------------------------------------


@dataclasses.dataclass(frozen=True)
class Fault:
  """One non-finite value written into an input of the layer.

  Attributes:
    target: "x", "router", "correction_bias" or an expert weight ("w_gate",
      "w_up", "w_down").
    index: where in that array; for "x", (token, feature) of the flattened
      [T, D] tokens.
    value: NaN, inf or -inf.
  """

  target: str
  index: tuple[int, ...]
  value: float


def _targets(cfg: moe_core.MoEConfig) -> tuple[str, ...]:
  targets = ("x", "router", "w_gate", "w_up", "w_down")
  return targets + (("correction_bias",) if cfg.correction_bias else ())


@st.composite
def faults(draw, case: cases.LayerCase, max_faults: int = 3) -> tuple:
  """1 to `max_faults` `Fault`s in the inputs of `case`, x rows most often
  (the faults R1 counts per token)."""
  cfg = case.cfg
  shapes = moe_core.param_shapes(cfg)
  shapes["x"] = (case.num_tokens, cfg.hidden_size)
  target_strategy = st.one_of(st.just("x"), st.sampled_from(_targets(cfg)))
  found = []
  for _ in range(draw(st.integers(1, max_faults))):
    target = draw(target_strategy)
    index = tuple(draw(st.integers(0, n - 1)) for n in shapes[target])
    found.append(Fault(target, index, draw(st.sampled_from(NON_FINITE))))
  return tuple(found)


def faulty_inputs(case: cases.LayerCase, found) -> tuple[dict, jnp.ndarray]:
  """(params, x) of `case` with the `Fault`s written in; x keeps its
  batch shape. The case's cached inputs are copied, not changed."""
  params, x, _ = cases.layer_inputs(case)
  arrays = {n: np.array(v) for n, v in params.items()}
  arrays["x"] = np.array(x).reshape(case.num_tokens, case.cfg.hidden_size)
  for fault in found:
    arrays[fault.target][fault.index] = fault.value
  faulty_x = jnp.asarray(arrays.pop("x").reshape(x.shape), x.dtype)
  faulty_params = {
      n: jnp.asarray(v, params[n].dtype) for n, v in arrays.items()
  }
  return faulty_params, faulty_x


# --- Expert ids out of range (policy R2, R4) ---------------------------------

# An id below 0 or at/after E; the int32 extremes included.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@st.composite
def bad_expert_ids(draw, case: cases.LayerCase, max_bad: int = 3) -> tuple:
  """((token, choice, id), ...): 1 to `max_bad` assignments of `case` given
  an id outside [0, E)."""
  cfg = case.cfg
  out_of_range = st.one_of(
      st.integers(_INT32_MIN, -1), st.integers(cfg.num_experts, _INT32_MAX)
  )
  return tuple(
      (
          draw(st.integers(0, case.num_tokens - 1)),
          draw(st.integers(0, cfg.top_k - 1)),
          draw(out_of_range),
      )
      for _ in range(draw(st.integers(1, max_bad)))
  )


@st.composite
def routing_faults(draw, case: cases.LayerCase, max_each: int = 2) -> tuple:
  """(bad ids as in `bad_expert_ids`, ((token, choice), ...) whose combine
  weight becomes NaN), at least one fault in all."""
  cfg = case.cfg
  assignment = st.tuples(
      st.integers(0, case.num_tokens - 1), st.integers(0, cfg.top_k - 1)
  )
  nan_weights = tuple(
      draw(assignment) for _ in range(draw(st.integers(0, max_each)))
  )
  bad_ids = ()
  if not nan_weights or draw(st.booleans()):
    bad_ids = draw(bad_expert_ids(case, max_each))
  return bad_ids, nan_weights


# --- Hash routing's table and token ids (policy R1) --------------------------

# DeepSeek-V4's hash layers: V token ids (1: every token reads row 0).
HASH_VOCAB_SIZES = (7, 1, 50)
ZERO_EXPERT_COUNTS = (0, 2)


@dataclasses.dataclass(frozen=True)
class HashFault:
  """A hash-routing case whose table or token ids hold bad values.

  Attributes:
    case: the layer case (`cfg.hash_vocab_size` V, maybe Z zero experts).
    entries: ((row, choice, id), ...): table entries set to an id outside
      [0, E + Z) (the int32 extremes included).
    tokens: ((token, id), ...): token ids set outside [0, V).
  """

  case: cases.LayerCase
  entries: tuple[tuple[int, int, int], ...]
  tokens: tuple[tuple[int, int], ...]


@st.composite
def hash_faults(draw) -> HashFault:
  """A hash-routing case with 0 to 3 bad table entries and 0 to 2 bad
  token ids (one at least); the entries mostly in rows the tokens read."""
  num_experts = draw(st.sampled_from((4, 1, 8)))
  zero = draw(st.sampled_from(ZERO_EXPERT_COUNTS))
  vocab = draw(st.sampled_from(HASH_VOCAB_SIZES))
  cfg = moe_core.MoEConfig(
      num_experts=num_experts,
      top_k=draw(st.integers(1, min(num_experts, 4))),
      hidden_size=draw(st.sampled_from(HIDDEN_SIZES)),
      expert_ffn_size=draw(st.sampled_from(FFN_SIZES)),
      score_func=draw(st.sampled_from(SCORE_FUNCS)),
      norm_topk_prob=draw(st.booleans()),
      hash_vocab_size=vocab,
      num_zero_experts=zero,
      capacity_factor=None
      if zero
      else draw(st.one_of(st.none(), st.sampled_from(CAPACITY_FACTORS))),
  )
  case = cases.LayerCase(
      name="fuzz_hash",
      cfg=cfg,
      batch_shape=draw(st.sampled_from(BATCH_SHAPES)),
      dtype=draw(st.sampled_from(("float32", "bfloat16"))),
      jit=draw(st.booleans()),
      seed=draw(st.integers(0, 2**16)),
  )
  read = np.asarray(cases.hash_token_ids(case))
  width = cfg.num_router_experts
  bad_id = st.one_of(
      st.integers(_INT32_MIN, -1), st.integers(width, _INT32_MAX)
  )
  entries = []
  for _ in range(draw(st.integers(0, 3))):
    any_row = draw(st.booleans()) and draw(st.booleans())  # 1 in 4.
    row = (
        draw(st.integers(0, vocab - 1))
        if any_row
        else int(read[draw(st.integers(0, case.num_tokens - 1))])
    )
    entries.append((row, draw(st.integers(0, cfg.top_k - 1)), draw(bad_id)))
  bad_token_id = st.one_of(
      st.integers(_INT32_MIN, -1), st.integers(vocab, _INT32_MAX)
  )
  tokens = tuple(
      (draw(st.integers(0, case.num_tokens - 1)), draw(bad_token_id))
      for _ in range(draw(st.integers(0 if entries else 1, 2)))
  )
  return HashFault(case, tuple(entries), tokens)


def hash_fault_inputs(fault: HashFault):
  """(params, x, token_ids [T] int32, valid params, valid token_ids) of
  `fault.case`, with the bad entries and token ids written in."""
  params, x, _ = cases.layer_inputs(fault.case)
  good_ids = cases.hash_token_ids(fault.case)
  table = np.array(params["hash_table"])
  for row, choice, expert in fault.entries:
    table[row, choice] = expert
  token_ids = np.array(good_ids)
  for token, value in fault.tokens:
    token_ids[token] = value
  bad_params = dict(params, hash_table=jnp.asarray(table, jnp.int32))
  return bad_params, x, jnp.asarray(token_ids, jnp.int32), params, good_ids


# --- Config floats at float32's edges ----------------------------------------

# float32's largest finite number and smallest normal one, and values past
# them (inf or 0 in float32, a subnormal flushed to 0), with moderate
# extremes that float32 holds.
_F32_MAX = config_lib.FLOAT32_MAX
_F32_TINY = config_lib.FLOAT32_TINY
FLOAT32_EDGE_VALUES = (1e39, 1e-50, 1e-40, _F32_MAX, _F32_TINY, 1e15, 1e-30)
# Accepted values in this range run the layer: finite and counted. (Past
# it, a product with the value may overflow float32 as any product can:
# router_input_scale=1e30 squares logits of 1e30 in the z-loss.)
FLOAT32_RUN_RANGE = (1e-30, 1e15)
# What each float field needs switched on to be read (or merely allowed).
FLOAT32_FIELD_SWITCHES = {
    "routed_scaling_factor": {},
    "norm_topk_p": dict(norm_topk_prob=True),
    "router_logit_softcap": {},
    "router_input_scale": {},
    "input_norm_epsilon": dict(router_input_norm=True, expert_input_norm=True),
    "output_norm_epsilon": dict(output_norm=True),
    "latent_norm_epsilon": dict(expert_latent_size=8, latent_norm=True),
    "post_expert_norm_epsilon": dict(post_expert_norm=True),
    "swiglu_limit": {},
    "swiglu_alpha": dict(activation="gpt_oss_glu"),
    "gate_softcap": dict(activation="softcapped_silu", up_softcap=1.0),
    "up_softcap": dict(activation="softcapped_silu", gate_softcap=1.0),
}


@st.composite
def config_float_edges(draw) -> tuple[dict, str, float]:
  """(MoEConfig fields, the float field drawn, its value): one of
  `config_lib.FLOAT32_FIELDS` at or past float32's edges (negated
  where the field may be negative)."""
  name = draw(st.sampled_from(sorted(config_lib.FLOAT32_FIELDS)))
  value = draw(st.sampled_from(FLOAT32_EDGE_VALUES))
  if name in ("routed_scaling_factor", "router_input_scale"):
    value = draw(st.sampled_from((value, -value)))
  fields = dict(
      num_experts=4,
      top_k=2,
      hidden_size=8,
      expert_ffn_size=8,
      **FLOAT32_FIELD_SWITCHES[name],
  )
  fields[name] = value
  return fields, name, value


# --- Group sizes (policy R5) -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmFault:
  """A grouped GEMM (and expert FFN) call whose group_sizes are invalid.

  rows [m, width] x weights [len(group_sizes), width, out_width]; the sizes
  have a negative entry or sum past m. For the expert FFN, width is D and
  out_width is F.
  """

  m: int
  width: int
  out_width: int
  group_sizes: tuple[int, ...]
  dtype: str
  transpose_rhs: bool
  jit: bool
  seed: int


@st.composite
def gemm_faults(draw, dtypes=("float32", "bfloat16")) -> GemmFault:
  """Sizes that break one rule: a negative entry, or a sum past the rows
  (by one, or by enough to wrap an int32 sum around)."""
  m = draw(st.integers(1, 12))
  num_groups = draw(st.integers(1, 5))
  sizes = [draw(st.integers(0, m)) for _ in range(num_groups)]
  broken = draw(st.integers(0, num_groups - 1))
  if draw(st.booleans()):
    sizes[broken] = draw(st.integers(_INT32_MIN, -1))
  else:
    others = sum(sizes) - sizes[broken]
    sizes[broken] = draw(st.integers(max(0, m + 1 - others), _INT32_MAX))
  return GemmFault(
      m=m,
      width=draw(st.sampled_from(HIDDEN_SIZES)),
      out_width=draw(st.sampled_from(FFN_SIZES)),
      group_sizes=tuple(sizes),
      dtype=draw(st.sampled_from(dtypes)),
      transpose_rhs=draw(st.booleans()),
      jit=draw(st.booleans()),
      seed=draw(st.integers(0, 2**16)),
  )


def gemm_fault_inputs(fault: GemmFault):
  """(rows [m, C], weights, group_sizes [E] int32 numpy, cotangent [m, N])."""
  rng = np.random.default_rng(fault.seed)
  e, c, n = len(fault.group_sizes), fault.width, fault.out_width
  w_shape = (e, n, c) if fault.transpose_rhs else (e, c, n)
  dtype = jnp.dtype(fault.dtype)
  return (
      jnp.asarray(rng.standard_normal((fault.m, c)), dtype),
      jnp.asarray(rng.standard_normal(w_shape) * c**-0.5, dtype),
      np.asarray(fault.group_sizes, np.int32),
      jnp.asarray(rng.standard_normal((fault.m, n)), dtype),
  )


def ffn_fault_inputs(fault: GemmFault):
  """(rows [m, D], group_sizes [E] int32 numpy, params, cfg, cotangent) for
  `Backend.expert_ffn`, with D = fault.width and F = fault.out_width."""
  cfg = moe_core.MoEConfig(
      num_experts=len(fault.group_sizes),
      top_k=1,
      hidden_size=fault.width,
      expert_ffn_size=fault.out_width,
  )
  rng = np.random.default_rng(fault.seed)
  dtype = jnp.dtype(fault.dtype)
  params = {
      n: jnp.asarray(rng.standard_normal(s) * s[-2] ** -0.5, dtype)
      for n, s in moe_core.param_shapes(cfg).items()
  }
  return (
      jnp.asarray(rng.standard_normal((fault.m, fault.width)), dtype),
      np.asarray(fault.group_sizes, np.int32),
      params,
      cfg,
      jnp.asarray(rng.standard_normal((fault.m, fault.width)), dtype),
  )


# --- Static mistakes in a layer call ----------------------------------------

# What a caller can get wrong that is known before anything runs, and the
# start of the message that names the argument (moe_core/validation.py).
STATIC_MISTAKES = {
    "no_tokens": (ValueError, "x must hold at least one token"),
    "wrong_hidden_size": (ValueError, "x must have shape [..., hidden_size="),
    "integer_tokens": (TypeError, "x must be floating point"),
    "missing_param": (ValueError, "params is missing"),
    "extra_param": (ValueError, "params has keys"),
    "param_shape": (ValueError, "params["),
    "integer_param": (TypeError, "params["),
}


@st.composite
def static_mistakes(draw) -> tuple[cases.LayerCase, str, str]:
  """(case, mistake, parameter name): a valid case, one of STATIC_MISTAKES
  and the parameter it concerns (for the params mistakes)."""
  case = draw(layer_cases(expert_counts=(4, 1, 8), dtypes=("float32",)))
  mistake = draw(st.sampled_from(sorted(STATIC_MISTAKES)))
  name = draw(st.sampled_from(sorted(moe_core.param_shapes(case.cfg))))
  return case, mistake, name


def make_static_mistake(case: cases.LayerCase, mistake: str, name: str):
  """(params, x) of `case` with `mistake` made (see STATIC_MISTAKES)."""
  params, x, _ = cases.layer_inputs(case)
  params = dict(params)
  d = case.cfg.hidden_size
  if mistake == "no_tokens":
    x = jnp.zeros(case.batch_shape[:-1] + (0, d), x.dtype)
  elif mistake == "wrong_hidden_size":
    x = jnp.zeros(case.batch_shape + (d + 1,), x.dtype)
  elif mistake == "integer_tokens":
    x = x.astype(jnp.int32)
  elif mistake == "missing_param":
    del params[name]
  elif mistake == "extra_param":
    params["unused_" + name] = params[name]
  elif mistake == "param_shape":
    params[name] = jnp.zeros(params[name].shape + (1,), params[name].dtype)
  elif mistake == "integer_param":
    params[name] = params[name].astype(jnp.int32)
  else:
    raise ValueError(f"unknown mistake {mistake!r}")
  return params, x


# --- update_correction_bias (policy R6) --------------------------------------


@dataclasses.dataclass(frozen=True)
class BiasUpdate:
  """One update_correction_bias(bias, counts, rate) call.

  Attributes:
    bias: the [E] float32 correction bias (may hold NaN).
    counts: tokens_per_expert [E]: float32 if any is fractional or not
      finite, else int32 (may be negative).
    rate: the update speed (may be negative, NaN or infinite).
    jit: run under jax.jit (bias and counts traced).
    traced_rate: pass the rate as a traced float32 array, not a Python
      float (only under jit).
  """

  bias: tuple[float, ...]
  counts: tuple[float, ...]
  rate: float
  jit: bool
  traced_rate: bool

  @property
  def counts_dtype(self):
    whole = all(math.isfinite(c) and c == int(c) for c in self.counts)
    return jnp.int32 if whole else jnp.float32


@st.composite
def bias_updates(draw) -> BiasUpdate:
  """Counts and rate valid or not: negative or non-finite counts, a NaN,
  infinite or negative rate, NaN in the bias."""
  e = draw(st.integers(1, 8))
  count = st.one_of(
      st.integers(0, 50).map(float),
      st.sampled_from((-1.0, -7.0, 2.5) + NON_FINITE),
  )
  bias_value = st.one_of(st.floats(-1.0, 1.0, width=32), st.just(math.nan))
  rate = st.one_of(
      st.sampled_from((1e-3, 0.0, 0.5)),
      st.sampled_from((-1e-3,) + NON_FINITE),
  )
  jit = draw(st.booleans())
  return BiasUpdate(
      bias=tuple(draw(bias_value) for _ in range(e)),
      counts=tuple(draw(count) for _ in range(e)),
      rate=draw(rate),
      jit=jit,
      traced_rate=jit and draw(st.booleans()),
  )


# --- mosaic_tpu's launch: group offsets, tiles, zero widths, TPU kinds -----


@dataclasses.dataclass(frozen=True)
class OffsetGemm:
  """A valid grouped GEMM over the local groups [offset, offset + E) of G
  (mosaic_tpu's `ops.grouped_gemm_with_offset`): rows [m, 8] x weights
  [E, 8, 16], sizes summing to at most m; and the faults to try on it, one
  at a time: `bad_offset` outside [0, G - E], group `bad_group`'s size
  made negative or past m, weights contracting over 7 columns."""

  m: int
  group_sizes: tuple[int, ...]
  num_local: int
  offset: int
  bad_offset: int
  bad_group: int
  seed: int

  def faults(self) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """name -> (offset, group_sizes, the weights' contracted width)."""

    def sized(size):
      sizes = list(self.group_sizes)
      sizes[self.bad_group] = size
      return tuple(sizes)

    return {
        "offset": (self.bad_offset, self.group_sizes, 8),
        "negative": (self.offset, sized(-3), 8),
        "past_rows": (self.offset, sized(self.m + 1), 8),
        "narrow": (self.offset, self.group_sizes, 7),
    }


@st.composite
def offset_gemms(draw) -> OffsetGemm:
  """Offsets in [0, G - E], bad ones up to 3 past either end."""
  m = draw(st.sampled_from((16, 40)))
  num_groups = draw(st.integers(1, 4))
  num_local = draw(st.integers(1, num_groups))
  high = num_groups - num_local
  return OffsetGemm(
      m=m,
      group_sizes=tuple(
          draw(st.integers(0, m // num_groups)) for _ in range(num_groups)
      ),
      num_local=num_local,
      offset=draw(st.integers(0, high)),
      bad_offset=draw(
          st.one_of(st.integers(high + 1, high + 3), st.integers(-3, -1))
      ),
      bad_group=draw(st.integers(0, num_groups - 1)),
      seed=draw(st.integers(0, 2**16)),
  )


def offset_gemm_inputs(call: OffsetGemm, width: int = 8):
  """(rows [m, 8] float32, local weights [E, width, 16] float32)."""
  rng = np.random.default_rng(call.seed)
  return (
      jnp.asarray(rng.standard_normal((call.m, 8)), jnp.float32),
      jnp.asarray(
          rng.standard_normal((call.num_local, width, 16)), jnp.float32
      ),
  )


@dataclasses.dataclass(frozen=True)
class TiledGemm:
  """A valid grouped GEMM, rows [m, width] x weights [E, width, out_width]
  ([E, out_width, width] transposed), on mosaic_tpu with the caller's
  `tiles` (its option's dict form)."""

  m: int
  width: int
  out_width: int
  group_sizes: tuple[int, ...]
  transpose_rhs: bool
  tiles: dict
  jit: bool
  seed: int


@st.composite
def tiled_gemms(draw) -> TiledGemm:
  """Tiles for every kernel kind (3 calls in 4), or some kinds' (the
  others the table's); bk left out (Tiles' default: the whole K) 2 times in
  3; widths under one tile and past one by a partial block."""

  def tiles():
    chosen = dict(
        bm=draw(st.sampled_from((128, 256))),
        bn=draw(st.sampled_from((128, 256))),
        chunk=draw(st.sampled_from((None, 128))),
    )
    bk = draw(st.sampled_from((None, None, 128)))
    return chosen if bk is None else dict(chosen, bk=bk)

  if draw(st.sampled_from((True, True, True, False))):
    chosen = tiles()
  else:
    chosen = {
        kind: tiles() if draw(st.booleans()) else None
        for kind in ("fwd", "dgrad", "wgrad")
    }
  m = draw(st.sampled_from((5, 130)))
  num_groups = draw(st.integers(1, 3))
  return TiledGemm(
      m=m,
      width=draw(st.sampled_from((8, 136))),
      out_width=draw(st.sampled_from((16, 136))),
      group_sizes=tuple(
          draw(st.integers(0, m // num_groups)) for _ in range(num_groups)
      ),
      transpose_rhs=draw(st.booleans()),
      tiles=chosen,
      jit=draw(st.booleans()),
      seed=draw(st.integers(0, 2**16)),
  )


def tiled_gemm_inputs(call: TiledGemm):
  """(rows [m, C], weights, group_sizes [E] int32, cotangent [m, N]), all
  float32 (`call.width` C and `call.out_width` N: either may be 0)."""
  rng = np.random.default_rng(call.seed)
  e, c, n = len(call.group_sizes), call.width, call.out_width
  w_shape = (e, n, c) if call.transpose_rhs else (e, c, n)
  return (
      jnp.asarray(rng.standard_normal((call.m, c)), jnp.float32),
      jnp.asarray(rng.standard_normal(w_shape), jnp.float32),
      jnp.asarray(call.group_sizes, jnp.int32),
      jnp.asarray(rng.standard_normal((call.m, n)), jnp.float32),
  )


# TPU device kinds as jax spells them (jax/_src/tpu_info.py), each with the
# generation of docs/mosaic_tpu.md's table it is, or None for a chip the
# table lacks (16 MiB of VMEM on v2, v3, v4 and v4 lite; TPU7 is not the
# tpu7x).
TPU_KINDS = {
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
    "TPU v2": None,
    "TPU v3": None,
    "TPU v4": None,
    "TPU v4 lite": None,
    "TPU7": None,
}
