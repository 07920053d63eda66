"""LayerSuite: moe_core.moe_layer on shapes that break kernels."""

from __future__ import annotations

from absl.testing import parameterized
import jax
import numpy as np

from conformance import base
from conformance import cases
from conformance import oracles
from conformance import tolerances


def _named(case_list):
  return parameterized.named_parameters(cases.named(case_list))


class LayerSuite(base.BackendTestCase):
  """The whole layer, forward and backward, against the reference and math."""

  @_named(cases.LAYER_CASES)
  def test_forward_matches_reference(self, case):
    # y's shape and dtype: assertMatchesPerTokenMath, which every backend runs.
    self.skip_if_oracle()
    self.assertYMatchesReference(case, self.run_layer(case))

  @_named(cases.LAYER_CASES)
  def test_dropless_output_is_weighted_sum_of_chosen_experts(self, case):
    got = self.run_layer(case)
    t, k = case.num_tokens, case.cfg.top_k
    self.assertEqual(int(got.aux["tokens_per_expert"].sum()), t * k)
    self.assertEqual(int(got.aux["dropped_tokens"]), 0)
    self.assertTrue(got.aux["kept"].all())
    self.assertMatchesPerTokenMath(case, got)

  @_named(cases.LAYER_CASES)
  def test_aux_fields_match_contract_and_reference(self, case):
    self.assertAuxMatchesReference(case, self.run_layer(case))

  # The variants of the router (cases.ROUTING_VARIANTS) and of the expert
  # FFN (cases.FFN_VARIANTS) make the same two claims.
  @_named(cases.ROUTING_VARIANTS + cases.FFN_VARIANTS)
  def test_variant_matches_reference(self, case):
    self.skip_if_shared_router_variant(case)
    self.assertLayerMatchesReference(case)

  @_named(cases.ROUTING_VARIANTS + cases.FFN_VARIANTS)
  def test_variant_matches_per_token_math(self, case):
    # Every backend, the oracle included, against the numpy formulas of
    # conformance/oracles.py (the router's choice and weights; activation,
    # clamp, biases, weights on input), all tokens kept.
    self.skip_if_shared_router_variant(case)
    self.assertDroplessMatchesPerTokenMath(case)

  @_named(cases.LAYER_GRAD_CASES)
  def test_gradients_match_reference(self, case):
    self.skip_if_shared_router_variant(case)
    params, x, _ = cases.layer_inputs(case)
    precision = tolerances.clamp_gradient_precision(case.cfg, case.dtype)
    if precision and not self.is_oracle():
      self.skip_unless_computes(case.dtype)
      with jax.default_matmul_precision(precision):
        # Traced here, not taken from the cache of runs at the default.
        got = base.compute_layer(self.backend, case, jit=case.jit).grads
    else:
      got = self.run_layer(case).grads
    self.assertEqual(sorted(got), sorted(list(params) + ["x"]))
    # The oracle's own gradients would be compared with themselves: for it,
    # only names, dtypes and the zero bias gradient are checked here (the
    # values: reference/gradient_check_test.py, by finite differences).
    want = None if self.is_oracle() else base.reference_layer(case).grads
    for name in sorted(got):
      with self.subTest(name):
        self.assertEqual(
            got[name].dtype, dict(params, x=x)[name].dtype, f"d {name} dtype"
        )
        if name == "correction_bias":  # Steers selection only.
          self.assertAllZero(got[name], msg="d correction_bias")
        elif want is not None:
          self.assertClose(
              got[name],
              want[name],
              case.dtype,
              "gradient",
              msg=f"d {name} vs reference",
          )

  @parameterized.named_parameters(
      ("shared_gated", "base_f32"), ("latent_shared", "ffn_latent_relu2_shared")
  )
  def test_float32_at_highest_precision_matches_reference(self, name):
    """Under jax.default_matmul_precision("highest") the float32 layer and
    its gradients match the reference to float32 accuracy on every
    platform: the backends' products follow the default matmul precision
    (docs/api.md, "Matmul precision"), the oracle's are HIGHEST always, and
    both run the same transcendentals. The table's row for float32 on a GPU
    or TPU (their default precision) is far looser."""
    self.skip_if_oracle()
    self.skip_unless_computes("float32")
    case = {c.name: c for c in cases.LAYER_CASES + cases.FFN_VARIANTS}[name]
    with jax.default_matmul_precision("highest"):
      # Traced here, not taken from the cache of runs at the default.
      got = base.compute_layer(self.backend, case, jit=True)
    want = base.reference_layer(case)
    for kind, result, oracle in (
        ("forward", {"y": got.y}, {"y": want.y}),
        ("gradient", got.grads, want.grads),
    ):
      tol = tolerances.float32_at_highest(kind, self.TOLERANCE_OVERRIDES)
      for key in sorted(result):
        with self.subTest(f"{kind} {key}"):
          problem = tolerances.violation(result[key], oracle[key], tol)
          self.assertIsNone(problem, f"{key} vs reference: {problem}")

  def test_experts_without_tokens_get_exactly_zero_gradient(self):
    case = cases.LAYER_BY_NAME["experts_without_tokens"]
    got = self.run_layer(case)
    np.testing.assert_array_equal(
        got.aux["tokens_per_expert"][list(case.cold_experts)],
        0,
        "the case should leave its cold experts without tokens",
    )
    for name in ("w_gate", "w_up", "w_down"):
      with self.subTest(name):
        self.assertAllZero(
            got.grads[name][list(case.cold_experts)],
            msg=f"d {name} of experts without tokens",
        )

  def test_hot_expert_takes_every_token(self):
    case = cases.LAYER_BY_NAME["one_expert_takes_all"]
    got = self.run_layer(case)
    hot, e = case.hot_expert, case.cfg.num_experts
    self.assertEqual(case.cfg.top_k, 1)  # So no other expert gets a token.
    np.testing.assert_array_equal(
        got.aux["expert_ids"], hot, "every token should go to the hot expert"
    )
    want_load = np.zeros(e, np.int32)
    want_load[hot] = case.num_tokens
    np.testing.assert_array_equal(got.aux["tokens_per_expert"], want_load)
    others = [i for i in range(e) if i != hot]
    for name in ("w_gate", "w_up", "w_down"):
      with self.subTest(name):
        self.assertAllZero(
            got.grads[name][others],
            msg=f"d {name} of experts other than the hot one",
        )
        self.assertTrue(
            np.any(got.grads[name][hot] != 0),
            f"d {name} of the hot expert should not be zero",
        )

  @_named(cases.CAPACITY_CASES)
  def test_capacity_drops_follow_gshard_priority(self, case):
    got = self.run_layer(case)
    capacity = case.cfg.expert_capacity(case.num_tokens)
    want_kept = oracles.gshard_keep(
        got.aux["expert_ids"], case.cfg.num_experts, capacity
    )
    self.assertGreater(
        int((~want_kept).sum()), 0, "the case should overflow some expert"
    )
    self.assertEqual(int(got.aux["dropped_tokens"]), int((~want_kept).sum()))
    np.testing.assert_array_equal(got.aux["kept"], want_kept)
    self.assertEqual(
        int(got.aux["tokens_per_expert"].sum()),
        case.num_tokens * case.cfg.top_k,
    )
    self.assertAllZero(
        got.aux["combine_weights"][~want_kept],
        msg="combine weights of dropped copies",
    )
    self.assertYMatchesReference(case, got)
    self.assertMatchesPerTokenMath(case, got)

  def test_layer_jit_and_eager_agree(self):
    case = cases.LAYER_BY_NAME["base_f32"]
    # Forward only: op-by-op gradients would cost more than the rest.
    eager = self.run_layer(case, jit=False, grads=False)
    jitted = self.run_layer(case, jit=True)
    self.assertClose(eager.y, jitted.y, case.dtype, msg="y, eager vs jit")
    self.assertClose(
        eager.y,
        base.reference_layer(case).y,
        case.dtype,
        msg="y, eager vs reference",
    )

  def test_layer_results_are_bitwise_deterministic(self):
    case = cases.LAYER_BY_NAME["base_bf16"]
    first = self.run_layer(case)
    y, grads = first.rerun()
    self.assertBitwiseEqual(y, first.y, msg="y")
    for name in sorted(grads):
      with self.subTest(name):
        self.assertBitwiseEqual(grads[name], first.grads[name], msg=f"d {name}")
