"""TABLE: every bad input to the public entry points, one `Row` each.

The rows are data, one line each, in a sub-table per entry point (and per
config its valid call is built for): {what a row changes: ((tag, change,
outcome), ...)}. A row's name is the entry point's prefix, the label of
what it changes and its tag ("route" "x" "rank3": route_x_rank3). The valid
calls and the changes are in bad_input_calls, the outcomes in
bad_input_outcomes, the runner in bad_input_suite. Over 400 lines because
it is data: 179 rows, a line each.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np


from conformance.bad_input_calls import (
    BIAS_CFG,
    CAPACITY_CFG,
    D,
    E,
    EXPERT_BIAS_CFG,
    F,
    GEMM_GROUP_SIZES,
    GEMM_M,
    HASH_CFG,
    HASH_ZERO_CFG,
    K,
    LATENT_CFG,
    RELU_CFG,
    T,
    V,
    WHOLE_CALL,
    Target,
    arg,
    aux_field,
    cast,
    head,
    nan_in_chosen_expert,
    param,
    replace_args,
    reshape,
    set_at,
    to,
    zeros,
)
from conformance.bad_input_outcomes import (
    Raises,
    Row,
    all_nan,
    both,
    dispatch_invalid,
    hash_invalid,
    layer_invalid,
    nan_and_count,
    nan_bias_entries,
    nan_rows,
    non_finite_rows,
    raises,
    route_invalid,
    tokens_of_nan_expert,
    tokens_with_bad_hash,
    tokens_with_bad_ids,
    tokens_with_nan_weight,
    tokens_with_nan_x,
)

# Short names, so that each row fits one line.
VE = functools.partial(raises, ValueError)
TE = functools.partial(raises, TypeError)
NC = nan_and_count
NAN, INF = math.nan, math.inf
I32, F32, BF16, BOOL = jnp.int32, jnp.float32, jnp.bfloat16, jnp.bool_

# The name of a row: this prefix for its entry point, then the label of
# what it changes, then its tag.
_PREFIXES = {
    "backend.dispatch": "backend_dispatch",
    "backend.combine": "backend_combine",
    "grouped_gemm": "gemm",
    "grouped_gemm_vjp": "gemm",
    "expert_ffn": "ffn",
    "expert_ffn_vjp": "ffn",
    "moe_layer": "layer",
    "update_correction_bias": "update_bias",
    "MoEConfig": "config",
}


def _rows(entry: str, groups: dict, **options) -> tuple[Row, ...]:
  """The rows of `groups`, {target: ((tag, change, outcome), ...)}.

  A target is an argument's name or a `Target`; each row applies `change`
  to it. `options` (cfg, setting) are those of every row (see `Row`).
  """
  prefix = _PREFIXES.get(entry, entry)
  rows = []
  for target, group in groups.items():
    if not isinstance(target, Target):
      target = arg(target)
    for tag, change, outcome in group:
      name = "_".join(part for part in (prefix, target.label, tag) if part)
      rows.append(Row(name, entry, target.corrupt(change), outcome, **options))
  return tuple(rows)


def _ids_error(low: str, high: str) -> str:
  """The message of expert ids outside [0, E), in [low, high]."""
  return (
      r"expert_ids must lie in \[0, num_experts=8\), got values in "
      rf"\[{low}, {high}\]"
  )


def _past_the_rows(sizes, num_rows: int) -> str:
  """The message of group sizes summing past the `num_rows` rows."""
  return (
      rf"sum\(group_sizes\) must be <= the {num_rows} rows, got "
      f"sum={sum(sizes)}"
  )


def _bad_group_sizes(negative, past, num_rows) -> tuple[tuple, ...]:
  """The group_sizes rows of a VJP entry point: `negative` has an entry
  below 0, `past` sums past the `num_rows` rows. Errors eagerly; under jit,
  NaN in the output and every gradient."""
  listed = ", ".join(map(str, negative))
  return (
      (
          "negative",
          to(jnp.asarray(negative, jnp.int32)),
          NC(all_nan, rf"group_sizes must be >= 0, got \[{listed}\]"),
      ),
      (
          "past_the_rows",
          to(jnp.asarray(past, jnp.int32)),
          NC(all_nan, _past_the_rows(past, num_rows)),
      ),
  )


# Expert ids 8 and -3 (E = 8): outside [0, E). Today, under jit:
# sum(group_sizes) is 19 of 20.
_IDS_8_AND_MINUS_3 = lambda ids: ids.at[1, 0].set(8).at[6, 1].set(-3)
_IDS_INVALID = NC(dispatch_invalid, _ids_error("-3", "8"))
_AUX_AS_DICT = lambda aux: dict(expert_ids=aux.expert_ids)
_AS_TUPLE = lambda d: (d.rows, d.group_sizes)
_FLOAT_WITH_NAN = lambda n: n.astype(F32).at[2].set(NAN)

# Outcomes too long for a row's line.
_BAD_ID_ROWS = NC(nan_rows(tokens_with_bad_ids), _ids_error(r"\d+", "99"))
_NAN_EXPERT_ROWS = NC(non_finite_rows(tokens_of_nan_expert))
_LAYER_NAN_X = NC(both(nan_rows(tokens_with_nan_x), layer_invalid))
_EVERY_TOKEN = lambda bad: np.ones(T, bool)
_LAYER_NAN_ROUTER = NC(both(non_finite_rows(_EVERY_TOKEN), layer_invalid))


# --- The rows of each entry point ---------------------------------------------

# route(x [T, D], router [D, E], cfg, correction_bias [E] or None).
_ROUTE = {
    "x": (
        ("rank3", reshape(2, 5, D), VE(r"x\.shape=\(2, 5, 16\)")),
        ("int", cast(I32), TE(r"\bx\b.*int32")),
        ("str", to("tokens"), TE(r"\bx\b.*str")),
        ("nan_token", set_at(3, NAN), NC(route_invalid)),
        ("inf_entry", set_at((6, 2), INF), NC(route_invalid)),
    ),
    "router": (
        ("wrong_shape", zeros(D, 7), VE(r"router.*\(16, 7\)")),
        ("bool", cast(BOOL), TE(r"router.*bool")),
        ("nan", set_at((5, 2), NAN), NC(route_invalid)),
    ),
    "correction_bias": (
        ("unused", zeros(E), VE(r"cfg\.correction_bias=False")),
    ),
    "cfg": (("not_a_config", to({"num_experts": E}), TE(r"cfg.*dict")),),
}
# Sigmoid scores steered by a correction bias. Today, with a NaN in it:
# finite output, every token sent to the same experts.
_ROUTE_BIAS = {
    "correction_bias": (
        ("missing", to(None), VE(r"correction_bias.*None")),
        ("wrong_shape", head(1), VE(r"correction_bias.*\(1,\)")),
        ("nan", set_at(2, NAN), NC(route_invalid)),
    ),
}
_ROUTE_CAPACITY = {
    "x": (("nan_token_with_capacity", set_at(3, NAN), NC(route_invalid)),),
}


def _hash_error(num_ids: int, low: str, high: str) -> str:
  """The message of a hash table holding ids outside [0, E + Z)."""
  return (
      rf"hash_table must hold expert ids in \[0, {num_ids}\), got values "
      rf"in \[{low}, {high}\]"
  )


# Hash routing (HASH_CFG: token t reads row t of the table). Today, under
# jit, with an id of -1 or 8 in a row: NaN outputs, none counted invalid,
# -1 counted for expert 0.
_HASH_MINUS_ONE = NC(hash_invalid, _hash_error(E, "-1", "7"))
_HASH_PAST = NC(hash_invalid, _hash_error(E, "0", "8"))
_HASH_INT32_MIN = NC(hash_invalid, _hash_error(E, "-2147483648", "7"))
_ROUTE_HASH = {
    "hash_table": (
        ("minus_one", set_at((1, 0), -1), _HASH_MINUS_ONE),
        ("past_the_experts", set_at((2, 1), E), _HASH_PAST),
        ("int32_min", set_at((4, 0), -(2**31)), _HASH_INT32_MIN),
        ("float", cast(F32), TE(r"hash_table must be an int32 array.*float32")),
        ("wrong_shape", head(3), VE(r"hash_table.*\(3, 2\)")),
        ("missing", to(None), VE(r"hash_table must be given iff.*None")),
    ),
    "token_ids": (
        ("past_the_vocab", set_at(3, V), NC(hash_invalid)),
        ("negative", set_at(5, -1), NC(hash_invalid)),
        ("float", cast(F32), TE(r"token_ids must be an int array.*float32")),
        ("of_other_tokens", head(9), VE(r"token_ids.*one id per token \(10\)")),
        ("missing", to(None), VE(r"token_ids must be given iff.*None")),
    ),
}

# dispatch(x [T, D], expert_ids [T, K], num_experts, kept [T, K] or None).
_DISPATCH = {
    "expert_ids": (
        ("out_of_range", _IDS_8_AND_MINUS_3, _IDS_INVALID),
        ("float", cast(F32), TE(r"expert_ids.*float32")),
        ("rank1", reshape(-1), VE(r"expert_ids.*\(20,\)")),
        ("of_other_tokens", head(9), VE(r"expert_ids\.shape=\(9, 2\)")),
    ),
    "x": (("int", cast(I32), TE(r"\bx\b.*int32")),),
    "num_experts": (
        ("bool", to(True), VE(r"num_experts must .*got True")),
        ("float", to(8.0), VE(r"num_experts.*8\.0")),
    ),
}
_DISPATCH_CAPACITY = {
    "expert_ids": (
        ("out_of_range_with_drops", _IDS_8_AND_MINUS_3, _IDS_INVALID),
    ),
    "kept": (
        ("int", cast(I32), TE(r"kept.*int32")),
        ("wrong_shape", lambda kept: kept[:, :1], VE(r"kept.*10, 1")),
    ),
}

# Backend.dispatch(x, aux, cfg).
_BACKEND_DISPATCH = {
    aux_field("expert_ids"): (
        ("out_of_range", _IDS_8_AND_MINUS_3, _IDS_INVALID),
    ),
    "aux": (("not_an_aux", _AUX_AS_DICT, TE(r"aux.*dict")),),
}

# combine(expert_out [M, D], dispatched, combine_weights [T, K], kept).
# Today, with the weights transposed: no error, an output of shape (2, 16).
_COMBINE = {
    arg("combine_weights", "weights"): (
        ("transposed", lambda w: w.T, VE(r"combine_weights.*\(2, 10\)")),
        ("wrong_shape", zeros(T, 3), VE(r"combine_weights\.shape=\(10, 3\)")),
        ("bool", cast(BOOL), TE(r"combine_weights.*bool")),
    ),
    "expert_out": (
        ("of_other_rows", head(19), VE(r"expert_out\.shape=\(19, 16\)")),
        ("int", cast(I32), TE(r"expert_out.*int32")),
    ),
    "dispatched": (("not_dispatched", _AS_TUPLE, TE(r"dispatched.*tuple")),),
    arg("combine_weights", "weight"): (
        ("nan", set_at((4, 1), NAN), NC(nan_rows(tokens_with_nan_weight))),
    ),
}

# Backend.combine(expert_out, dispatched, aux, cfg).
_BACKEND_COMBINE = {
    aux_field("combine_weights", "weights"): (
        ("transposed", lambda w: w.T, VE(r"combine_weights.*\(2, 10\)")),
    ),
}

# Backend.grouped_gemm(rows [M, C], weights [G, C, N], group_sizes [G]).
_GEMM = {
    "rows": (
        ("rank3", lambda r: r[None], VE(r"rows.*\(1, 28, 16\)")),
        ("int", cast(I32), TE(r"rows.*int32")),
        ("bool_scalar", to(True), TE(r"rows.*bool")),
    ),
    "weights": (
        ("rank2", lambda w: w[0], VE(r"weights.*\(16, 8\)")),
        ("wrong_contraction", zeros(4, 15, 8), VE(r"weights.*\(4, 15, 8\)")),
        ("bfloat16", cast(BF16), TE(r"weights.*bfloat16")),
    ),
    arg("transpose_rhs", "weights"): (
        ("not_transposed", to(True), VE(r"weights.*\(4, 16, 8\)")),
    ),
    "group_sizes": (
        ("float", cast(F32), TE(r"group_sizes.*float32")),
        ("wrong_length", head(3), VE(r"group_sizes.*\(3,\)")),
        ("list", to(list(GEMM_GROUP_SIZES)), TE(r"group_sizes.*list")),
    ),
    "out_dtype": (
        ("int", to(I32), TE(r"out_dtype.*int32")),
        ("not_a_dtype", to("fast"), TE(r"out_dtype.*fast")),
    ),
}
# Today, under jit: the backends disagree.
_GEMM_VJP = {
    "group_sizes": _bad_group_sizes((-4, 10, 10, 8), (4, 10, 10, 8), GEMM_M),
}

# Backend.expert_ffn(rows [M, D], group_sizes [E], params, cfg).
# Today, with w_up narrower than w_gate: pallas gives a finite result.
_EXPERT_FFN = {
    param("w_up"): (
        ("narrower_than_w_gate", zeros(E, D, 4), VE(r"w_up.*\(8, 16, 4\)")),
    ),
    param("w_down"): (
        ("mismatched", zeros(E, 4, D), VE(r"w_down.*\(8, 4, 16\)")),
        ("missing", to(None), VE(r"w_down")),
    ),
    param("w_gate"): (("int", cast(I32), TE(r"w_gate.*int32")),),
    "rows": (
        ("wrong_width", zeros(T * K, 12), VE(r"rows\.shape=\(20, 12\)")),
        ("int", cast(I32), TE(r"rows.*int32")),
    ),
    "params": (
        ("not_a_dict", lambda p: tuple(p.values()), TE(r"params.*tuple")),
    ),
    "cfg": (("not_a_config", to("cfg"), TE(r"cfg.*str")),),
}
# The same with the expert biases (EXPERT_BIAS_CFG).
_EXPERT_FFN_BIAS = {
    param("b_down"): (
        ("missing", to(None), VE(r"missing \['b_down'\]")),
        ("wrong_width", zeros(E, 4), VE(r"b_down.*\(8, 16\).*\(8, 4\)")),
    ),
}
# At a latent width (LATENT_CFG): rows of the model's width are refused.
_EXPERT_FFN_LATENT = {
    "rows": (
        (
            "model_width",
            zeros(T * K, D),
            VE(r"rows.*expert_latent_size=8.*\(20, 16\)"),
        ),
    ),
    param("w_up"): (
        ("model_width", zeros(E, D, F), VE(r"w_up.*\(8, 8, 8\).*\(8, 16, 8\)")),
    ),
}
_EXPERT_FFN_VJP = {
    "group_sizes": _bad_group_sizes(
        (-4, 6, 2, 4, 0, 5, 2, 3), (4, 3, 1, 4, 0, 5, 2, 3), T * K
    ),
}

# Backend.routed_experts(params, x [T, D], aux, cfg).
# Today, under jit, with an expert id of 99: token 3's output is 0.
_ROUTED_EXPERTS = {
    aux_field("expert_ids"): (
        ("out_of_range", set_at(3, 99), _BAD_ID_ROWS),
        ("float", cast(F32), TE(r"expert_ids.*float32")),
    ),
    arg("x", "routing"): (
        ("of_other_tokens", head(9), VE(r"expert_ids.*\(10, 2\)")),
    ),
    param("w_up"): (("missing", to(None), VE(r"w_up")),),
    param("w_down"): (
        ("mismatched", zeros(E, D, D), VE(r"w_down.*\(8, 16, 16\)")),
    ),
    "aux": (("not_an_aux", _AUX_AS_DICT, TE(r"aux.*dict")),),
    "x": (
        ("int", cast(I32), TE(r"\bx\b.*int32")),
        ("nan_token", set_at(3, NAN), NC(nan_rows(tokens_with_nan_x))),
    ),
    WHOLE_CALL: (("w_gate_nan", nan_in_chosen_expert, _NAN_EXPERT_ROWS),),
}

# moe_layer(params, x, cfg, backend).
_LAYER = {
    "x": (("nan_token", set_at(3, NAN), _LAYER_NAN_X),),
    param("router"): (("nan", set_at((5, 2), NAN), _LAYER_NAN_ROUTER),),
    param("shared_gate", "extra"): (
        ("parameter", zeros(D, 1), VE(r"shared_gate")),
    ),
    "cfg": (("not_a_config", to(None), TE(r"cfg.*None")),),
}

# moe_layer with hash routing, and with Z = 2 zero experts (ids 8 and 9
# are theirs, 10 is past them). Today, under jit: NaN rows, uncounted.
_HASH_ROWS = both(nan_rows(tokens_with_bad_hash), hash_invalid)
_HASH_LAYER_MINUS_ONE = NC(_HASH_ROWS, _hash_error(E, "-1", "7"))
_LAYER_HASH = {
    param("hash_table"): (
        ("minus_one", set_at((1, 0), -1), _HASH_LAYER_MINUS_ONE),
    ),
    "token_ids": (("past_the_vocab", set_at(3, V), NC(_HASH_ROWS)),),
}
_HASH_PAST_ZERO = NC(_HASH_ROWS, _hash_error(E + 2, "0", "10"))
_LAYER_HASH_ZERO = {
    param("hash_table"): (
        ("past_the_zero_experts", set_at((2, 1), E + 2), _HASH_PAST_ZERO),
    ),
}

# moe_layer with a non-gated activation (RELU_CFG): no w_gate.
_LAYER_RELU = {
    param("w_gate", "extra"): (
        ("parameter", zeros(E, D, F), VE(r"keys \['w_gate'\].*not use")),
    ),
}

# update_correction_bias(correction_bias [E], tokens_per_expert [E], rate).
# Today, with a rate of NaN: accepted.
_UPDATE_BIAS = {
    "rate": (
        ("nan", to(NAN), VE(r"rate.*nan")),
        ("inf", to(INF), VE(r"rate.*inf")),
        ("negative", to(-1e-3), VE(r"rate.*-0\.001")),
    ),
    "tokens_per_expert": (
        ("negative", set_at(2, -1), NC(all_nan, r"tokens_per_expert.*-1")),
        ("nan", _FLOAT_WITH_NAN, NC(all_nan, r"tokens_per_expert.*nan")),
        ("wrong_length", head(7), VE(r"tokens_per_expert.*\(7,\)")),
    ),
    "correction_bias": (
        ("nan", set_at(1, NAN), NC(nan_rows(nan_bias_entries))),
        ("rank2", lambda b: b[None], VE(r"correction_bias.*\(1, 8\)")),
        ("int", cast(I32), TE(r"correction_bias.*int32")),
        ("str", to("bias"), TE(r"correction_bias.*str")),
    ),
}
# The rate as an array: a value known only when the call runs.
_UPDATE_BIAS_ARRAY_RATE = {
    "rate": (
        ("array_nan", to(jnp.asarray(NAN, F32)), NC(all_nan, r"rate.*nan")),
    ),
}

# init_params(key, cfg, dtype).
_INIT_PARAMS = {
    "key": (
        ("int", to(0), TE(r"key.*int")),
        ("float", to(jnp.zeros((2,), F32)), TE(r"key.*float32")),
        ("str", to("seed"), TE(r"key.*str")),
        ("batch", lambda key: jax.random.split(key, 3), VE(r"key.*\(3,\)")),
    ),
    "cfg": (("not_a_config", to({"num_experts": E}), TE(r"cfg.*dict")),),
    "dtype": (("int", to(I32), TE(r"dtype.*int32")),),
}

# param_shapes(cfg).
_PARAM_SHAPES = {
    "cfg": (
        ("dict", to({"num_experts": E}), TE(r"cfg.*dict")),
        ("none", to(None), TE(r"cfg.*None")),
    ),
}


def _f32(field: str, value: float) -> Raises:
  """The error of a config float outside float32's range."""
  got = re.escape(repr(value))
  return VE(rf"{field} must be (0 or )?within float32's range.*got {got}\.")


# MoEConfig(**fields): one row a field (field, tag, bad value, outcome).
_CONFIG_FIELDS = (
    ("num_experts", "negative", -8, VE(r"num_experts.*-8")),
    ("top_k", "zero", 0, VE(r"top_k.*got 0")),
    ("hidden_size", "bool", True, VE(r"hidden_size.*True")),
    ("expert_ffn_size", "float", 8.0, VE(r"expert_ffn_size.*8\.0")),
    ("shared_ffn_size", "negative", -1, VE(r"shared_ffn_size.*-1")),
    ("top_k", "above_num_experts", 9, VE(r"top_k=9")),
    ("norm_epsilon", "nan", NAN, VE(r"norm_epsilon.*nan")),
    ("norm_epsilon", "inf", INF, VE(r"norm_epsilon.*inf")),
    ("routed_scaling_factor", "nan", NAN, VE(r"routed_scaling_factor.*nan")),
    ("capacity_factor", "inf", INF, VE(r"capacity_factor.*inf")),
    ("capacity_factor", "bool", True, VE(r"capacity_factor.*True")),
    ("score_func", "unknown", "relu", VE(r"score_func.*relu")),
    ("activation", "unknown", "swish", VE(r"activation.*'swish'")),
    ("swiglu_limit", "zero", 0.0, VE(r"swiglu_limit.*None or.*0\.0")),
    ("swiglu_limit", "nan", NAN, VE(r"swiglu_limit.*nan")),
    ("swiglu_alpha", "unread", 1.702, VE(r"swiglu_alpha.*gpt_oss_glu.*silu")),
    ("gate_softcap", "unread", 30.0, VE(r"gate_softcap.*softcapped_silu")),
    ("up_softcap", "negative", -1.0, VE(r"up_softcap.*-1\.0")),
    ("expert_bias", "int", 1, TE(r"expert_bias must be a bool, got 1")),
    ("routing_weights_on_input", "str", "y", TE(r"routing_weights_on_input")),
    ("sparsemixer_epsilon", "negative", -0.1, VE(r"sparsemixer_eps.*-0\.1")),
    ("router_bias", "int", 1, TE(r"router_bias must be a bool, got 1")),
    ("expert_input_norm", "str", "yes", TE(r"expert_input_norm.*'yes'")),
    ("router_logit_softcap", "negative", -1.0, VE(r"softcap.*>= 0.*-1\.0")),
    ("input_norm_epsilon", "zero", 0.0, VE(r"input_norm_eps.*> 0.*0\.0")),
    ("router_input_scale", "inf", INF, VE(r"router_input_scale.*inf")),
    ("correction_bias_on", "unknown", "weights", VE(r"bias_on.*'weights'")),
    ("num_zero_experts", "negative", -1, VE(r"num_zero_experts.*>= 0.*-1")),
    ("hash_vocab_size", "negative", -5, VE(r"hash_vocab_size.*>= 0.*-5")),
    ("zero_expert_output", "unknown", "mean", VE(r"zero_expert_out.*'mean'")),
    ("output_bias", "int", 1, TE(r"output_bias must be a bool, got 1")),
    ("output_norm_epsilon", "zero", 0.0, VE(r"output_norm_eps.*> 0.*0\.0")),
    ("num_always_on_experts", "not_below_top_k", 9, VE(r"always_on.*< top_k")),
    ("norm_topk_p", "zero", 0.0, VE(r"norm_topk_p.*> 0.*0\.0")),
    ("shared_combine", "unknown", "max", VE(r"shared_combine.*'max'")),
    ("shared_swiglu_clamp", "str", "no", TE(r"shared_swiglu_clamp.*'no'")),
    ("expert_latent_size", "negative", -4, VE(r"expert_latent_size.*>= 0.*-4")),
    ("expert_latent_size", "float", 8.0, VE(r"expert_latent_size.*8\.0")),
    ("latent_norm", "int", 1, TE(r"latent_norm must be a bool, got 1")),
    ("latent_norm_epsilon", "zero", 0.0, VE(r"latent_norm_eps.*> 0.*0\.0")),
    ("post_expert_norm", "str", "y", TE(r"post_expert_norm must be a bool")),
    ("post_expert_norm_epsilon", "nan", NAN, VE(r"post_expert_norm_eps.*nan")),
    ("latent_bias", "int", 1, TE(r"latent_bias must be a bool, got 1")),
    ("shared_expert_bias", "str", "y", TE(r"shared_expert_bias must be a")),
)
# Floats that float32 makes inf or 0 (field, tag, value): refused, naming
# the field and the range. Today: NaN outputs, some of them uncounted.
_FLOAT32_FIELDS = (
    ("router_logit_softcap", "f32_inf", 1e39),
    ("router_input_scale", "f32_inf", 1e39),
    ("routed_scaling_factor", "f32_inf", -1e39),
    ("input_norm_epsilon", "f32_zero", 1e-50),
    ("output_norm_epsilon", "f32_zero", 1e-50),
    ("latent_norm_epsilon", "f32_subnormal", 1e-40),
    ("post_expert_norm_epsilon", "f32_zero", 1e-50),
    ("swiglu_limit", "f32_zero", 1e-50),
)


def _by_field(rows) -> dict:
  """{field: ((tag, to(value), outcome), ...)} of (field, tag, value,
  outcome) rows."""
  groups = {}
  for field, tag, value, outcome in rows:
    groups.setdefault(field, []).append((tag, to(value), outcome))
  return groups


_GPT_OSS, _LIMIT = "gpt_oss_glu", dict(swiglu_limit=7.0)
_NO_ALPHA = VE(r"activation='gpt_oss_glu' needs swiglu_alpha.*got None")
_RELU_LIMIT = VE(r"swiglu_limit.*non-gated activation='relu'")
_CONFIG = {
    WHOLE_CALL: (
        ("unknown_field", replace_args(num_expert=E), TE(r"\bnum_expert\b")),
        ("gpt_oss_glu_no_alpha", replace_args(activation=_GPT_OSS), _NO_ALPHA),
        ("relu_limit", replace_args(activation="relu", **_LIMIT), _RELU_LIMIT),
        (
            "sparsemixer_norm",
            replace_args(score_func="sparsemixer", norm_topk_prob=True),
            VE(r"'sparsemixer'.*norm_topk_prob"),
        ),
        (
            "zero_experts_with_capacity",
            replace_args(num_zero_experts=2, capacity_factor=1.0),
            VE(r"num_zero_experts > 0 needs.*capacity_factor=1\.0"),
        ),
        (
            "always_on_experts_with_hash_routing",
            replace_args(num_always_on_experts=1, hash_vocab_size=10),
            VE(r"num_always_on_experts > 0 needs.*hash_vocab_size=10"),
        ),
        (
            "p_norm_without_norm_topk_prob",
            replace_args(norm_topk_p=2.0),
            VE(r"norm_topk_p=2\.0 needs norm_topk_prob=True"),
        ),
        (
            "shared_mean_without_shared_expert",
            replace_args(shared_combine="mean"),
            VE(r"shared_combine='mean' needs shared_ffn_size > 0"),
        ),
        (
            "shared_clamp_off_without_limit",
            replace_args(shared_swiglu_clamp=False),
            VE(r"shared_swiglu_clamp=False.*swiglu_limit=None"),
        ),
        (
            "latent_norm_without_latent_size",
            replace_args(latent_norm=True),
            VE(r"latent_norm=True.*expert_latent_size=0"),
        ),
        (
            "latent_bias_without_latent_size",
            replace_args(latent_bias=True),
            VE(r"latent_bias=True.*expert_latent_size=0"),
        ),
        (
            "shared_bias_without_shared_expert",
            replace_args(shared_expert_bias=True),
            VE(r"shared_expert_bias=True needs shared_ffn_size > 0"),
        ),
        (
            "post_expert_norm_with_weights_on_input",
            replace_args(post_expert_norm=True, routing_weights_on_input=True),
            VE(r"post_expert_norm=True.*routing_weights_on_input=True"),
        ),
        (
            "gate_softcap_f32_inf",
            replace_args(
                activation="softcapped_silu", gate_softcap=1e39, up_softcap=1.0
            ),
            _f32("gate_softcap", 1e39),
        ),
        (
            "up_softcap_f32_zero",
            replace_args(
                activation="softcapped_silu", gate_softcap=1.0, up_softcap=1e-50
            ),
            _f32("up_softcap", 1e-50),
        ),
        (
            "swiglu_alpha_f32_inf",
            replace_args(activation=_GPT_OSS, swiglu_alpha=1e39),
            _f32("swiglu_alpha", 1e39),
        ),
        (
            "norm_topk_p_f32_inf",
            replace_args(norm_topk_prob=True, norm_topk_p=1e39),
            _f32("norm_topk_p", 1e39),
        ),
        (
            "bias_on_logits_without_bias",
            replace_args(correction_bias_on="logits"),
            VE(r"correction_bias_on='logits' needs correction_bias=True"),
        ),
    ),
}


# --- The table ----------------------------------------------------------------

TABLE = (
    *_rows("route", _ROUTE),
    *_rows("route", _ROUTE_BIAS, cfg=BIAS_CFG),
    *_rows("route", _ROUTE_CAPACITY, cfg=CAPACITY_CFG),
    *_rows("route", _ROUTE_HASH, cfg=HASH_CFG),
    *_rows("dispatch", _DISPATCH),
    *_rows("dispatch", _DISPATCH_CAPACITY, cfg=CAPACITY_CFG),
    *_rows("backend.dispatch", _BACKEND_DISPATCH),
    *_rows("combine", _COMBINE),
    *_rows("backend.combine", _BACKEND_COMBINE),
    *_rows("grouped_gemm", _GEMM),
    *_rows("grouped_gemm_vjp", _GEMM_VJP),
    *_rows("expert_ffn", _EXPERT_FFN),
    *_rows("expert_ffn", _EXPERT_FFN_BIAS, cfg=EXPERT_BIAS_CFG),
    *_rows("expert_ffn", _EXPERT_FFN_LATENT, cfg=LATENT_CFG),
    *_rows("expert_ffn_vjp", _EXPERT_FFN_VJP),
    *_rows("routed_experts", _ROUTED_EXPERTS),
    *_rows("moe_layer", _LAYER),
    *_rows("moe_layer", _LAYER_RELU, cfg=RELU_CFG),
    *_rows("moe_layer", _LAYER_HASH, cfg=HASH_CFG),
    *_rows("moe_layer", _LAYER_HASH_ZERO, cfg=HASH_ZERO_CFG),
    *_rows("update_correction_bias", _UPDATE_BIAS),
    *_rows(
        "update_correction_bias",
        _UPDATE_BIAS_ARRAY_RATE,
        setting=replace_args(rate=jnp.asarray(1e-3, F32)),
    ),
    *_rows("init_params", _INIT_PARAMS),
    *_rows("param_shapes", _PARAM_SHAPES),
    *_rows("MoEConfig", _by_field(_CONFIG_FIELDS)),
    *_rows(
        "MoEConfig",
        _by_field((f, t, v, _f32(f, v)) for f, t, v in _FLOAT32_FIELDS),
    ),
    *_rows("MoEConfig", _CONFIG),
)

# Group sizes in int64, run with jax_enable_x64 on (BadInputSuite's
# test_bad_input_under_x64). A size of 2**32 + k wraps to k in int32: today,
# under jit, checked after the cast, such sizes summed to a valid count and
# gave a finite answer with the wrong groups. Made when the row runs, so that
# the int64 array is made with x64 on.
_WRAPS = 2**32


def _int64(sizes):
  return lambda _: jnp.asarray(sizes, jnp.int64)


_GEMM_INT64 = (_WRAPS + 4, 10, 6, 8)  # Wraps to GEMM_GROUP_SIZES.
_FFN_INT64 = (_WRAPS + 2, 3, 1, 4, 0, 5, 2, 3)  # Wraps to the FFN's sizes.
X64_TABLE = (
    *_rows(
        "grouped_gemm_vjp",
        {
            "group_sizes": (
                (
                    "int64_past_int32",
                    _int64(_GEMM_INT64),
                    NC(all_nan, _past_the_rows(_GEMM_INT64, GEMM_M)),
                ),
            )
        },
    ),
    *_rows(
        "expert_ffn_vjp",
        {
            "group_sizes": (
                (
                    "int64_past_int32",
                    _int64(_FFN_INT64),
                    NC(all_nan, _past_the_rows(_FFN_INT64, T * K)),
                ),
            )
        },
    ),
)
