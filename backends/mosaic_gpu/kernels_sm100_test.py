"""The sm_100 (tcgen05) gmm kernel in Mosaic GPU's interpreter, and exported.

Inputs are bfloat16; the reference is `jax.lax.ragged_dot` in float32 on the
same (bf16-exact) values, so with float32 outputs only the order of the
float32 sums differs. Shapes are small but cover tiles shared by groups,
empty groups, padded C and N, several C steps and column blocks, and NaN in
the rows past sum(group_sizes).

The interpreter simulates TMEM and tcgen05 from jax 0.11 on; on older JAX
the interpreted tests skip with the interpreter's error. The export tests
lower for a Blackwell device without one: Mosaic GPU takes the target
compute capability from the abstract mesh's device (default sm_90).
"""

import dataclasses

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from backends.mosaic_gpu import kernels_sm100
from backends.mosaic_gpu import tiling


def _interpret_params(**kwargs):
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu

  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:  # jax 0.10.2 keeps it private.
    from jax._src.pallas.mosaic_gpu.interpret import params as private

    params = private.InterpretGPUParams
  return params(**kwargs)


def _races_found():
  # pylint: disable-next=g-import-not-at-top
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

  return interpret_pallas_call.get_races().races_found


def _reset_interpreter():
  """The interpreter must be reset after a kernel raised inside it."""
  # pylint: disable-next=g-import-not-at-top
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

  interpret_pallas_call.reset_gpu_interpret_mode_state()


def _silu(x):
  return x / (1.0 + jnp.exp(-x))


def _ragged(x, w, group_sizes, transpose_rhs=False):
  """float32 ragged_dot; rows past sum(group_sizes) give 0 (NaN-free)."""
  x = jnp.nan_to_num(jnp.asarray(x, jnp.float32))
  w = jnp.asarray(w, jnp.float32)
  if transpose_rhs:
    w = jnp.swapaxes(w, 1, 2)
  return np.asarray(
      jax.lax.ragged_dot(x, w, jnp.asarray(group_sizes, jnp.int32))
  )


def _rows(rng, m, c, used):
  """[m, c] bf16 rows, NaN past row `used`."""
  x = rng.standard_normal((m, c)).astype(np.float32)
  x[used:] = np.nan
  return jnp.asarray(x, jnp.bfloat16)


def _weights(rng, e, d1, d2):
  return jnp.asarray(rng.standard_normal((e, d1, d2)), jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class _Blackwell:
  """An abstract B200: what Mosaic GPU reads to pick the target (sm_100)."""

  device_kind: str = "NVIDIA B200"
  platform: str = "gpu"
  num_cores: int = 148
  compute_capability: str = "10.0"


def _export_for_sm100(f, *args):
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_Blackwell())
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.export.export(jax.jit(f), platforms=["cuda"])(*args)


def _kernel_modules(stablehlo_text):
  """The serialized Mosaic GPU modules of the mosaic_gpu_v2 custom calls."""
  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir

  found = []

  def walk(op):
    for region in op.regions:
      for block in region:
        for inner in block:
          if inner.name == "stablehlo.custom_call":
            target = ir.StringAttr(inner.attributes["call_target_name"]).value
            if target == "mosaic_gpu_v2":
              config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
              found.append(ir.StringAttr(config["module"]).value_bytes)
          walk(inner)

  with mlir.make_ir_context():
    walk(ir.Module.parse(stablehlo_text).operation)
  return found


class KernelsSm100Test(absltest.TestCase):

  def gmm(self, *args, params=None, **kwargs):
    """kernels_sm100.gmm in the interpreter; skips where it lacks tcgen05."""
    params = params or _interpret_params()
    try:
      outs = kernels_sm100.gmm(*args, interpret=params, **kwargs)
      return [np.asarray(o.astype(jnp.float32)) for o in outs]
    except NotImplementedError as e:
      if "tmem" not in str(e).lower() and "tcgen05" not in str(e).lower():
        raise
      _reset_interpreter()
      self.skipTest(
          f"jax {jax.__version__}: Mosaic GPU's interpreter cannot run "
          f"tcgen05/TMEM: {e}"
      )

  def assert_rows(self, out, expected, used, rtol=1e-5, atol=1e-4):
    """Owned rows match; rows past `used` are exactly zero."""
    np.testing.assert_allclose(
        out[:used], expected[:used], rtol=rtol, atol=atol
    )
    np.testing.assert_array_equal(out[used:], 0.0)

  def test_boundaries_off_grid_empty_group_nan_tail(self):
    # Group ends 70 and 170 fall inside row tiles; group 1 is empty; rows
    # 170..199 are NaN. C=96 and N=96 are padded to 128 (2 steps, 2 blocks).
    rng = np.random.default_rng(0)
    sizes, m, c, n = [70, 0, 100], 200, 96, 96
    x, w = _rows(rng, m, c, sum(sizes)), _weights(rng, 3, c, n)
    tiles = tiling.Tiles(bm=128, bk=64, bn=64, stages=2)
    (out,) = self.gmm([x], [w], jnp.asarray(sizes, jnp.int32), tiles=tiles)
    self.assertEqual(out.shape, (m, n))
    # Default out_dtype (bf16): the float32 sums, rounded once.
    self.assert_rows(
        out, _ragged(x, w, sizes), sum(sizes), rtol=2**-7, atol=1e-3
    )

  def test_one_group_holds_all_rows_bm64(self):
    # bm=64: the M=64 MMA into a half-lane TMEM accumulator.
    rng = np.random.default_rng(1)
    sizes, m, c, n = [0, 150, 0], 150, 64, 128
    x, w = _rows(rng, m, c, sum(sizes)), _weights(rng, 3, c, n)
    tiles = tiling.Tiles(bm=64, bk=32, bn=128, stages=3)
    (out,) = self.gmm(
        [x],
        [w],
        jnp.asarray(sizes, jnp.int32),
        tiles=tiles,
        out_dtype=jnp.float32,
    )
    self.assert_rows(out, _ragged(x, w, sizes), m)

  def test_bm256_two_row_blocks(self):
    # bm=256: two M=128 accumulators per tile; the second group starts in
    # the second half of the first tile.
    rng = np.random.default_rng(2)
    sizes, m, c, n = [180, 60, 10], 300, 64, 64
    x, w = _rows(rng, m, c, sum(sizes)), _weights(rng, 3, c, n)
    tiles = tiling.Tiles(bm=256, bk=64, bn=64, stages=2)
    (out,) = self.gmm(
        [x],
        [w],
        jnp.asarray(sizes, jnp.int32),
        tiles=tiles,
        out_dtype=jnp.float32,
    )
    self.assert_rows(out, _ragged(x, w, sizes), sum(sizes))

  def test_transpose_rhs(self):
    # rhs [E, N, C], contracted on C; three C steps of 32 in a 3-deep pipe.
    rng = np.random.default_rng(3)
    sizes, m, c, n = [30, 90, 0, 40], 180, 96, 80
    x, w = _rows(rng, m, c, sum(sizes)), _weights(rng, 4, n, c)
    tiles = tiling.Tiles(bm=128, bk=32, bn=64, stages=3)
    (out,) = self.gmm(
        [x],
        [w],
        jnp.asarray(sizes, jnp.int32),
        tiles=tiles,
        transpose_rhs=True,
        out_dtype=jnp.float32,
    )
    expected = _ragged(x, w, sizes, transpose_rhs=True)
    self.assert_rows(out, expected, sum(sizes))

  def test_gate_up_two_accumulators(self):
    # Two products into two accumulators; the epilogue returns both and the
    # fused silu(gate) * up from the same tiles.
    rng = np.random.default_rng(4)
    sizes, m, c, n = [50, 0, 120], 190, 64, 64
    x = _rows(rng, m, c, sum(sizes))
    wg, wu = _weights(rng, 3, c, n), _weights(rng, 3, c, n)
    tiles = tiling.Tiles(bm=128, bk=64, bn=64, stages=2)
    gate, up, act = self.gmm(
        [x],
        [wg, wu],
        jnp.asarray(sizes, jnp.int32),
        tiles=tiles,
        products=((0, 0, 0), (0, 1, 1)),
        epilogue=lambda accs: (accs[0], accs[1], _silu(accs[0]) * accs[1]),
        num_outputs=3,
        out_dtype=jnp.float32,
    )
    used = sum(sizes)
    g, u = _ragged(x, wg, sizes), _ragged(x, wu, sizes)
    self.assert_rows(gate, g, used)
    self.assert_rows(up, u, used)
    self.assert_rows(act, np.asarray(_silu(g) * u), used, rtol=1e-4)

  def test_dx_of_gate_up_one_accumulator(self):
    # dX = d_gate @ wg^T + d_up @ wu^T: two products into one accumulator.
    rng = np.random.default_rng(5)
    sizes, m, c, n = [0, 100, 60], 170, 64, 96
    dg, du = _rows(rng, m, n, sum(sizes)), _rows(rng, m, n, sum(sizes))
    wg, wu = _weights(rng, 3, c, n), _weights(rng, 3, c, n)
    tiles = tiling.Tiles(bm=128, bk=64, bn=64, stages=2)
    (dx,) = self.gmm(
        [dg, du],
        [wg, wu],
        jnp.asarray(sizes, jnp.int32),
        tiles=tiles,
        products=((0, 0, 0), (1, 1, 0)),
        transpose_rhs=True,
        out_dtype=jnp.float32,
    )
    expected = _ragged(dg, wg, sizes, True) + _ragged(du, wu, sizes, True)
    self.assert_rows(dx, expected, sum(sizes))

  def test_no_races(self):
    # The interpreter's happens-before race detector over the TMA loads,
    # the asynchronous MMAs (barriers that order the tensor core) and the
    # reuse of SMEM and TMEM across the work items of a persistent program
    # (2 programs, 4 row tiles x 2 column blocks each, 3 C steps in a
    # 2-deep pipeline).
    rng = np.random.default_rng(6)
    sizes, m, c, n = [100, 0, 150], 256, 96, 128
    x, w = _rows(rng, m, c, sum(sizes)), _weights(rng, 3, c, n)
    tiles = tiling.Tiles(bm=64, bk=32, bn=64, stages=2)
    (out,) = self.gmm(
        [x],
        [w],
        jnp.asarray(sizes, jnp.int32),
        tiles=tiles,
        out_dtype=jnp.float32,
        params=_interpret_params(detect_races=True),
    )
    self.assertFalse(_races_found())
    self.assert_rows(out, _ragged(x, w, sizes), sum(sizes))

  def test_tiles_that_do_not_fit_raise(self):
    with self.assertRaisesRegex(ValueError, "TMEM columns"):
      kernels_sm100.check_tiles(tiling.Tiles(bm=256, bn=256), num_accs=2)
    with self.assertRaisesRegex(ValueError, "stages >= 2"):
      kernels_sm100.check_tiles(tiling.Tiles(stages=1), num_accs=1)
    kernels_sm100.check_tiles(tiling.Tiles(bm=128, bn=256), num_accs=2)

  def _export_gate_up(self):
    tiles = tiling.Tiles(bm=128, bk=64, bn=128, stages=4)

    def f(x, wg, wu, sizes):
      return kernels_sm100.gmm(
          [x],
          [wg, wu],
          sizes,
          tiles=tiles,
          products=((0, 0, 0), (0, 1, 1)),
          epilogue=lambda accs: (_silu(accs[0]) * accs[1],),
          num_outputs=1,
          num_programs=148,
      )

    w = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16)
    return _export_for_sm100(
        f,
        jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16),
        w,
        w,
        jax.ShapeDtypeStruct((8,), jnp.int32),
    )

  def test_export_for_sm100(self):
    text = self._export_gate_up().mlir_module()
    self.assertIn("mosaic_gpu_v2", text)
    # The kernel's PTX is tcgen05 (wgmma does not exist on sm_100).
    self.assertIn("tcgen05.mma", text)
    self.assertNotIn("wgmma", text)

  def test_export_targets_sm100(self):
    # pylint: disable=g-import-not-at-top
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic import gpu as mgpu

    (module,) = _kernel_modules(self._export_gate_up().mlir_module())
    context = mlir.make_ir_context()
    mgpu.dialect.register_dialect(context)
    with context:
      context.allow_unregistered_dialects = True
      try:
        kernel = ir.Module.parse(module)
      except ir.MLIRError as e:
        detail = " ".join(line.strip() for line in str(e).splitlines())
        self.skipTest(
            f"jax {jax.__version__} cannot parse its own serialized Mosaic "
            f"GPU module, so its target is not checked: {detail[:200]}"
        )
      attrs = kernel.operation.attributes
      arch = (
          ir.IntegerAttr(attrs["mosaic_gpu.arch_major"]).value,
          ir.IntegerAttr(attrs["mosaic_gpu.arch_minor"]).value,
      )
    self.assertEqual(arch, (10, 0))


if __name__ == "__main__":
  absltest.main()
