"""The Triton GEMM kernels in Triton's CPU interpreter, against float64 numpy.

Shapes are small and tiles are 16-32 rows, so row tiles shared by two
groups, empty groups, partial tiles and K/N tails all occur. Outputs start
as NaN, so an element no program writes shows up.

The kernels are run as `InterpretedFunction(kernel.fn)`, not through
TRITON_INTERPRET=1: that variable only acts on functions decorated after it
is set, so it would have to precede the first `import triton` of the whole
process (and would then turn every kernel of the process, including those
the AOT compile tests hand to triton.compile, into interpreted ones). An
InterpretedFunction alone cannot call other @triton.jit functions (the
kernels' helpers, tl.cdiv, tl.sigmoid): the backend's corrections to the
interpreter (`backends.triton.interpreter.fixes`, those of its interpret
mode) let it for the duration of one launch, and make loops with run-time
bounds work on Triton 3.6 with NumPy 2.4.
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

try:
  import torch
  import triton
  from triton.runtime import interpreter as triton_interpreter
except ImportError as e:
  _MISSING = f"Triton's interpreter needs torch and triton: {e}"
else:
  _MISSING = None
  from backends.triton import kernels
  from backends.triton import interpreter

_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def _launch(kernel, grid, *args, **constexprs):
  fn = triton_interpreter.InterpretedFunction(getattr(kernel, "fn", kernel))
  with interpreter.fixes():
    fn[grid](*args, **constexprs)


def _torch(array, dtype="float32"):
  """A CPU tensor of `array` in dtype (float32 is copied first)."""
  tensor = torch.from_numpy(np.ascontiguousarray(array))
  return tensor.to(getattr(torch, dtype))


def _numpy64(tensor):
  """A float64 numpy copy of a CPU tensor (bf16 included)."""
  return tensor.to(torch.float64).numpy()


def _nan_tensor(shape, dtype):
  return torch.full(shape, float("nan"), dtype=getattr(torch, dtype))


def _offsets(group_sizes):
  return np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int64)


def _erf(x):
  return np.vectorize(math.erf)(x)


_ACTIVATIONS = {
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5
    * x
    * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
}


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


# The registry's other gated activations in float64, from their formulas
# (GPT-OSS; Inkling 2), with the options the kernel gets as constexprs.
_ALPHA, _GATE_CAP, _UP_CAP = 1.702, 0.9, 1.1
_GLUS = {
    **{
        name: (lambda act: lambda g, u: act(g) * u)(act)
        for name, act in _ACTIVATIONS.items()
    },
    "gpt_oss_glu": lambda g, u: (u + 1.0) * g * _sigmoid(_ALPHA * g),
    "softcapped_silu": lambda g, u: (
        _GATE_CAP
        * np.tanh(g / _GATE_CAP)
        * _sigmoid(g)
        * _UP_CAP
        * np.tanh(u / _UP_CAP)
    ),
}


def _gmm_reference(x, w, group_sizes, transpose_w=False, row_scale=None):
  """out[r] = row_scale[r] * x[r] @ w[g(r)] in float64; zeros past the sum."""
  offsets = _offsets(group_sizes)
  n = w.shape[1] if transpose_w else w.shape[2]
  out = np.zeros((x.shape[0], n))
  for g in range(len(group_sizes)):
    rows = slice(offsets[g], offsets[g + 1])
    out[rows] = x[rows] @ (w[g].T if transpose_w else w[g])
    if row_scale is not None:
      out[rows] *= row_scale[rows, None]
  return out


def _tgmm_reference(a, b, group_sizes, row_scale=None):
  """out[e] = a_e^T (row_scale_e * b_e) in float64."""
  offsets = _offsets(group_sizes)
  out = np.zeros((len(group_sizes), a.shape[1], b.shape[1]))
  for e in range(len(group_sizes)):
    rows = slice(offsets[e], offsets[e + 1])
    scaled = b[rows]
    if row_scale is not None:
      scaled = scaled * row_scale[rows, None]
    out[e] = a[rows].T @ scaled
  return out


def _rows(m, k, group_sizes, seed):
  """[m, k] float32 normal rows, NaN at and past sum(group_sizes)."""
  rows = np.random.default_rng(seed).standard_normal((m, k))
  rows = rows.astype(np.float32)
  rows[sum(group_sizes) :] = np.nan
  return rows


class _KernelTestCase(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if _MISSING:
      self.skipTest(_MISSING)

  def assert_close(self, got, want, dtype, msg=""):
    self.assertFalse(np.isnan(got).any(), f"{msg}: NaN in the output")
    tol = _TOLERANCE[dtype]
    scale = max(float(np.abs(want).max()), 1.0) if want.size else 1.0
    np.testing.assert_allclose(
        got, want, rtol=tol, atol=tol * scale, err_msg=msg
    )


class TileListTest(_KernelTestCase):
  """kernels.tile_list follows the brief's rule."""

  def test_worked_example(self):
    # Rows 0-19 group 0, none group 1, 20-49 group 2, 50-69 the tail (3);
    # tiles of 16 rows: 0-15, 16-31, 32-47, 48-63, 64-69.
    offsets, group_ids, m_tile_ids, num_tiles = kernels.tile_list(
        [20, 0, 30], 70, 16
    )
    np.testing.assert_array_equal(offsets, [0, 20, 20, 50])
    self.assertEqual(num_tiles.tolist(), [7])
    self.assertLen(group_ids, 5 + 3)
    np.testing.assert_array_equal(group_ids, [0, 0, 2, 2, 2, 3, 3, 0])
    np.testing.assert_array_equal(m_tile_ids, [0, 1, 1, 2, 3, 3, 4, 0])
    for array in (offsets, group_ids, m_tile_ids, num_tiles):
      self.assertEqual(array.dtype, np.int32)

  @parameterized.parameters(0, 1, 2, 3, 4)
  def test_every_row_has_exactly_one_owner(self, seed):
    rng = np.random.default_rng(seed)
    m, block_m = int(rng.integers(1, 120)), int(rng.choice([8, 16, 32]))
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), [0.25] * 4)
    offsets, group_ids, m_tile_ids, num_tiles = kernels.tile_list(
        sizes, m, block_m
    )
    count = int(num_tiles[0])
    self.assertLen(group_ids, -(-m // block_m) + 4)
    self.assertLessEqual(count, len(group_ids))
    ends = np.append(offsets[1:], m)
    owners = np.zeros(m, np.int64)
    for g, tile in zip(group_ids[:count], m_tile_ids[:count]):
      self.assertLess(offsets[g], ends[g])  # Only groups with rows.
      rows = np.arange(tile * block_m, min((tile + 1) * block_m, m))
      mine = rows[(rows >= offsets[g]) & (rows < ends[g])]
      self.assertNotEmpty(mine)
      owners[mine] += 1
    np.testing.assert_array_equal(owners, 1)
    pairs = list(zip(group_ids[:count], m_tile_ids[:count]))
    self.assertEqual(pairs, sorted(pairs))
    np.testing.assert_array_equal(group_ids[count:], 0)
    np.testing.assert_array_equal(m_tile_ids[count:], 0)

  def test_rejects_sizes_past_the_rows(self):
    with self.assertRaisesRegex(ValueError, "at most m=10"):
      kernels.tile_list([6, 5], 10, 4)


class GmmKernelTest(_KernelTestCase):
  """gmm_kernel, no ACTIVATION: out = row_scale * x @ w[g], zeros past
  sum(group_sizes)."""

  def _run(
      self,
      group_sizes,
      m=80,
      k=48,
      n=64,
      dtype="float32",
      out_dtype=None,
      transpose_w=False,
      row_scale=False,
      blocks=(16, 32, 16),
      seed=0,
  ):
    out_dtype = out_dtype or dtype
    block_m, block_n, block_k = blocks
    num_groups = len(group_sizes)
    rng = np.random.default_rng(seed)
    x = _torch(_rows(m, k, group_sizes, seed), dtype)
    w_shape = (num_groups, n, k) if transpose_w else (num_groups, k, n)
    w = _torch(rng.standard_normal(w_shape).astype(np.float32), dtype)
    scale = rng.uniform(0.5, 2.0, m).astype(np.float32)
    scale[sum(group_sizes) :] = np.nan
    scale = _torch(scale) if row_scale else torch.zeros(1)
    offsets, group_ids, m_tile_ids, num_tiles = kernels.tile_list(
        group_sizes, m, block_m
    )
    out = _nan_tensor((m, n), out_dtype)
    _launch(
        kernels.gmm_kernel,
        (len(group_ids), triton.cdiv(n, block_n)),
        x,
        w,
        torch.zeros(1, dtype=w.dtype),  # w_up: unread without ACTIVATION.
        scale,
        *(torch.from_numpy(a) for a in (offsets, group_ids, m_tile_ids)),
        torch.from_numpy(num_tiles),
        out,
        M=m,
        K=k,
        N=n,
        E=num_groups,
        TRANSPOSE_W=transpose_w,
        HAS_ROW_SCALE=row_scale,
        ACTIVATION="",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_F32=True,
    )
    want = _gmm_reference(
        _numpy64(x),
        _numpy64(w),
        group_sizes,
        transpose_w,
        _numpy64(scale) if row_scale else None,
    )
    return _numpy64(out), want

  @parameterized.named_parameters(
      ("random_sizes", (13, 30, 7, 30)),
      ("empty_groups", (0, 25, 0, 0, 55, 0)),
      ("one_group_holds_every_row", (0, 80, 0)),
      ("boundaries_on_the_tile_grid", (16, 32, 0, 32)),
      ("single_group", (80,)),
  )
  def test_matches_numpy(self, group_sizes):
    got, want = self._run(group_sizes)
    self.assert_close(got, want, "float32")

  def test_padding_rows_are_exact_zeros(self):
    # Rows 50..79 hold NaN in x and in the row scale.
    got, want = self._run((9, 0, 41), row_scale=True)
    np.testing.assert_array_equal(got[50:], 0.0)
    self.assert_close(got, want, "float32")

  def test_no_rows_at_all(self):
    got, _ = self._run((0, 0), m=40)
    np.testing.assert_array_equal(got, 0.0)

  @parameterized.named_parameters(
      ("k_and_n_tails", 40, 40, (16, 32, 16)),
      ("tiles_wider_than_k_and_n", 24, 20, (32, 32, 32)),
  )
  def test_k_and_n_not_multiples_of_the_blocks(self, k, n, blocks):
    got, want = self._run((11, 0, 37, 20), m=75, k=k, n=n, blocks=blocks)
    self.assert_close(got, want, "float32")

  def test_transposed_weights(self):
    got, want = self._run((21, 3, 0, 40), m=72, k=40, n=56, transpose_w=True)
    self.assert_close(got, want, "float32")

  def test_row_scale(self):
    got, want = self._run((17, 0, 33, 30), row_scale=True)
    self.assert_close(got, want, "float32")

  @parameterized.named_parameters(
      ("bf16_out", "bfloat16", False, False),
      ("f32_out", "float32", False, False),
      ("transposed_scaled", "bfloat16", True, True),
  )
  def test_bfloat16(self, out_dtype, transpose_w, row_scale):
    got, want = self._run(
        (19, 0, 26, 20),
        m=70,
        dtype="bfloat16",
        out_dtype=out_dtype,
        transpose_w=transpose_w,
        row_scale=row_scale,
    )
    self.assert_close(got, want, "bfloat16")
    np.testing.assert_array_equal(got[65:], 0.0)


class GatedGmmKernelTest(_KernelTestCase):
  """gmm_kernel with an ACTIVATION: act(x @ w_gate[g]) * (x @ w_up[g])."""

  def _run(
      self,
      group_sizes,
      activation,
      dtype="float32",
      m=72,
      k=40,
      n=48,
      limit=None,
  ):
    block_m, block_n, block_k = 16, 32, 16
    num_groups = len(group_sizes)
    rng = np.random.default_rng(1)
    x = _torch(_rows(m, k, group_sizes, 1), dtype)
    w_gate, w_up = (
        _torch(
            rng.standard_normal((num_groups, k, n)).astype(np.float32), dtype
        )
        for _ in range(2)
    )
    offsets, group_ids, m_tile_ids, num_tiles = kernels.tile_list(
        group_sizes, m, block_m
    )
    out = _nan_tensor((m, n), dtype)
    _launch(
        kernels.gmm_kernel,
        (len(group_ids), triton.cdiv(n, block_n)),
        x,
        w_gate,
        w_up,
        torch.zeros(1),  # row_scale: unread without HAS_ROW_SCALE.
        *(torch.from_numpy(a) for a in (offsets, group_ids, m_tile_ids)),
        torch.from_numpy(num_tiles),
        out,
        M=m,
        K=k,
        N=n,
        E=num_groups,
        TRANSPOSE_W=False,
        HAS_ROW_SCALE=False,
        ACTIVATION=activation,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_F32=True,
        SWIGLU_LIMIT=0.0 if limit is None else limit,
        SWIGLU_ALPHA=_ALPHA,
        GATE_SOFTCAP=_GATE_CAP,
        UP_SOFTCAP=_UP_CAP,
    )
    x, w_gate, w_up = _numpy64(x), _numpy64(w_gate), _numpy64(w_up)
    gate = _gmm_reference(x, w_gate, group_sizes)
    up = _gmm_reference(x, w_up, group_sizes)
    if limit is not None:
      gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return _numpy64(out), _GLUS[activation](gate, up)

  @parameterized.product(
      activation=(
          "silu",
          "gelu",
          "gelu_tanh",
          "gpt_oss_glu",
          "softcapped_silu",
      ),
      limit=(None, 2.0),
  )
  def test_matches_numpy(self, activation, limit):
    # Products of unit-variance rows and weights over k=40: the limit 2
    # clamps a good share of gate and up.
    got, want = self._run((14, 0, 35, 10), activation, limit=limit)
    self.assert_close(got, want, "float32", f"{activation}, limit {limit}")
    np.testing.assert_array_equal(got[59:], 0.0)

  def test_bfloat16(self):
    got, want = self._run((0, 30, 22), "silu", dtype="bfloat16")
    self.assert_close(got, want, "bfloat16")
    np.testing.assert_array_equal(got[52:], 0.0)


class TgmmKernelTest(_KernelTestCase):
  """tgmm_kernel: out[e] = a_e^T (row_scale_e * b_e)."""

  def _run(
      self,
      group_sizes,
      m=80,
      p=48,
      q=40,
      dtype="float32",
      out_dtype=None,
      row_scale=False,
      blocks=(16, 32, 16),
  ):
    out_dtype = out_dtype or dtype
    block_m, block_p, block_q = blocks
    num_groups = len(group_sizes)
    a = _torch(_rows(m, p, group_sizes, 2), dtype)
    b = _torch(_rows(m, q, group_sizes, 3), dtype)
    rng = np.random.default_rng(4)
    scale = rng.uniform(0.5, 2.0, m).astype(np.float32)
    scale[sum(group_sizes) :] = np.nan
    scale = _torch(scale) if row_scale else torch.zeros(1)
    out = _nan_tensor((num_groups, p, q), out_dtype)
    _launch(
        kernels.tgmm_kernel,
        (num_groups, triton.cdiv(p, block_p), triton.cdiv(q, block_q)),
        a,
        b,
        scale,
        torch.from_numpy(_offsets(group_sizes).astype(np.int32)),
        out,
        M=m,
        P=p,
        Q=q,
        E=num_groups,
        HAS_ROW_SCALE=row_scale,
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        BLOCK_Q=block_q,
        DOT_F32=True,
    )
    want = _tgmm_reference(
        _numpy64(a),
        _numpy64(b),
        group_sizes,
        _numpy64(scale) if row_scale else None,
    )
    return _numpy64(out), want

  @parameterized.named_parameters(
      ("random_sizes", (13, 30, 7, 30)),
      ("one_group_holds_every_row", (80,)),
      ("padding_rows_hold_nan", (5, 21, 0, 19)),
      ("p_and_q_tails", (20, 0, 41), 70, 40, 24),
  )
  def test_matches_numpy(self, group_sizes, m=80, p=48, q=40):
    got, want = self._run(group_sizes, m=m, p=p, q=q)
    self.assert_close(got, want, "float32")

  def test_empty_groups_are_exact_zeros(self):
    got, want = self._run((0, 33, 0, 0, 40, 0), blocks=(32, 16, 32))
    for e in (0, 2, 3, 5):
      np.testing.assert_array_equal(got[e], 0.0, err_msg=f"group {e}")
    self.assert_close(got, want, "float32")

  def test_no_rows_at_all(self):
    got, _ = self._run((0, 0, 0), m=32)
    np.testing.assert_array_equal(got, 0.0)

  def test_row_scale(self):
    got, want = self._run((25, 0, 31, 9), row_scale=True)
    self.assert_close(got, want, "float32")

  @parameterized.named_parameters(
      ("bf16_out", "bfloat16", False),
      ("f32_out_scaled", "float32", True),
  )
  def test_bfloat16(self, out_dtype, row_scale):
    got, want = self._run(
        (27, 0, 17, 20),
        dtype="bfloat16",
        out_dtype=out_dtype,
        row_scale=row_scale,
    )
    self.assert_close(got, want, "bfloat16")


class SignatureTest(_KernelTestCase):
  """kernels.signature names every parameter of each kernel, in order."""

  def test_gmm(self):
    types, values = kernels.signature(
        "gmm",
        "bfloat16",
        "float32",
        M=64,
        K=32,
        N=48,
        E=4,
        BLOCK_M=16,
        BLOCK_N=32,
        BLOCK_K=16,
        HAS_ROW_SCALE=True,
    )
    self.assertEqual(
        list(types.items())[:9],
        [
            ("x_ptr", "*bf16"),
            ("w_ptr", "*bf16"),
            ("w_up_ptr", "*bf16"),
            ("row_scale_ptr", "*fp32"),
            ("group_offsets_ptr", "*i32"),
            ("group_ids_ptr", "*i32"),
            ("m_tile_ids_ptr", "*i32"),
            ("num_tiles_ptr", "*i32"),
            ("out_ptr", "*fp32"),
        ],
    )
    self.assertEqual(
        values,
        dict(
            M=64,
            K=32,
            N=48,
            E=4,
            TRANSPOSE_W=False,
            HAS_ROW_SCALE=True,
            ACTIVATION="",
            BLOCK_M=16,
            BLOCK_N=32,
            BLOCK_K=16,
            DOT_F32=False,
            # The activation's options: 0.0, unused without an ACTIVATION.
            SWIGLU_LIMIT=0.0,
            SWIGLU_ALPHA=0.0,
            GATE_SOFTCAP=0.0,
            UP_SOFTCAP=0.0,
        ),
    )
    for name in values:
      self.assertEqual(types[name], "constexpr")

  def test_gated_gmm_and_tgmm(self):
    types, values = kernels.signature(
        "gmm",
        np.float32,
        np.float32,
        M=8,
        K=16,
        N=16,
        E=1,
        ACTIVATION="gelu",
        BLOCK_M=16,
        BLOCK_N=16,
        BLOCK_K=16,
    )
    self.assertEqual(types["w_up_ptr"], "*fp32")
    self.assertEqual(values["ACTIVATION"], "gelu")
    types, _ = kernels.signature(
        "tgmm",
        "bfloat16",
        "bfloat16",
        M=8,
        P=16,
        Q=16,
        E=1,
        BLOCK_M=16,
        BLOCK_P=16,
        BLOCK_Q=16,
    )
    self.assertEqual(
        [t for t in types.values() if t != "constexpr"],
        ["*bf16", "*bf16", "*fp32", "*i32", "*bf16"],
    )

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, r"needs the constexprs \['M'"):
      kernels.signature("tgmm", "float32", "float32", P=1)
    with self.assertRaisesRegex(ValueError, "unknown ones"):
      kernels.signature("gmm", "float32", "float32", BLOCK_Z=1)
    with self.assertRaisesRegex(ValueError, "got 'int8'"):
      kernels.signature("gmm", "int8", "float32")
    with self.assertRaisesRegex(ValueError, "one of"):
      kernels.signature("dense", "float32", "float32")


if __name__ == "__main__":
  absltest.main()
