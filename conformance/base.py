"""BackendTestCase: what every conformance suite shares (setup, comparisons)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, ClassVar

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from conformance import cases
from conformance import oracles
from conformance import tolerances


@dataclasses.dataclass
class LayerResult:
  """One moe_layer call (and its gradients, when the case asks for them).

  y and the arrays of aux and grads are numpy copies; `rerun()` calls the
  same (compiled) function again and returns (y, grads) as jax arrays.
  """

  y: np.ndarray
  aux: dict[str, np.ndarray]
  grads: dict[str, np.ndarray] | None
  rerun: Callable[[], tuple[Any, Any]]


@dataclasses.dataclass
class GemmResult:
  """grouped_gemm's output and (d_rows, d_weights) for the case cotangent."""

  out: np.ndarray
  d_rows: np.ndarray
  d_weights: np.ndarray
  rerun: Callable[[], tuple[Any, Any, Any]]


# Results of the expensive calls (a jitted layer and its gradients, a grouped
# GEMM and its vjp), per process and per (backend, options, case): the several
# properties checked on one case compile it once, and the reference runs once
# for all the backends a process tests.
_CACHE: dict[tuple, Any] = {}


def cached(key, compute):
  """compute(), memoised per process under `key` (if hashable)."""
  try:
    hash(key)
  except TypeError:  # Unhashable backend options: no caching.
    return compute()
  if key not in _CACHE:
    _CACHE[key] = compute()
  return _CACHE[key]


def _options_key(options: dict) -> str:
  return json.dumps(options, sort_keys=True, default=repr)


def _aux_to_numpy(aux) -> dict[str, np.ndarray]:
  return {
      f.name: np.asarray(getattr(aux, f.name)) for f in dataclasses.fields(aux)
  }


def layer_fn(backend, case: cases.LayerCase, grads: bool, **layer_kwargs):
  """f(params, x) -> (y, aux, grads or None) for the case.

  grads are those of sum(y * cotangent) with respect to every parameter and
  x (under the key "x"); layer_kwargs go to moe_layer (mesh=..., ...).
  """
  cfg = case.cfg
  _, _, cotangent = cases.layer_inputs(case)
  if not grads:

    def forward(params, x):
      y, aux = moe_core.moe_layer(
          params, x, cfg, backend=backend, **layer_kwargs
      )
      return y, aux, None

    return forward

  def loss(params, x):
    y, aux = moe_core.moe_layer(params, x, cfg, backend=backend, **layer_kwargs)
    return jnp.sum(y.astype(jnp.float32) * cotangent), (y, aux)

  def forward_and_grads(params, x):
    (_, (y, aux)), (d_params, d_x) = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True
    )(params, x)
    return y, aux, dict(d_params, x=d_x)

  return forward_and_grads


def compute_layer(
    backend, case: cases.LayerCase, jit: bool, grads: bool | None = None
) -> LayerResult:
  """Runs `case` on `backend`; with gradients if `grads` (default: if the
  case asks for them)."""
  params, x, _ = cases.layer_inputs(case)
  fn = layer_fn(backend, case, case.grads if grads is None else grads)
  if jit:
    fn = jax.jit(fn)
  y, aux, grads = fn(params, x)

  def rerun():
    y, _, grads = fn(params, x)
    return y, grads

  return LayerResult(
      y=np.asarray(y),
      aux=_aux_to_numpy(aux),
      grads=None
      if grads is None
      else {n: np.asarray(g) for n, g in grads.items()},
      rerun=rerun,
  )


def reference_layer(case: cases.LayerCase) -> LayerResult:
  """The oracle: the reference backend on `case`, jitted unless the case
  says not. A reference backend under test shares this result."""
  return cached(
      ("reference", _options_key({}), "layer", case, case.jit, case.grads),
      lambda: compute_layer(moe_core.get_backend("reference"), case, case.jit),
  )


def reference_gemm(case: cases.GemmCase) -> GemmResult:
  """The reference backend's grouped GEMM on `case` (jitted), cached."""
  return cached(
      ("reference", _options_key({}), "gemm", case, True),
      lambda: compute_gemm(moe_core.get_backend("reference"), case, True),
  )


def gemm_function(backend, case: cases.GemmCase, *, grads: bool, **options):
  """f(rows, weights) -> (out,), or (out, d_rows, d_weights) with `grads`:
  backend.grouped_gemm with case's group sizes and layout and `options`
  (out_dtype, precision), differentiated against case's cotangent (see
  cases.gemm_inputs)."""
  _, _, group_sizes, cotangent = cases.gemm_inputs(case)

  def gemm(rows, weights):
    return backend.grouped_gemm(
        rows,
        weights,
        group_sizes,
        transpose_rhs=case.transpose_rhs,
        **options,
    )

  def fn(rows, weights):
    if not grads:
      return (gemm(rows, weights),)
    out, vjp = jax.vjp(gemm, rows, weights)
    return (out,) + vjp(cotangent)

  return fn


def compute_gemm(backend, case: cases.GemmCase, jit: bool) -> GemmResult:
  rows, weights, _, _ = cases.gemm_inputs(case)
  fn = gemm_function(backend, case, grads=True, out_dtype=case.out_dtype)
  if jit:
    fn = jax.jit(fn)
  out, d_rows, d_weights = fn(rows, weights)
  return GemmResult(
      np.asarray(out),
      np.asarray(d_rows),
      np.asarray(d_weights),
      rerun=lambda: fn(rows, weights),
  )


class BackendTestCase(parameterized.TestCase):
  """Base of every suite: builds the backend or skips, and compares.

  Subclasses set BACKEND (a registered name), optionally BACKEND_OPTIONS
  (keyword arguments of moe_core.get_backend) and TOLERANCE_OVERRIDES (see
  `tolerances.lookup`; loosen only with a reason in a comment).
  """

  BACKEND: ClassVar[str]
  BACKEND_OPTIONS: ClassVar[dict] = {}
  TOLERANCE_OVERRIDES: ClassVar[dict] = {}

  def setUp(self):
    super().setUp()
    try:
      self.backend = moe_core.get_backend(self.BACKEND, **self.BACKEND_OPTIONS)
    except ImportError as e:
      self.skipTest(f"backend {self.BACKEND!r} cannot be imported here: {e}")
    ok, reason = self.backend.availability()
    if not ok:
      self.skipTest(f"backend {self.BACKEND!r} cannot run here: {reason}")

  # --- The oracle itself -----------------------------------------------------

  ORACLE_SKIP_REASON: ClassVar[str] = (
      "reference is the oracle: comparing it with itself cannot fail; its "
      "forward is checked against float64 numpy oracles in this suite and "
      "its gradients by finite differences in reference/gradient_check_test.py"
  )

  def is_oracle(self) -> bool:
    """True when the backend under test is the oracle itself.

    `reference_layer`, `reference_gemm` and the stages' reference results
    are then the very results under test (same cache key), so a comparison
    with them cannot fail and is skipped (see ORACLE_SKIP_REASON).
    """
    return self.BACKEND == "reference" and not self.BACKEND_OPTIONS

  def skip_if_oracle(self):
    """Skips a test that is nothing but a comparison with the reference."""
    if self.is_oracle():
      self.skipTest(self.ORACLE_SKIP_REASON)

  SHARED_ROUTER_SKIP_REASON: ClassVar[str] = (
      "a router-only variant (cases.ROUTER_ONLY_VARIANTS): this backend "
      "routes through moe_core.routing, which the reference's suite checks "
      "on every variant against numpy"
  )

  def routes_itself(self) -> bool:
    """True when the backend overrides the route stage (`Backend._route`)."""
    return type(self.backend)._route is not moe_core.Backend._route

  def skip_if_shared_router_variant(self, case):
    """Skips a router-only variant on a backend using the shared router."""
    if (
        case.name in cases.ROUTER_ONLY_VARIANTS
        and not self.is_oracle()
        and not self.routes_itself()
    ):
      self.skipTest(self.SHARED_ROUTER_SKIP_REASON)

  def compute_dtype(self) -> str:
    """float32 if the backend computes in it, else its first dtype's name.

    For tests whose point is not the dtype (checkpoint names, say).
    """
    supported = self.backend.dtypes
    if supported is None or jnp.dtype(jnp.float32) in supported:
      return "float32"
    return jnp.dtype(supported[0]).name

  def skip_unless_computes(self, dtype):
    """Skips a case in a dtype outside the backend's `dtypes`.

    Such a backend raises NotImplementedError for it (the base `Backend`
    checks, and "auto" passes the input on), which the backends' own tests
    cover; the case has nothing to compare.
    """
    supported = self.backend.dtypes
    if supported is not None and jnp.dtype(dtype) not in supported:
      self.skipTest(
          f"backend {self.BACKEND!r} computes in "
          f"{[jnp.dtype(d).name for d in supported]}, not "
          f"{jnp.dtype(dtype).name} (it raises NotImplementedError)"
      )

  # --- Running, with the per-process cache ----------------------------------

  def _key(self, *parts):
    return (self.BACKEND, _options_key(self.BACKEND_OPTIONS)) + parts

  def run_layer(
      self,
      case: cases.LayerCase,
      jit: bool | None = None,
      grads: bool | None = None,
  ) -> LayerResult:
    """The backend under test on `case`, cached. By default jitted and with
    gradients as the case says."""
    self.skip_unless_computes(case.dtype)
    jit = case.jit if jit is None else jit
    grads = case.grads if grads is None else grads
    return cached(
        self._key("layer", case, jit, grads),
        lambda: compute_layer(self.backend, case, jit, grads),
    )

  def run_gemm(self, case: cases.GemmCase, jit: bool = True) -> GemmResult:
    """The backend under test on `case` (by default jitted), cached."""
    self.skip_unless_computes(case.dtype)
    return cached(
        self._key("gemm", case, jit),
        lambda: compute_gemm(self.backend, case, jit),
    )

  # --- Comparisons ----------------------------------------------------------

  def tolerance(self, dtype, kind: str = "forward") -> tolerances.Tolerance:
    return tolerances.lookup(dtype, kind, self.TOLERANCE_OVERRIDES)

  def assertClose(
      self, actual, expected, dtype, kind: str = "forward", msg: str = ""
  ):
    """`actual` within the table tolerance for `dtype` of `expected`."""
    problem = tolerances.violation(
        actual, expected, self.tolerance(dtype, kind)
    )
    if problem:
      self.fail(f"{self.BACKEND}: {msg}: {problem}")

  def assertAllZero(self, x, msg: str = ""):
    """Exactly zero everywhere (NaN fails too)."""
    x = np.asarray(x).astype(np.float64)
    bad = np.argwhere(x != 0)
    if bad.size:
      self.fail(
          f"{self.BACKEND}: {msg}: {len(bad)} nonzero values, first "
          f"at {tuple(bad[0])} = {x[tuple(bad[0])]}"
      )

  def assertBitwiseEqual(self, a, b, msg: str = ""):
    a, b = np.asarray(a), np.asarray(b)
    self.assertEqual(a.dtype, b.dtype, msg)
    self.assertEqual(a.shape, b.shape, msg)
    self.assertTrue(
        a.tobytes() == b.tobytes(),
        f"{self.BACKEND}: {msg}: results differ bit for bit",
    )

  # --- Layer properties shared by the layer and routing suites -------------

  def assertYMatchesReference(self, case: cases.LayerCase, result: LayerResult):
    """y equals the reference's y; a no-op for the oracle itself, whose y
    the per-token float64 recomputation checks instead."""
    if self.is_oracle():
      return
    self.assertClose(
        result.y, reference_layer(case).y, case.dtype, msg="y vs reference"
    )

  def assertLayerMatchesReference(self, case: cases.LayerCase):
    """`case`'s layer: y and every aux field equal the reference's."""
    got = self.run_layer(case)
    self.assertYMatchesReference(case, got)
    self.assertAuxMatchesReference(case, got)

  def assertDroplessMatchesPerTokenMath(self, case: cases.LayerCase):
    """`case`'s layer drops no copy, and its y is the per-token math of
    `assertMatchesPerTokenMath`."""
    got = self.run_layer(case)
    self.assertEqual(int(got.aux["dropped_tokens"]), 0)
    self.assertMatchesPerTokenMath(case, got)

  def assertMatchesPerTokenMath(
      self, case: cases.LayerCase, result: LayerResult
  ):
    """y[t] = sum_k w[t, k] FFN_{ids[t, k]}(x[t]) (+ shared), in numpy.

    Uses the layer's own routing decision (expert_ids, combine_weights, with
    dropped copies at weight 0); the routing itself is checked separately.
    """
    params, x, _ = cases.layer_inputs(case)
    cfg = case.cfg
    self.assertEqual(result.y.shape, x.shape, "y shape")
    self.assertEqual(result.y.dtype, x.dtype, "y dtype")
    tokens = np.asarray(x).reshape(-1, cfg.hidden_size)
    weights = np.where(result.aux["kept"], result.aux["combine_weights"], 0)
    want = oracles.layer_from_routing(
        params, tokens, result.aux["expert_ids"], weights, cfg
    )
    self.assertClose(
        result.y.reshape(tokens.shape),
        want,
        case.dtype,
        msg="y vs per-token float64 recomputation",
    )

  def assertAuxMatchesReference(
      self, case: cases.LayerCase, result: LayerResult
  ):
    """Every aux field has its contract shape and dtype and equals the
    reference's: integers and masks exactly, floats to float32 rounding
    (the contract only, for the oracle itself)."""
    # The router's width: E plus any zero experts.
    t, e, k = case.num_tokens, case.cfg.num_router_experts, case.cfg.top_k
    contract = {
        "router_logits": ((t, e), np.float32),
        "router_probs": ((t, e), np.float32),
        "expert_ids": ((t, k), np.int32),
        "combine_weights": ((t, k), np.float32),
        "kept": ((t, k), np.bool_),
        "tokens_per_expert": ((e,), np.int32),
        "load_balancing_loss": ((), np.float32),
        "router_z_loss": ((), np.float32),
        "dropped_tokens": ((), np.int32),
        "invalid_assignments": ((), np.int32),
    }
    self.assertEqual(sorted(result.aux), sorted(contract))
    # The oracle's own aux would be compared with itself; its routing is
    # checked against numpy in RoutingSuite.test_routing_matches_numpy_router.
    want = None if self.is_oracle() else reference_layer(case).aux
    # Routing is float32 at HIGHEST precision on every platform.
    routing_tol = tolerances.routing()
    for name, (shape, dtype) in contract.items():
      with self.subTest(f"aux.{name}"):
        got = result.aux[name]
        self.assertEqual(got.shape, shape, f"aux.{name} shape")
        self.assertEqual(got.dtype, np.dtype(dtype), f"aux.{name} dtype")
        if want is None:
          continue
        if np.issubdtype(got.dtype, np.floating):
          problem = tolerances.violation(got, want[name], routing_tol)
          self.assertIsNone(problem, f"aux.{name} vs reference: {problem}")
        else:
          np.testing.assert_array_equal(
              got, want[name], f"aux.{name} vs reference"
          )
