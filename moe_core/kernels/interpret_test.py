"""The kernel backends' shared `interpret` option and their common defaults.

pallas, mosaic_gpu and triton read `interpret` through
`moe_core.kernels.interpret`: the same value gives the same mode in each
(auto interpreted off a GPU and compiled for an AOT GPU target, False
unavailable off a GPU, a bad value the same error), and each leaves its
fused activation epilogue off unless asked.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from backends.mosaic_gpu import backend as mosaic_backend
from backends.mosaic_gpu import ops as mosaic_ops
from backends.pallas import backend as pallas_backend
from backends.pallas import ops as pallas_ops
from backends.triton import backend as triton_backend
from backends.triton import launch_record
from moe_core import compat
from moe_core.kernels import gpu
from moe_core.kernels import interpret as interpret_lib
from moe_core.testing import cuda_export

# Small tiles, so that the interpreted runs stay quick; triton's are
# `configs.INTERPRET` whenever it interprets.
_BACKENDS = (
    ("pallas", pallas_backend.PallasBackend, {"tiles": {"bm": 16}}),
    (
        "mosaic_gpu",
        mosaic_backend.MosaicGpuBackend,
        {"tiles": {"bm": 64, "bk": 64, "bn": 64}},
    ),
    ("triton", triton_backend.TritonBackend, {}),
)
# The custom call each backend's compiled kernels lower to for CUDA.
_COMPILED_CALL = {
    "pallas": cuda_export.TRITON_CALL,
    "mosaic_gpu": "mosaic_gpu_v2",
}


def _off_gpu(test: absltest.TestCase) -> None:
  if jax.default_backend() == "gpu":
    test.skipTest("checks the backends off a GPU; this host has one")


class _Settings:
  """A stand-in for an interpreter settings class (its name is its type)."""


class InterpreterTest(parameterized.TestCase):
  """`Interpreter` on its own: parsing, errors and auto."""

  INTERPRETER = interpret_lib.Interpreter(
      default=lambda: "the interpreter",
      names=(("debug", lambda: "the debug interpreter"),),
      params=(("_Settings", "a _Settings"),),
  )

  def test_parse(self):
    parse = self.INTERPRETER.parse
    self.assertIs(parse(None), interpret_lib.AUTO)
    self.assertIs(parse(False), False)
    self.assertEqual(parse(True), "the interpreter")
    self.assertEqual(parse("debug"), "the debug interpreter")
    settings = _Settings()
    self.assertIs(parse(settings), settings)

  @parameterized.parameters(
      ("yes", ValueError, "got 'yes'"),
      ("auto", ValueError, "got 'auto'"),
      (1, TypeError, r"got 1 \(int\)"),
      (0, TypeError, r"got 0 \(int\)"),
      (np.bool_(True), TypeError, r"got (np\.)?True_? \(bool_?\)"),
      (object(), TypeError, r"got <object .*> \(object\)"),
  )
  def test_bad_values_name_what_is_allowed(self, value, error, got):
    with self.assertRaisesRegex(
        error,
        r"^interpret must be None \(auto\), True, False, 'debug' or a "
        r"_Settings, " + got,
    ):
      self.INTERPRETER.parse(value)

  def test_auto_follows_the_lowering_platform(self):
    here = "gpu" if jax.default_backend() == "gpu" else jax.default_backend()
    self.assertEqual(gpu.lowering_platform(), here)
    with compat.abstract_gpu_mesh("NVIDIA H100 80GB HBM3"):
      self.assertEqual(gpu.lowering_platform(), "gpu")
      self.assertFalse(interpret_lib.interprets(interpret_lib.AUTO))
      self.assertIs(self.INTERPRETER.resolve(interpret_lib.AUTO), False)
    self.assertEqual(
        interpret_lib.interprets(interpret_lib.AUTO), here != "gpu"
    )

  def test_given_settings_do_not_follow_the_platform(self):
    with compat.abstract_gpu_mesh():
      self.assertTrue(interpret_lib.interprets("the interpreter"))
      self.assertEqual(
          self.INTERPRETER.resolve("the interpreter"), "the interpreter"
      )
    self.assertFalse(interpret_lib.interprets(False))
    self.assertIs(self.INTERPRETER.resolve(False), False)


class BackendsAgreeTest(parameterized.TestCase):
  """The three backends, one meaning of each value."""

  @parameterized.named_parameters(*_BACKENDS)
  def test_auto_is_the_interpreter_off_a_gpu(self, cls, options):
    _off_gpu(self)
    auto, interpreted = cls(interpret=None), cls(interpret=True)
    self.assertIsNot(auto.interpret, False)
    self.assertEqual(auto.interpret, interpreted.interpret)
    # Available exactly where the interpreter is, with the same reason.
    self.assertEqual(auto.availability(), interpreted.availability())
    self.assertIn("interpret=None", repr(auto))

  @parameterized.named_parameters(*_BACKENDS)
  def test_auto_runs_the_interpreter_off_a_gpu(self, cls, options):
    """A grouped GEMM under auto, against float64 numpy: compiled kernels
    would not lower off a GPU."""
    _off_gpu(self)
    be = cls(interpret=None, **options)
    ok, reason = be.availability()
    if not ok:
      self.skipTest(f"the interpreter is unavailable here: {reason}")
    sizes = np.array([40, 0, 72, 16])  # 128 rows, one empty group.
    keys = jax.random.split(jax.random.key(0), 2)
    rows = jax.random.normal(keys[0], (128, 64), jnp.bfloat16)
    weights = jax.random.normal(keys[1], (4, 64, 64), jnp.bfloat16)
    out = jax.jit(be.grouped_gemm)(rows, weights, jnp.asarray(sizes, "int32"))
    x = np.asarray(rows, np.float64)
    w = np.asarray(weights, np.float64)
    groups = np.repeat(np.arange(4), sizes)
    want = np.einsum("mc,mcn->mn", x, w[groups])
    np.testing.assert_allclose(
        np.asarray(out, np.float64), want, rtol=2e-2, atol=2e-1
    )

  @parameterized.named_parameters(*_BACKENDS)
  def test_auto_compiles_for_an_aot_gpu_target(self, cls, options):
    be = cls(interpret=None, **options)
    with compat.abstract_gpu_mesh("NVIDIA H100 80GB HBM3"):
      self.assertIs(be.interpret, False)

  @parameterized.named_parameters(
      (n, cls, options) for n, cls, options in _BACKENDS if n in _COMPILED_CALL
  )
  def test_auto_lowers_the_compiled_kernels_for_cuda(self, cls, options):
    del options  # The shipped tiles: what a GPU program uses.
    be = cls(interpret=None)
    exported = cuda_export.export_for_cuda(
        be.grouped_gemm,
        jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        device_kind="NVIDIA H100 80GB HBM3",
    )
    calls = cuda_export.custom_calls(exported.mlir_module())
    self.assertIn(_COMPILED_CALL[type(be).name], calls)
    self.assertEqual(set(calls), {_COMPILED_CALL[type(be).name]})

  def test_triton_auto_launches_by_the_lowering_platform(self):
    """The recorded launches (no kernel runs): compiled for the target."""
    be = triton_backend.TritonBackend(interpret=None)
    # Shapes no other test traces: a trace cached by another would launch
    # nothing here.
    rows = jnp.zeros((96, 48), jnp.bfloat16)
    weights = jnp.zeros((3, 48, 32), jnp.bfloat16)
    sizes = jnp.array([64, 0, 32], jnp.int32)

    def modes():
      with launch_record.recording() as calls:
        jax.eval_shape(be.grouped_gemm, rows, weights, sizes)
      self.assertNotEmpty(calls)
      return {call.mode for call in calls}

    with compat.abstract_gpu_mesh("NVIDIA H100 80GB HBM3"):
      self.assertEqual(modes(), {"gpu"})
    if jax.default_backend() != "gpu":
      self.assertEqual(modes(), {"interpret"})

  @parameterized.named_parameters(*_BACKENDS)
  def test_false_is_unavailable_off_a_gpu(self, cls, options):
    _off_gpu(self)
    be = cls(interpret=False)
    self.assertIs(be.interpret, False)
    ok, reason = be.availability()
    self.assertFalse(ok)
    self.assertRegex(reason, rf"^{type(be).name}: .*interpret=True")

  @parameterized.named_parameters(*_BACKENDS)
  def test_true_is_the_interpreter_for_an_aot_gpu_target_too(
      self, cls, options
  ):
    be = cls(interpret=True)
    with compat.abstract_gpu_mesh():
      self.assertIsNot(be.interpret, False)

  @parameterized.named_parameters(*_BACKENDS)
  def test_bad_values_raise_the_same_errors(self, cls, options):
    del options
    with self.assertRaisesRegex(
        ValueError, r"^interpret must be None \(auto\), True.* got 'y'\.$"
    ):
      cls(interpret="y")
    with self.assertRaisesRegex(
        TypeError,
        r"^interpret must be None \(auto\), True.* got 1 \(int\)\.$",
    ):
      cls(interpret=1)

  def test_each_names_its_own_settings(self):
    self.assertRegex(
        _error(pallas_backend.PallasBackend),
        r"None \(auto\), True, False, 'debug' or a pltpu.InterpretParams,",
    )
    self.assertRegex(
        _error(mosaic_backend.MosaicGpuBackend),
        r"None \(auto\), True, False or an InterpretGPUParams,",
    )
    self.assertRegex(
        _error(triton_backend.TritonBackend), r"None \(auto\), True or False,"
    )

  @parameterized.named_parameters(*_BACKENDS)
  def test_only_its_own_settings_objects(self, cls, options):
    del options
    others = {
        "InterpretParams": pallas_ops.INTERPRETER.parse("debug"),
        "InterpretGPUParams": mosaic_ops.interpret_params(),
    }
    own = {"pallas": "InterpretParams", "mosaic_gpu": "InterpretGPUParams"}
    if cls.name in own:  # Its own are taken as they are.
      settings = others.pop(own[cls.name])
      self.assertIs(cls(interpret=settings).interpret, settings)
    for name, settings in others.items():
      with self.assertRaisesRegex(TypeError, rf"\({name}\)\.$"):
        cls(interpret=settings)

  @parameterized.named_parameters(*_BACKENDS)
  def test_fuse_activation_is_off_by_default(self, cls, options):
    del options
    self.assertIs(cls().fuse_activation, False)
    self.assertIs(cls(fuse_activation=True).fuse_activation, True)


def _error(cls) -> str:
  try:
    cls(interpret="y")
  except ValueError as e:
    return str(e)
  raise AssertionError(f"{cls.__name__}(interpret='y') raised nothing")


if __name__ == "__main__":
  absltest.main()
