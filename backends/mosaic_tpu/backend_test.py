"""MosaicTpuBackend's options, availability, auto mode and refusals."""

import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.mosaic_tpu import backend as tpu_backend
from backends.mosaic_tpu import ops
from backends.mosaic_tpu import tiling
from conformance import oracles
from moe_core import backend as backend_lib
from moe_core import registry
from moe_core import permute
from moe_core.kernels import interpret as interpret_lib
from moe_core.kernels import permutation


def _tpu_mesh(device_kind: str = "TPU v5 lite"):
  """An abstract one-chip TPU mesh, as `moe_core.aot` lowers inside."""
  device = jax.sharding.AbstractDevice(
      device_kind=device_kind, num_cores=1, platform="tpu"
  )
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def _offset_inputs(num_local=2, width=8):
  """rows [128, width], local weights [num_local, width, 16] and the sizes of
  4 global groups, (30, 0, 50, 20): rows 100: past them."""
  rows = jax.random.normal(jax.random.key(0), (128, width))
  local = jax.random.normal(jax.random.key(1), (num_local, width, 16))
  return rows, local, jnp.asarray([30, 0, 50, 20], jnp.int32)


class MosaicTpuBackendTest(parameterized.TestCase):

  def test_registered_and_first_in_auto_on_a_tpu(self):
    self.assertIn("mosaic_tpu", registry.registered_backends())
    self.assertEqual(
        registry.auto_order("tpu"), ("mosaic_tpu", "xla", "reference")
    )

  def test_off_a_tpu_compiled_is_unavailable_with_the_reason(self):
    if jax.default_backend() == "tpu":
      self.skipTest("checks the backend off a TPU; this host has one")
    ok, why = tpu_backend.MosaicTpuBackend(interpret=False).availability()
    self.assertFalse(ok)
    self.assertRegex(why, r"^mosaic_tpu: .*TPUs only.*interpret=True")
    self.assertEqual(tpu_backend.MosaicTpuBackend().availability(), (True, ""))

  def test_auto_compiles_when_lowered_for_a_tpu(self):
    launch = tpu_backend.MosaicTpuBackend().launch
    self.assertIs(launch.interpreting, interpret_lib.interprets(None, "tpu"))
    with _tpu_mesh():
      self.assertFalse(launch.interpreting)
      self.assertIs(launch.kernel_interpret, False)

  @parameterized.parameters(
      ("TPU v5 lite", "v5e"),
      ("TPU v5", "v5p"),
      ("TPU v6 lite", "v6e"),
      ("TPU7x", "tpu7x"),
  )
  def test_generation_is_the_one_lowered_for(self, kind, want):
    with _tpu_mesh(kind):
      self.assertEqual(tiling.generation(), want)
      launch = tpu_backend.MosaicTpuBackend().launch.kernel_launch()
      self.assertEqual(launch.generation, want)

  def test_fused_epilogues_on_by_default(self):
    be = tpu_backend.MosaicTpuBackend()
    self.assertTrue(be.fuse_activation)
    self.assertTrue(be.fuse_routing_weights)
    # The fused gate/up names its residuals (gate, up, h) beside down.
    self.assertEqual(
        be.checkpoint_names("silu"),
        (*backend_lib.FUSED_CHECKPOINT_NAMES, backend_lib.DOWN_NAME),
    )
    unfused = tpu_backend.MosaicTpuBackend(fuse_activation=False)
    self.assertEqual(
        unfused.checkpoint_names("silu"), backend_lib.CHECKPOINT_NAMES
    )
    # The exact gelu needs erfc, which Mosaic TPU lacks: unfused.
    self.assertEqual(be.checkpoint_names("gelu"), backend_lib.CHECKPOINT_NAMES)

  def test_bad_options_name_the_option(self):
    with self.assertRaisesRegex(TypeError, "fuse_activation must be a bool"):
      tpu_backend.MosaicTpuBackend(fuse_activation="yes")
    with self.assertRaisesRegex(
        TypeError, "fuse_routing_weights must be a bool, got int"
    ):
      tpu_backend.MosaicTpuBackend(fuse_routing_weights=1)
    with self.assertRaisesRegex(ValueError, r"generation must be one of"):
      tpu_backend.MosaicTpuBackend(generation="v4")
    with self.assertRaisesRegex(ValueError, r"interpret must be"):
      tpu_backend.MosaicTpuBackend(interpret="fast")
    with self.assertRaisesRegex(ValueError, r"Tiles.bm must be"):
      tpu_backend.MosaicTpuBackend(tiles={"bm": 100})

  def test_grouped_gemm_with_offset_computes_only_the_local_groups(self):
    sizes = jnp.asarray([30, 0, 50, 20], jnp.int32)
    rows = jax.random.normal(jax.random.key(0), (128, 128))
    local = jax.random.normal(jax.random.key(1), (2, 128, 128))
    launch = tpu_backend.MosaicTpuBackend(interpret=True).launch
    got = ops.grouped_gemm_with_offset(rows, local, sizes, jnp.int32(1), launch)
    # Groups 1 (empty) and 2 (rows 30:80) are local: rows 30:80 times the
    # second local weight, every other row zero.
    want = (
        jnp.zeros((128, 128))
        .at[30:80]
        .set(jnp.dot(rows[30:80], local[1], precision="highest"))
    )
    self.assertLess(float(jnp.max(jnp.abs(got - want))), 1e-4)

  @parameterized.parameters(0, 1, 2)
  def test_grouped_gemm_with_offset_matches_numpy(self, offset):
    rows, local, sizes = _offset_inputs()
    launch = tpu_backend.MosaicTpuBackend(interpret=True).launch
    want = oracles.grouped_gemm_with_offset(rows, local, sizes, offset)
    run = jax.jit(ops.grouped_gemm_with_offset, static_argnums=4)
    for got in (
        ops.grouped_gemm_with_offset(rows, local, sizes, offset, launch),
        run(rows, local, sizes, jnp.int32(offset), launch),
    ):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)

  @parameterized.parameters((0, 0), (2, 0), (2, 2))
  def test_grouped_gemm_with_offset_without_local_groups(self, g, offset):
    """E = 0 local weights (of G = 0 or 2 groups): every row is zero."""
    launch = tpu_backend.MosaicTpuBackend(interpret=True).launch
    out = ops.grouped_gemm_with_offset(
        jnp.ones((16, 8)),
        jnp.ones((0, 8, 4)),
        jnp.ones((g,), jnp.int32),
        offset,
        launch,
    )
    np.testing.assert_array_equal(out, np.zeros((16, 4)))

  @parameterized.parameters(3, 5, -1)
  def test_grouped_gemm_with_offset_out_of_range(self, offset):
    """Concrete: ValueError; traced: all NaN, or the words of the
    ValueError under `moe_core.checked`. Found: 3, 5 and -1 were clamped
    to 2, computing groups 2 and 3 (a negative offset wrapped first)."""
    rows, local, sizes = _offset_inputs()
    launch = tpu_backend.MosaicTpuBackend(interpret=True).launch
    message = (
        "group_offset must lie in [0, G - E = 2] (G=4 groups in "
        f"group_sizes, E=2 in weights), got {offset}."
    )
    for given in (offset, jnp.int32(offset), np.int64(offset)):
      with self.assertRaises(ValueError) as caught:
        ops.grouped_gemm_with_offset(rows, local, sizes, given, launch)
      self.assertEqual(str(caught.exception), message)
    run = jax.jit(ops.grouped_gemm_with_offset, static_argnums=4)
    out = run(rows, local, sizes, jnp.int32(offset), launch)
    self.assertTrue(np.all(np.isnan(out)), out)
    with self.assertRaisesRegex(ValueError, re.escape(message)):
      moe_core.checked(run)(rows, local, sizes, jnp.int32(offset), launch)

  def test_grouped_gemm_with_offset_refuses_bad_arguments(self):
    rows, local, sizes = _offset_inputs()
    launch = tpu_backend.MosaicTpuBackend(interpret=True).launch
    cases = (
        # Found: the kernel's padding dropped the 8th column.
        (dict(weights=local[:, :7]), ValueError, r"contract over rows' C=8"),
        (
            dict(group_sizes=sizes[:1]),
            ValueError,
            r"group_sizes must have shape \(G,\) with G >= the 2 groups of "
            r"weights, got group_sizes.shape=\(1,\)",
        ),
        (
            dict(group_sizes=sizes.astype(jnp.float32)),
            TypeError,
            "group_sizes must be an integer",
        ),
        (dict(group_offset=1.0), TypeError, r"group_offset must be an int"),
        (dict(group_offset=True), TypeError, r"group_offset must be an int"),
        (
            dict(group_offset=jnp.ones((1,), jnp.int32)),
            ValueError,
            r"group_offset must be a scalar, got group_offset.shape=\(1,\)",
        ),
        (
            dict(weights=local.astype(jnp.bfloat16)),
            TypeError,
            "needs rows and weights of one dtype, float32 or bfloat16, got "
            "rows float32, weights bfloat16",
        ),
        (
            dict(
                rows=rows.astype(jnp.float16), weights=local.astype(jnp.float16)
            ),
            TypeError,
            "float32 or bfloat16, got rows float16, weights float16",
        ),
        (dict(out_dtype=jnp.int32), TypeError, "out_dtype must be None or"),
        (dict(launch=None), TypeError, "launch must be an ops.Launch"),
    )
    args = dict(
        rows=rows,
        weights=local,
        group_sizes=sizes,
        group_offset=1,
        launch=launch,
    )
    for changes, kind, message in cases:
      with self.subTest(message):
        with self.assertRaisesRegex(kind, message):
          ops.grouped_gemm_with_offset(**dict(args, **changes))

  @parameterized.parameters((30, -5, 50, 20), (30, 60, 50, 20))
  def test_grouped_gemm_with_offset_bad_group_sizes(self, *given):
    """As `Backend.grouped_gemm`: concrete sizes raise its ValueError,
    traced ones give an all-NaN output. Found: a negative size gave finite
    garbage."""
    rows, local, _ = _offset_inputs(num_local=4)
    sizes = jnp.asarray(given, jnp.int32)
    launch = tpu_backend.MosaicTpuBackend(interpret=True).launch
    with self.assertRaises(ValueError) as want:
      moe_core.get_backend("xla").grouped_gemm(rows, local, sizes)
    with self.assertRaises(ValueError) as got:
      ops.grouped_gemm_with_offset(rows, local[:2], sizes, 1, launch)
    self.assertEqual(str(got.exception), str(want.exception))
    run = jax.jit(ops.grouped_gemm_with_offset, static_argnums=4)
    out = run(rows, local[:2], sizes, jnp.int32(1), launch)
    self.assertTrue(np.all(np.isnan(out)), out)

  @parameterized.parameters("TPU v2", "TPU v3", "TPU v4", "TPU v4 lite")
  def test_unknown_generation_is_refused_so_auto_moves_on(self, kind):
    """Found: a generation the table lacks got the v5e's tiles (128 MiB of
    VMEM), which XLA's compiler refused where `xla` compiles."""
    cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=128, expert_ffn_size=128
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    x = jnp.ones((8, 128))
    be = tpu_backend.MosaicTpuBackend()
    message = f"got device_kind '{kind}'; backend 'xla' runs there"
    with _tpu_mesh(kind):
      with self.assertRaisesRegex(NotImplementedError, message):
        jax.jit(lambda p, x: moe_core.moe_layer(p, x, cfg, backend=be)).lower(
            params, x
        )
      # Interpreted, the kernels need no VMEM: any TPU runs them.
      interpreted = tpu_backend.MosaicTpuBackend(interpret=True).launch
      self.assertEqual(
          interpreted.kernel_launch().generation, tiling.DEFAULT_GENERATION
      )
      with mock.patch.object(jax, "default_backend", return_value="tpu"):
        ok, why = be.availability()
        self.assertFalse(ok)
        self.assertRegex(why, message)
        self.assertEqual(
            [b.name for b in registry.auto_candidates()], ["xla", "reference"]
        )
        # A generation named by the caller is the caller's choice.
        chosen = tpu_backend.MosaicTpuBackend(generation="v5p")
        self.assertEqual(chosen.availability(), (True, ""))

  @parameterized.parameters(8, 200)
  def test_whole_k_tile_override_differentiates_any_width(self, width):
    """tiles without bk (the whole K, Tiles' default). Found: jax.grad
    failed for a contracted width not a multiple of 128, with an error
    about a bk the caller never gave."""
    be = moe_core.get_backend(
        "mosaic_tpu", tiles={"bm": 128, "bn": 128}, interpret=True
    )
    _check_matches_xla(self, be, rows=(40, width), weights=(3, width, 24))

  @parameterized.parameters(((40, 8), (3, 8, 0)), ((40, 0), (3, 0, 24)))
  def test_zero_widths_match_xla(self, rows, weights):
    """An output width N or a contracted width C of 0: empty or zero
    arrays, as `xla`'s. Found: an error about a Tiles.bn never given."""
    be = moe_core.get_backend("mosaic_tpu", interpret=True)
    _check_matches_xla(self, be, rows=rows, weights=weights)

  @parameterized.parameters("fp8_tensor", "fp8_block", "mxfp8", "nvfp4")
  def test_low_precision_recipes_refused_naming_the_backend_that_runs_them(
      self, recipe
  ):
    cfg = moe_core.MoEConfig(
        num_experts=4,
        top_k=2,
        hidden_size=128,
        expert_ffn_size=128,
        precision=recipe,
    )
    params = moe_core.init_params(jax.random.key(0), cfg, jnp.bfloat16)
    x = jnp.ones((8, 128), jnp.bfloat16)
    be = moe_core.get_backend("mosaic_tpu", interpret=True)
    with self.assertRaisesRegex(
        NotImplementedError, rf"mosaic_tpu: precision '{recipe}'.*'xla'"
    ):
      jax.eval_shape(
          lambda p, x: moe_core.moe_layer(p, x, cfg, backend=be), params, x
      )


def _check_matches_xla(test, be, *, rows, weights):
  """`be`'s grouped GEMM and its gradients, eager and jitted, against
  `xla`'s on random rows and weights of these shapes, groups (10, 0, 25)."""
  rows = jax.random.normal(jax.random.key(0), rows)
  weights = jax.random.normal(jax.random.key(1), weights)
  sizes = jnp.asarray([10, 0, 25], jnp.int32)
  cotangent = jax.random.normal(jax.random.key(2), (rows.shape[0], 24))

  def value_and_grads(backend):
    def run(r, w):
      out, vjp = jax.vjp(lambda r, w: backend.grouped_gemm(r, w, sizes), r, w)
      return (out, *vjp(cotangent[:, : out.shape[1]]))

    return run

  want = value_and_grads(moe_core.get_backend("xla"))(rows, weights)
  for jit in (False, True):
    run = value_and_grads(be)
    got = (jax.jit(run) if jit else run)(rows, weights)
    for name, g, w in zip(("out", "d_rows", "d_weights"), got, want):
      with test.subTest(f"{name}, jit={jit}"):
        test.assertEqual(g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


class TpuPermutationKernelsTest(parameterized.TestCase):
  """The per-choice sums of `ops.TpuPermutationKernels` against the
  library's defaults (each op over the [T, K, D] array of every copy), op
  by op, with dropped copies and invalid ids, and through the primitive's
  derivatives."""

  T, K, D, E = 7, 3, 5, 4

  def _plan(self, drop, invalid):
    ids = jax.random.randint(jax.random.key(1), (self.T, self.K), 0, self.E)
    if invalid:
      ids = ids.at[2, 1].set(self.E + 3)
    kept = None
    if drop:
      kept = jnp.ones((self.T, self.K), bool).at[1, 0].set(False)
      kept = kept.at[5, 2].set(False)
    return permutation.Plan.of(permute.plan_unchecked(ids, self.E, kept), kept)

  @parameterized.product(
      drop=[False, True], invalid=[False, True], nan_invalid=[False, True]
  )
  def test_each_op_matches_the_defaults(self, drop, invalid, nan_invalid):
    plan = self._plan(drop, invalid)
    keys = jax.random.split(jax.random.key(2), 3)
    a = self.T * self.K
    rows = jax.random.normal(keys[0], (a, self.D), jnp.bfloat16)
    dy = jax.random.normal(keys[1], (self.T, self.D), jnp.float32)
    weights = jax.random.uniform(keys[2], (self.T, self.K), minval=0.1)
    ours, want = ops.TpuPermutationKernels(), permutation.PermutationKernels()
    calls = {
        "scatter": lambda k: k.scatter(rows, plan, top_k=self.K),
        "combine": lambda k: k.combine(
            rows, weights, plan, top_k=self.K, nan_invalid=nan_invalid
        ),
        "row_dots": lambda k: k.row_dots(
            dy, rows, plan, top_k=self.K, nan_invalid=nan_invalid
        ),
    }
    for name, call in calls.items():
      with self.subTest(name):
        got, expected = call(ours), call(want)
        self.assertEqual(got.dtype, expected.dtype)
        self.assertEqual(got.shape, expected.shape)
        got = np.asarray(got, np.float32)
        expected = np.asarray(expected, np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        # An invalid copy's NaN reaches combine and row_dots only (scatter,
        # the gather's transpose, skips it).
        self.assertEqual(
            bool(np.isnan(got).any()),
            nan_invalid and invalid and name != "scatter",
        )
        np.testing.assert_allclose(
            np.nan_to_num(got), np.nan_to_num(expected), rtol=1e-2, atol=1e-2
        )

  def test_combine_gradients_match_the_defaults(self):
    plan = self._plan(drop=True, invalid=False)
    keys = jax.random.split(jax.random.key(4), 3)
    rows = jax.random.normal(keys[0], (self.T * self.K, self.D))
    weights = jax.random.uniform(keys[1], (self.T, self.K), minval=0.1)
    ct = jax.random.normal(keys[2], (self.T, self.D))

    def grads(kernels):
      loss = lambda r, w: jnp.vdot(
          permutation.combine(kernels, r, w, plan, top_k=self.K), ct
      )
      return jax.jit(jax.grad(loss, (0, 1)))(rows, weights)

    got = grads(ops.TpuPermutationKernels())
    want = grads(permutation.PermutationKernels())
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
