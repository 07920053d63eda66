"""Property-based fuzzing of every backend against the reference (hypothesis).

Random valid configs and inputs (every router family, groups, capacity, a
shared expert, E up to 256, 1 to 8 tokens, float32/bfloat16/float16, traced
under jax.jit and static; half of them with extreme but finite routing
inputs, logits up to about +-3e4) must agree with the reference backend
within the conformance tolerances, finite and with every assignment
counted; random invalid ones (non-finite data, expert ids, group sizes,
hash tables and token ids out of range, bias updates, config floats past
float32's range) must give the outcome the run-time policy documents
(docs/api.md, "Guarantees"), the same on every backend. mosaic_tpu's own
launch options are fuzzed too: its grouped GEMM under a group offset (valid
and out of range), the caller's tiles, zero widths and every TPU kind it
may be lowered for. The strategies are in conformance/fuzz_strategies.py.

Profiles, chosen by the environment variable DROPLESS_FUZZ_PROFILE:

  ci     (default) a fixed (derandomised) set of examples, under 3 minutes
         on two cores; no shrinking, so that a failure reports at once.
  debug  the ci examples, shrunk to a minimal one when one fails.
  long   about 12 times as many random examples, shrunk (about half an hour):
           DROPLESS_FUZZ_PROFILE=long python -m pytest conformance/fuzz_test.py
         or, under Bazel,
           bazel test //conformance:fuzz_test \\
             --test_env=DROPLESS_FUZZ_PROFILE=long --test_timeout=3600

A failure prints its example and a `@reproduce_failure` blob. Each failure
found so far is pinned below as an `@hypothesis.example` or a
`test_regression_*` function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from unittest import mock

from absl.testing import absltest
import hypothesis
from hypothesis import strategies as st
import jax
from jax import export
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import config as config_lib
from conformance import bad_input_outcomes
from conformance import cases
from conformance import fuzz_strategies as fs
from conformance import oracles
from conformance import tolerances
from conformance.example_backend import backend as example_backend

# --- Profiles -----------------------------------------------------------------

PROFILE_ENV = "DROPLESS_FUZZ_PROFILE"

_COMMON = dict(
    # Compiling is most of an example's time, and varies with the machine.
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
    print_blob=True,
    # No .hypothesis/ directory in the source tree (or Bazel's sandbox).
    database=None,
)
_NO_SHRINK = tuple(p for p in hypothesis.Phase if p != hypothesis.Phase.shrink)
hypothesis.settings.register_profile(
    "ci", derandomize=True, max_examples=8, phases=_NO_SHRINK, **_COMMON
)
hypothesis.settings.register_profile(
    "debug",
    derandomize=True,
    max_examples=8,
    verbosity=hypothesis.Verbosity.verbose,
    **_COMMON,
)
hypothesis.settings.register_profile("long", max_examples=100, **_COMMON)
_PROFILES = ("ci", "debug", "long")


def _load_profile() -> None:
  name = os.environ.get(PROFILE_ENV, "ci")
  if name not in _PROFILES:
    raise ValueError(f"{PROFILE_ENV} must be one of {_PROFILES}, got {name!r}.")
  hypothesis.settings.load_profile(name)


_load_profile()


def _examples(scale: float) -> hypothesis.settings:
  """The profile's settings with `scale` times its max_examples: each
  property's share, by what one of its examples costs."""
  base_count = hypothesis.settings.default.max_examples
  return hypothesis.settings(max_examples=max(1, round(scale * base_count)))


# --- Backends -----------------------------------------------------------------

# Backends whose traced program unrolls a Python loop over the experts: at
# E = 256 one compile takes 5 to 15 s on two cores, so they run those cases
# op by op (the conformance suite's experts_256 case does the same).
_UNROLLED_BACKENDS = ("reference", "example")
_MAX_UNROLLED_EXPERTS = 16


@functools.cache
def _backends() -> dict[str, moe_core.Backend]:
  """name -> backend, for every backend that runs here.

  The registered ones, and the template of conformance/example_backend/,
  which is a folder to copy and not registered: an instance serves
  wherever a name does.
  """
  found = {n: moe_core.get_backend(n) for n in moe_core.available_backends()}
  found.setdefault("example", example_backend.ExampleBackend())
  return found


def _traced(name: str, case: cases.LayerCase) -> bool:
  """Whether backend `name` runs `case` under jit (see _UNROLLED_BACKENDS)."""
  if name in _UNROLLED_BACKENDS:
    return case.jit and case.cfg.num_experts <= _MAX_UNROLLED_EXPERTS
  return case.jit


def _supports(backend: moe_core.Backend, dtype) -> bool:
  return backend.dtypes is None or jnp.dtype(dtype) in backend.dtypes


# --- Outcomes -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Raised:
  """A call that raised: the exception's type and message."""

  kind: type
  message: str


@dataclasses.dataclass
class LayerOut:
  """A moe_layer call that returned: y [T, D] and aux, as float32 numpy."""

  y: np.ndarray
  aux: dict[str, np.ndarray]


def _raised_or(fn):
  """fn(), or `Raised` for the errors the policy documents."""
  try:
    return fn()
  except (ValueError, TypeError, NotImplementedError) as e:
    return Raised(type(e), str(e))


def _to_numpy(x) -> np.ndarray:
  """x as numpy; floats (bfloat16 and float16 too) as float32."""
  x = np.asarray(x)
  return x.astype(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _layer(
    backend, params, x, cfg, jit: bool, token_ids=None
) -> LayerOut | Raised:
  """moe_layer on `backend` (with `token_ids` for hash routing), y
  flattened to [T, D]."""

  def layer(params, x, token_ids):
    return moe_core.moe_layer(
        params, x, cfg, backend=backend, token_ids=token_ids
    )

  def run():
    y, aux = (jax.jit(layer) if jit else layer)(params, x, token_ids)
    return LayerOut(
        y=_to_numpy(y).reshape(-1, cfg.hidden_size),
        aux={
            f.name: _to_numpy(getattr(aux, f.name))
            for f in dataclasses.fields(aux)
        },
    )

  return _raised_or(run)


# --- Comparisons --------------------------------------------------------------


def _tolerance(dtype) -> tolerances.Tolerance:
  """The conformance table's forward tolerance for `dtype`.

  The table has no float16 row; float16 keeps 11 significant bits, as
  tfloat32 does, and the tfloat32 row is built from exactly that unit
  roundoff (2^-11), so float16 uses it.
  """
  if jnp.dtype(dtype) == jnp.float16:
    return tolerances.TABLE["tfloat32"]["forward"]
  return tolerances.lookup(dtype, "forward")


def _clear_decisions(logits, cfg, bias=None) -> np.ndarray:
  """[T] bool: the token's expert choice has no near tie.

  From float32 logits, in float64: every gap that decides the choice (the
  K best eligible experts in order, the K-th against the next, and with
  groups the topk_group-th best group against the next) exceeds 1e-5 of
  the scores compared, plus 1e-30 (scores that small underflow in float32
  and tie at 0). A backend may break such a tie either way; any gap at all
  is 1000 times what float32 rounding moves a score. NaN scores are never
  clear.
  """
  logits = oracles.f64(logits)
  with np.errstate(all="ignore"):
    if cfg.score_func == "softmax":
      z = np.exp(logits - logits.max(axis=-1, keepdims=True))
      scores = z / z.sum(axis=-1, keepdims=True)
    else:
      scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + (0.0 if bias is None else oracles.f64(bias))

  def clear(ranked) -> bool:
    ranked = np.asarray(ranked)
    gaps = ranked[:-1] - ranked[1:]
    allowed = 1e-5 * np.maximum(abs(ranked[:-1]), abs(ranked[1:])) + 1e-30
    return bool(np.all(gaps > allowed))

  per_group = cfg.experts_per_group
  out = np.zeros(choice.shape[0], bool)
  for t, row in enumerate(choice):
    if not np.all(np.isfinite(row)):
      continue
    eligible = np.arange(cfg.num_experts)
    if cfg.n_group > 1:
      groups = row.reshape(cfg.n_group, per_group)
      if cfg.group_score == "max":
        group_scores = groups.max(axis=1)
      else:
        group_scores = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
      order = np.argsort(-group_scores, kind="stable")
      if not clear(group_scores[order][: cfg.topk_group + 1]):
        continue
      best = order[: cfg.topk_group]
      eligible = np.concatenate(
          [np.arange(g * per_group, (g + 1) * per_group) for g in best]
      )
    ranked = np.sort(row[eligible])[::-1]
    out[t] = clear(ranked[: cfg.top_k + 1])
  return out


def _nan_aware_equal(a, b) -> bool:
  """Same dtype, shape and values, NaN equal to NaN."""
  if np.asarray(a).dtype != np.asarray(b).dtype:
    return False
  a, b = _to_numpy(a), _to_numpy(b)
  if a.shape != b.shape:
    return False
  if np.issubdtype(a.dtype, np.floating):
    return bool(np.array_equal(a, b, equal_nan=True))
  return bool(np.array_equal(a, b))


# Valid (case, extreme) pairs that passed in this process; each compiles
# anew, and hypothesis may draw one value twice.
_PASSED: set[tuple] = set()

# DeepSeek-V3's router on 256 experts, as an explicit example: the largest
# bucket is one draw in six, and a short profile may miss it.
_DEEPSEEK_V3_LIKE = cases.LayerCase(
    name="fuzz_deepseek_v3_like",
    cfg=moe_core.MoEConfig(
        num_experts=256,
        top_k=8,
        hidden_size=8,
        expert_ffn_size=16,
        score_func="sigmoid",
        norm_topk_prob=True,
        norm_epsilon=1e-20,
        routed_scaling_factor=2.5,
        correction_bias=True,
        n_group=8,
        topk_group=4,
        group_score="sum_top2",
        shared_ffn_size=8,
    ),
    batch_shape=(3,),
    dtype="bfloat16",
    jit=True,
    seed=1,
)


def _small_case(**cfg_changes) -> cases.LayerCase:
  """4 float32 tokens, 4 experts, top-1, all choosing expert 0 (static)."""
  cfg = moe_core.MoEConfig(
      num_experts=4, top_k=1, hidden_size=8, expert_ffn_size=8
  )
  return cases.LayerCase(
      name="fuzz_regression",
      cfg=cfg.replace(**cfg_changes),
      batch_shape=(4,),
      jit=False,
      hot_expert=0,
  )


@st.composite
def _int64_sizes_that_wrap(draw) -> fs.GemmFault:
  """R5 under jax_enable_x64: group sizes whose int32 wrap is valid (one
  entry moved by a nonzero multiple of 2**32, up or down), for int64."""
  fault = draw(fs.gemm_faults(dtypes=("float32",)))
  sizes, room = [], fault.m
  for _ in fault.group_sizes:
    sizes.append(draw(st.integers(0, room)))
    room -= sizes[-1]
  wraps = draw(st.integers(-(2**30), 2**30).filter(bool))
  sizes[draw(st.integers(0, len(sizes) - 1))] += wraps * 2**32
  return dataclasses.replace(fault, group_sizes=tuple(sizes))


class FuzzTest(absltest.TestCase):
  """Each property runs every backend on each example."""

  # --- Assertions shared by the properties -----------------------------------

  def assertWithin(self, actual, expected, tol, msg):
    problem = tolerances.violation(actual, expected, tol)
    if problem:
      self.fail(f"{msg}: {problem}")

  def assertRaisedExactly(self, got, kind, message, msg):
    """`got` is Raised(kind, message), message matched in full."""
    if not isinstance(got, Raised):
      self.fail(f"{msg}: expected {kind.__name__}({message!r}), got a result")
    self.assertIs(got.kind, kind, f"{msg}: {got.message}")
    self.assertEqual(got.message, message, msg)

  def assertSameAux(self, got, want, compare_ids, msg):
    """Same fields; floats within the routing tolerance with the same
    NaN/Inf positions; integers and masks equal exactly on the tokens of
    `compare_ids` [T] (the others only where every token is compared:
    counts and capacity depend on all of them)."""
    self.assertEqual(sorted(got), sorted(want), f"{msg}: aux fields")
    every_token = bool(np.all(compare_ids))
    for name, expected in want.items():
      actual = got[name]
      where = f"{msg}: aux.{name}"
      self.assertEqual(actual.shape, expected.shape, where)
      self.assertEqual(actual.dtype, expected.dtype, where)
      if np.issubdtype(expected.dtype, np.floating):
        finite = np.isfinite(expected)
        np.testing.assert_array_equal(
            np.isnan(actual), np.isnan(expected), f"{where}: NaN positions"
        )
        np.testing.assert_array_equal(
            actual[~finite & ~np.isnan(expected)],
            expected[~finite & ~np.isnan(expected)],
            f"{where}: infinities",
        )
        if name == "combine_weights" and not every_token:
          finite &= compare_ids[:, None]
        self.assertWithin(
            actual[finite], expected[finite], tolerances.routing(), where
        )
      elif name == "expert_ids":
        np.testing.assert_array_equal(
            actual[compare_ids], expected[compare_ids], where
        )
      elif every_token:
        np.testing.assert_array_equal(actual, expected, where)

  # --- (a) Valid inputs agree with the reference ----------------------------

  def _oracle(self, case: cases.LayerCase, params, x) -> LayerOut:
    """The reference on `case` with inputs (params, x)."""
    got = _layer(
        _backends()["reference"],
        params,
        x,
        case.cfg,
        _traced("reference", case),
    )
    if isinstance(got, Raised):
      self.fail(f"reference raised {got.kind.__name__}: {got.message}")
    return got

  def assertFiniteAndCounted(self, got: LayerOut, case, msg):
    """Finite inputs (logits of any size): finite y and aux, nothing
    invalid, every assignment kept or dropped (docs/api.md, "Guarantees")."""
    bad = np.flatnonzero(~np.all(np.isfinite(got.y), axis=-1))
    self.assertEqual(bad.size, 0, f"{msg}: non-finite y rows {bad.tolist()}")
    for name, value in got.aux.items():
      if np.issubdtype(value.dtype, np.floating):
        self.assertTrue(np.all(np.isfinite(value)), f"{msg}: aux.{name}")
    self.assertEqual(int(got.aux["invalid_assignments"]), 0, msg)
    self.assertEqual(
        int(got.aux["kept"].sum()) + int(got.aux["dropped_tokens"]),
        case.num_tokens * case.cfg.top_k,
        f"{msg}: kept + dropped + invalid != T*K",
    )

  def _check_oracle_against_numpy(self, case, params, x, oracle):
    """The reference's routing against oracles.route and its y against the
    per-token float64 sum, where no near tie leaves the choice open."""
    cfg = case.cfg
    tokens = oracles.f64(x).reshape(-1, cfg.hidden_size)
    aux = oracle.aux
    bias = params.get("correction_bias")
    self.assertWithin(
        aux["router_logits"],
        tokens @ oracles.f64(params["router"]),
        tolerances.routing(),
        "reference: router_logits vs numpy",
    )
    clear = _clear_decisions(aux["router_logits"], cfg, bias)
    want = oracles.route(aux["router_logits"], cfg, bias)
    want["invalid_assignments"] = 0
    np.testing.assert_array_equal(
        aux["expert_ids"][clear],
        want["expert_ids"][clear],
        "reference: expert_ids vs numpy",
    )
    if np.all(clear):
      for name in ("kept", "tokens_per_expert"):
        np.testing.assert_array_equal(aux[name], want[name], name)
      for name in ("dropped_tokens", "invalid_assignments"):
        self.assertEqual(int(aux[name]), want[name], f"reference: {name}")
      for name in ("combine_weights", "router_probs", "load_balancing_loss"):
        self.assertWithin(
            aux[name],
            want[name],
            tolerances.routing(),
            f"reference: {name} vs numpy",
        )
    self.assertWithin(
        aux["router_z_loss"],
        want["router_z_loss"],
        tolerances.routing(),
        "reference: router_z_loss vs numpy",
    )
    weights = np.where(aux["kept"], aux["combine_weights"], 0.0)
    self.assertWithin(
        oracle.y.reshape(tokens.shape),
        oracles.layer_from_routing(
            params, tokens, aux["expert_ids"], weights, cfg
        ),
        _tolerance(case.dtype),
        "reference: y vs per-token float64 sum",
    )

  def _check_backend_matches_oracle(self, name, case, params, x, oracle):
    backend = _backends()[name]
    traced = _traced(name, case)
    msg = f"{name} ({'traced' if traced else 'static'})"
    got = _layer(backend, params, x, case.cfg, traced)
    if not _supports(backend, case.dtype):
      # Valid input this backend cannot do: the documented refusal.
      self.assertIsInstance(got, Raised, msg)
      self.assertIs(got.kind, NotImplementedError, f"{msg}: {got.message}")
      self.assertIn(f"{case.dtype} operands are not supported", got.message)
      return
    if isinstance(got, Raised):
      self.fail(f"{msg} raised {got.kind.__name__}: {got.message}")
    self.assertFiniteAndCounted(got, case, msg)
    want_ids = oracle.aux["expert_ids"]
    tied = ~_clear_decisions(
        oracle.aux["router_logits"],
        case.cfg,
        params.get("correction_bias"),
    )
    differs = np.any(got.aux["expert_ids"] != want_ids, axis=-1)
    self.assertFalse(
        np.any(differs & ~tied),
        f"{msg}: expert_ids differ from the reference's on tokens "
        f"{np.flatnonzero(differs & ~tied).tolist()} without a near tie",
    )
    if np.any(differs):
      return  # A near tie went the other way: y differs, legitimately.
    self.assertSameAux(got.aux, oracle.aux, ~tied, msg)
    self.assertWithin(
        got.y,
        oracle.y.reshape(got.y.shape),
        _tolerance(case.dtype),
        f"{msg}: y vs reference",
    )

  @_examples(1.75)
  @hypothesis.example(case_and_extreme=(_DEEPSEEK_V3_LIKE, None))
  @hypothesis.given(case_and_extreme=fs.layer_cases_with_extremes())
  def test_valid_layer_matches_reference(self, case_and_extreme):
    """(a): y and aux of every backend match the reference's, whose routing
    and y match float64 numpy; a dtype a backend lacks raises
    NotImplementedError, the documented refusal. Half the examples write
    extreme but finite routing inputs in (`fs.RouterExtreme`: logits up to
    about +-3e4, all equal, one-hot, huge or tiny router weights, a bias
    that alone chooses): y and aux stay finite and every assignment is
    counted."""
    if case_and_extreme in _PASSED:
      return  # Drawn again (hypothesis may build one value twice).
    case, extreme = case_and_extreme
    params, x = fs.extreme_inputs(case, extreme)
    oracle = self._oracle(case, params, x)
    self.assertFiniteAndCounted(oracle, case, f"reference, {extreme}")
    self._check_oracle_against_numpy(case, params, x, oracle)
    for name in _backends():
      if name != "reference":  # The oracle itself, checked against numpy.
        self._check_backend_matches_oracle(name, case, params, x, oracle)
    _PASSED.add(case_and_extreme)

  # --- (b) Invalid inputs: the documented outcome, alike on every backend ---

  @_examples(4)
  @hypothesis.given(mistake=fs.static_mistakes())
  def test_static_mistakes_raise_alike(self, mistake):
    """Static problems raise the same type and message on every backend,
    eagerly and under jit, naming the argument; no tokens is one of them."""
    case, kind, name = mistake
    params, x = fs.make_static_mistake(case, kind, name)
    want_type, want_start = fs.STATIC_MISTAKES[kind]
    first = None
    for backend_name, backend in _backends().items():
      for traced in (False, True):
        msg = f"{backend_name} ({'traced' if traced else 'static'}), {kind}"
        got = _layer(backend, params, x, case.cfg, traced)
        self.assertIsInstance(got, Raised, msg)
        self.assertIs(got.kind, want_type, f"{msg}: {got.message}")
        self.assertTrue(got.message.startswith(want_start), got.message)
        if kind == "no_tokens":
          self.assertEqual(
              got.message,
              "x must hold at least one token, got "
              f"x.shape={tuple(x.shape)}.",
          )
        first = first or got
        self.assertEqual(got, first, f"{msg}: differs from the first")

  @_examples(1.25)
  @hypothesis.given(
      case_and_faults=fs.layer_cases(expert_counts=(4, 1, 8, 16)).flatmap(
          lambda case: st.tuples(st.just(case), fs.faults(case))
      )
  )
  def test_non_finite_data_gives_documented_outcome(self, case_and_faults):
    """R1 and R7: NaN/Inf in x, router, bias or expert weights."""
    case, found = case_and_faults
    params, x = fs.faulty_inputs(case, found)
    cfg = case.cfg
    t, k = case.num_tokens, cfg.top_k
    bias = params.get("correction_bias")
    tokens = oracles.f64(x).reshape(t, cfg.hidden_size)
    with np.errstate(all="ignore"):
      logits = tokens @ oracles.f64(params["router"])
    clear = _clear_decisions(logits, cfg, bias)
    invalid = _invalid_tokens(logits, cfg, bias)
    bad_rows = ~np.all(np.isfinite(tokens), axis=-1)
    bad_experts = {
        f.index[0] for f in found if f.target in ("w_gate", "w_up", "w_down")
    }
    outcomes = {}
    for name, backend in _backends().items():
      got = _layer(backend, params, x, cfg, _traced(name, case))
      msg = f"{name} ({'traced' if _traced(name, case) else 'static'})"
      if not _supports(backend, case.dtype):
        self.assertIsInstance(got, Raised, msg)
        self.assertIs(got.kind, NotImplementedError, msg)
        continue
      if isinstance(got, Raised):
        self.fail(f"{msg} raised {got.kind.__name__}: {got.message}")
      aux = got.aux
      # R1: the invalid tokens, counted, unkept, NaN-weighted, NaN out.
      self.assertEqual(int(aux["invalid_assignments"]), k * invalid.sum(), msg)
      self.assertEqual(
          int(aux["kept"].sum())
          + int(aux["dropped_tokens"])
          + int(aux["invalid_assignments"]),
          t * k,
          f"{msg}: kept + dropped + invalid != T*K",
      )
      self.assertEqual(
          int(aux["tokens_per_expert"].sum()),
          t * k - int(aux["invalid_assignments"]),
          f"{msg}: tokens_per_expert counts invalid assignments",
      )
      self.assertFalse(np.any(aux["kept"][invalid]), msg)
      self.assertTrue(np.all(np.isnan(aux["combine_weights"][invalid])), msg)
      self.assertTrue(
          np.all(np.isnan(got.y[invalid])), f"{msg}: invalid tokens' y"
      )
      # R7: no finite output for a token the fault touches.
      touches_bad_expert = np.zeros(t, bool)
      for e in bad_experts:
        touches_bad_expert |= np.any(
            (aux["expert_ids"] == e) & aux["kept"], axis=-1
        )
      touched = invalid | bad_rows | touches_bad_expert
      finite_y = np.all(np.isfinite(got.y), axis=-1)
      self.assertFalse(
          np.any(finite_y & touched),
          f"{msg}: tokens {np.flatnonzero(finite_y & touched).tolist()} "
          "touched by a non-finite input have a finite output",
      )
      outcomes[name] = got
    # Alike on every backend: routing, NaN mask, and the finite values.
    want = outcomes["reference"]
    for name, got in outcomes.items():
      self.assertSameAux(got.aux, want.aux, clear & ~invalid, name)
      np.testing.assert_array_equal(
          np.isnan(got.y), np.isnan(want.y), f"{name}: y NaN mask"
      )
      finite = np.all(np.isfinite(want.y), axis=-1)
      self.assertWithin(
          got.y[finite],
          want.y[finite],
          _tolerance(case.dtype),
          f"{name}: finite y rows vs reference",
      )

  # --- Expert ids out of range, NaN combine weights (R2, R3, R4) ------------

  @_examples(1)
  @hypothesis.given(
      case_and_ids=fs.layer_cases(
          expert_counts=(4, 1, 8, 16), dtypes=("float32", "bfloat16")
      ).flatmap(lambda case: st.tuples(st.just(case), fs.bad_expert_ids(case)))
  )
  def test_dispatch_of_ids_out_of_range(self, case_and_ids):
    """R2: concrete ids raise; traced ones are marked invalid, sorted last
    as NaN rows and left out of group_sizes; alike on every backend."""
    case, bad_ids = case_and_ids
    cfg = case.cfg
    _, tokens, aux = _routed(case)
    aux = _with_routing_faults(aux, bad_ids, ())
    ids = np.asarray(aux.expert_ids)
    first = None
    for name, backend in _backends().items():
      if not case.jit:
        got = _raised_or(lambda: backend.dispatch(tokens, aux, cfg))
        self.assertRaisedExactly(
            got, ValueError, _ids_message(ids, cfg), f"{name}: dispatch"
        )
        continue
      dispatched = jax.jit(
          lambda x, aux, backend=backend: backend.dispatch(x, aux, cfg)
      )(tokens, aux)
      self._check_dispatched(dispatched, tokens, aux, cfg, name)
      first = first or dispatched
      for field in ("rows", "group_sizes", "assignment", "position", "invalid"):
        self.assertTrue(
            _nan_aware_equal(getattr(dispatched, field), getattr(first, field)),
            f"{name}: Dispatched.{field} differs from the first backend's",
        )

  def _check_dispatched(self, dispatched, tokens, aux, cfg, msg):
    """The traced outcome of R2, from numpy."""
    ids = np.asarray(aux.expert_ids).reshape(-1).astype(np.int64)
    m, e, k = ids.size, cfg.num_experts, cfg.top_k
    invalid = (ids < 0) | (ids >= e)
    kept = np.ones(m, bool) if cfg.dropless else np.asarray(aux.kept).ravel()
    counted = kept & ~invalid
    np.testing.assert_array_equal(dispatched.invalid, invalid, msg)
    np.testing.assert_array_equal(
        dispatched.group_sizes,
        np.bincount(ids[counted], minlength=e),
        f"{msg}: group_sizes count only valid, kept copies",
    )
    assignment = np.asarray(dispatched.assignment)
    position = np.asarray(dispatched.position)
    np.testing.assert_array_equal(np.sort(assignment), np.arange(m), msg)
    np.testing.assert_array_equal(position[assignment], np.arange(m), msg)
    # Experts in order (stable within one), then dropped, then invalid.
    keys = np.where(counted, ids, np.where(invalid, e + 1, e))
    used = int(counted.sum())
    np.testing.assert_array_equal(
        assignment[:used],
        np.argsort(keys, kind="stable")[:used],
        f"{msg}: grouped copies",
    )
    self.assertTrue(
        np.all(np.diff(keys[assignment]) >= 0),
        f"{msg}: invalid copies must come after every group and drop",
    )
    rows = _to_numpy(dispatched.rows)[position]  # Assignment order.
    self.assertTrue(np.all(np.isnan(rows[invalid])), f"{msg}: invalid rows")
    np.testing.assert_array_equal(
        rows[counted],
        _to_numpy(tokens)[np.flatnonzero(counted) // k],
        f"{msg}: the rows of valid copies",
    )

  @_examples(0.75)
  @hypothesis.given(
      case_and_faults=fs.layer_cases(
          expert_counts=(4, 1, 8, 16), dtypes=("float32", "bfloat16")
      ).flatmap(lambda case: st.tuples(st.just(case), fs.routing_faults(case)))
  )
  def test_routed_experts_with_bad_routing(self, case_and_faults):
    """R3, R4: a token with an id out of range (traced) or a NaN combine
    weight gets a NaN row, other rows are unchanged; concrete ids out of
    range raise. Alike on every backend."""
    case, (bad_ids, nan_weights) = case_and_faults
    cfg = case.cfg
    params, tokens, aux = _routed(case)
    faulty = _with_routing_faults(aux, bad_ids, nan_weights)
    bad_tokens = np.zeros(case.num_tokens, bool)
    bad_tokens[[f[0] for f in bad_ids] + [f[0] for f in nan_weights]] = True
    outcomes = {}
    for name, backend in _backends().items():
      traced = _traced(name, case)
      msg = f"{name} ({'traced' if traced else 'static'})"

      def routed(params, x, aux, backend=backend):
        return backend.routed_experts(params, x, aux, cfg)

      routed = jax.jit(routed) if traced else routed
      if bad_ids and not traced:
        got = _raised_or(lambda: routed(params, tokens, faulty))
        self.assertRaisedExactly(
            got, ValueError, _ids_message(faulty.expert_ids, cfg), msg
        )
        continue
      y = _to_numpy(routed(params, tokens, faulty))
      clean = _to_numpy(routed(params, tokens, aux))
      self.assertTrue(
          np.all(np.isnan(y[bad_tokens])), f"{msg}: faulty tokens' rows"
      )
      self.assertTrue(np.all(np.isfinite(y[~bad_tokens])), msg)
      self.assertWithin(
          y[~bad_tokens],
          clean[~bad_tokens],
          _tolerance(case.dtype),
          f"{msg}: the other rows must not change",
      )
      outcomes[name] = y
    if outcomes:
      want = outcomes.get("reference", next(iter(outcomes.values())))
      for name, y in outcomes.items():
        self.assertWithin(
            y[~bad_tokens],
            want[~bad_tokens],
            _tolerance(case.dtype),
            f"{name}: valid rows vs reference",
        )

  # --- Hash routing's table and token ids (R1) -------------------------------

  @_examples(1)
  @hypothesis.given(fault=fs.hash_faults())
  def test_hash_routing_faults_give_documented_outcome(self, fault):
    """R1 for DeepSeek-V4's hash routing: eagerly, a table id outside
    [0, E + Z) raises naming the table; under jit (and eagerly for bad token
    ids alone) the tokens that read a bad row or have an id outside [0, V)
    are invalid (NaN y rows and weights, counted, not kept, out of
    tokens_per_expert), the others valid and as in the valid call
    (dropless); alike on every backend. Found: a traced table's bad ids gave
    NaN rows counted as kept, -1 counted for expert 0."""
    case, cfg = fault.case, fault.case.cfg
    params, x, token_ids, good_params, good_ids = fs.hash_fault_inputs(fault)
    table = np.asarray(params["hash_table"]).astype(np.int64)
    width = cfg.num_router_experts
    invalid = bad_input_outcomes.tokens_with_bad_hash(
        dict(cfg=cfg, hash_table=table, token_ids=token_ids)
    )
    t, k = case.num_tokens, cfg.top_k
    outcomes = {}
    for name, backend in _backends().items():
      traced = _traced(name, case)
      msg = f"{name} ({'traced' if traced else 'static'})"
      got = _layer(backend, params, x, cfg, traced, token_ids)
      if not _supports(backend, case.dtype):
        self.assertIsInstance(got, Raised, msg)
        self.assertIs(got.kind, NotImplementedError, f"{msg}: {got.message}")
        continue
      if fault.entries and not traced:
        self.assertRaisedExactly(
            got,
            ValueError,
            f"hash_table must hold expert ids in [0, {width}), got values "
            f"in [{table.min()}, {table.max()}].",
            msg,
        )
        continue
      if isinstance(got, Raised):
        self.fail(f"{msg} raised {got.kind.__name__}: {got.message}")
      aux = got.aux
      self.assertEqual(int(aux["invalid_assignments"]), k * invalid.sum(), msg)
      self.assertFalse(np.any(aux["kept"][invalid]), f"{msg}: kept")
      self.assertTrue(np.all(np.isnan(aux["combine_weights"][invalid])), msg)
      self.assertEqual(
          int(aux["kept"].sum())
          + int(aux["dropped_tokens"])
          + int(aux["invalid_assignments"]),
          t * k,
          f"{msg}: kept + dropped + invalid != T*K",
      )
      np.testing.assert_array_equal(
          aux["tokens_per_expert"],
          np.bincount(aux["expert_ids"][~invalid].ravel(), minlength=width),
          f"{msg}: tokens_per_expert counts the valid assignments only",
      )
      self.assertTrue(np.all(np.isnan(got.y[invalid])), f"{msg}: invalid y")
      self.assertTrue(np.all(np.isfinite(got.y[~invalid])), f"{msg}: valid y")
      outcomes[name] = got
    if not outcomes:
      return
    want = outcomes.get("reference")
    if cfg.dropless:  # With capacity the invalid tokens free their slots.
      want = _layer(
          _backends()["reference"], good_params, x, cfg, case.jit, good_ids
      )
    if want is None:
      return
    for name, got in outcomes.items():
      self.assertWithin(
          got.y[~invalid],
          want.y[~invalid],
          _tolerance(case.dtype),
          f"{name}: the valid tokens' y",
      )

  # --- Config floats at float32's edges --------------------------------------

  @_examples(1)
  @hypothesis.given(edge=fs.config_float_edges())
  def test_config_floats_past_float32_are_refused(self, edge):
    """A MoEConfig float that float32 makes inf or 0 (a subnormal too) is
    refused naming the field and float32's range; one float32 holds is
    accepted, and in `fs.FLOAT32_RUN_RANGE` gives a finite, fully counted
    layer on every backend, as the reference's. Found: soft-caps, scales
    and norm epsilons of 1e39 or 1e-50 gave NaN outputs, some uncounted."""
    fields, name, value = edge
    got = _raised_or(lambda: moe_core.MoEConfig(**fields))
    in_range = config_lib.FLOAT32_TINY <= abs(value) <= config_lib.FLOAT32_MAX
    if not in_range:
      self.assertIsInstance(got, Raised, f"{name}={value!r} was accepted")
      self.assertIs(got.kind, ValueError, got.message)
      self.assertTrue(got.message.startswith(f"{name} must be "), got.message)
      self.assertIn("within float32's range", got.message)
      self.assertTrue(got.message.endswith(f"got {value!r}."), got.message)
      return
    self.assertNotIsInstance(got, Raised, f"{name}={value!r}: {got}")
    low, high = fs.FLOAT32_RUN_RANGE
    if not low <= abs(value) <= high:
      return
    case = cases.LayerCase(
        name="fuzz_float32_edge", cfg=got, batch_shape=(3,), seed=7
    )
    params, x, _ = cases.layer_inputs(case)
    oracle = self._oracle(case, params, x)
    self.assertFiniteAndCounted(oracle, case, f"reference, {name}={value!r}")
    for backend_name in _backends():
      if backend_name != "reference":
        self._check_backend_matches_oracle(
            backend_name, case, params, x, oracle
        )

  # --- Group sizes (R5) ------------------------------------------------------

  @_examples(0.75)
  @hypothesis.given(fault=fs.gemm_faults())
  def test_bad_group_sizes_poison_gemm_and_ffn(self, fault):
    """R5: concrete bad group sizes raise the documented message; traced
    ones make the whole output NaN and put NaN in the gradients of rows
    and weights. grouped_gemm and expert_ffn, every backend."""
    sizes = list(fault.group_sizes)
    if min(sizes) < 0:
      want = f"group_sizes must be >= 0, got {sizes}."
    else:
      want = (
          f"sum(group_sizes) must be <= the {fault.m} rows, got "
          f"sum={sum(sizes)} (group_sizes={sizes})."
      )
    rows, weights, group_sizes, cotangent = fs.gemm_fault_inputs(fault)
    ffn_rows, ffn_sizes, ffn_params, ffn_cfg, ffn_cotangent = (
        fs.ffn_fault_inputs(fault)
    )
    expert_weights = {n: ffn_params[n] for n in ("w_gate", "w_up", "w_down")}
    for name, backend in _backends().items():

      def gemm(rows, weights, sizes, backend=backend):
        return backend.grouped_gemm(
            rows, weights, sizes, transpose_rhs=fault.transpose_rhs
        )

      def ffn(rows, weights, sizes, backend=backend):
        return backend.expert_ffn(
            rows, sizes, dict(ffn_params, **weights), ffn_cfg
        )

      if not fault.jit:
        for what, call in (
            ("grouped_gemm", lambda: gemm(rows, weights, group_sizes)),
            ("expert_ffn", lambda: ffn(ffn_rows, expert_weights, ffn_sizes)),
        ):
          self.assertRaisedExactly(
              _raised_or(call), ValueError, want, f"{name}: {what}"
          )
        continue
      for what, fn, args, cot in (
          ("grouped_gemm", gemm, (rows, weights, group_sizes), cotangent),
          (
              "expert_ffn",
              ffn,
              (ffn_rows, expert_weights, ffn_sizes),
              ffn_cotangent,
          ),
      ):
        out, d_rows, d_weights = jax.jit(_value_and_vjp(fn))(*args, cot)
        msg = f"{name}: {what} (traced)"
        self.assertTrue(np.all(np.isnan(_to_numpy(out))), f"{msg}: output")
        self.assertTrue(np.any(np.isnan(_to_numpy(d_rows))), f"{msg}: d_rows")
        for leaf in jax.tree_util.tree_leaves(d_weights):
          self.assertTrue(np.any(np.isnan(_to_numpy(leaf))), f"{msg}: d_w")

  @_examples(0.125)
  @hypothesis.given(fault=_int64_sizes_that_wrap())
  def test_int64_group_sizes_past_int32_poison_gemm(self, fault):
    """R5 with jax_enable_x64: traced int64 sizes whose int32 wrap is valid
    make the whole output NaN, every backend (checked before any cast).

    The forward of grouped_gemm only, to keep ci's time to seconds;
    BadInputSuite's x64 rows check expert_ffn, the gradients and the eager
    error on every backend.
    """
    rows, weights, _, _ = fs.gemm_fault_inputs(
        dataclasses.replace(fault, group_sizes=(0,) * len(fault.group_sizes))
    )
    with jax.enable_x64(True):
      sizes = np.asarray(fault.group_sizes, np.int64)
      for name, backend in _backends().items():

        def gemm(rows, weights, sizes, backend=backend):
          return backend.grouped_gemm(
              rows, weights, sizes, transpose_rhs=fault.transpose_rhs
          )

        out = jax.jit(gemm)(rows, weights, sizes)
        self.assertTrue(
            np.all(np.isnan(_to_numpy(out))), f"{name}: {fault.group_sizes}"
        )

  # --- update_correction_bias (R6) ------------------------------------------

  @_examples(3)
  @hypothesis.given(update=fs.bias_updates())
  def test_correction_bias_update_policy(self, update):
    """R6: a bad Python rate raises naming it; concrete bad counts raise;
    traced bad counts or rate give an all-NaN bias; NaN in the bias stays
    where it is; otherwise bias + rate * sign(mean - load)."""
    bias = np.asarray(update.bias, np.float32)
    counts = np.asarray(update.counts).astype(update.counts_dtype)
    rate = update.rate
    bad_rate = not (math.isfinite(rate) and rate >= 0)
    bad_counts = not (
        np.all(np.isfinite(update.counts)) and min(update.counts) >= 0
    )
    if update.traced_rate:
      args = (bias, counts, np.float32(rate))
      call = jax.jit(moe_core.update_correction_bias)
    else:
      args = (bias, counts)

      def call(bias, counts):
        return moe_core.update_correction_bias(bias, counts, rate)

      call = jax.jit(call) if update.jit else call
    got = _raised_or(lambda: call(*args))
    if bad_rate and not update.traced_rate:
      self.assertIsInstance(got, Raised)
      self.assertIs(got.kind, ValueError, got.message)
      self.assertTrue(got.message.startswith("rate must be"), got.message)
    elif bad_counts and not update.jit:
      self.assertIsInstance(got, Raised)
      self.assertIs(got.kind, ValueError, got.message)
      self.assertTrue(
          got.message.startswith("tokens_per_expert must"), got.message
      )
    elif bad_counts or bad_rate:
      self.assertNotIsInstance(got, Raised)
      self.assertTrue(np.all(np.isnan(np.asarray(got))), "traced bad input")
    else:
      self.assertNotIsInstance(got, Raised)
      load = counts.astype(np.float64)
      want = bias + rate * np.sign(load.mean() - load)
      np.testing.assert_allclose(
          np.asarray(got), want, rtol=1e-6, atol=1e-7, equal_nan=True
      )

  # --- mosaic_tpu's launch options -------------------------------------------

  @_examples(0.375)
  @hypothesis.given(call=fs.offset_gemms())
  def test_mosaic_tpu_group_offset(self, call):
    """mosaic_tpu's grouped GEMM over the groups [offset, offset + E) of G
    gives the rows of those groups times their weights, zeros elsewhere
    (numpy); each fault of `call.faults()` on the same call raises a
    ValueError naming the argument when concrete, and makes the whole
    output NaN when traced (narrow weights raise at trace time). Found:
    offsets out of range clamped to G - E, 7-wide weights against 8-wide
    rows accepted, a negative size a finite output."""
    backend = moe_core.get_backend("mosaic_tpu", interpret=True)
    g, e, m = len(call.group_sizes), call.num_local, call.m
    eager = backend.ops.grouped_gemm_with_offset
    traced = jax.jit(eager, static_argnums=4)

    def gemm(run, offset, sizes, width):
      rows, weights = fs.offset_gemm_inputs(call, width)
      sizes = jnp.asarray(sizes, jnp.int32)
      return _raised_or(
          lambda: run(rows, weights, sizes, offset, backend.launch)
      )

    got = gemm(traced, jnp.int32(call.offset), call.group_sizes, 8)
    self.assertNotIsInstance(got, Raised, str(got))
    rows, weights = fs.offset_gemm_inputs(call)
    self.assertWithin(
        _to_numpy(got),
        oracles.grouped_gemm_with_offset(
            rows, weights, call.group_sizes, call.offset
        ),
        _tolerance("float32"),
        "vs numpy",
    )
    words = {
        "offset": f"group_offset must lie in [0, G - E = {g - e}] (G={g} ",
        "negative": "group_sizes must be >= 0, got ",
        "past_rows": f"sum(group_sizes) must be <= the {m} rows, got ",
        "narrow": "weights [E, C, N] must contract over rows' C=8, got ",
    }
    for fault, (offset, sizes, width) in call.faults().items():
      got = gemm(eager, offset, sizes, width)
      self.assertIsInstance(got, Raised, f"{fault} accepted")
      self.assertIs(got.kind, ValueError, f"{fault}: {got.message}")
      self.assertTrue(got.message.startswith(words[fault]), got.message)
      got = gemm(traced, jnp.int32(offset), sizes, width)
      if fault == "narrow":
        self.assertIsInstance(got, Raised, "narrow weights traced")
        self.assertIs(got.kind, ValueError, got.message)
      else:
        self.assertTrue(np.all(np.isnan(_to_numpy(got))), f"{fault}: {got}")

  @_examples(0.375)
  @hypothesis.given(call=fs.tiled_gemms())
  def test_mosaic_tpu_tiles_and_zero_widths(self, call):
    """mosaic_tpu with the caller's tiles (whole K or steps, any kind left
    to the table): the grouped GEMM and both gradients match numpy, and
    with the output or the contracted width 0 instead, numpy's empty or
    zero arrays. Found: bk=None failed jax.grad for a width not a multiple
    of 128; a width of 0 failed outright."""
    backend = moe_core.get_backend(
        "mosaic_tpu", tiles=call.tiles, interpret=True
    )

    def gemm(rows, weights, sizes):
      return backend.grouped_gemm(
          rows, weights, sizes, transpose_rhs=call.transpose_rhs
      )

    run = _value_and_vjp(gemm)
    run = jax.jit(run) if call.jit else run
    for shape in (
        call,
        dataclasses.replace(call, width=0),
        dataclasses.replace(call, out_width=0),
    ):
      msg = f"C={shape.width}, N={shape.out_width}"
      rows, weights, sizes, cotangent = fs.tiled_gemm_inputs(shape)
      got = _raised_or(lambda: run(rows, weights, sizes, cotangent))
      self.assertNotIsInstance(got, Raised, f"{msg}: {got}")
      want = (
          oracles.grouped_gemm(rows, weights, sizes, call.transpose_rhs),
          *oracles.grouped_gemm_grads(
              rows, weights, sizes, cotangent, call.transpose_rhs
          ),
      )
      for name, actual, expected, kind in zip(
          ("out", "d_rows", "d_weights"),
          got,
          want,
          ("forward", "gradient", "gradient"),
      ):
        self.assertWithin(
            _to_numpy(actual),
            expected,
            tolerances.lookup("float32", kind),
            f"{msg}: {name} vs numpy",
        )

  @_examples(0.75)
  @hypothesis.example(kind="TPU v4")
  @hypothesis.given(kind=st.sampled_from(tuple(fs.TPU_KINDS)))
  def test_mosaic_tpu_on_every_tpu_kind(self, kind):
    """Compiled for a TPU of `kind` (an abstract one, as moe_core.aot
    lowers for): the kernels take that chip's generation's tiles, or, for
    a chip the tile table lacks, the backend refuses (NotImplementedError
    naming the kind; unavailable there, so "auto" moves on). Found: v4
    got the v5e's tiles, which overflow its VMEM."""
    backend = moe_core.get_backend("mosaic_tpu")
    # Exported for a TPU: jax 0.10 lowers a compiled Mosaic kernel for no
    # other platform.
    run = export.export(
        jax.jit(_value_and_vjp(backend.grouped_gemm)), platforms=["tpu"]
    )
    rows = jnp.ones((16, 128), jnp.bfloat16)
    weights = jnp.ones((2, 128, 128), jnp.bfloat16)
    sizes = jnp.asarray([8, 8], jnp.int32)
    want = fs.TPU_KINDS[kind]
    with (
        _tpu_mesh(kind),
        mock.patch.object(jax, "default_backend", return_value="tpu"),
    ):
      got = _raised_or(lambda: run(rows, weights, sizes, rows))
      available, why = backend.availability()
      if want is None:
        self.assertIsInstance(got, Raised, f"{kind}: lowered")
        self.assertIs(got.kind, NotImplementedError, got.message)
        self.assertIn(f"got device_kind {kind!r}", got.message)
        self.assertEqual((available, why), (False, got.message))
      else:
        self.assertNotIsInstance(got, Raised, f"{kind}: {got}")
        self.assertEqual(backend.launch.kernel_launch().generation, want)
        self.assertTrue(available, why)

  # --- Failures the fuzzer found, pinned -------------------------------------

  def test_regression_invalid_tokens_output_nan_on_every_backend(self):
    """R1: an infinite correction bias makes every token invalid, so every
    output row is NaN. Found: the reference returned 0 for them (its
    mixture zeroes the weights of unkept copies, NaN ones included)."""
    case = _small_case(correction_bias=True)
    params, x = fs.faulty_inputs(
        case, (fs.Fault("correction_bias", (2,), math.inf),)
    )
    for name, backend in _backends().items():
      got = _layer(backend, params, x, case.cfg, jit=False)
      self.assertEqual(int(got.aux["invalid_assignments"]), case.num_tokens)
      self.assertTrue(np.all(np.isnan(got.y)), f"{name}: y = {got.y}")

  def test_regression_underflowing_sigmoid_scores_give_finite_rows(self):
    """Finite logits, finite outputs: sigmoid scores, norm_topk_prob and
    norm_epsilon 0, every logit near -1e4. Found (issue 28): each score
    underflowed to 0, the renormalisation was 0/0, and the NaN rows were
    counted as kept; the strategies then drew logits of about +-3 only."""
    case = _small_case(score_func="sigmoid", norm_topk_prob=True, top_k=2)
    params, x = fs.extreme_inputs(
        case,
        fs.RouterExtreme(
            offset=-1e4,
            spread=1.0,
            one_hot=None,
            one_hot_gap=0.0,
            bias_scale=1.0,
        ),
    )
    for name, backend in _backends().items():
      got = _layer(backend, params, x, case.cfg, jit=False)
      self.assertNotIsInstance(got, Raised, name)
      self.assertFiniteAndCounted(got, case, name)
      np.testing.assert_allclose(
          got.aux["combine_weights"].sum(-1), 1.0, rtol=1e-6, err_msg=name
      )

  def test_regression_nan_expert_weights_reach_only_their_tokens(self):
    """R7 and docs/api.md ("propagates to the tokens that use them"): NaN in
    the weights of an expert no token chose leaves every output finite.
    Found: the reference's y was NaN everywhere (it runs every expert on
    every token and multiplies the unchosen ones by 0)."""
    case = _small_case()
    params, x = fs.faulty_inputs(
        case, (fs.Fault("w_gate", (1, 0, 0), math.nan),)
    )
    for name, backend in _backends().items():
      got = _layer(backend, params, x, case.cfg, jit=False)
      np.testing.assert_array_equal(got.aux["expert_ids"], 0)  # Hot expert.
      self.assertTrue(np.all(np.isfinite(got.y)), f"{name}: y = {got.y}")

  def test_regression_nan_weight_of_a_dropped_copy_gives_nan_row(self):
    """R3: a NaN combine weight makes its token's row NaN even where
    capacity dropped the copy. Found: the reference's row was finite."""
    # One slot per expert (ceil(0.5 * 4 * 1 / 4)); every token wants
    # expert 0, so tokens 1..3 are dropped.
    case = _small_case(capacity_factor=0.5)
    params, tokens, aux = _routed(case)
    np.testing.assert_array_equal(np.asarray(aux.kept)[:, 0], [1, 0, 0, 0])
    faulty = _with_routing_faults(aux, (), ((1, 0),))
    for name, backend in _backends().items():
      y = _to_numpy(backend.routed_experts(params, tokens, faulty, case.cfg))
      self.assertTrue(np.all(np.isnan(y[1])), f"{name}: row 1 = {y[1]}")
      self.assertTrue(np.all(np.isfinite(y[[0, 2, 3]])), name)


def _tpu_mesh(device_kind: str):
  """An abstract one-chip TPU mesh of `device_kind`, as `moe_core.aot`
  lowers inside."""
  device = jax.sharding.AbstractDevice(
      device_kind=device_kind, num_cores=1, platform="tpu"
  )
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def _routed(case: cases.LayerCase):
  """(params, tokens [T, D], aux): the case's inputs, routed."""
  params, x, _ = cases.layer_inputs(case)
  tokens = x.reshape(-1, case.cfg.hidden_size)
  aux = moe_core.route(
      tokens, params["router"], case.cfg, params.get("correction_bias")
  )
  return params, tokens, aux


def _with_routing_faults(aux, bad_ids, nan_weights):
  """aux with ids out of range ((token, choice, id), ...) and NaN combine
  weights ((token, choice), ...) written in."""
  ids = np.array(aux.expert_ids)
  weights = np.array(aux.combine_weights)
  for token, choice, expert in bad_ids:
    ids[token, choice] = expert
  for token, choice in nan_weights:
    weights[token, choice] = np.nan
  return dataclasses.replace(
      aux, expert_ids=jnp.asarray(ids), combine_weights=jnp.asarray(weights)
  )


def _ids_message(ids, cfg) -> str:
  """The documented error for concrete ids out of range (R2, R4)."""
  ids = np.asarray(ids)
  return (
      f"expert_ids must lie in [0, num_experts={cfg.num_experts}), got "
      f"values in [{ids.min()}, {ids.max()}]."
  )


def _value_and_vjp(fn):
  """(rows, weights, sizes, cotangent) -> (fn(...), d_rows, d_weights)."""

  def run(rows, weights, sizes, cotangent):
    out, vjp = jax.vjp(lambda r, w: fn(r, w, sizes), rows, weights)
    d_rows, d_weights = vjp(cotangent.astype(out.dtype))
    return out, d_rows, d_weights

  return run


def _invalid_tokens(logits, cfg, bias) -> np.ndarray:
  """[T] bool: the tokens R1 makes invalid, from float64 logits [T, E].

  docs/api.md, "Guarantees": NaN or Inf in x, the router or the correction bias
  makes the tokens it touches invalid, i.e. those with a non-finite logit
  or selection score (scores + bias). A sigmoid maps an infinite logit to
  a finite score, so the logits count on their own.
  """
  with np.errstate(all="ignore"):
    if cfg.score_func == "softmax":
      z = np.exp(logits - logits.max(axis=-1, keepdims=True))
      scores = z / z.sum(axis=-1, keepdims=True)
    else:
      scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + (0.0 if bias is None else oracles.f64(bias))
  finite = np.isfinite(logits) & np.isfinite(choice)
  return ~np.all(finite, axis=-1)


if __name__ == "__main__":
  absltest.main()
