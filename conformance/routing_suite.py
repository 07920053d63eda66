"""RoutingSuite: every router option through the layer, and a numpy router."""

from __future__ import annotations

import dataclasses

from absl.testing import parameterized
import numpy as np

from conformance import base
from conformance import cases
from conformance import oracles
from conformance import tolerances


def _named(case_list):
  return parameterized.named_parameters(cases.named(case_list))


class RoutingSuite(base.BackendTestCase):
  """Routing variants end to end; the routing decision against numpy."""

  @_named(cases.ROUTING_VARIANTS)
  def test_variant_matches_reference(self, case):
    got = self.run_layer(case)
    self.assertYMatchesReference(case, got)
    self.assertAuxMatchesReference(case, got)

  @_named(cases.ROUTING_VARIANTS)
  def test_variant_output_is_weighted_sum_of_chosen_experts(self, case):
    got = self.run_layer(case)
    self.assertEqual(int(got.aux["dropped_tokens"]), 0)
    self.assertMatchesPerTokenMath(case, got)

  @_named(cases.LAYER_CASES + cases.ROUTING_VARIANTS + cases.CAPACITY_CASES)
  def test_routing_matches_numpy_router(self, case):
    params, x, _ = cases.layer_inputs(case)
    cfg = case.cfg
    aux = self.run_layer(case).aux
    # Routing is float32 at HIGHEST precision on every platform.
    tol = tolerances.TABLE["float32"]["forward"]

    def check_close(name, got, want):
      problem = tolerances.violation(got, want, tol)
      self.assertIsNone(problem, f"{name} vs numpy: {problem}")

    tokens = oracles.f64(x).reshape(-1, cfg.hidden_size)
    check_close(
        "router_logits",
        aux["router_logits"],
        tokens @ oracles.f64(params["router"]),
    )
    bias = params.get("correction_bias")
    want = oracles.route(aux["router_logits"], cfg, bias)
    np.testing.assert_array_equal(
        aux["expert_ids"], want["expert_ids"], "expert_ids vs numpy router"
    )
    np.testing.assert_array_equal(aux["kept"], want["kept"])
    np.testing.assert_array_equal(
        aux["tokens_per_expert"], want["tokens_per_expert"]
    )
    self.assertEqual(int(aux["dropped_tokens"]), want["dropped_tokens"])
    # Finite inputs: nothing is invalid (README, "Guarantees").
    self.assertEqual(int(aux["invalid_assignments"]), 0)
    for name in (
        "combine_weights",
        "router_probs",
        "load_balancing_loss",
        "router_z_loss",
    ):
      check_close(name, aux[name], want[name])
    if bias is not None:
      unbiased = oracles.route(
          aux["router_logits"], dataclasses.replace(cfg, correction_bias=False)
      )
      self.assertFalse(
          np.array_equal(unbiased["expert_ids"], want["expert_ids"]),
          "the case's correction bias should change some token's experts",
      )
