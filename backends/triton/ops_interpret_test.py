"""The triton backend with every kernel in Triton's interpreter, on the CPU.

TritonBackend(interpret=True) against the reference backend and
moe_core.permute: the grouped GEMM in both layouts (forward, dX, dW; empty
groups, NaN in the padding rows, sum(group_sizes) < M), the expert FFN fused
and unfused for each activation, dispatch and combine with their gradients
(dropped copies, invalid ids, a NaN weight), and a small MoE layer with the
routing weights in the down GEMM's epilogue and without. The interpreter
needs torch: on legs without it every test but the tile list's skips.
Tiles are the interpreter's 16x32x32, so groups straddle row tiles and C and
N take several blocks.
"""

from __future__ import annotations

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.triton import backend as triton_backend
from backends.triton import launch
from backends.triton import ops
from conformance import base
from conformance import cases
from conformance import tolerances
from moe_core import activations
from moe_core import backend as backend_lib
from moe_core import permute
from moe_core import registry

if "triton" not in registry.registered_backends():
  registry.register_backend("triton", "backends.triton.backend:TritonBackend")

_INTERPRET = launch.Runner(mode="interpret")

# Kernel launches cost ~10 ms per program in the interpreter: a subset of
# the conformance cases that still has every layout and edge (the shared
# suite runs them all on a GPU).
_GEMM_CASES = tuple(
    cases.GEMM_BY_NAME[n]
    for n in (
        "f32_full",
        "bf16_padded",
        "f32_transposed",
        "bf16_transposed_padded",
        "one_row",
        "odd_37_k48_n80",
        "all_groups_empty",
        "bf16_rows_f32_out",
    )
)


def _kernels_or_skip(test):
  """backends.triton.kernels (imports triton), or skips the test."""
  try:
    # pylint: disable-next=g-import-not-at-top
    from backends.triton import kernels
  except ImportError as e:
    test.skipTest(f"triton is not importable here: {e}")
  return kernels


class TileListTest(parameterized.TestCase):
  """ops.tile_list (JAX, on device) against the kernels' numpy rule."""

  @parameterized.parameters(
      ((10, 0, 23, 31), 64, 16),
      ((5, 17, 0, 20), 64, 16),  # 22 tail rows.
      ((0, 1, 0), 1, 16),
      ((3, 0, 34), 37, 16),
      ((64, 1, 0, 60), 129, 32),
      ((0, 0, 0), 24, 16),
      ((16, 16, 16), 48, 16),  # Boundaries on the tile grid.
      ((17,), 20, 64),
      ((0,), 0, 16),
  )
  def test_matches_numpy_rule(self, sizes, m, block_m):
    kernels = _kernels_or_skip(self)
    got = jax.jit(ops.tile_list, static_argnums=(1, 2))(
        jnp.asarray(sizes, jnp.int32), m, block_m
    )
    want = kernels.tile_list(np.asarray(sizes), m, block_m)
    for name, g, w in zip(
        ("group_offsets", "group_ids", "m_tile_ids", "num_tiles"), got, want
    ):
      self.assertEqual(g.dtype, jnp.int32, name)
      np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)

  @parameterized.parameters(((7, 0, 9, 30), 50, 16), ((1, 1, 1, 1), 8, 16))
  def test_every_row_has_one_visit(self, sizes, m, block_m):
    """Each row is owned by exactly one listed (group, tile) visit."""
    offsets, group_ids, tiles, num_tiles = (
        np.asarray(a)
        for a in ops.tile_list(jnp.asarray(sizes, jnp.int32), m, block_m)
    )
    self.assertEqual(len(group_ids), -(-m // block_m) + len(sizes))
    starts = np.append(offsets, m)
    owners = np.zeros(m, np.int64)
    for g, t in zip(group_ids[: num_tiles[0]], tiles[: num_tiles[0]]):
      rows = np.arange(t * block_m, min((t + 1) * block_m, m))
      mine = rows[(rows >= starts[g]) & (rows < starts[g + 1])]
      self.assertGreater(mine.size, 0, f"visit ({g}, {t}) owns no row")
      owners[mine] += 1
    np.testing.assert_array_equal(owners, 1)


class InterpretTestCase(parameterized.TestCase):
  """Skips unless Triton's interpreter can run here (torch and triton)."""

  def setUp(self):
    super().setUp()
    ok, reason = launch.availability(_INTERPRET)
    if not ok:
      self.skipTest(reason)

  def backend(self, **options):
    """The backend in the interpreter; the activation fused unless told
    (the tests' path before the epilogue became opt-in)."""
    options = {"fuse_activation": True, **options}
    return triton_backend.TritonBackend(interpret=True, **options)

  def assertClose(self, actual, expected, dtype, kind="forward", msg=""):
    problem = tolerances.violation(
        actual, expected, tolerances.lookup(dtype, kind)
    )
    if problem:
      self.fail(f"{msg}: {problem}")

  def assertAllZero(self, x, msg=""):
    x = np.asarray(x).astype(np.float64)
    self.assertTrue(np.all(x == 0), f"{msg}: not all exactly zero")


class GroupedGemmTest(InterpretTestCase):

  @parameterized.named_parameters((c.name, c) for c in _GEMM_CASES)
  def test_matches_reference(self, case):
    got = base.compute_gemm(self.backend(), case, jit=True)
    want = base.reference_gemm(case)
    used = case.used_rows
    self.assertEqual(got.out.dtype, np.dtype(case.result_dtype))
    self.assertEqual(got.d_rows.dtype, np.dtype(case.dtype))
    self.assertEqual(got.d_weights.dtype, np.dtype(case.dtype))
    self.assertClose(got.out[:used], want.out[:used], case.dtype, msg="out")
    self.assertClose(
        got.d_rows[:used], want.d_rows[:used], case.dtype, "gradient", "dX"
    )
    self.assertClose(
        got.d_weights, want.d_weights, case.dtype, "gradient", "dW"
    )
    # The padding rows hold NaN: exact zeros out, exact zero gradient.
    self.assertAllZero(got.out[used:], "padding rows of out")
    self.assertAllZero(got.d_rows[used:], "padding rows of dX")
    for g, size in enumerate(case.group_sizes):
      if size == 0:
        self.assertAllZero(got.d_weights[g], f"dW of empty group {g}")

  def test_eager_matches_jit(self):
    """Op by op, each kernel is its own pure_callback: same results."""
    case = cases.GEMM_BY_NAME["one_row"]
    eager = base.compute_gemm(self.backend(), case, jit=False)
    jitted = base.compute_gemm(self.backend(), case, jit=True)
    for name in ("out", "d_rows", "d_weights"):
      np.testing.assert_array_equal(
          getattr(eager, name), getattr(jitted, name), err_msg=name
      )


# Config fields of each activation case: the plain GLUs by name, the clamp
# (at these scales it clamps part of gate and up), and the registry's GLUs
# with their options.
_ACTIVATION_CASES = {
    "silu": dict(activation="silu"),
    "gelu": dict(activation="gelu"),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "silu_clamped": dict(activation="silu", swiglu_limit=0.5),
    "gpt_oss_glu_clamped": dict(
        activation="gpt_oss_glu", swiglu_alpha=1.702, swiglu_limit=0.5
    ),
    "softcapped_silu": dict(
        activation="softcapped_silu", gate_softcap=0.6, up_softcap=0.8
    ),
}


class ExpertFfnTest(InterpretTestCase):

  @parameterized.product(
      fuse_activation=(False, True),
      activation=(
          "silu",
          "gelu",
          "gelu_tanh",
          "silu_clamped",
          "gpt_oss_glu_clamped",
          "softcapped_silu",
      ),
  )
  def test_matches_reference(self, fuse_activation, activation):
    m, d, f, used = 40, 32, 48, 35
    sizes = jnp.array([12, 0, 17, 6], jnp.int32)  # 5 padding rows.
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((m, d)).astype(np.float32)
    rows[used:] = np.nan
    params = {
        "w_gate": rng.standard_normal((4, d, f)) / d**0.5,
        "w_up": rng.standard_normal((4, d, f)) / d**0.5,
        "w_down": rng.standard_normal((4, f, d)) / f**0.5,
    }
    params = {n: jnp.asarray(p, jnp.float32) for n, p in params.items()}
    cotangent = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    cfg = moe_core.MoEConfig(
        num_experts=4,
        top_k=2,
        hidden_size=d,
        expert_ffn_size=f,
        **_ACTIVATION_CASES[activation],
    )

    def run(be, rows):
      def loss(rows, params):
        y = be.expert_ffn(rows, sizes, params, cfg)
        return jnp.sum(y * cotangent), y

      (_, y), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(
          rows, params
      )
      return y, grads

    be = self.backend(fuse_activation=fuse_activation)
    # Every case runs in the epilogue when asked, the clamp and options too.
    self.assertEqual(
        be.checkpoint_names(cfg),
        (backend_lib.DOWN_NAME,)
        if fuse_activation
        else backend_lib.CHECKPOINT_NAMES,
    )
    y, (d_rows, d_params) = jax.jit(lambda r: run(be, r))(jnp.asarray(rows))
    ref = moe_core.get_backend("reference")
    want_y, (want_rows, want_params) = jax.jit(lambda r: run(ref, r))(
        jnp.asarray(np.where(np.isnan(rows), 0, rows))
    )
    self.assertClose(y[:used], want_y[:used], "float32", msg="y")
    self.assertAllZero(y[used:], "padding rows of y")
    self.assertClose(
        d_rows[:used], want_rows[:used], "float32", "gradient", "d rows"
    )
    self.assertAllZero(d_rows[used:], "padding rows of d rows")
    for name in params:
      self.assertClose(
          d_params[name], want_params[name], "float32", "gradient", name
      )
      self.assertAllZero(d_params[name][1], f"d {name} of empty expert 1")


class EpilogueFallbackTest(InterpretTestCase):
  """What the gated kernel cannot compute runs unfused, never wrongly."""

  def test_biases_and_registered_activations_run_unfused(self):
    # Biases go between the products and the activation; a registered
    # activation is arbitrary JAX the kernel does not know.
    name = "abs_glu_for_triton_test"
    activations.register(
        activations.Activation(name, True, lambda g, u, s: jnp.abs(g) * u)
    )
    self.addCleanup(activations._REGISTRY.pop, name)
    be = self.backend(fuse_activation=True)
    ref = moe_core.get_backend("reference")
    sizes = jnp.array([9, 0, 7], jnp.int32)
    rows = jax.random.normal(jax.random.key(0), (16, 16))
    for changes in (
        dict(expert_bias=True, swiglu_limit=0.5),
        dict(activation=name),
    ):
      cfg = moe_core.MoEConfig(
          num_experts=3, top_k=1, hidden_size=16, expert_ffn_size=24, **changes
      )
      params = moe_core.init_params(jax.random.key(1), cfg)
      params = {
          n: v + 0.3 if n.startswith("b_") else v for n, v in params.items()
      }
      with self.subTest(**{k: str(v) for k, v in changes.items()}):
        self.assertEqual(be.checkpoint_names(cfg), backend_lib.CHECKPOINT_NAMES)
        loss = lambda b, p: jnp.sum(jnp.sin(b.expert_ffn(rows, sizes, p, cfg)))
        got = jax.value_and_grad(loss, 1)(be, params)
        want = jax.value_and_grad(loss, 1)(ref, params)
        self.assertClose(got[0], want[0], "float32", msg="loss")
        for n in params:
          self.assertClose(got[1][n], want[1][n], "float32", "gradient", n)


def _route(cfg, dtype):
  x, router, _, _, _ = cases.permute_inputs(cfg)
  aux = moe_core.route(x, router, cfg)
  return x.astype(dtype), aux


def _permute_case(cfg, dtype, invalid_tokens=(), nan_weight=None):
  """(x, aux, expert_out, cotangent) for the dispatch/combine stages.

  expert_out holds NaN in the rows past the groups (dropped or invalid
  copies); `invalid_tokens` get an out-of-range expert id (traced under
  jit, so marked invalid rather than raising); `nan_weight` is a (t, k)
  whose combine weight becomes NaN.
  """
  x, aux = _route(cfg, dtype)
  _, _, expert_out, weights, cotangent = cases.permute_inputs(cfg)
  ids = np.array(aux.expert_ids)
  for t in invalid_tokens:
    ids[t, 0] = cfg.num_experts + 3
  weights = np.where(np.asarray(aux.kept), np.asarray(weights), 0.0)
  if nan_weight is not None:
    weights[nan_weight] = np.nan
  aux = dataclasses.replace(
      aux,
      expert_ids=jnp.asarray(ids, jnp.int32),
      combine_weights=jnp.asarray(weights, jnp.float32),
  )
  return x, aux, expert_out.astype(dtype), cotangent.astype(dtype)


class DispatchCombineTest(InterpretTestCase):
  """backend.dispatch / combine against moe_core.permute, values and vjps."""

  @parameterized.named_parameters(
      ("dropless_f32", cases.PERMUTE_CFG, "float32", (), None),
      ("dropless_bf16", cases.PERMUTE_CFG, "bfloat16", (), None),
      ("capacity_f32", cases.PERMUTE_CAPACITY_CFG, "float32", (), None),
      (
          "invalid_ids_and_nan_weight",
          cases.PERMUTE_CFG,
          "float32",
          (2, 9),
          (5, 1),
      ),
      (
          "capacity_invalid_bf16",
          cases.PERMUTE_CAPACITY_CFG,
          "bfloat16",
          (4,),
          None,
      ),
  )
  def test_match_moe_core_permute(self, cfg, dtype, invalid_tokens, nan_weight):
    x, aux, expert_out, cotangent = _permute_case(
        cfg, dtype, invalid_tokens, nan_weight
    )
    kept = None if cfg.dropless else aux.kept
    be = self.backend()

    def stages(dispatch, combine):
      """rows, their vjp in x, y and its vjp in (expert_out, weights)."""

      def run(x, expert_out, ids, weights):
        rows, rows_vjp = jax.vjp(lambda x: dispatch(x, ids), x)
        y, y_vjp = jax.vjp(
            lambda out, w: combine(out, ids, w), expert_out, weights
        )
        (d_x,) = rows_vjp(expert_out)
        d_out, d_w = y_vjp(cotangent)
        return rows, d_x, y, d_out, d_w

      return jax.jit(run)(x, expert_out, aux.expert_ids, aux.combine_weights)

    def with_aux(ids, w=None):
      changes = dict(expert_ids=ids)
      if w is not None:
        changes["combine_weights"] = w
      return dataclasses.replace(aux, **changes)

    got = stages(
        lambda x, ids: be.dispatch(x, with_aux(ids), cfg).rows,
        lambda out, ids, w: be.combine(
            out, be.dispatch(x, with_aux(ids), cfg), with_aux(ids, w), cfg
        ),
    )
    want = stages(
        lambda x, ids: permute.dispatch(x, ids, cfg.num_experts, kept).rows,
        lambda out, ids, w: permute.combine(
            out, permute.dispatch(x, ids, cfg.num_experts, kept), w, kept
        ),
    )
    names = ("rows", "d x", "y", "d expert_out", "d weights")
    for name, g, w in zip(names, got, want):
      with self.subTest(name):
        g, w = np.asarray(g), np.asarray(w)
        self.assertEqual(g.dtype, w.dtype)
        # NaN exactly where moe_core has NaN (invalid copies, NaN weights).
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), name)
        finite = ~np.isnan(w)
        # d x sums a token's K copies in float32 where XLA's scatter-add
        # sums in the rows' dtype: gradients get the gradient tolerance.
        kind = "forward" if name in ("rows", "y") else "gradient"
        self.assertClose(g[finite], w[finite], dtype, kind, name)
    # The gather itself moves bits: rows equal bit for bit.
    np.testing.assert_array_equal(
        np.asarray(got[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8)
    )

  def test_dispatch_metadata_is_moe_core_sort(self):
    cfg = cases.PERMUTE_CAPACITY_CFG
    x, aux = _route(cfg, "float32")
    got = self.backend().dispatch(x, aux, cfg)
    want = permute.dispatch(x, aux.expert_ids, cfg.num_experts, aux.kept)
    for field in ("group_sizes", "assignment", "position", "invalid"):
      np.testing.assert_array_equal(
          np.asarray(getattr(got, field)),
          np.asarray(getattr(want, field)),
          err_msg=field,
      )
    self.assertEqual(got.top_k, want.top_k)

  def test_dispatch_validates_like_moe_core(self):
    cfg = cases.PERMUTE_CFG
    x, aux = _route(cfg, "float32")
    with self.assertRaisesRegex(ValueError, "one expert_ids row per token"):
      self.backend().dispatch(x[:-1], aux, cfg)
    with self.assertRaisesRegex(ValueError, r"must lie in \[0, num_experts"):
      self.backend().dispatch(
          x, dataclasses.replace(aux, expert_ids=aux.expert_ids + 100), cfg
      )


def _layer_case(name, dtype):
  return dataclasses.replace(cases.LAYER_BY_NAME[name], dtype=dtype)


class LayerTest(InterpretTestCase):
  """moe_core.moe_layer, forward and gradients, against the reference."""

  @parameterized.named_parameters(
      ("unfused_f32", False, "float32"),
      ("fused_f32", True, "float32"),
      ("fused_bf16", True, "bfloat16"),
  )
  def test_matches_reference(self, fuse_routing_weights, dtype):
    case = _layer_case("base_f32", dtype)
    be = self.backend(fuse_routing_weights=fuse_routing_weights)
    got = base.compute_layer(be, case, jit=True, grads=True)
    want = base.reference_layer(case)
    self.assertEqual(got.y.dtype, np.dtype(dtype))
    self.assertClose(got.y, want.y, dtype, msg="y")
    self.assertEqual(sorted(got.grads), sorted(want.grads))
    for name in sorted(got.grads):
      with self.subTest(name):
        self.assertEqual(got.grads[name].dtype, want.grads[name].dtype)
        self.assertClose(
            got.grads[name], want.grads[name], dtype, "gradient", name
        )

  @parameterized.parameters(False, True)
  def test_invalid_ids_and_nan_weights_make_only_their_tokens_nan(
      self, fuse_routing_weights
  ):
    case = _layer_case("odd_37_tokens_d48_f80", "float32")
    cfg = case.cfg
    params, x, _ = cases.layer_inputs(case)
    x = x.reshape(-1, cfg.hidden_size)
    aux = moe_core.route(x, params["router"], cfg)
    ids = np.array(aux.expert_ids)
    ids[3, 1] = -1  # Out of range: traced under jit, so NaN, not an error.
    weights = np.array(aux.combine_weights)
    weights[20, 0] = np.nan
    aux = dataclasses.replace(
        aux,
        expert_ids=jnp.asarray(ids),
        combine_weights=jnp.asarray(weights),
    )
    be = self.backend(fuse_routing_weights=fuse_routing_weights)
    ref = moe_core.get_backend("reference")

    def routed(b):
      return jax.jit(lambda p, x, a: b.routed_experts(p, x, a, cfg))(
          params, x, aux
      )

    got, want = np.asarray(routed(be)), np.asarray(routed(ref))
    nan_tokens = np.isnan(got).all(axis=1)
    np.testing.assert_array_equal(np.nonzero(nan_tokens)[0], [3, 20])
    self.assertFalse(np.isnan(np.delete(got, [3, 20], axis=0)).any())
    self.assertTrue(np.isnan(want[[3, 20]]).all())
    self.assertClose(
        np.delete(got, [3, 20], axis=0),
        np.delete(want, [3, 20], axis=0),
        "float32",
        msg="other tokens",
    )

  @parameterized.product(
      fuse_routing_weights=(False, True), fuse_activation=(False, True)
  )
  def test_checkpoint_names_are_the_documented_ones(
      self, fuse_routing_weights, fuse_activation
  ):
    case = cases.LAYER_BY_NAME["base_f32"]
    cfg = case.cfg
    params, x, _ = cases.layer_inputs(case)
    be = self.backend(
        fuse_routing_weights=fuse_routing_weights,
        fuse_activation=fuse_activation,
    )
    aux = moe_core.route(x, params["router"], cfg)
    jaxpr = jax.make_jaxpr(lambda p, x: be.routed_experts(p, x, aux, cfg))(
        params, x
    )
    names = sorted(
        eqn.params["name"]
        for eqn in jaxpr.jaxpr.eqns
        if eqn.primitive.name == "name"
    )
    self.assertEqual(names, sorted(be.checkpoint_names(cfg.activation)))


if __name__ == "__main__":
  absltest.main()
