"""Tests of the suite's own machinery: test classes, skips, tolerances."""

import os
import sys
import types
import unittest
from unittest import mock

from absl.testing import absltest
import ml_dtypes
import numpy as np

import moe_core
from conformance import cases
from conformance import oracles
from conformance import suite
from conformance import tolerances


def _test_names(cls) -> list[str]:
  return unittest.TestLoader().getTestCaseNames(cls)


def _xla_test_classes():
  """What backends/xla/conformance_test.py defines, with some settings.

  Built per call: at module level, the test runners would run them.
  """

  class XlaConformanceTest(suite.ConformanceTest):
    BACKEND = "xla"
    BACKEND_OPTIONS = {"levels": (64, 8)}
    TOLERANCE_OVERRIDES = {"bfloat16": (0.1, 0.1)}

  class XlaExpertParallelTest(suite.ExpertParallelTest):
    BACKEND = "xla"

  return XlaConformanceTest, XlaExpertParallelTest


class TestClassesTest(absltest.TestCase):
  """The classes a backend subclasses, and which of them a run picks."""

  def _assert_runs_every_suite_test(self, combined, suites):
    runs = {getattr(combined, n) for n in _test_names(combined)}
    expected = 0
    for suite_cls in suites:
      self.assertTrue(issubclass(combined, suite_cls))
      for name in _test_names(suite_cls):
        expected += 1
        self.assertIn(
            getattr(suite_cls, name),
            runs,
            f"{suite_cls.__name__}.{name} does not run in "
            f"{combined.__name__}: another suite has a test of that name",
        )
    # Each once: no test runs under two names.
    self.assertLen(_test_names(combined), expected)

  def test_conformance_test_runs_every_test_of_every_suite(self):
    self._assert_runs_every_suite_test(suite.ConformanceTest, suite.SUITES)

  def test_expert_parallel_test_runs_every_test_of_every_ep_suite(self):
    self._assert_runs_every_suite_test(
        suite.ExpertParallelTest, suite.EP_SUITES
    )

  def test_subclass_builds_its_backend_with_its_options(self):
    xla_conformance_test, _ = _xla_test_classes()
    test = xla_conformance_test("test_layer_rejects_missing_parameter")
    try:
      test.setUp()
    except unittest.SkipTest as e:
      self.fail(f"the xla backend should build here: {e}")
    self.assertEqual(test.backend.name, "xla")
    self.assertEqual(test.backend.levels, (64, 8))
    self.assertEqual(
        test.tolerance("bfloat16"),
        tolerances.lookup("bfloat16", "forward", {"bfloat16": (0.1, 0.1)}),
    )

  def test_router_only_variants_run_where_the_route_stage_is_not_shared(self):
    """Skipped on a backend using moe_core.routing; run on the oracle and
    on a backend with its own `_route`; other variants run everywhere."""
    router_only = cases.ROUTING_VARIANTS[0]
    self.assertIn(router_only.name, cases.ROUTER_ONLY_VARIANTS)
    reaching_stages = [
        c
        for c in cases.ROUTING_VARIANTS
        if c.name not in cases.ROUTER_ONLY_VARIANTS
    ]
    self.assertNotEmpty(reaching_stages)
    xla_conformance_test, _ = _xla_test_classes()

    class OwnRouter(type(moe_core.get_backend("xla"))):

      def _route(self, x, router, cfg, correction_bias, **extras):
        return super()._route(x, router, cfg, correction_bias, **extras)

    class OracleTest(suite.ConformanceTest):
      BACKEND = "reference"

    def skips(test_cls, case, backend=None):
      test = test_cls("test_layer_rejects_missing_parameter")
      test.setUp()
      if backend is not None:
        test.backend = backend
      try:
        test.skip_if_shared_router_variant(case)
      except unittest.SkipTest as e:
        self.assertIn("moe_core.routing", str(e))
        return True
      return False

    self.assertTrue(skips(xla_conformance_test, router_only))
    self.assertFalse(skips(xla_conformance_test, reaching_stages[0]))
    self.assertFalse(skips(xla_conformance_test, router_only, OwnRouter()))
    self.assertFalse(skips(OracleTest, router_only))

  def test_backend_whose_module_is_missing_skips_with_the_reason(self):
    class AbsentConformanceTest(suite.ConformanceTest):
      BACKEND = "absent"

    registry = moe_core.registry._REGISTRY  # pylint: disable=protected-access
    with mock.patch.dict(
        registry, {"absent": "no_such_package.backend:Absent"}
    ):
      test = AbsentConformanceTest("test_layer_rejects_missing_parameter")
      result = test.defaultTestResult()
      test.run(result)
    self.assertEmpty(result.errors)
    self.assertEmpty(result.failures)
    self.assertLen(result.skipped, 1)
    self.assertRegex(
        result.skipped[0][1],
        "backend 'absent' cannot be imported here: .*" "no_such_package",
    )

  def test_a_run_picks_the_single_device_or_the_ep_classes(self):
    module = types.ModuleType("a_backend_conformance_test")
    module.suite = suite
    module.ConformanceTest = suite.ConformanceTest  # Imported bases: not run.
    module.XlaConformanceTest, module.XlaExpertParallelTest = (
        _xla_test_classes()
    )
    with mock.patch.dict(os.environ):
      os.environ.pop(suite.EP_ENV, None)
      self.assertFalse(suite.runs_ep_suites())
      self.assertEqual(suite.classes_to_run(module), ["XlaConformanceTest"])
      os.environ[suite.EP_ENV] = "1"
      self.assertTrue(suite.runs_ep_suites())
      self.assertEqual(suite.classes_to_run(module), ["XlaExpertParallelTest"])

  def test_main_without_test_classes_exits_with_the_reason(self):
    empty = types.ModuleType("__main__")
    with mock.patch.dict(sys.modules, {"__main__": empty}):
      with self.assertRaisesRegex(SystemExit, "no subclass of suite"):
        suite.main()


class TolerancesTest(absltest.TestCase):

  def test_bfloat16_rounding_of_the_result_passes(self):
    expected = np.random.default_rng(0).standard_normal((64, 64))
    rounded = expected.astype(ml_dtypes.bfloat16)
    tol = tolerances.lookup("bfloat16", "forward", platform="cpu")
    self.assertIsNone(tolerances.violation(rounded, expected, tol))

  def test_one_wrong_value_fails(self):
    expected = np.random.default_rng(1).standard_normal((64, 64))
    actual = expected.copy()
    actual[3, 5] += 0.05 * np.abs(expected).max()  # A 5% error.
    for dtype in ("float32", "bfloat16"):
      with self.subTest(dtype):
        tol = tolerances.lookup(dtype, "gradient", platform="cpu")
        self.assertRegex(
            tolerances.violation(actual, expected, tol),
            r"1 of 4096 values off; worst at \(3, 5\)",
        )

  def test_nan_and_shape_mismatch_fail(self):
    tol = tolerances.lookup("float32", "forward", platform="cpu")
    self.assertRegex(
        tolerances.violation(np.array([1.0, np.nan]), np.ones(2), tol),
        "non-finite",
    )
    self.assertRegex(tolerances.violation(np.ones(3), np.ones(2), tol), "shape")

  def test_all_zero_expected_needs_exact_zeros(self):
    tol = tolerances.lookup("bfloat16", "forward", platform="cpu")
    self.assertIsNone(tolerances.violation(np.zeros(4), np.zeros(4), tol))
    self.assertIsNotNone(
        tolerances.violation(np.array([0, 0, 1e-30, 0]), np.zeros(4), tol)
    )

  def test_float32_row_follows_the_platform(self):
    self.assertEqual(tolerances.row_for("float32", "cpu"), "float32")
    self.assertEqual(tolerances.row_for("float32", "gpu"), "tfloat32")
    self.assertEqual(tolerances.row_for("bfloat16", "gpu"), "bfloat16")

  def test_clamped_float32_gradients_compare_at_full_precision_off_the_cpu(
      self,
  ):
    clamped = cases.FFN_STAGE_CFGS["_gpt_oss_glu_bias"]
    self.assertIsNotNone(clamped.swiglu_limit)
    unclamped = cases.FFN_STAGE_CFGS[""]
    self.assertIsNone(unclamped.swiglu_limit)
    for platform in ("tpu", "gpu"):
      self.assertEqual(
          tolerances.clamp_gradient_precision(clamped, "float32", platform),
          "highest",
      )
      # bfloat16 operands: one pass everywhere, the oracle's too.
      self.assertIsNone(
          tolerances.clamp_gradient_precision(clamped, "bfloat16", platform)
      )
      self.assertIsNone(
          tolerances.clamp_gradient_precision(unclamped, "float32", platform)
      )
    self.assertIsNone(
        tolerances.clamp_gradient_precision(clamped, "float32", "cpu")
    )

  def test_routing_is_the_float32_row_off_a_tpu(self):
    for platform in ("cpu", "gpu", "cuda"):
      self.assertEqual(
          tolerances.routing(platform), tolerances.TABLE["float32"]["forward"]
      )

  def test_tpu_routing_admits_its_transcendentals_not_a_wrong_router(self):
    # The combine weight a TPU v5e gave against float64 numpy (0.490055
    # for 0.490074), as one of a token's two normalised weights: over the
    # float32 row, within the TPU's. A 1% error (a wrong score function)
    # fails both.
    expected = np.array([0.490074, 0.509926])
    measured = np.array([0.490055, 0.509926])
    self.assertIsNotNone(
        tolerances.violation(measured, expected, tolerances.routing("cpu"))
    )
    self.assertIsNone(
        tolerances.violation(measured, expected, tolerances.routing("tpu"))
    )
    self.assertIsNotNone(
        tolerances.violation(
            expected * [1.01, 1.0], expected, tolerances.routing("tpu")
        )
    )

  def test_float32_at_highest_is_the_float32_row_on_every_platform(self):
    for kind in tolerances.KINDS:
      self.assertEqual(
          tolerances.float32_at_highest(kind), tolerances.TABLE["float32"][kind]
      )
    self.assertEqual(
        tolerances.float32_at_highest("forward", {"float32": (0.5, 0.25)}),
        (0.5, 0.25),
    )

  def test_overrides_loosen_one_dtype_and_kind(self):
    both = {"bfloat16": (0.5, 0.25)}
    one = {"bfloat16": {"gradient": (0.5, 0.25)}}
    self.assertEqual(
        tolerances.lookup("bfloat16", "forward", both, "cpu"), (0.5, 0.25)
    )
    self.assertEqual(
        tolerances.lookup("bfloat16", "forward", one, "cpu"),
        tolerances.TABLE["bfloat16"]["forward"],
    )
    self.assertEqual(
        tolerances.lookup("bfloat16", "gradient", one, "cpu"), (0.5, 0.25)
    )
    self.assertEqual(
        tolerances.lookup("float32", "forward", both, "cpu"),
        tolerances.TABLE["float32"]["forward"],
    )


class OraclesTest(absltest.TestCase):
  """The numpy oracles on examples worked out by hand."""

  def test_gshard_keep_serves_first_choices_first(self):
    # Capacity 1. First choices in token order: token 0 takes expert 0,
    # token 1 finds it full, token 2 takes expert 1. Then second choices:
    # experts 1 and 1 are full for tokens 0 and 1, token 2 takes expert 2.
    expert_ids = np.array([[0, 1], [0, 1], [1, 2]])
    want = np.array([[True, False], [False, False], [True, True]])
    np.testing.assert_array_equal(oracles.gshard_keep(expert_ids, 3, 1), want)

  def test_grouped_gemm_on_a_hand_example(self):
    rows = np.array([[1.0, 2.0], [3.0, 4.0], [np.nan, np.nan]])
    weights = np.array([[[1.0], [0.0]], [[0.0], [1.0]]])  # [2, 2, 1]
    out = oracles.grouped_gemm(rows, weights, [1, 1])
    np.testing.assert_array_equal(out, [[1.0], [4.0], [0.0]])

  def test_route_on_a_hand_example(self):
    cfg = moe_core.MoEConfig(
        num_experts=4,
        top_k=2,
        hidden_size=1,
        expert_ffn_size=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
    )
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))
    got = oracles.route(logits, cfg)
    np.testing.assert_array_equal(got["expert_ids"], [[1, 3]])
    np.testing.assert_allclose(
        got["combine_weights"], [[2.0 * 4 / 7, 2.0 * 3 / 7]]
    )


if __name__ == "__main__":
  absltest.main()
