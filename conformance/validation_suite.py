"""ValidationSuite: bad input fails early, naming the argument and its value."""

from __future__ import annotations

import re

from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np

import moe_core
from conformance import base

# Every optional parameter enabled, so that each name can be broken.
_FULL_CFG = moe_core.MoEConfig(
    num_experts=4,
    top_k=2,
    hidden_size=16,
    expert_ffn_size=24,
    correction_bias=True,
    shared_ffn_size=8,
    shared_expert_gate=True,
)
_PARAM_NAMES = tuple(moe_core.param_shapes(_FULL_CFG))
_NO_BIAS_CFG = _FULL_CFG.replace(correction_bias=False)


def _params(cfg):
  return {
      n: jnp.zeros(s, jnp.float32)
      for n, s in moe_core.param_shapes(cfg).items()
  }


def _tokens(cfg, num_tokens=5):
  return jnp.ones((num_tokens, cfg.hidden_size), jnp.float32)


def _int32(*values):
  return jnp.array(values, jnp.int32)


# A config change that breaks one rule, and its ValueError's message.
_BAD_CONFIGS = (
    (
        "top_k_above_num_experts",
        dict(top_k=5),
        "top_k must be <= num_experts, got top_k=5, num_experts=4",
    ),
    (
        "n_group_not_dividing_experts",
        dict(n_group=3),
        "n_group must divide num_experts, got n_group=3, num_experts=4",
    ),
    (
        "topk_group_above_n_group",
        dict(n_group=2, topk_group=3),
        "topk_group must be <= n_group, got topk_group=3, n_group=2",
    ),
    (
        "sum_top2_with_one_expert_per_group",
        dict(n_group=4, topk_group=2, group_score="sum_top2"),
        "group_score='sum_top2' needs at least 2 experts per group, "
        "got num_experts=4 / n_group=4 = 1",
    ),
)

# Grouped GEMM arguments that break one rule (the others are
# ValidationSuite._gemm's defaults), built when the test runs: the error and
# its message.
_BAD_GEMMS = (
    (
        "float_group_sizes",
        TypeError,
        "group_sizes must be an integer (int32) array, got dtype float32",
        lambda: dict(group_sizes=jnp.array([1.0, 2.0, 0.0, 3.0], jnp.float32)),
    ),
    (
        "group_sizes_of_wrong_length",
        ValueError,
        "group_sizes must have shape (4,) (one size per group), "
        "got group_sizes.shape=(3,)",
        lambda: dict(group_sizes=_int32(1, 2, 3)),
    ),
    (
        "mixed_dtypes",
        TypeError,
        "grouped_gemm needs rows and weights of one dtype, "
        "got rows float32, weights bfloat16",
        lambda: dict(weights=jnp.ones((4, 8, 3), jnp.bfloat16)),
    ),
    (
        "group_sizes_past_the_rows",
        ValueError,
        "sum(group_sizes) must be <= the 6 rows, "
        "got sum=7 (group_sizes=[1, 2, 1, 3])",
        lambda: dict(group_sizes=_int32(1, 2, 1, 3)),
    ),
    (
        "negative_group_sizes",
        ValueError,
        "group_sizes must be >= 0, got [2, -1, 2, 3]",
        lambda: dict(group_sizes=_int32(2, -1, 2, 3)),
    ),
)


class ValidationSuite(base.BackendTestCase):
  """Each check pinned by its message, through this backend's entry points."""

  def _raises(self, error: type[Exception], message: str):
    """assertRaisesRegex of `message` as written: not a regular expression."""
    return self.assertRaisesRegex(error, re.escape(message))

  def _layer(self, params, x, cfg, backend=None):
    return moe_core.moe_layer(params, x, cfg, backend=backend or self.backend)

  # --- The layer ---------------------------------------------------------

  def test_layer_rejects_wrong_hidden_size(self):
    x = jnp.ones((5, 12), jnp.float32)
    with self._raises(
        ValueError,
        "x must have shape [..., hidden_size=16], got x.shape=(5, 12)",
    ):
      self._layer(_params(_FULL_CFG), x, _FULL_CFG)

  def test_layer_rejects_integer_tokens(self):
    x = jnp.ones((5, 16), jnp.int32)
    with self._raises(TypeError, "x must be floating point, got dtype int32"):
      self._layer(_params(_FULL_CFG), x, _FULL_CFG)

  @parameterized.named_parameters([(n, n) for n in _PARAM_NAMES])
  def test_layer_rejects_wrong_parameter_shape(self, name):
    params = _params(_FULL_CFG)
    shape = moe_core.param_shapes(_FULL_CFG)[name]
    bad = shape[:-1] + (shape[-1] + 1,)
    params[name] = jnp.zeros(bad, jnp.float32)
    with self._raises(
        ValueError, f"params[{name!r}] must have shape {shape}, got {bad}"
    ):
      self._layer(params, _tokens(_FULL_CFG), _FULL_CFG)

  def test_layer_rejects_missing_parameter(self):
    params = _params(_FULL_CFG)
    del params["w_down"]
    with self._raises(
        ValueError, "params is missing ['w_down'] for this config"
    ):
      self._layer(params, _tokens(_FULL_CFG), _FULL_CFG)

  def test_layer_rejects_extra_parameter(self):
    cfg = _NO_BIAS_CFG
    params = _params(_FULL_CFG)  # Still holds a correction_bias.
    with self._raises(
        ValueError,
        "params has keys ['correction_bias'] that this config does not use",
    ):
      self._layer(params, _tokens(cfg), cfg)

  def test_unknown_backend_lists_valid_names(self):
    names = ["auto"] + moe_core.registered_backends()
    message = f"unknown MoE backend 'no_such_backend'; valid names: {names}"
    with self._raises(ValueError, message):
      moe_core.get_backend("no_such_backend")
    with self._raises(ValueError, message):
      self._layer(
          _params(_FULL_CFG),
          _tokens(_FULL_CFG),
          _FULL_CFG,
          backend="no_such_backend",
      )

  # --- The config ----------------------------------------------------------

  @parameterized.named_parameters(*_BAD_CONFIGS)
  def test_config_rejects(self, changes, message):
    with self._raises(ValueError, message):
      _FULL_CFG.replace(**changes)

  # --- The grouped GEMM ------------------------------------------------------

  def _gemm(self, rows=None, weights=None, group_sizes=None, **kwargs):
    rows = jnp.ones((6, 8), jnp.float32) if rows is None else rows
    weights = jnp.ones((4, 8, 3), jnp.float32) if weights is None else weights
    group_sizes = (
        jnp.array([1, 2, 0, 3], jnp.int32)
        if group_sizes is None
        else group_sizes
    )
    return self.backend.grouped_gemm(rows, weights, group_sizes, **kwargs)

  def test_grouped_gemm_accepts_the_defaults_of_these_tests(self):
    self.skip_unless_computes("float32")
    out = self._gemm()  # So that each rejection below has one cause.
    np.testing.assert_array_equal(out, np.full((6, 3), 8.0, np.float32))

  @parameterized.named_parameters(*_BAD_GEMMS)
  def test_grouped_gemm_rejects(self, error, message, bad_arguments):
    with self._raises(error, message):
      self._gemm(**bad_arguments())

  def test_grouped_gemm_rejects_mismatched_contraction(self):
    with self._raises(
        ValueError,
        "weights [E, C, N] must contract over rows' C=8, "
        "got rows.shape=(6, 8), weights.shape=(4, 7, 3)",
    ):
      self._gemm(weights=jnp.ones((4, 7, 3), jnp.float32))
    with self._raises(
        ValueError, "weights [E, N, C] must contract over rows' C=8"
    ):
      self._gemm(transpose_rhs=True)

  # --- The stages ----------------------------------------------------------
  # Public on their own, so each checks what it is given: an expert id out of
  # range, say, would fall outside every group and lose its token silently.

  def test_route_rejects_router_of_wrong_shape(self):
    cfg = _NO_BIAS_CFG
    with self._raises(
        ValueError, "router must have shape (16, 4), got router.shape=(16, 5)"
    ):
      moe_core.route(_tokens(cfg), jnp.zeros((16, 5), jnp.float32), cfg)

  def test_route_rejects_correction_bias_of_wrong_shape(self):
    with self._raises(
        ValueError,
        "correction_bias must have shape (4,), got correction_bias.shape=(1,)",
    ):
      moe_core.route(
          _tokens(_FULL_CFG),
          jnp.zeros((16, 4), jnp.float32),
          _FULL_CFG,
          jnp.zeros((1,), jnp.float32),
      )

  def test_route_rejects_unflattened_tokens(self):
    cfg = _NO_BIAS_CFG
    with self._raises(
        ValueError, "route needs tokens of shape [T, D], got x.shape=(2, 5, 16)"
    ):
      moe_core.route(
          jnp.ones((2, 5, 16), jnp.float32),
          jnp.zeros((16, 4), jnp.float32),
          cfg,
      )

  def test_dispatch_rejects_expert_ids_out_of_range(self):
    ids = jnp.array([[0, 1], [2, 4], [3, 0]], jnp.int32)
    with self._raises(
        ValueError,
        "expert_ids must lie in [0, num_experts=4), got values in [0, 4]",
    ):
      moe_core.dispatch(_tokens(_FULL_CFG, 3), ids, 4)
    with self._raises(ValueError, "got values in [-1, 3]"):
      moe_core.dispatch(_tokens(_FULL_CFG, 3), ids.at[1, 1].set(-1), 4)

  def test_dispatch_rejects_a_token_count_mismatch(self):
    ids = jnp.zeros((4, 2), jnp.int32)
    with self._raises(
        ValueError,
        "dispatch needs one expert_ids row per token, got x.shape=(3, 16), "
        "expert_ids.shape=(4, 2)",
    ):
      moe_core.dispatch(_tokens(_FULL_CFG, 3), ids, 4)

  def test_dispatch_rejects_float_expert_ids(self):
    with self._raises(
        TypeError,
        "expert_ids must be an integer (int32) array, got dtype float32",
    ):
      moe_core.dispatch(_tokens(_FULL_CFG, 3), jnp.zeros((3, 2)), 4)

  def test_combine_rejects_rows_that_were_not_dispatched(self):
    x = _tokens(_FULL_CFG, 3)
    d = moe_core.dispatch(x, jnp.array([[0, 1], [2, 3], [3, 0]], jnp.int32), 4)
    weights = jnp.ones((3, 2), jnp.float32)
    with self._raises(
        ValueError,
        "expert_out must have the dispatched M=6 rows, "
        "got expert_out.shape=(5, 16)",
    ):
      moe_core.combine(jnp.ones((5, 16), jnp.float32), d, weights)
    with self._raises(
        ValueError,
        "combine_weights must have the dispatched shape [T, K]=(3, 2), "
        "got combine_weights.shape=(3, 3)",
    ):
      moe_core.combine(d.rows, d, jnp.ones((3, 3), jnp.float32))
    # [K, T] has the right T*K but the wrong layout.
    with self._raises(
        ValueError,
        "combine_weights must have the dispatched shape [T, K]=(3, 2), "
        "got combine_weights.shape=(2, 3)",
    ):
      moe_core.combine(d.rows, d, weights.T)

  def _expert_ffn(self, rows=None, group_sizes=None):
    rows = jnp.ones((6, 16), jnp.float32) if rows is None else rows
    group_sizes = (
        jnp.array([1, 2, 0, 3], jnp.int32)
        if group_sizes is None
        else group_sizes
    )
    return self.backend.expert_ffn(
        rows, group_sizes, _params(_FULL_CFG), _FULL_CFG
    )

  def test_expert_ffn_accepts_the_defaults_of_these_tests(self):
    self.skip_unless_computes("float32")
    out = self._expert_ffn()  # Zero weights: zero output, one cause below.
    np.testing.assert_array_equal(out, np.zeros((6, 16), np.float32))

  def test_expert_ffn_rejects_rows_of_wrong_width(self):
    with self._raises(
        ValueError,
        "rows must have shape [M, hidden_size=16], got rows.shape=(6, 12)",
    ):
      self._expert_ffn(rows=jnp.ones((6, 12), jnp.float32))

  def test_expert_ffn_rejects_group_sizes_past_the_rows(self):
    with self._raises(
        ValueError, "sum(group_sizes) must be <= the 6 rows, got sum=9"
    ):
      self._expert_ffn(group_sizes=jnp.array([4, 2, 0, 3], jnp.int32))

  def test_routed_experts_rejects_routing_of_other_tokens(self):
    cfg = _NO_BIAS_CFG
    params = _params(cfg)
    aux = moe_core.route(_tokens(cfg, 5), params["router"], cfg)
    with self._raises(
        ValueError, "expert_ids must have shape [T, K]=(4, 2), got (5, 2)"
    ):
      self.backend.routed_experts(params, _tokens(cfg, 4), aux, cfg)
