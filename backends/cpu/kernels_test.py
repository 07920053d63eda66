"""The cpu backend's custom calls against float64 numpy, on every kernel set.

The conformance suite runs the backend as users do; here the shapes reach
what it does not: several row chunks and column blocks per group, depths
past one packed slice, 1 and 256 experts, NaN in the rows and cotangents
past the groups, export, and the loader's refusals. Each numerics case runs
on every kernel set this CPU has (`library.use_kernels`: AVX-512, AVX2 and
portable on an AVX-512 host), compiled once, and its bfloat16 cases also
on `amx-emulated`: the AMX kernel's packing and blocking on an emulated
tile unit, which runs on any CPU (AmxEmulatedTest adds the tiles' ragged
edges). Also: the measured verdicts that "auto" reads (verdicts.py)
against their bench/results files.
"""

import ctypes
import json
import os
import re
import subprocess
import sys
import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import export
import jax.numpy as jnp
import numpy as np

from backends.cpu import kernels as kernels_lib
from backends.cpu import library
from backends.cpu import verdicts
from conformance import oracles
from moe_core import registry

_KERNELS_ENV = "DROPLESS_CPU_KERNELS"
_RESULTS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "results"
)

# (M, C, N, group sizes): rows, contracted width, output width.
_SHAPES = {
    # Three groups of several 256-row chunks and N past one 96-wide block.
    "big_groups": (700, 72, 200, (300, 0, 390)),
    # A depth past one packed slice (768 float32, 1536 bfloat16 steps).
    "deep": (40, 1601, 50, (17, 0, 20)),
    "one_expert_all_rows": (130, 33, 49, (130,)),
    "one_expert_padded": (130, 33, 49, (77,)),
    "empty_groups_only": (24, 16, 24, (0, 0, 0)),
    # The xla backend's grouped_gemm_test layouts.
    "last_group_takes_all": (100, 16, 24, (0, 0, 0, 0, 100)),
    "first_takes_all_but_one": (100, 16, 24, (99, 0, 0, 0, 1)),
    "ragged_with_empty": (100, 16, 24, (30, 0, 7, 41, 12)),
    "short_of_m": (100, 16, 24, (3, 0, 0, 4, 0)),
}


def _many_experts(rng, experts, used):
  """Random sizes for `experts` groups summing to `used` (many empty)."""
  return tuple(
      int(s) for s in rng.multinomial(used, rng.dirichlet([0.3] * experts))
  )


def _inputs(m, c, n, sizes, dtype, transpose_rhs, seed=0):
  """rows with NaN past the groups, weights, sizes, NaN-padded cotangent."""
  rng = np.random.default_rng(seed)
  used = sum(sizes)
  rows = rng.standard_normal((m, c)).astype(np.float32)
  rows[used:] = np.nan
  shape = (len(sizes), n, c) if transpose_rhs else (len(sizes), c, n)
  weights = rng.standard_normal(shape).astype(np.float32)
  cotangent = rng.standard_normal((m, n)).astype(np.float32)
  cotangent[used:] = np.nan
  cast = lambda x: jnp.asarray(x, dtype)
  return (
      cast(rows),
      cast(weights),
      jnp.asarray(sizes, jnp.int32),
      cast(cotangent),
  )


def _close(test, got, want, dtype, scale, msg):
  """bfloat16 operands multiply exactly in float32: both dtypes then differ
  from float64 by float32 summation, plus rounding to bf16 outputs."""
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  rtol = 1e-2 if dtype == jnp.bfloat16 else 2e-5
  np.testing.assert_allclose(
      got, want, rtol=rtol, atol=rtol * scale, err_msg=msg
  )


def _sets_here():
  """The kernel sets this CPU runs: its best and every set below it."""
  best = verdicts.KERNEL_SETS.index(library.best_kernels())
  return verdicts.KERNEL_SETS[best:]


def _sets_for(dtype):
  """The sets a case of `dtype` operands runs on: this CPU's, and for
  bfloat16 the AMX emulation (its float32 is one of this CPU's sets)."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    return _sets_here() + verdicts.TEST_KERNEL_SETS
  return _sets_here()


class CpuKernelsTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.backend = registry.get_backend("cpu")
    ok, reason = self.backend.availability()
    if not ok:
      self.skipTest(reason)
    self.addCleanup(library.use_kernels, library.kernels())

  def test_selects_only_sets_this_cpu_runs(self):
    best = library.best_kernels()
    self.assertIn(best, verdicts.KERNEL_SETS)
    self.assertIn(library.kernels(), _sets_here())
    for name in verdicts.KERNEL_SETS:
      want = name if name in _sets_here() else best
      self.assertEqual(library.use_kernels(name), want)
      self.assertEqual(self.backend.kernels(), want)
    self.assertEqual(library.use_kernels("no-such-set"), best)
    # The emulation runs on every CPU, and cpuid never picks it.
    self.assertNotIn(best, verdicts.TEST_KERNEL_SETS)
    for name in verdicts.TEST_KERNEL_SETS:
      self.assertEqual(library.use_kernels(name), name)
      self.assertEqual(self.backend.kernels(), name)

  def test_amx_on_a_cpu_without_it_runs_the_cpus_best(self):
    # As asking for avx512 on an AVX2-only CPU does: never an instruction
    # the CPU lacks, no error.
    best = library.best_kernels()
    if best == "amx":
      self.skipTest("this CPU runs amx")
    self.assertEqual(library.use_kernels("amx"), best)
    self.assertEqual(self.backend.kernels(), best)

  @parameterized.product(
      shape=sorted(_SHAPES),
      dtype=["float32", "bfloat16"],
      transpose_rhs=[False, True],
  )
  def test_forward_and_gradients_match_numpy(self, shape, dtype, transpose_rhs):
    m, c, n, sizes = _SHAPES[shape]
    self._check(m, c, n, sizes, jnp.dtype(dtype), transpose_rhs)

  @parameterized.parameters("float32", "bfloat16")
  def test_256_experts_with_empty_groups_and_padding(self, dtype):
    rng = np.random.default_rng(1)
    sizes = _many_experts(rng, 256, 560)
    self.assertGreater(sizes.count(0), 10)
    self._check(600, 40, 56, sizes, jnp.dtype(dtype), False)

  def _check(self, m, c, n, sizes, dtype, transpose_rhs):
    """Forward and gradients against float64 numpy on every set here."""
    rows, weights, group_sizes, cotangent = _inputs(
        m, c, n, sizes, dtype, transpose_rhs
    )
    used = sum(sizes)
    gemm = lambda r, w: self.backend.grouped_gemm(
        r, w, group_sizes, transpose_rhs=transpose_rhs, out_dtype=jnp.float32
    )
    forward = jax.jit(lambda r, w: jax.vjp(gemm, r, w))
    want = oracles.grouped_gemm(rows, weights, group_sizes, transpose_rhs)
    want_rows, want_weights = oracles.grouped_gemm_grads(
        rows, weights, group_sizes, cotangent, transpose_rhs
    )
    for kernels in _sets_for(dtype):
      # The set is read in each call: the compiled programs are reused.
      library.use_kernels(kernels)
      out, vjp = forward(rows, weights)
      d_rows, d_weights = jax.jit(vjp)(cotangent.astype(jnp.float32))
      # NaN rows past the groups are never read: zeros out, zero gradient.
      self.assertTrue(np.all(np.asarray(out[used:]) == 0), kernels)
      self.assertTrue(
          np.all(np.asarray(d_rows[used:], np.float32) == 0), kernels
      )
      _close(self, out, want, dtype, np.sqrt(c), f"{kernels} forward")
      _close(self, d_rows, want_rows, dtype, np.sqrt(n), f"{kernels} d rows")
      _close(
          self,
          d_weights,
          want_weights,
          dtype,
          np.sqrt(m),
          f"{kernels} d weights",
      )

  def test_bfloat16_output_is_rounded_float32_sum(self):
    rows, weights, group_sizes, _ = _inputs(
        64, 48, 40, (30, 0, 34), jnp.bfloat16, False
    )
    # NaN and infinities must round like any value (NaN stays NaN).
    rows = rows.at[0, 0].set(jnp.nan).at[1, 0].set(jnp.inf)
    for kernels in _sets_for(jnp.bfloat16):
      library.use_kernels(kernels)
      got = self.backend.grouped_gemm(rows, weights, group_sizes)
      self.assertEqual(got.dtype, jnp.bfloat16)
      exact = self.backend.grouped_gemm(
          rows, weights, group_sizes, out_dtype=jnp.float32
      )
      np.testing.assert_array_equal(
          np.asarray(got, np.float32),
          np.asarray(exact.astype(jnp.bfloat16), np.float32),
          err_msg=kernels,
      )

  def test_export_records_the_versioned_targets_and_round_trips(self):
    rows, weights, group_sizes, cotangent = _inputs(
        48, 16, 24, (20, 0, 20), jnp.float32, False
    )

    def loss(r, w):
      out = self.backend.grouped_gemm(r, w, group_sizes)
      return jnp.sum(jnp.where(jnp.isnan(cotangent), 0.0, cotangent) * out)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    rows = jnp.nan_to_num(rows)
    # Our targets are not in jax.export's list of stable custom calls.
    with self.assertRaisesRegex(ValueError, "custom calls"):
      export.export(fn)(rows, weights)
    exported = export.export(
        fn,
        disabled_checks=[
            export.DisabledSafetyCheck.custom_call(t)
            for t in self.backend.custom_call_targets
        ],
    )(rows, weights)
    text = exported.mlir_module()
    # Forward and dX are the gmm target, dW the tgmm one; each name carries
    # its calling convention's version, and the typed FFI API (4).
    for target in library.TARGETS:
      self.assertRegex(text, rf"custom_call @{target}\(")
      self.assertTrue(target.endswith("_v1"))
    self.assertEqual(
        set(re.findall(r"api_version = (\d+)", text)) - {"4"}, set()
    )
    restored = export.deserialize(exported.serialize())
    for got, want in zip(
        jax.tree.leaves(restored.call(rows, weights)),
        jax.tree.leaves(fn(rows, weights)),
    ):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  def test_a_large_call_runs_on_several_threads_of_xlas_pool(self):
    if (os.cpu_count() or 1) < 2:
      self.skipTest("one core: XLA's pool has one thread")
    rows = jnp.ones((4096, 512))
    weights = jnp.ones((8, 512, 1024))
    sizes = jnp.full((8,), 512, jnp.int32)
    jax.block_until_ready(
        jax.jit(self.backend.grouped_gemm)(rows, weights, sizes)
    )
    lib = library._loaded[0]  # pylint: disable=protected-access
    counts = {}
    for name in ("DroplessCpuLastPoolThreads", "DroplessCpuLastWorkers"):
      getattr(lib, name).restype = ctypes.c_int64
      counts[name] = getattr(lib, name)()
    # ~700 blocks of tens of microseconds: the caller and at least one
    # helper on XLA's pool take some (the caller never takes them all).
    self.assertGreaterEqual(counts["DroplessCpuLastPoolThreads"], 2, counts)
    self.assertGreaterEqual(counts["DroplessCpuLastWorkers"], 2, counts)


# (M, C, N, group sizes) at the AMX kernel's edges: its blocks are 32 rows
# (two 16-row tiles) x 32 columns (two 16-column tiles), its depth steps
# 32 (16 bfloat16 pairs), its depth slices 1024.
_AMX_SHAPES = {
    # M, C, N off every multiple; groups of 1 row, empty groups, a group
    # one row past one tile (17), rows past the groups.
    "ragged": (45, 37, 23, (1, 0, 17, 0, 1, 20)),
    # Whole tiles: the forward reads its rows in place (32-row panels,
    # depth a multiple of 32).
    "whole_tiles": (96, 64, 32, (32, 0, 64)),
    # One column tile (N=16), a group of one row tile exactly, an odd depth
    # (the last pair half zero); a 32-row panel right before the NaN rows
    # past the groups, so that reading its rows in place past the depth
    # (31, or N=16 for dX) would bring NaN into the sums.
    "one_column_tile": (52, 31, 16, (1, 16, 32)),
    # Three column tiles (the last pair has one), an odd depth of 3 steps.
    "three_column_tiles": (40, 71, 48, (40,)),
    # The forward's depth past one slice: in place then packed (64 rows),
    # packed throughout (5 rows).
    "deep_rows": (70, 1100, 20, (64, 0, 5)),
    # The weight gradient's depth (a group's rows) past one slice.
    "deep_group": (1100, 24, 20, (1060,)),
}


class AmxEmulatedTest(parameterized.TestCase):
  """The AMX kernel's bfloat16 path, on the emulated tile unit, at the
  tiles' edges: the custom calls (forward and dX are gmm, dW is tgmm)
  against float64 numpy and against the portable set in float32, and the
  forward's bfloat16 output as its float32 sums rounded."""

  def setUp(self):
    super().setUp()
    ok, why = library.load()
    if not ok:
      self.skipTest(why)
    self.kernels = kernels_lib.CpuKernels()
    self.addCleanup(library.use_kernels, library.kernels())

  def _calls(self, rows, weights, group_sizes, cotangent, transpose_rhs):
    """(forward, d rows, d weights) of the custom calls, float32."""
    f32 = jnp.float32
    forward = self.kernels.gmm(
        rows, weights, group_sizes, transpose_rhs=transpose_rhs, out_dtype=f32
    )
    d_rows = self.kernels.gmm(
        cotangent,
        weights,
        group_sizes,
        transpose_rhs=not transpose_rhs,
        out_dtype=f32,
    )
    lhs, rhs = (cotangent, rows) if transpose_rhs else (rows, cotangent)
    d_weights = self.kernels.tgmm(
        lhs, rhs, group_sizes, num_groups=weights.shape[0], out_dtype=f32
    )
    return forward, d_rows, d_weights

  @parameterized.product(shape=sorted(_AMX_SHAPES), transpose_rhs=[False, True])
  def test_matches_float64_and_portable(self, shape, transpose_rhs):
    m, c, n, sizes = _AMX_SHAPES[shape]
    rows, weights, group_sizes, cotangent = _inputs(
        m, c, n, sizes, jnp.bfloat16, transpose_rhs
    )
    used = sum(sizes)
    # float64 of the bfloat16 values: the kernels' products are exact.
    x = np.asarray(rows.astype(jnp.float32), np.float64)
    w = np.asarray(weights.astype(jnp.float32), np.float64)
    dy = np.asarray(cotangent.astype(jnp.float32), np.float64)
    want_out, want_rows = np.zeros((m, n)), np.zeros((m, c))
    want_weights = np.zeros(weights.shape)
    start = 0
    for g, size in enumerate(sizes):
      w_g = w[g].T if transpose_rhs else w[g]  # [C, N]
      x_g, dy_g = x[start : start + size], dy[start : start + size]
      want_out[start : start + size] = x_g @ w_g
      want_rows[start : start + size] = dy_g @ w_g.T
      grad = x_g.T @ dy_g  # [C, N]
      want_weights[g] = grad.T if transpose_rhs else grad
      start += size
    wants = (want_out, want_rows, want_weights)
    # Depths summed per output: C, N, a group's rows.
    depths = (c, n, max(max(sizes), 1))
    got = {}
    for kernels in ("portable", "amx-emulated"):
      self.assertEqual(library.use_kernels(kernels), kernels)
      got[kernels] = [
          np.asarray(a, np.float64)
          for a in self._calls(
              rows, weights, group_sizes, cotangent, transpose_rhs
          )
      ]
    for name, out, ref, want, depth in zip(
        ("forward", "d rows", "d weights"),
        got["amx-emulated"],
        got["portable"],
        wants,
        depths,
    ):
      # float32 sums of exact products: off float64 by rounding only.
      tol = dict(rtol=1e-5, atol=1e-5 * np.sqrt(depth))
      np.testing.assert_allclose(out, want, err_msg=name, **tol)
      np.testing.assert_allclose(out, ref, err_msg=f"{name} vs portable", **tol)
      if name != "d weights":
        # Rows past the groups (NaN in the inputs) are zeros, never read.
        self.assertTrue(np.all(out[used:] == 0), name)
    # A bfloat16 output is the float32 sums rounded to nearest even (still
    # amx-emulated, selected last).
    rounded = self.kernels.gmm(
        rows,
        weights,
        group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=jnp.bfloat16,
    )
    np.testing.assert_array_equal(
        np.asarray(rounded, np.float32),
        np.asarray(
            jnp.asarray(got["amx-emulated"][0], jnp.bfloat16), np.float32
        ),
    )


class VerdictsTest(parameterized.TestCase):
  """The data "auto" reads agrees with the measurements it names."""

  def test_every_measured_set_and_dtype_has_a_verdict(self):
    for kernels in verdicts.KERNEL_SETS:
      for dtype in verdicts.DTYPES:
        if kernels in verdicts.UNMEASURED:
          self.assertNotIn((kernels, dtype), verdicts.VERDICTS)
        else:
          self.assertIn((kernels, dtype), verdicts.VERDICTS)
    self.assertContainsSubset(verdicts.UNMEASURED, verdicts.KERNEL_SETS)
    for kernels in verdicts.TEST_KERNEL_SETS:
      self.assertNotIn(kernels, verdicts.KERNEL_SETS)
      for dtype in verdicts.DTYPES:
        self.assertNotIn((kernels, dtype), verdicts.VERDICTS)

  @parameterized.parameters(*sorted(verdicts.VERDICTS))
  def test_verdict_is_what_its_results_file_measured(self, kernels, dtype):
    v = verdicts.verdict(kernels, dtype)
    with open(os.path.join(_RESULTS, v.evidence)) as fh:
      run = json.load(fh)
    self.assertEqual((run["cpu_kernels"], run["dtype"]), (kernels, dtype))
    self.assertFalse(run["quick"])
    cases = {(r["experts"], r["skew"]) for r in run["results"]}
    self.assertEqual({e for e, _ in cases}, {8, 64})
    self.assertEqual({k for _, k in cases}, {"even", "random", "zipf"})
    over_xla = [
        r[f"{phase}_time_over_xla"]
        for r in run["results"]
        if r["method"] == "cpu"
        for phase in ("fwd", "fwd_bwd")
    ]
    self.assertLen(over_xla, 2 * len(cases))
    geometric_mean = float(np.exp(np.mean(np.log(over_xla))))
    self.assertEqual(v.beats_xla, geometric_mean < 1, over_xla)


class AutoRuleTest(parameterized.TestCase):
  """ "auto" takes the cpu backend exactly where its kernels' verdicts win."""

  def setUp(self):
    super().setUp()
    ok, why = registry.availability("cpu")
    if not ok:
      self.skipTest(why)

  @parameterized.parameters(*verdicts.KERNEL_SETS, *verdicts.TEST_KERNEL_SETS)
  def test_auto_picks_cpu_only_where_its_kernels_beat_xla(self, kernels):
    wins = all(
        (kernels, d) in verdicts.VERDICTS
        and verdicts.verdict(kernels, d).beats_xla
        for d in verdicts.DTYPES
    )
    with mock.patch.object(library, "kernels", return_value=kernels):
      picked = registry.get_backend("auto").name
      ok, why = registry.auto_choice("cpu")
      # Named, it runs whatever its verdict.
      self.assertEqual(registry.availability("cpu"), (True, ""))
    self.assertEqual(picked, "cpu" if wins else "xla")
    self.assertEqual(ok, wins)
    if not wins:
      self.assertIn(repr(kernels), why)
      self.assertIn("--moe_backend=cpu", why)

  @parameterized.parameters("amx", "avx10")
  def test_auto_passes_over_a_set_no_measurement_covers(self, kernels):
    # amx: no machine of ours has AMX; avx10: a set newer than the table.
    with mock.patch.object(library, "kernels", return_value=kernels):
      self.assertEqual(registry.get_backend("auto").name, "xla")
      ok, why = registry.auto_choice("cpu")
    self.assertFalse(ok)
    self.assertIn(f"no measured verdict for its {kernels!r} kernels", why)

  def test_auto_passes_over_the_amx_emulation(self):
    with mock.patch.object(library, "kernels", return_value="amx-emulated"):
      self.assertEqual(registry.get_backend("auto").name, "xla")
      ok, why = registry.auto_choice("cpu")
    self.assertFalse(ok)
    self.assertIn("'amx-emulated' kernels are a test-only emulation", why)


class LoaderTest(parameterized.TestCase):

  @parameterized.parameters("portable", "amx", "amx-emulated")
  def test_environment_lowers_the_kernels_never_past_the_cpu(self, asked):
    ok, why = library.load()
    if not ok:
      self.skipTest(why)
    best = library.best_kernels()
    # A set the CPU lacks (amx here, unless it has AMX) runs its best; the
    # emulation runs anywhere.
    if asked in verdicts.TEST_KERNEL_SETS or asked in _sets_here():
      want = asked
    else:
      want = best
    script = (
        "from backends.cpu import library\n"
        "print(library.kernels(), library.best_kernels())\n"
    )
    env = dict(
        os.environ,
        **{
            _KERNELS_ENV: asked,
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        },
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    self.assertEqual(result.stdout.split(), [want, best])

  def test_missing_library_is_unavailable_and_auto_falls_through(self):
    script = (
        "from moe_core import registry\n"
        "print(registry.get_backend('cpu').availability())\n"
        "print(registry.get_backend('auto').name)\n"
    )
    env = dict(
        os.environ,
        **{
            library.LIBRARY_ENV: "/nonexistent/libdropless_cpu.so",
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        },
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    availability, auto = result.stdout.strip().splitlines()[-2:]
    self.assertIn("(False, 'cpu: cannot load /nonexistent", availability)
    self.assertEqual(auto, "xla")

  def test_library_for_a_newer_jaxlib_is_refused(self):
    def built_for():
      return b"99.0.0"

    lib = types.SimpleNamespace(DroplessCpuBuiltForJaxlib=built_for)
    why = library._incompatible(lib, "lib.so")  # pylint: disable=protected-access
    self.assertRegex(why, r"built against jaxlib 99\.0\.0's FFI headers")

  def test_library_for_this_or_an_older_jaxlib_is_accepted(self):
    def built_for():
      return b"0.10.2"

    lib = types.SimpleNamespace(DroplessCpuBuiltForJaxlib=built_for)
    self.assertEqual(library._incompatible(lib, "lib.so"), "")  # pylint: disable=protected-access


if __name__ == "__main__":
  absltest.main()
