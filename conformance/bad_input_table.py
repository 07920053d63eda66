"""TABLE: every bad input to the public entry points, one `Row` each.

Over 400 lines because it is data: one row per bad input; the calls they
corrupt are in bad_input_calls, the outcomes in bad_input_outcomes, the
runner in bad_input_suite.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


from conformance.bad_input_calls import (
    BIAS_CFG,
    CAPACITY_CFG,
    D,
    E,
    GEMM_GROUP_SIZES,
    GEMM_N,
    K,
    T,
    astype,
    map_arg,
    map_aux,
    map_param,
    nan_in_chosen_expert,
    replace_args,
    zeros_of,
)
from conformance.bad_input_outcomes import (
    Row,
    all_nan,
    both,
    dispatch_invalid,
    layer_invalid,
    nan_and_count,
    nan_bias_entries,
    nan_rows,
    non_finite_rows,
    raises,
    route_invalid,
    tokens_of_nan_expert,
    tokens_with_bad_ids,
    tokens_with_nan_weight,
    tokens_with_nan_x,
)

_IDS_8_AND_MINUS_3 = lambda ids: ids.at[1, 0].set(8).at[6, 1].set(-3)
_IDS_RANGE_ERROR = (
    r"expert_ids must lie in \[0, num_experts=8\), got values in \[-3, 8\]"
)


# --- The table ----------------------------------------------------------------

TABLE = (
    # route(x [T, D], router [D, E], cfg, correction_bias [E] or None).
    Row(
        "route_x_rank3",
        "route",
        map_arg("x", lambda x: x.reshape(2, 5, D)),
        raises(ValueError, r"x\.shape=\(2, 5, 16\)"),
    ),
    Row(
        "route_x_int",
        "route",
        map_arg("x", astype(jnp.int32)),
        raises(TypeError, r"\bx\b.*int32"),
    ),
    Row(
        "route_x_str",
        "route",
        replace_args(x="tokens"),
        raises(TypeError, r"\bx\b.*str"),
    ),
    Row(
        "route_router_wrong_shape",
        "route",
        map_arg("router", zeros_of((D, 7))),
        raises(ValueError, r"router.*\(16, 7\)"),
    ),
    Row(
        "route_router_bool",
        "route",
        map_arg("router", astype(jnp.bool_)),
        raises(TypeError, r"router.*bool"),
    ),
    Row(
        "route_correction_bias_missing",
        "route",
        replace_args(correction_bias=None),
        raises(ValueError, r"correction_bias.*None"),
        cfg=BIAS_CFG,
    ),
    Row(
        "route_correction_bias_unused",
        "route",
        replace_args(correction_bias=jnp.zeros((E,), jnp.float32)),
        raises(ValueError, r"cfg\.correction_bias=False"),
    ),
    Row(
        "route_correction_bias_wrong_shape",
        "route",
        map_arg("correction_bias", lambda b: b[:1]),
        raises(ValueError, r"correction_bias.*\(1,\)"),
        cfg=BIAS_CFG,
    ),
    Row(
        "route_cfg_not_a_config",
        "route",
        replace_args(cfg={"num_experts": E}),
        raises(TypeError, r"cfg.*dict"),
    ),
    Row(
        "route_x_nan_token",
        "route",
        map_arg("x", lambda x: x.at[3].set(jnp.nan)),
        nan_and_count(route_invalid),
    ),
    Row(
        "route_x_inf_entry",
        "route",
        map_arg("x", lambda x: x.at[6, 2].set(jnp.inf)),
        nan_and_count(route_invalid),
    ),
    Row(
        "route_router_nan",
        "route",
        map_arg("router", lambda r: r.at[5, 2].set(jnp.nan)),
        nan_and_count(route_invalid),
    ),
    # Today: finite output, every token sent to the same experts.
    Row(
        "route_correction_bias_nan",
        "route",
        map_arg("correction_bias", lambda b: b.at[2].set(jnp.nan)),
        nan_and_count(route_invalid),
        cfg=BIAS_CFG,
    ),
    Row(
        "route_x_nan_token_with_capacity",
        "route",
        map_arg("x", lambda x: x.at[3].set(jnp.nan)),
        nan_and_count(route_invalid),
        cfg=CAPACITY_CFG,
    ),
    # dispatch(x [T, D], expert_ids [T, K], num_experts, kept [T, K] or None).
    # Today, under jit: sum(group_sizes) is 19 of 20.
    Row(
        "dispatch_expert_ids_out_of_range",
        "dispatch",
        map_arg("expert_ids", _IDS_8_AND_MINUS_3),
        nan_and_count(dispatch_invalid, _IDS_RANGE_ERROR),
    ),
    Row(
        "dispatch_expert_ids_out_of_range_with_drops",
        "dispatch",
        map_arg("expert_ids", _IDS_8_AND_MINUS_3),
        nan_and_count(dispatch_invalid, _IDS_RANGE_ERROR),
        cfg=CAPACITY_CFG,
    ),
    Row(
        "dispatch_expert_ids_float",
        "dispatch",
        map_arg("expert_ids", astype(jnp.float32)),
        raises(TypeError, r"expert_ids.*float32"),
    ),
    Row(
        "dispatch_expert_ids_rank1",
        "dispatch",
        map_arg("expert_ids", lambda ids: ids.reshape(-1)),
        raises(ValueError, r"expert_ids.*\(20,\)"),
    ),
    Row(
        "dispatch_expert_ids_of_other_tokens",
        "dispatch",
        map_arg("expert_ids", lambda ids: ids[:9]),
        raises(ValueError, r"expert_ids\.shape=\(9, 2\)"),
    ),
    Row(
        "dispatch_x_int",
        "dispatch",
        map_arg("x", astype(jnp.int32)),
        raises(TypeError, r"\bx\b.*int32"),
    ),
    Row(
        "dispatch_num_experts_bool",
        "dispatch",
        replace_args(num_experts=True),
        raises(ValueError, r"num_experts must .*got True"),
    ),
    Row(
        "dispatch_num_experts_float",
        "dispatch",
        replace_args(num_experts=8.0),
        raises(ValueError, r"num_experts.*8\.0"),
    ),
    Row(
        "dispatch_kept_int",
        "dispatch",
        map_arg("kept", astype(jnp.int32)),
        raises(TypeError, r"kept.*int32"),
        cfg=CAPACITY_CFG,
    ),
    Row(
        "dispatch_kept_wrong_shape",
        "dispatch",
        map_arg("kept", lambda kept: kept[:, :1]),
        raises(ValueError, r"kept.*10, 1"),
        cfg=CAPACITY_CFG,
    ),
    # Backend.dispatch(x, aux, cfg).
    Row(
        "backend_dispatch_expert_ids_out_of_range",
        "backend.dispatch",
        map_aux(expert_ids=_IDS_8_AND_MINUS_3),
        nan_and_count(dispatch_invalid, _IDS_RANGE_ERROR),
    ),
    Row(
        "backend_dispatch_aux_not_an_aux",
        "backend.dispatch",
        map_arg("aux", lambda aux: dict(expert_ids=aux.expert_ids)),
        raises(TypeError, r"aux.*dict"),
    ),
    # combine(expert_out [M, D], dispatched, combine_weights [T, K], kept).
    # Today: no error, an output of shape (2, 16).
    Row(
        "combine_weights_transposed",
        "combine",
        map_arg("combine_weights", lambda w: w.T),
        raises(ValueError, r"combine_weights.*\(2, 10\)"),
    ),
    Row(
        "combine_expert_out_of_other_rows",
        "combine",
        map_arg("expert_out", lambda out: out[:19]),
        raises(ValueError, r"expert_out\.shape=\(19, 16\)"),
    ),
    Row(
        "combine_weights_wrong_shape",
        "combine",
        map_arg("combine_weights", zeros_of((T, 3))),
        raises(ValueError, r"combine_weights\.shape=\(10, 3\)"),
    ),
    Row(
        "combine_expert_out_int",
        "combine",
        map_arg("expert_out", astype(jnp.int32)),
        raises(TypeError, r"expert_out.*int32"),
    ),
    Row(
        "combine_weights_bool",
        "combine",
        map_arg("combine_weights", astype(jnp.bool_)),
        raises(TypeError, r"combine_weights.*bool"),
    ),
    Row(
        "combine_dispatched_not_dispatched",
        "combine",
        map_arg("dispatched", lambda d: (d.rows, d.group_sizes)),
        raises(TypeError, r"dispatched.*tuple"),
    ),
    Row(
        "combine_weight_nan",
        "combine",
        map_arg("combine_weights", lambda w: w.at[4, 1].set(jnp.nan)),
        nan_and_count(nan_rows(tokens_with_nan_weight)),
    ),
    # Backend.combine(expert_out, dispatched, aux, cfg).
    Row(
        "backend_combine_weights_transposed",
        "backend.combine",
        map_aux(combine_weights=lambda w: w.T),
        raises(ValueError, r"combine_weights.*\(2, 10\)"),
    ),
    # Backend.grouped_gemm(rows [M, C], weights [G, C, N], group_sizes [G]).
    Row(
        "gemm_rows_rank3",
        "grouped_gemm",
        map_arg("rows", lambda r: r[None]),
        raises(ValueError, r"rows.*\(1, 28, 16\)"),
    ),
    Row(
        "gemm_rows_int",
        "grouped_gemm",
        map_arg("rows", astype(jnp.int32)),
        raises(TypeError, r"rows.*int32"),
    ),
    Row(
        "gemm_rows_bool_scalar",
        "grouped_gemm",
        replace_args(rows=True),
        raises(TypeError, r"rows.*bool"),
    ),
    Row(
        "gemm_weights_rank2",
        "grouped_gemm",
        map_arg("weights", lambda w: w[0]),
        raises(ValueError, r"weights.*\(16, 8\)"),
    ),
    Row(
        "gemm_weights_wrong_contraction",
        "grouped_gemm",
        map_arg("weights", zeros_of((4, 15, GEMM_N))),
        raises(ValueError, r"weights.*\(4, 15, 8\)"),
    ),
    Row(
        "gemm_weights_not_transposed",
        "grouped_gemm",
        replace_args(transpose_rhs=True),
        raises(ValueError, r"weights.*\(4, 16, 8\)"),
    ),
    Row(
        "gemm_weights_bfloat16",
        "grouped_gemm",
        map_arg("weights", astype(jnp.bfloat16)),
        raises(TypeError, r"weights.*bfloat16"),
    ),
    Row(
        "gemm_group_sizes_float",
        "grouped_gemm",
        map_arg("group_sizes", astype(jnp.float32)),
        raises(TypeError, r"group_sizes.*float32"),
    ),
    Row(
        "gemm_group_sizes_wrong_length",
        "grouped_gemm",
        map_arg("group_sizes", lambda g: g[:3]),
        raises(ValueError, r"group_sizes.*\(3,\)"),
    ),
    Row(
        "gemm_group_sizes_list",
        "grouped_gemm",
        replace_args(group_sizes=list(GEMM_GROUP_SIZES)),
        raises(TypeError, r"group_sizes.*list"),
    ),
    Row(
        "gemm_out_dtype_int",
        "grouped_gemm",
        replace_args(out_dtype=jnp.int32),
        raises(TypeError, r"out_dtype.*int32"),
    ),
    Row(
        "gemm_out_dtype_not_a_dtype",
        "grouped_gemm",
        replace_args(out_dtype="fast"),
        raises(TypeError, r"out_dtype.*fast"),
    ),
    # Today, under jit: the backends disagree.
    Row(
        "gemm_group_sizes_negative",
        "grouped_gemm_vjp",
        replace_args(group_sizes=jnp.asarray([-4, 10, 10, 8], jnp.int32)),
        nan_and_count(
            all_nan, r"group_sizes must be >= 0, got \[-4, 10, 10, 8\]"
        ),
    ),
    Row(
        "gemm_group_sizes_past_the_rows",
        "grouped_gemm_vjp",
        replace_args(group_sizes=jnp.asarray([4, 10, 10, 8], jnp.int32)),
        nan_and_count(
            all_nan, r"sum\(group_sizes\) must be <= the 28 rows, got sum=32"
        ),
    ),
    # Backend.expert_ffn(rows [M, D], group_sizes [E], params, cfg).
    # Today: pallas gives a finite result.
    Row(
        "ffn_w_up_narrower_than_w_gate",
        "expert_ffn",
        map_param("w_up", zeros_of((E, D, 4))),
        raises(ValueError, r"w_up.*\(8, 16, 4\)"),
    ),
    Row(
        "ffn_w_down_mismatched",
        "expert_ffn",
        map_param("w_down", zeros_of((E, 4, D))),
        raises(ValueError, r"w_down.*\(8, 4, 16\)"),
    ),
    Row(
        "ffn_w_down_missing",
        "expert_ffn",
        map_param("w_down", lambda w: None),
        raises(ValueError, r"w_down"),
    ),
    Row(
        "ffn_w_gate_int",
        "expert_ffn",
        map_param("w_gate", astype(jnp.int32)),
        raises(TypeError, r"w_gate.*int32"),
    ),
    Row(
        "ffn_rows_wrong_width",
        "expert_ffn",
        map_arg("rows", zeros_of((T * K, 12))),
        raises(ValueError, r"rows\.shape=\(20, 12\)"),
    ),
    Row(
        "ffn_rows_int",
        "expert_ffn",
        map_arg("rows", astype(jnp.int32)),
        raises(TypeError, r"rows.*int32"),
    ),
    Row(
        "ffn_params_not_a_dict",
        "expert_ffn",
        map_arg("params", lambda p: tuple(p.values())),
        raises(TypeError, r"params.*tuple"),
    ),
    Row(
        "ffn_cfg_not_a_config",
        "expert_ffn",
        replace_args(cfg="cfg"),
        raises(TypeError, r"cfg.*str"),
    ),
    Row(
        "ffn_group_sizes_negative",
        "expert_ffn_vjp",
        replace_args(
            group_sizes=jnp.asarray([-4, 6, 2, 4, 0, 5, 2, 3], jnp.int32)
        ),
        nan_and_count(
            all_nan,
            r"group_sizes must be >= 0, got \[-4, 6, 2, 4, 0, 5, 2, 3\]",
        ),
    ),
    Row(
        "ffn_group_sizes_past_the_rows",
        "expert_ffn_vjp",
        replace_args(
            group_sizes=jnp.asarray([4, 3, 1, 4, 0, 5, 2, 3], jnp.int32)
        ),
        nan_and_count(
            all_nan, r"sum\(group_sizes\) must be <= the 20 rows, got sum=22"
        ),
    ),
    # Backend.routed_experts(params, x [T, D], aux, cfg).
    # Today, under jit: token 3's output is 0.
    Row(
        "routed_experts_expert_ids_out_of_range",
        "routed_experts",
        map_aux(expert_ids=lambda ids: ids.at[3].set(99)),
        nan_and_count(
            nan_rows(tokens_with_bad_ids),
            r"expert_ids must lie in \[0, num_experts=8\), got values in "
            r"\[\d+, 99\]",
        ),
    ),
    Row(
        "routed_experts_routing_of_other_tokens",
        "routed_experts",
        map_arg("x", lambda x: x[:9]),
        raises(ValueError, r"expert_ids.*\(10, 2\)"),
    ),
    Row(
        "routed_experts_w_up_missing",
        "routed_experts",
        map_param("w_up", lambda w: None),
        raises(ValueError, r"w_up"),
    ),
    Row(
        "routed_experts_w_down_mismatched",
        "routed_experts",
        map_param("w_down", zeros_of((E, D, D))),
        raises(ValueError, r"w_down.*\(8, 16, 16\)"),
    ),
    Row(
        "routed_experts_aux_not_an_aux",
        "routed_experts",
        map_arg("aux", lambda aux: dict(expert_ids=aux.expert_ids)),
        raises(TypeError, r"aux.*dict"),
    ),
    Row(
        "routed_experts_expert_ids_float",
        "routed_experts",
        map_aux(expert_ids=astype(jnp.float32)),
        raises(TypeError, r"expert_ids.*float32"),
    ),
    Row(
        "routed_experts_x_int",
        "routed_experts",
        map_arg("x", astype(jnp.int32)),
        raises(TypeError, r"\bx\b.*int32"),
    ),
    Row(
        "routed_experts_x_nan_token",
        "routed_experts",
        map_arg("x", lambda x: x.at[3].set(jnp.nan)),
        nan_and_count(nan_rows(tokens_with_nan_x)),
    ),
    Row(
        "routed_experts_w_gate_nan",
        "routed_experts",
        nan_in_chosen_expert,
        nan_and_count(non_finite_rows(tokens_of_nan_expert)),
    ),
    # moe_layer(params, x, cfg, backend).
    Row(
        "layer_x_nan_token",
        "moe_layer",
        map_arg("x", lambda x: x.at[3].set(jnp.nan)),
        nan_and_count(both(nan_rows(tokens_with_nan_x), layer_invalid)),
    ),
    Row(
        "layer_router_nan",
        "moe_layer",
        map_param("router", lambda r: r.at[5, 2].set(jnp.nan)),
        nan_and_count(
            both(non_finite_rows(lambda bad: np.ones(T, bool)), layer_invalid)
        ),
    ),
    Row(
        "layer_extra_parameter",
        "moe_layer",
        map_param("shared_gate", zeros_of((D, 1))),
        raises(ValueError, r"shared_gate"),
    ),
    Row(
        "layer_cfg_not_a_config",
        "moe_layer",
        replace_args(cfg=None),
        raises(TypeError, r"cfg.*None"),
    ),
    # update_correction_bias(correction_bias [E], tokens_per_expert [E], rate).
    # Today: accepted.
    Row(
        "update_bias_rate_nan",
        "update_correction_bias",
        replace_args(rate=math.nan),
        raises(ValueError, r"rate.*nan"),
    ),
    Row(
        "update_bias_rate_inf",
        "update_correction_bias",
        replace_args(rate=math.inf),
        raises(ValueError, r"rate.*inf"),
    ),
    Row(
        "update_bias_rate_negative",
        "update_correction_bias",
        replace_args(rate=-1e-3),
        raises(ValueError, r"rate.*-0\.001"),
    ),
    Row(
        "update_bias_rate_array_nan",
        "update_correction_bias",
        replace_args(rate=jnp.asarray(jnp.nan, jnp.float32)),
        nan_and_count(all_nan, r"rate.*nan"),
        setting=replace_args(rate=jnp.asarray(1e-3, jnp.float32)),
    ),
    Row(
        "update_bias_tokens_per_expert_negative",
        "update_correction_bias",
        map_arg("tokens_per_expert", lambda n: n.at[2].set(-1)),
        nan_and_count(all_nan, r"tokens_per_expert.*-1"),
    ),
    Row(
        "update_bias_tokens_per_expert_nan",
        "update_correction_bias",
        map_arg(
            "tokens_per_expert",
            lambda n: n.astype(jnp.float32).at[2].set(jnp.nan),
        ),
        nan_and_count(all_nan, r"tokens_per_expert.*nan"),
    ),
    Row(
        "update_bias_correction_bias_nan",
        "update_correction_bias",
        map_arg("correction_bias", lambda b: b.at[1].set(jnp.nan)),
        nan_and_count(nan_rows(nan_bias_entries)),
    ),
    Row(
        "update_bias_correction_bias_rank2",
        "update_correction_bias",
        map_arg("correction_bias", lambda b: b[None]),
        raises(ValueError, r"correction_bias.*\(1, 8\)"),
    ),
    Row(
        "update_bias_tokens_per_expert_wrong_length",
        "update_correction_bias",
        map_arg("tokens_per_expert", lambda n: n[:7]),
        raises(ValueError, r"tokens_per_expert.*\(7,\)"),
    ),
    Row(
        "update_bias_correction_bias_int",
        "update_correction_bias",
        map_arg("correction_bias", astype(jnp.int32)),
        raises(TypeError, r"correction_bias.*int32"),
    ),
    Row(
        "update_bias_correction_bias_str",
        "update_correction_bias",
        replace_args(correction_bias="bias"),
        raises(TypeError, r"correction_bias.*str"),
    ),
    # init_params(key, cfg, dtype).
    Row(
        "init_params_key_int",
        "init_params",
        replace_args(key=0),
        raises(TypeError, r"key.*int"),
    ),
    Row(
        "init_params_key_float",
        "init_params",
        replace_args(key=jnp.zeros((2,), jnp.float32)),
        raises(TypeError, r"key.*float32"),
    ),
    Row(
        "init_params_key_str",
        "init_params",
        replace_args(key="seed"),
        raises(TypeError, r"key.*str"),
    ),
    Row(
        "init_params_key_batch",
        "init_params",
        map_arg("key", lambda key: jax.random.split(key, 3)),
        raises(ValueError, r"key.*\(3,\)"),
    ),
    Row(
        "init_params_cfg_not_a_config",
        "init_params",
        replace_args(cfg={"num_experts": E}),
        raises(TypeError, r"cfg.*dict"),
    ),
    Row(
        "init_params_dtype_int",
        "init_params",
        replace_args(dtype=jnp.int32),
        raises(TypeError, r"dtype.*int32"),
    ),
    # param_shapes(cfg).
    Row(
        "param_shapes_cfg_dict",
        "param_shapes",
        replace_args(cfg={"num_experts": E}),
        raises(TypeError, r"cfg.*dict"),
    ),
    Row(
        "param_shapes_cfg_none",
        "param_shapes",
        replace_args(cfg=None),
        raises(TypeError, r"cfg.*None"),
    ),
    # MoEConfig(**fields).
    Row(
        "config_num_experts_negative",
        "MoEConfig",
        replace_args(num_experts=-8),
        raises(ValueError, r"num_experts.*-8"),
    ),
    Row(
        "config_top_k_zero",
        "MoEConfig",
        replace_args(top_k=0),
        raises(ValueError, r"top_k.*got 0"),
    ),
    Row(
        "config_hidden_size_bool",
        "MoEConfig",
        replace_args(hidden_size=True),
        raises(ValueError, r"hidden_size.*True"),
    ),
    Row(
        "config_expert_ffn_size_float",
        "MoEConfig",
        replace_args(expert_ffn_size=8.0),
        raises(ValueError, r"expert_ffn_size.*8\.0"),
    ),
    Row(
        "config_shared_ffn_size_negative",
        "MoEConfig",
        replace_args(shared_ffn_size=-1),
        raises(ValueError, r"shared_ffn_size.*-1"),
    ),
    Row(
        "config_top_k_above_num_experts",
        "MoEConfig",
        replace_args(top_k=9),
        raises(ValueError, r"top_k=9"),
    ),
    Row(
        "config_norm_epsilon_nan",
        "MoEConfig",
        replace_args(norm_epsilon=math.nan),
        raises(ValueError, r"norm_epsilon.*nan"),
    ),
    Row(
        "config_norm_epsilon_inf",
        "MoEConfig",
        replace_args(norm_epsilon=math.inf),
        raises(ValueError, r"norm_epsilon.*inf"),
    ),
    Row(
        "config_routed_scaling_factor_nan",
        "MoEConfig",
        replace_args(routed_scaling_factor=math.nan),
        raises(ValueError, r"routed_scaling_factor.*nan"),
    ),
    Row(
        "config_capacity_factor_inf",
        "MoEConfig",
        replace_args(capacity_factor=math.inf),
        raises(ValueError, r"capacity_factor.*inf"),
    ),
    Row(
        "config_capacity_factor_bool",
        "MoEConfig",
        replace_args(capacity_factor=True),
        raises(ValueError, r"capacity_factor.*True"),
    ),
    Row(
        "config_score_func_unknown",
        "MoEConfig",
        replace_args(score_func="relu"),
        raises(ValueError, r"score_func.*relu"),
    ),
    Row(
        "config_unknown_field",
        "MoEConfig",
        replace_args(num_expert=E),
        raises(TypeError, r"\bnum_expert\b"),
    ),
)
