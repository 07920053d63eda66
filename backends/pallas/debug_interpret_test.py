"""The kernels under the bounds-checking interpreter, on small shapes.

JAX's default interpreter clamps an out-of-bounds `ref[pl.ds(...)]` read (the
dynamic_slice rule), which hides a read past the end of a buffer; on a GPU it
would read garbage. `pltpu.InterpretParams()` checks every read and write
against the buffer's shape and raises instead. It is about 30x slower: small
shapes only. It loads only from refs in the default memory space (since jax
0.11 it refuses ANY/HBM refs, what `pl.no_block_spec` now gives), so the
kernels pass whole-array operands as `pl.BlockSpec()`.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from backends.pallas import backend as pallas_backend
from backends.pallas import kernels
from backends.pallas import metadata
from backends.pallas import ops
from backends.pallas import tiling
from moe_core import ffn
from reference import backend as reference

_TILES = tiling.Tiles(bm=16, bk=16, bn=16)
_SIZES = (10, 0, 23, 9)  # Shared tiles, an empty group, 22 padding rows.


def _inputs(m=64, k=32, n=48, seed=0):
  rng = np.random.default_rng(seed)
  used = sum(_SIZES)
  rows = rng.standard_normal((m, k)).astype(np.float32)
  rows[used:] = np.nan
  dy = rng.standard_normal((m, n)).astype(np.float32)
  dy[used:] = np.nan
  weights = rng.standard_normal((len(_SIZES), k, n)).astype(np.float32)
  return (
      jnp.asarray(rows),
      jnp.asarray(weights),
      jnp.asarray(_SIZES, jnp.int32),
      jnp.asarray(dy),
  )


class DebugInterpretTest(parameterized.TestCase):

  def tearDown(self):
    pltpu.reset_tpu_interpret_mode_state()
    super().tearDown()

  def test_gmm_forward_and_transposed_stay_in_bounds(self):
    rows, weights, sizes, dy = _inputs()
    used = sum(_SIZES)
    clean_rows = rows.at[used:].set(0)
    clean_dy = dy.at[used:].set(0)
    debug = pltpu.InterpretParams()
    (out,) = kernels.gmm(
        [rows], [weights], sizes, tiles=_TILES, interpret=debug
    )
    np.testing.assert_allclose(
        out,
        reference.grouped_gemm(clean_rows, weights, sizes),
        atol=1e-4,
        rtol=1e-5,
    )
    (d_rows,) = kernels.gmm(
        [dy],
        [weights],
        sizes,
        tiles=_TILES,
        interpret=debug,
        transpose_rhs=True,
    )
    np.testing.assert_allclose(
        d_rows,
        reference.grouped_gemm(clean_dy, weights, sizes, transpose_rhs=True),
        atol=1e-4,
        rtol=1e-5,
    )

  def test_tgmm_stays_in_bounds(self):
    rows, weights, sizes, dy = _inputs()
    used = sum(_SIZES)
    (d_weights,) = kernels.tgmm(
        rows, [dy], sizes, tiles=_TILES, interpret=pltpu.InterpretParams()
    )
    _, vjp = jax.vjp(
        lambda w: reference.grouped_gemm(rows.at[used:].set(0), w, sizes),
        weights,
    )
    np.testing.assert_allclose(
        d_weights, vjp(dy.at[used:].set(0))[0], atol=1e-4, rtol=1e-5
    )

  def test_gate_up_pair_stays_in_bounds(self):
    """Two weight operands, two accumulators, two outputs in one pass."""
    rows, w_gate, sizes, _ = _inputs()
    _, w_up, _, _ = _inputs(seed=1)
    clean_rows = rows.at[sum(_SIZES) :].set(0)
    gate, up = kernels.gmm(
        [rows],
        [w_gate, w_up],
        sizes,
        tiles=_TILES,
        interpret=pltpu.InterpretParams(),
        products=((0, 0, 0), (0, 1, 1)),
        num_outputs=2,
    )
    for got, w in ((gate, w_gate), (up, w_up)):
      np.testing.assert_allclose(
          got,
          reference.grouped_gemm(clean_rows, w, sizes),
          atol=1e-4,
          rtol=1e-5,
      )

  def test_fused_swiglu_and_its_backward_stay_in_bounds(self):
    """The SiLU epilogue forward, then the two-product dX and two-rhs dW."""
    rows, w_gate, sizes, dy = _inputs()
    _, w_up, _, _ = _inputs(seed=1)
    used = sum(_SIZES)
    launch = ops.Launch(
        tiles=tiling.TileConfig.parse(_TILES), interpret=pltpu.InterpretParams()
    )

    def fused(x, wg, wu):
      return ops.gated_gate_up(x, wg, wu, sizes, "silu", launch)

    def want(x, wg, wu):
      return ffn.gated(
          reference.grouped_gemm(x, wg, sizes),
          reference.grouped_gemm(x, wu, sizes),
          "silu",
      )

    out, vjp = jax.vjp(fused, rows, w_gate, w_up)
    want_out, want_vjp = jax.vjp(want, rows.at[used:].set(0), w_gate, w_up)
    np.testing.assert_allclose(out, want_out, atol=1e-4, rtol=1e-4)
    for name, got, expected in zip(
        ("d_rows", "d_w_gate", "d_w_up"), vjp(dy), want_vjp(dy.at[used:].set(0))
    ):
      np.testing.assert_allclose(
          got, expected, atol=1e-3, rtol=1e-4, err_msg=name
      )

  def test_backend_debug_mode_runs_grouped_gemm(self):
    be = pallas_backend.PallasBackend(tiles=_TILES, interpret="debug")
    rows, weights, sizes, _ = _inputs(m=32, k=16, n=16, seed=1)
    sizes = jnp.array([5, 0, 11, 16], jnp.int32)
    rows = rows[:32]
    weights = weights[:, :16, :16]
    np.testing.assert_allclose(
        be.grouped_gemm(rows, weights, sizes),
        reference.grouped_gemm(rows, weights, sizes),
        atol=1e-4,
        rtol=1e-5,
    )

  def _tiles_off_by(self, shift):
    """Patches metadata.build: every tile id `shift` tiles too far."""
    real_build = metadata.build

    def off_by(group_sizes, num_rows, bm):
      meta = real_build(group_sizes, num_rows, bm)
      return meta._replace(tile_ids=meta.tile_ids + shift)

    return mock.patch.object(metadata, "build", off_by)

  def test_catches_a_read_past_the_rows(self):
    """A tile list one tile off reads past the rows: the interpreter raises."""
    rows, weights, sizes, _ = _inputs()
    with self._tiles_off_by(1):
      with self.assertRaisesRegex(Exception, r"Out-of-bounds"):
        jax.block_until_ready(
            kernels.gmm(
                [rows],
                [weights],
                sizes,
                tiles=_TILES,
                interpret=pltpu.InterpretParams(),
            )
        )

  def test_catches_a_read_past_the_rows_in_tgmm(self):
    """The same in dW, whose row operands are whole-array inputs.

    dW visits only the groups' own tiles, the last of them tile 2 of 4 (row
    41 is the last used): two tiles off reads past the 64 rows.
    """
    rows, _, sizes, dy = _inputs()
    with self._tiles_off_by(2):
      with self.assertRaisesRegex(Exception, r"Out-of-bounds"):
        jax.block_until_ready(
            kernels.tgmm(
                rows,
                [dy],
                sizes,
                tiles=_TILES,
                interpret=pltpu.InterpretParams(),
            )
        )


if __name__ == "__main__":
  absltest.main()
