"""The launcher: interpreter path, recorder, jax-triton 0.3/0.4, AOT compile."""

import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import extend as jex
import jax.numpy as jnp
import numpy as np

from backends.testing import triton_aot_compile
from backends.triton import configs
from backends.triton import launch
from backends.triton import launch_record
from backends.triton import target as target_lib
from moe_core import compat

try:
  import triton  # pylint: disable=g-import-not-at-top
  import triton.language as tl  # pylint: disable=g-import-not-at-top
except ImportError:
  triton = None

if triton is not None:

  @triton.jit
  def _scaled(x, scale):
    return x * scale

  @triton.jit
  def add_kernel(
      x_ptr,
      y_ptr,
      out_ptr,
      N: tl.constexpr,
      BLOCK: tl.constexpr,
      SCALE: tl.constexpr = 1.0,
  ):
    """out = SCALE * (x + y) in float32, cast to out's dtype; [N] arrays."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    x = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask, other=0).to(tl.float32)
    out = _scaled(x + y, SCALE)  # A device function: a JITFunction call.
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

  @triton.jit
  def masked_dot_kernel(
      a_ptr,
      b_ptr,
      keep_ptr,
      out_ptr,
      row_sum_ptr,
      M: tl.constexpr,
      K: tl.constexpr,
      N: tl.constexpr,
      DOT_F32: tl.constexpr,
  ):
    """out = a @ b on rows with keep[row] == 1, else 0; row_sum = sum(out).

    a [M, K], b [K, N] (one block each); keep [M] int8; out [M, N] in a's
    dtype; row_sum [M] float32. One program.
    """
    rows = tl.arange(0, M)
    ks = tl.arange(0, K)
    cols = tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
    b = tl.load(b_ptr + ks[:, None] * N + cols[None, :])
    if DOT_F32:
      a = a.to(tl.float32)
      b = b.to(tl.float32)
    acc = tl.zeros((M, N), tl.float32)  # A standard-library JITFunction.
    acc = tl.dot(a, b, acc)
    keep = tl.load(keep_ptr + rows) != 0
    acc = tl.where(keep[:, None], acc, 0.0)
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
    )
    tl.store(row_sum_ptr + rows, tl.sum(acc, axis=1))


def _fake_kernel():
  """An object shaped like a @triton.jit kernel (`fn`), needing no triton."""

  def fake(
      x_ptr,
      offsets_ptr,
      out_ptr,
      M: "tl.constexpr",
      BLOCK: "tl.constexpr",
      DOT_F32: "tl.constexpr",
      FLAG: "tl.constexpr" = 3,
  ):
    del x_ptr, offsets_ptr, out_ptr, M, BLOCK, DOT_F32, FLAG

  return types.SimpleNamespace(fn=fake)


_INTERPRET = launch.Runner(mode="interpret")
_GPU = launch.Runner(mode="gpu")


def _skip_unless_interpretable(test):
  ok, reason = launch.availability(_INTERPRET)
  if not ok:
    test.skipTest(reason)


def _skip_unless_triton(test):
  if triton is None:
    test.skipTest("triton is not installed: no kernel to interpret or compile.")


class InterpretTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    _skip_unless_interpretable(self)

  def _add(self, x, y, n, block, grid=None, scale=2.0):
    return launch.call(
        _INTERPRET,
        add_kernel,
        (x, y),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid or (-(-n // block),),
        4,
        3,
        N=n,
        BLOCK=block,
        SCALE=scale,
    )

  @parameterized.parameters("float32", "bfloat16", "float16")
  def test_vector_add_matches_numpy_exactly(self, dtype):
    # Exact for bfloat16 too: the launcher makes the interpreter round the
    # float32 -> bfloat16 cast to nearest even, as the GPU and XLA do.
    rng = np.random.default_rng(0)
    x = rng.standard_normal(37).astype(np.float32)
    y = rng.standard_normal(37).astype(np.float32)
    xd, yd = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
    (got,) = self._add(xd, yd, 37, 16)
    # The kernel adds in float32, scales by 2 (exact), casts once.
    want = 2.0 * (np.asarray(xd, np.float32) + np.asarray(yd, np.float32))
    self.assertEqual(got.dtype, jnp.dtype(dtype))
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(jnp.asarray(want, dtype))
    )

  def test_under_jit_and_vmap(self):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 20)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((3, 20)), jnp.float32)

    def add(a, b):
      return self._add(a, b, 20, 16)[0]

    want = 2.0 * (np.asarray(x, np.float64) + np.asarray(y, np.float64))
    np.testing.assert_allclose(jax.jit(add)(x[0], y[0]), want[0], rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(add))(x, y), want, rtol=1e-6)

  def test_elements_no_program_writes_are_nan(self):
    x = jnp.ones(40, jnp.float32)
    # One program of 16 covers elements 0..15 only.
    (got,) = self._add(x, x, 40, 16, grid=(1,))
    got = np.asarray(got)
    np.testing.assert_array_equal(got[:16], 2.0 * 2.0)
    self.assertTrue(np.all(np.isnan(got[16:])))

  @parameterized.parameters("float32", "bfloat16")
  def test_dot_with_int8_flags_and_two_outputs(self, dtype):
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((16, 32)), dtype)
    b = jnp.asarray(rng.standard_normal((32, 16)), dtype)
    keep = jnp.asarray(rng.integers(0, 2, 16), jnp.int8)
    out, row_sum = launch.call(
        _INTERPRET,
        masked_dot_kernel,
        (a, b, keep),
        (
            jax.ShapeDtypeStruct((16, 16), dtype),
            jax.ShapeDtypeStruct((16,), jnp.float32),
        ),
        (1,),
        4,
        3,
        M=16,
        K=32,
        N=16,
        DOT_F32=False,  # Forced True here.
    )
    product = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    product[np.asarray(keep) == 0] = 0.0
    tolerance = {"float32": 1e-5, "bfloat16": 1e-2}[dtype]
    self.assertEqual(out.dtype, jnp.dtype(dtype))
    self.assertEqual(row_sum.dtype, jnp.float32)
    np.testing.assert_allclose(
        np.asarray(out, np.float64), product, rtol=tolerance, atol=tolerance * 8
    )
    np.testing.assert_allclose(
        np.asarray(row_sum), product.sum(axis=1), rtol=1e-5, atol=1e-4
    )

  def test_language_is_restored_and_compiling_still_works(self):
    # The interpreter patches triton.language while a kernel runs; a leak
    # (tl.core's functions, patched by tl.zeros' device call) would break
    # every later triton.compile.
    modules = (tl, tl.core, tl.math, tl.standard, tl.tensor)
    before = [dict(vars(m)) for m in modules]
    a = jnp.ones((16, 16), jnp.bfloat16)
    launch.call(
        _INTERPRET,
        masked_dot_kernel,
        (a, a, jnp.ones(16, jnp.int8)),
        (
            jax.ShapeDtypeStruct((16, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((16,), jnp.float32),
        ),
        (1,),
        4,
        3,
        M=16,
        K=16,
        N=16,
    )[0].block_until_ready()
    for module, names in zip(modules, before):
      changed = [n for n, v in names.items() if vars(module).get(n) is not v]
      self.assertEqual(changed, [], f"{module.__name__} left patched")
    self.assertIs(
        triton.runtime.jit.JITFunction.__call__,
        inspect.getattr_static(triton.runtime.jit.JITFunction, "__call__"),
    )
    signature = {
        "x_ptr": "*bf16",
        "y_ptr": "*bf16",
        "out_ptr": "*bf16",
        "N": "constexpr",
        "BLOCK": "constexpr",
        "SCALE": "constexpr",
    }
    info = triton_aot_compile.compile_kernel(
        add_kernel, signature, {"N": 64, "BLOCK": 64, "SCALE": 1.0}, 90, 1, 1
    )
    self.assertGreater(info.registers, 0)


class RecorderTest(parameterized.TestCase):

  def _call(self, runner=_GPU, **constexprs):
    x = jnp.ones((8, 4), jnp.bfloat16)
    offsets = jnp.zeros((3,), jnp.int32)
    return launch.call(
        runner,
        _fake_kernel(),
        (x, offsets),
        [jax.ShapeDtypeStruct((8, 2), jnp.float32)],
        (2, 3),
        8,
        4,
        **{"M": 8, "BLOCK": 16, **constexprs},
    )

  def test_records_the_launch_and_returns_zeros(self):
    with launch_record.recording() as calls:
      (out,) = self._call()
    self.assertLen(calls, 1)
    record = calls[0]
    self.assertEqual(record.name, "fake")
    self.assertEqual(
        record.in_avals,
        (
            jax.ShapeDtypeStruct((8, 4), jnp.bfloat16),
            jax.ShapeDtypeStruct((3,), jnp.int32),
        ),
    )
    self.assertEqual(
        record.out_types, (jax.ShapeDtypeStruct((8, 2), jnp.float32),)
    )
    self.assertEqual(
        (record.grid, record.num_warps, record.num_stages), ((2, 3), 8, 4)
    )
    # Defaults filled in; DOT_F32 False on the GPU.
    self.assertEqual(
        record.constexprs, {"M": 8, "BLOCK": 16, "DOT_F32": False, "FLAG": 3}
    )
    self.assertEqual(record.mode, "gpu")
    np.testing.assert_array_equal(out, np.zeros((8, 2), np.float32))

  def test_dot_f32_follows_the_mode(self):
    with launch_record.recording() as calls:
      self._call(_INTERPRET, DOT_F32=False)
      self._call(_GPU, DOT_F32=True)
    self.assertTrue(calls[0].constexprs["DOT_F32"])  # The interpreter's.
    self.assertTrue(calls[1].constexprs["DOT_F32"])  # The caller's.

  def test_traces_record_once_and_nest(self):
    f = jax.jit(lambda: self._call()[0])
    with launch_record.recording() as outer:
      jax.eval_shape(f)
      with launch_record.recording() as inner:
        self._call()
        self._call()
    self.assertLen(outer, 1)
    self.assertLen(inner, 2)

  def test_empty_grid_returns_zeros_without_launching(self):
    # The GPU mode would need jax_triton: nothing may reach it.
    with mock.patch.object(
        launch, "_jax_triton", side_effect=AssertionError("launched")
    ):
      x = jnp.ones((0, 4), jnp.bfloat16)
      (out,) = launch.call(
          _GPU,
          _fake_kernel(),
          (x, x),
          [jax.ShapeDtypeStruct((0, 2), jnp.float32)],
          (0,),
          4,
          3,
          M=0,
          BLOCK=16,
      )
    self.assertEqual(out.shape, (0, 2))

  @parameterized.named_parameters(
      (
          "arity",
          dict(extra_array=True),
          ValueError,
          r"fake takes 3 arrays \(x_ptr, offsets_ptr, out_ptr\): the inputs, "
          r"then one per output; got 4\.",
      ),
      (
          "unknown",
          dict(constexprs={"BLOCKK": 2}),
          ValueError,
          r"fake has the constexprs \['BLOCK', 'DOT_F32', 'FLAG', 'M'\]; got "
          r"unknown \['BLOCKK'\]\.",
      ),
      (
          "missing",
          dict(constexprs={"M": None}),
          ValueError,
          r"fake needs the constexprs \['M'\]\.",
      ),
      (
          "grid",
          dict(grid=(1, 2, 3, 4)),
          ValueError,
          r"grid must be 1 to 3 non-negative Python ints, got \(1, 2, 3, 4\)\.",
      ),
      (
          "scalar",
          dict(scalar=True),
          TypeError,
          r"fake: argument 1 must be an array \(run-time values travel as "
          r"arrays\), got int\.",
      ),
      (
          "runner",
          dict(runner="gpu"),
          TypeError,
          r"runner must be a launch.Runner, got str\.",
      ),
  )
  def test_invalid_calls_raise(self, change, error, message):
    x = jnp.ones((4,), jnp.float32)
    args = [x, 7 if change.get("scalar") else x]
    if change.get("extra_array"):
      args.append(x)
    constexprs = {"M": 4, "BLOCK": 16, **change.get("constexprs", {})}
    constexprs = {k: v for k, v in constexprs.items() if v is not None}
    with launch_record.recording(), self.assertRaisesRegex(error, message):
      launch.call(
          change.get("runner", _GPU),
          _fake_kernel(),
          args,
          jax.ShapeDtypeStruct((4,), jnp.float32),
          change.get("grid", (1,)),
          4,
          3,
          **constexprs,
      )


class RunnerTest(absltest.TestCase):

  def test_configs_are_parsed_and_hashable(self):
    small = {"block_m": 16, "block_n": 16, "block_k": 16}
    runner = launch.Runner(
        mode="interpret", configs={"fwd": small}, generation="sm100"
    )
    self.assertEqual(
        runner.configs, configs.Overrides(fwd=configs.Config(16, 16, 16))
    )
    self.assertEqual(
        hash(runner),
        hash(
            launch.Runner(
                mode="interpret", configs={"fwd": small}, generation="sm100"
            )
        ),
    )
    self.assertIsNone(launch.Runner().configs)

  def test_config_follows_mode_and_override(self):
    args = ("fwd", 8192, 4096, 4096, 8, jnp.bfloat16)
    self.assertIs(_INTERPRET.config(*args), configs.INTERPRET)
    self.assertEqual(
        launch.Runner(generation="sm90").config(*args),
        configs.TABLE[("sm90", "fwd", "many_rows")],
    )
    small = configs.Config(16, 16, 16)
    self.assertIs(
        launch.Runner(mode="interpret", configs=small).config(*args), small
    )

  def test_invalid_runner_raises(self):
    with self.assertRaisesRegex(
        ValueError,
        r"Runner.mode must be one of \('gpu', 'interpret', 'auto'\), got "
        r"'cuda'\.",
    ):
      launch.Runner(mode="cuda")
    with self.assertRaisesRegex(
        ValueError,
        r"generation must be None or one "
        r"of \['sm100', 'sm90'\], got 'hopper'\.",
    ):
      launch.Runner(generation="hopper")
    with self.assertRaisesRegex(
        TypeError, r"configs must be None, .*got " r"int\."
    ):
      launch.Runner(configs=3)


def _fake_jax_triton(keyword, returns_list=True, with_options=False):
  """A module with jax-triton 0.3's (out_shape=) or 0.4's (out_type=)
  triton_call, recording its keyword arguments; `with_options`: it also
  names compute_capability= and backend_options= (0.4)."""
  seen = {}

  def triton_call(
      *args, kernel, grid, num_warps=None, num_stages=None, **kwargs
  ):
    seen.update(
        kwargs,
        args=args,
        kernel=kernel,
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    outs = [jnp.zeros(o.shape, o.dtype) for o in kwargs[keyword]]
    return outs if returns_list or len(outs) > 1 else outs[0]

  # The real signatures name the keyword; this one takes it through kwargs.
  parameters = list(inspect.signature(triton_call).parameters.values())
  named = [keyword] if keyword else []
  if with_options:
    named += ["compute_capability", "backend_options"]
  elif keyword == "out_shape":  # 0.3 names the capability too.
    named += ["compute_capability"]
  for name in named:
    parameters.insert(
        2,
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None),
    )
  triton_call.__signature__ = inspect.Signature(parameters)
  return (
      types.SimpleNamespace(triton_call=triton_call, __version__="fake"),
      seen,
  )


class JaxTritonTest(parameterized.TestCase):

  @parameterized.parameters(
      ("out_type", True),
      ("out_shape", True),
      ("out_type", False),
      ("out_shape", False),
  )
  def test_picks_the_output_keyword(self, keyword, returns_list):
    module, seen = _fake_jax_triton(keyword, returns_list)
    x = jnp.ones((8,), jnp.float32)
    out_type = jax.ShapeDtypeStruct((8,), jnp.bfloat16)
    with mock.patch.object(launch, "_jax_triton", return_value=module):
      outs = launch.call(
          _GPU, _fake_kernel(), (x, x), out_type, (2,), 8, 4, M=8, BLOCK=4
      )
    self.assertIsInstance(outs, tuple)
    self.assertLen(outs, 1)
    self.assertEqual(outs[0].dtype, jnp.bfloat16)
    self.assertEqual(seen[keyword], [out_type])
    self.assertNotIn(
        {"out_type": "out_shape", "out_shape": "out_type"}[keyword], seen
    )
    self.assertEqual(
        {
            k: seen[k]
            for k in (
                "grid",
                "num_warps",
                "num_stages",
                "M",
                "BLOCK",
                "DOT_F32",
                "FLAG",
            )
        },
        {
            "grid": (2,),
            "num_warps": 8,
            "num_stages": 4,
            "M": 8,
            "BLOCK": 4,
            "DOT_F32": False,
            "FLAG": 3,
        },
    )
    self.assertLen(seen["args"], 2)

  def test_an_unknown_version_raises(self):
    module, _ = _fake_jax_triton(None)
    x = jnp.ones((8,), jnp.float32)
    with mock.patch.object(launch, "_jax_triton", return_value=module):
      with self.assertRaisesRegex(
          ImportError,
          r"jax_triton fake's triton_call takes neither "
          r"out_type= nor out_shape=",
      ):
        launch.call(
            _GPU,
            _fake_kernel(),
            (x, x),
            jax.ShapeDtypeStruct((8,), jnp.float32),
            (2,),
            8,
            4,
            M=8,
            BLOCK=4,
        )

  def test_the_installed_jax_triton(self):
    try:
      module = launch._jax_triton()  # pylint: disable=protected-access
    except ImportError as e:
      self.skipTest(str(e))
    version = tuple(int(p) for p in module.__version__.split(".")[:2])
    want = "out_type" if version >= (0, 4) else "out_shape"
    self.assertEqual(launch._out_keyword(module), want)  # pylint: disable=protected-access


class TargetTest(parameterized.TestCase):
  """The GPU jax-triton compiles for: the target's, in the PTX it takes."""

  @parameterized.parameters(
      ("NVIDIA H100 80GB HBM3", 90),
      ("NVIDIA H200", 90),
      ("NVIDIA GH200 480GB", 90),
      ("NVIDIA B200", 100),
      ("NVIDIA GB200", 100),
      ("NVIDIA A100-SXM4-80GB", None),
  )
  def test_capability_follows_the_target_kind(self, kind, want):
    with compat.abstract_gpu_mesh(kind):
      self.assertEqual(target_lib.target_capability(), want)

  def test_no_target_outside_a_gpu_topology(self):
    self.assertIsNone(target_lib.target_capability())

  @parameterized.parameters(
      (90, 94, 90),  # Triton 3.9 (ptxas 13.4), CUDA 13.0 plugin.
      (90, 88, None),  # Triton 3.6 (ptxas 12.9): its default is accepted.
      (90, 90, None),
      (None, 94, None),  # No CUDA plugin: Triton's default.
      (90, None, None),
  )
  def test_ptx_version_is_capped_at_the_plugins(self, plugin, triton_ptx, want):
    with (
        mock.patch.object(
            target_lib, "_plugin_ptx_version", return_value=plugin
        ),
        mock.patch.object(
            target_lib, "_triton_ptx_version", return_value=triton_ptx
        ),
    ):
      self.assertEqual(target_lib.ptx_version(100), want)

  @parameterized.parameters(
      ("out_type", 100, 90, {"compute_capability": 100,
                             "backend_options": {"ptx_version": 90}}),
      ("out_type", None, None, {}),
      # jax-triton 0.3: no backend_options, the capability only.
      ("out_shape", 90, 90, {"compute_capability": 90}),
  )  # fmt: skip
  def test_triton_call_gets_the_target(self, keyword, capability, ptx, want):
    module, seen = _fake_jax_triton(keyword, with_options=keyword == "out_type")
    x = jnp.ones((8,), jnp.float32)
    with (
        mock.patch.object(launch, "_jax_triton", return_value=module),
        mock.patch.object(
            target_lib, "target_capability", return_value=capability
        ),
        mock.patch.object(target_lib, "ptx_version", return_value=ptx),
    ):
      launch.call(
          _GPU,
          _fake_kernel(),
          (x, x),
          jax.ShapeDtypeStruct((8,), jnp.float32),
          (2,),
          8,
          4,
          M=8,
          BLOCK=4,
      )
    got = {
        k: seen[k]
        for k in ("compute_capability", "backend_options")
        if seen.get(k) is not None
    }
    self.assertEqual(got, want)

  def test_installed_plugin_and_triton_ptx_versions(self):
    plugin = target_lib._plugin_ptx_version()  # pylint: disable=protected-access
    if plugin is None:
      self.skipTest("no CUDA plugin of jax, or no triton, here")
    # CUDA 13.0, the plugins' build, takes PTX ISA 9.0.
    self.assertGreaterEqual(plugin, 90)
    ptx = target_lib.ptx_version(100)
    self.assertTrue(ptx is None or ptx == plugin, ptx)


class CacheDirTest(parameterized.TestCase):
  """jax-triton's import leaves TRITON_CACHE_DIR as the caller had it."""

  @parameterized.parameters(
      (None, "", None),  # jax-triton 0.3 sets it to "".
      ("/tmp/cache", "", "/tmp/cache"),
      ("/tmp/cache", None, "/tmp/cache"),  # 0.4 unsets it.
      (None, None, None),
  )
  def test_restored(self, before, after_import, want):
    env = {} if after_import is None else {"TRITON_CACHE_DIR": after_import}
    with mock.patch.dict(os.environ, env, clear=False):
      if after_import is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
      launch._restore_cache_dir(before)  # pylint: disable=protected-access
      self.assertEqual(os.environ.get("TRITON_CACHE_DIR"), want)

  def test_after_importing_jax_triton(self):
    try:
      launch._jax_triton()  # pylint: disable=protected-access
    except ImportError as e:
      self.skipTest(str(e))
    # A fresh process: jax-triton changes the variable at its first import.
    script = (
        "import os\n"
        "from backends.triton import launch\n"
        "launch._jax_triton()\n"
        "print(repr(os.environ.get('TRITON_CACHE_DIR')))\n"
    )
    cache = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, cache, ignore_errors=True)
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=cache,
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        JAX_PLATFORMS="cpu",
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertEqual(done.stdout.strip().splitlines()[-1], repr(cache))


class DceRuleTest(absltest.TestCase):
  """jax-triton 0.4.1's two-argument DCE rule on jax 0.12 (three)."""

  def test_a_two_argument_rule_is_adapted(self):
    # pylint: disable-next=g-import-not-at-top
    from jax.interpreters import partial_eval as pe

    primitive = jex.core.Primitive("fake_triton_kernel_call")
    calls = []

    def rule(used_outputs, eqn):
      calls.append((used_outputs, eqn))
      return [True], eqn

    module = types.SimpleNamespace(
        triton_lib=types.SimpleNamespace(triton_kernel_call_p=primitive)
    )
    pe.dce_rules[primitive] = rule
    self.addCleanup(pe.dce_rules.pop, primitive)
    launch._adapt_dce_rule(module)  # pylint: disable=protected-access
    registered = pe.dce_rules[primitive]
    if launch._positional_count(pe.dce_jaxpr_closed_call_rule) == 3:  # pylint: disable=protected-access
      self.assertIsNot(registered, rule)
      self.assertEqual(registered([False], [True], "eqn"), ([True], "eqn"))
      self.assertEqual(calls, [([False], "eqn")])
      launch._adapt_dce_rule(module)  # pylint: disable=protected-access
      self.assertIs(pe.dce_rules[primitive], registered)  # Once only.
    else:  # jax <= 0.11 calls it with two.
      self.assertIs(registered, rule)

  def test_a_jitted_triton_call_lowers_for_cuda(self):
    """jit's DCE calls the rule; the kernel is built for sm_90 here."""
    _skip_unless_triton(self)
    ok, reason = launch.compilable()
    if not ok:
      self.skipTest(reason)
    try:
      launch._jax_triton()  # pylint: disable=protected-access
    except ImportError as e:
      self.skipTest(str(e))
    x = jax.ShapeDtypeStruct((1000,), jnp.float32)

    def f(x, y):
      (out,) = launch.call(
          _GPU, add_kernel, (x, y), x, (8,), 4, 3, N=1000, BLOCK=128
      )
      return out * 2

    try:
      with mock.patch.object(target_lib, "target_capability", return_value=90):
        lowered = jax.jit(f).trace(x, x).lower(lowering_platforms=("cuda",))
    except RuntimeError as e:
      if "jax-triton requires JAX to be installed with GPU support" in str(e):
        self.skipTest(f"no CUDA plugin of jax here: {e}")
      raise
    self.assertIn("triton_kernel_call", lowered.as_text())


def _device(platform, capability=None, kind="NVIDIA H200"):
  return types.SimpleNamespace(
      platform=platform, device_kind=kind, compute_capability=capability
  )


class AvailabilityTest(parameterized.TestCase):

  def _gpu_availability(self, device, jax_triton_ok=True, compilable=True):
    error = ImportError(
        "triton: jax_triton is not importable (ValueError: "
        "no gpu_triton); the GPU mode needs jax-triton."
    )
    why = "" if compilable else "triton: TRITON_INTERPRET is set (...)."
    with (
        mock.patch.object(jax, "devices", return_value=[device]),
        mock.patch.object(
            launch, "_jax_triton", side_effect=None if jax_triton_ok else error
        ),
        mock.patch.object(launch, "compilable", return_value=(compilable, why)),
    ):
      return launch.availability(_GPU)

  def test_gpu_ready(self):
    self.assertEqual(self._gpu_availability(_device("gpu", "9.0")), (True, ""))

  def test_each_missing_piece_is_named(self):
    self.assertEqual(
        self._gpu_availability(_device("cpu"), jax_triton_ok=False),
        (
            False,
            "triton: jax_triton is not importable (ValueError: no "
            "gpu_triton); the GPU mode needs jax-triton; no GPU: this device "
            "is "
            "cpu; pass interpret=True to run the kernels in Triton's "
            "interpreter.",
        ),
    )
    self.assertEqual(
        self._gpu_availability(_device("gpu", "7.5", "Tesla T4")),
        (
            False,
            "triton: Tesla T4 has compute capability 7.5 < 8.0 (bf16 "
            "tensor cores).",
        ),
    )
    ok, reason = self._gpu_availability(_device("gpu", None, "AMD MI300X"))
    self.assertFalse(ok)
    self.assertIn("AMD MI300X reports no CUDA compute capability", reason)

  @parameterized.parameters(("1", False), ("0", True), ("", True))
  def test_compilable_unless_triton_interpret(self, value, want):
    _skip_unless_triton(self)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": value}):
      ok, reason = launch.compilable()
    self.assertEqual(ok, want)
    if not want:
      self.assertIn("TRITON_INTERPRET is set", reason)

  def test_triton_interpret_is_named(self):
    self.assertEqual(
        self._gpu_availability(_device("gpu", "9.0"), compilable=False),
        (False, "triton: TRITON_INTERPRET is set (...)."),
    )

  def test_this_machine(self):
    ok, reason = launch.availability(_GPU)
    if jax.devices()[0].platform != "gpu":
      self.assertFalse(ok)
      self.assertIn("no GPU: this device is", reason)
    try:
      launch._jax_triton()  # pylint: disable=protected-access
    except ImportError:
      self.assertIn("jax_triton is not importable", reason)

  def test_interpret_names_what_is_missing(self):
    with mock.patch.dict(sys.modules, {"torch": None}):
      ok, reason = launch.availability(_INTERPRET)
    self.assertFalse(ok)
    self.assertIn("torch is not installed (pip install torch)", reason)


class CompileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    _skip_unless_triton(self)
    ok, reason = launch.compilable()
    if not ok:
      self.skipTest(reason)

  def _record(self, dtype, block):
    x = jnp.ones((1000,), dtype)
    with launch_record.recording() as calls:
      launch.call(
          _GPU,
          add_kernel,
          (x, x),
          jax.ShapeDtypeStruct(x.shape, x.dtype),
          (-(-1000 // block),),
          4,
          3,
          N=1000,
          BLOCK=block,
      )
    return calls[0]

  @parameterized.product(capability=(90, 100), dtype=("bfloat16", "float32"))
  def test_compile_for_a_record(self, capability, dtype):
    info = triton_aot_compile.compile_for(self._record(dtype, 1024), capability)
    self.assertEqual(
        (
            info.name,
            info.capability,
            info.num_warps,
            info.num_stages,
            info.threads,
        ),
        ("add_kernel", capability, 4, 3, 128),
    )
    self.assertGreater(info.registers, 0)
    self.assertLessEqual(
        info.registers, triton_aot_compile.MAX_REGISTERS_PER_THREAD
    )
    self.assertEqual(info.local_bytes, 0)
    self.assertEqual(info.violations(), [])

  def test_registers_match_cuobjdump(self):
    tool = os.path.join(
        os.path.dirname(triton.__file__),
        "backends",
        "nvidia",
        "bin",
        "cuobjdump",
    )
    source = triton.compiler.ASTSource(
        fn=add_kernel,
        signature={
            "x_ptr": "*fp32",
            "y_ptr": "*fp32",
            "out_ptr": "*fp32",
            "N": "constexpr",
            "BLOCK": "constexpr",
            "SCALE": "constexpr",
        },
        constexprs={"N": 4096, "BLOCK": 4096, "SCALE": 3.0},
    )
    compiled = triton.compile(
        source,
        target=triton.backends.compiler.GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "num_stages": 3},
    )
    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory)
    path = os.path.join(directory, "add.cubin")
    with open(path, "wb") as f:
      f.write(compiled.asm["cubin"])
    try:
      dump = subprocess.run(
          [tool, "--dump-resource-usage", path],
          capture_output=True,
          text=True,
          check=True,
      ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
      self.skipTest(f"Triton's cuobjdump does not run here: {e}")
    match = re.search(r"Function add_kernel:\s*REG:(\d+) STACK:(\d+)", dump)
    self.assertIsNotNone(match, dump)
    self.assertEqual(
        triton_aot_compile.cubin_resources(compiled.asm["cubin"], "add_kernel"),
        (int(match.group(1)), int(match.group(2))),
    )

  def test_cubin_resources_rejects_other_files(self):
    with self.assertRaisesRegex(ValueError, r"Not a 64-bit little-endian ELF"):
      triton_aot_compile.cubin_resources(b"\x7fELF\x01\x01" + bytes(64), "k")


class ViolationsTest(absltest.TestCase):

  def _info(self, **change):
    fields = dict(
        name="k",
        capability=90,
        num_warps=4,
        num_stages=3,
        shared_bytes=1024,
        registers=128,
        local_bytes=0,
    )
    return triton_aot_compile.CompiledInfo(**{**fields, **change})

  def test_within_limits(self):
    self.assertEqual(
        self._info(
            shared_bytes=232448, registers=255, num_warps=8
        ).violations(),
        [],
    )

  def test_each_limit(self):
    self.assertEqual(
        self._info(shared_bytes=232449).violations(),
        ["shared memory 232449 > 232448 bytes"],
    )
    self.assertEqual(
        self._info(registers=256).violations(),
        ["256 registers per thread > 255"],
    )
    # 16 warps of 130 registers (allocated as 136): 69632 > 65536.
    self.assertEqual(
        self._info(registers=130, num_warps=16).violations(),
        ["69632 registers per block (130 x 512 threads) > 65536"],
    )
    with self.assertRaisesRegex(
        ValueError,
        r"No limits known for capability " r"75; known: \[80, 90, 100\]\.",
    ):
      self._info(capability=75).violations()


if __name__ == "__main__":
  absltest.main()
