"""The permutation kernels in Triton's interpreter, against moe_core.permute.

Each kernel runs on torch CPU tensors through
`triton.runtime.interpreter.InterpretedFunction` (so no TRITON_INTERPRET
variable is needed, whatever imported triton first), inside the backend's
corrections to the interpreter (`backends.triton.interpreter.fixes`, which
let it call the kernels' @triton.jit helpers), and is compared with
`moe_core.permute.dispatch` / `combine` and their `jax.vjp`. D = 40 with
16-wide column blocks and 8- or 16-row blocks, so partial row and column
blocks occur, and the weights gradient loops over three D steps.
"""

from __future__ import annotations

import inspect

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from backends.testing import triton_aot_compile
from moe_core import permute

try:
  import triton
  from triton.runtime import interpreter

  from backends.triton import interpreter as triton_interpreter
  from backends.triton import permute_kernels
except ImportError as e:  # The kernels need triton; every test skips.
  triton = None
  _NO_TRITON = f"triton is not installed: {e}"

try:
  import torch
except ImportError:
  torch = None

_D = 40
_BLOCKS = dict(BLOCK_R=16, BLOCK_T=8, BLOCK_D=16)

# name: (T, K, E, options). ids: "random" (repeats allowed), "distinct"
# (each token picks K different experts) or "one" (every copy on expert 1).
_CASES = {
    "one_token": (1, 2, 4, dict()),
    "odd_tokens": (7, 3, 5, dict()),
    "129_tokens": (129, 2, 8, dict()),
    "top_1": (10, 1, 3, dict()),
    "k_equals_e": (9, 4, 4, dict(ids="distinct")),
    "one_expert": (11, 2, 4, dict(ids="one")),
    "dropped": (13, 2, 4, dict(drop=True)),
    "invalid_id": (12, 3, 4, dict(invalid=True)),
    "nan_weight": (8, 2, 3, dict(nan_weight=True, drop=True)),
}


def _inputs(
    t,
    k,
    e,
    dtype,
    ids="random",
    drop=False,
    invalid=False,
    nan_weight=False,
    seed=0,
):
  """Routing, activations and cotangents for one case, as numpy arrays.

  Returns a dict: x [T, D], expert_ids [T, K] int32 (with `invalid`, two
  out of range), kept [T, K] bool or None, expert_out [A, D] (combine's
  input), weights [T, K] float32, d_rows [A, D] (dispatch's cotangent),
  dy [T, D] (combine's cotangent). A = T*K; D = 40.
  """
  rng = np.random.default_rng(seed)
  a = t * k
  if ids == "distinct":
    expert_ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
  elif ids == "one":
    expert_ids = np.ones((t, k))
  else:
    expert_ids = rng.integers(0, e, (t, k))
  expert_ids = expert_ids.astype(np.int32)
  kept = None
  if drop:
    kept = rng.random((t, k)) > 0.3
    kept[0, 0] = True
    kept[-1, -1] = False
  if invalid:
    expert_ids[1, 0] = e  # One past the end.
    expert_ids[-1, -1] = -1
  weights = rng.random((t, k)).astype(np.float32)
  if nan_weight:
    weights[0, 0] = np.nan  # On a kept copy.
    weights[-1, -1] = np.nan  # On a dropped copy: combine still gives NaN.
  cast = lambda v: np.asarray(jnp.asarray(v, dtype))
  return dict(
      x=cast(rng.standard_normal((t, _D))),
      expert_ids=expert_ids,
      kept=kept,
      expert_out=cast(rng.standard_normal((a, _D))),
      weights=weights,
      d_rows=cast(rng.standard_normal((a, _D))),
      dy=cast(rng.standard_normal((t, _D))),
  )


def _reference(inputs, num_experts):
  """dispatch, combine and their vjps: the values the kernels must give.

  Also poisons the inputs where the kernels must not look: expert_out is
  NaN in dropped copies' rows (combine never reads them) and d_rows in
  invalid copies' rows (dispatch's vjp drops them); those are returned too.
  One jitted function per case (compiling costs more than running here).
  Under jit the expert ids are traced, so out-of-range ones become
  `invalid` instead of raising.
  """
  kept = inputs["kept"]

  @jax.jit
  def run(x, expert_ids, kept, expert_out, weights, d_rows, dy):
    def rows_of(x):
      return permute.dispatch(x, expert_ids, num_experts, kept).rows

    dispatched = permute.dispatch(x, expert_ids, num_experts, kept)
    sorted_invalid = dispatched.invalid[dispatched.assignment]
    d_rows = jnp.where(sorted_invalid[:, None], jnp.nan, d_rows)
    if kept is not None:
      dropped = ~kept.reshape(-1)[dispatched.assignment]
      expert_out = jnp.where(dropped[:, None], jnp.nan, expert_out)
    _, dispatch_vjp = jax.vjp(rows_of, x)
    (dx,) = dispatch_vjp(d_rows.astype(x.dtype))
    y, combine_vjp = jax.vjp(
        lambda r, w: permute.combine(r, dispatched, w, kept),
        expert_out.astype(x.dtype),
        weights,
    )
    d_expert_out, d_weights = combine_vjp(dy)
    return dict(
        dispatched=dispatched,
        expert_out=expert_out.astype(x.dtype),
        d_rows=d_rows.astype(x.dtype),
        rows=dispatched.rows,
        dx=dx,
        y=y,
        d_expert_out=d_expert_out,
        d_weights=d_weights,
    )

  out = run(
      inputs["x"],
      inputs["expert_ids"],
      None if kept is None else jnp.asarray(kept),
      inputs["expert_out"],
      inputs["weights"],
      inputs["d_rows"],
      inputs["dy"],
  )
  out = jax.tree_util.tree_map(np.asarray, out)
  return out


def _to_torch(a):
  a = np.ascontiguousarray(a)
  if a.dtype == jnp.bfloat16:  # torch cannot read numpy's bfloat16.
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
  if a.dtype == np.bool_:
    a = a.astype(np.int8)
  return torch.from_numpy(a.copy())


def _to_numpy(tensor):
  if tensor.dtype == torch.bfloat16:
    return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
  return tensor.numpy()


def _nan_tensor(shape, like):
  # NaN-filled outputs: an element no program writes cannot pass.
  return torch.full(shape, float("nan"), dtype=like.dtype)


def _run(name, grid, *args, **constexprs):
  """Runs kernel `name` in Triton's interpreter on torch CPU tensors.

  Inside the backend's corrections to the interpreter (`fixes`), as in its
  interpret mode: they let the kernel call its @triton.jit helpers.
  """
  kernel = interpreter.InterpretedFunction(permute_kernels.KERNELS[name].fn)
  with triton_interpreter.fixes():
    kernel[grid](*args, **constexprs)


def _assert_exact(got, want, msg):
  # assert_array_equal treats NaN as equal to NaN, position by position.
  np.testing.assert_array_equal(
      np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=msg
  )


def _rounded_toward_zero(values_f32):
  """float32 -> bfloat16 by dropping the low 16 bits (exact in bfloat16)."""
  bits = np.ascontiguousarray(values_f32, np.float32).view(np.uint32)
  return (bits & np.uint32(0xFFFF0000)).view(np.float32)


def _assert_bf16_product(test, got, want, inputs, kept, dispatched, msg):
  """got == want (jax.vjp), or the same float32 product rounded toward zero.

  Triton's interpreter (3.6 to 3.9) converts float32 to bfloat16 by
  truncation, where a GPU and XLA round to nearest even, so a bf16 result
  may be one ulp toward zero (`fixes` rounds to nearest even, as the GPU;
  the check admits both). The float32 product is recomputed here in
  numpy: weights[a] * dy[a // K] for live copies, 0 otherwise.
  """
  assignment = np.asarray(dispatched.assignment)
  k = kept.shape[1]
  live = kept.reshape(-1) & ~np.asarray(dispatched.invalid)
  w = inputs["weights"].reshape(-1)[assignment]
  dy = inputs["dy"].astype(np.float32)[assignment // k]
  product = np.where(live[assignment][:, None], w[:, None] * dy, 0.0)
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  ok = (got == want) | (got == _rounded_toward_zero(product.astype(np.float32)))
  ok |= np.isnan(got) & np.isnan(want)
  test.assertTrue(
      np.all(ok),
      f"{msg}: {np.sum(~ok)} elements differ from jax.vjp by more "
      "than the interpreter's rounding",
  )


def _assert_sum_close(got, want, terms, dtype, msg):
  """Equal NaN positions; finite values within `terms` roundings of dtype."""
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  eps = float(jnp.finfo(dtype).eps)
  finite = want[np.isfinite(want)]
  scale = float(np.max(np.abs(finite))) if finite.size else 1.0
  np.testing.assert_allclose(
      got, want, rtol=terms * eps, atol=terms * eps * scale, err_msg=msg
  )


class PermuteKernelsInterpretTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if triton is None:
      self.skipTest(_NO_TRITON)
    if torch is None:
      self.skipTest("Triton's interpreter needs torch (CPU), not installed.")

  @parameterized.product(case=sorted(_CASES), dtype=["float32", "bfloat16"])
  def test_matches_dispatch_combine_and_vjps(self, case, dtype):
    t, k, e, options = _CASES[case]
    inputs = _inputs(t, k, e, dtype, **options)
    ref = _reference(inputs, e)
    dispatched = ref["dispatched"]
    a = t * k
    kept = inputs["kept"]
    kept = np.ones((t, k), bool) if kept is None else kept
    assignment = _to_torch(np.asarray(dispatched.assignment))
    position = _to_torch(np.asarray(dispatched.position))
    invalid = _to_torch(np.asarray(dispatched.invalid))
    kept_t = _to_torch(kept.reshape(-1))
    weights = _to_torch(inputs["weights"])
    x = _to_torch(inputs["x"])
    expert_out = _to_torch(ref["expert_out"])
    d_rows = _to_torch(ref["d_rows"])
    dy = _to_torch(inputs["dy"])
    shape = dict(T=t, K=k, D=_D)
    by_rows = dict(BLOCK_R=_BLOCKS["BLOCK_R"], BLOCK_D=_BLOCKS["BLOCK_D"])
    by_tokens = dict(BLOCK_T=_BLOCKS["BLOCK_T"], BLOCK_D=_BLOCKS["BLOCK_D"])

    def grid(name, blocks):
      return permute_kernels.grid(name, **shape, **blocks)

    with self.subTest("permute"):
      out = _nan_tensor((a, _D), x)
      _run(
          "permute",
          grid("permute", by_rows),
          x,
          assignment,
          invalid,
          out,
          **shape,
          **by_rows,
      )
      _assert_exact(_to_numpy(out), ref["rows"], "permute")

    with self.subTest("permute_bwd"):
      dx = _nan_tensor((t, _D), x)
      _run(
          "permute_bwd",
          grid("permute_bwd", by_tokens),
          d_rows,
          position,
          invalid,
          dx,
          **shape,
          **by_tokens,
      )
      # dispatch's vjp adds the K copies in the data dtype (a scatter-add),
      # the kernel in float32: K roundings apart at most.
      _assert_sum_close(_to_numpy(dx), ref["dx"], k, dtype, "permute_bwd")
      self.assertTrue(
          np.all(np.isfinite(_to_numpy(dx).astype(np.float32))),
          "an invalid copy's NaN cotangent reached dx",
      )

    with self.subTest("unpermute"):
      y = _nan_tensor((t, _D), expert_out)
      _run(
          "unpermute",
          grid("unpermute", by_tokens),
          expert_out,
          position,
          weights,
          kept_t,
          invalid,
          y,
          **shape,
          **by_tokens,
      )
      # Both sum in float32; the order may differ, and a bf16 result can
      # then round one way or the other.
      terms = k if dtype == "float32" else 1
      _assert_sum_close(_to_numpy(y), ref["y"], terms, dtype, "unpermute")

    with self.subTest("unpermute_bwd_rows"):
      d_out = _nan_tensor((a, _D), dy)
      _run(
          "unpermute_bwd_rows",
          grid("unpermute_bwd_rows", by_rows),
          dy,
          assignment,
          weights,
          kept_t,
          invalid,
          d_out,
          **shape,
          **by_rows,
      )
      got = _to_numpy(d_out)
      if dtype == "float32":
        _assert_exact(got, ref["d_expert_out"], "unpermute_bwd_rows")
      else:
        _assert_bf16_product(
            self,
            got,
            ref["d_expert_out"],
            inputs,
            kept,
            dispatched,
            "unpermute_bwd_rows",
        )

    with self.subTest("unpermute_bwd_weights"):
      d_w = torch.full((t, k), float("nan"), dtype=torch.float32)
      _run(
          "unpermute_bwd_weights",
          grid("unpermute_bwd_weights", by_tokens),
          dy,
          expert_out,
          position,
          kept_t,
          invalid,
          d_w,
          **shape,
          **by_tokens,
      )
      _assert_sum_close(
          _to_numpy(d_w),
          ref["d_weights"],
          _D,
          "float32",
          "unpermute_bwd_weights",
      )


class SignatureTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if triton is None:
      self.skipTest(_NO_TRITON)

  @parameterized.parameters(
      ("permute", "BLOCK_R"),
      ("permute_bwd", "BLOCK_T"),
      ("unpermute", "BLOCK_T"),
      ("unpermute_bwd_rows", "BLOCK_R"),
      ("unpermute_bwd_weights", "BLOCK_T"),
  )
  def test_signature_names_every_parameter_in_order(self, name, block):
    sig, constexprs = permute_kernels.signature(
        name, jnp.bfloat16, T=5, K=2, D=64, BLOCK_D=32, **{block: 16}
    )
    kernel = permute_kernels.KERNELS[name]
    params = list(inspect.signature(kernel.fn).parameters)
    self.assertEqual(list(sig), params)
    self.assertEqual(
        constexprs, dict(T=5, K=2, D=64, BLOCK_D=32, **{block: 16})
    )
    for param, kind in sig.items():
      if param.endswith("_ptr"):
        self.assertIn(kind, ("*bf16", "*fp32", "*i32", "*i8"), param)
      else:
        self.assertEqual(kind, "constexpr", param)
    first = params[0]
    self.assertEqual(sig[first], "*bf16")

  def test_signature_follows_the_data_dtype(self):
    sig, _ = permute_kernels.signature(
        "unpermute", "float32", T=1, K=1, D=8, BLOCK_T=8, BLOCK_D=8
    )
    self.assertEqual(
        sig,
        dict(
            rows_ptr="*fp32",
            position_ptr="*i32",
            weights_ptr="*fp32",
            kept_ptr="*i8",
            invalid_ptr="*i8",
            out_ptr="*fp32",
            T="constexpr",
            K="constexpr",
            D="constexpr",
            BLOCK_T="constexpr",
            BLOCK_D="constexpr",
        ),
    )

  def test_signature_rejects_wrong_constexprs(self):
    with self.assertRaisesRegex(ValueError, r"permute needs constexprs"):
      permute_kernels.signature(
          "permute", "float32", T=1, K=1, D=8, BLOCK_T=8, BLOCK_D=8
      )

  def test_signature_rejects_unknown_kernel_and_dtype(self):
    with self.assertRaisesRegex(ValueError, r"name must be one of"):
      permute_kernels.signature("gather", "float32")
    with self.assertRaisesRegex(NotImplementedError, r"got float16"):
      permute_kernels.signature(
          "permute", jnp.float16, T=1, K=1, D=8, BLOCK_R=8, BLOCK_D=8
      )

  def test_grid_is_row_blocks_by_column_blocks(self):
    shape = dict(T=129, K=3, D=40, BLOCK_D=16)
    self.assertEqual(
        permute_kernels.grid("permute", BLOCK_R=16, **shape), (25, 3)
    )
    self.assertEqual(
        permute_kernels.grid("unpermute", BLOCK_T=8, **shape), (17, 3)
    )
    self.assertEqual(
        permute_kernels.grid("unpermute_bwd_weights", BLOCK_T=8, **shape),
        (17, 3),
    )

  @parameterized.parameters("bfloat16", "float32")
  def test_every_kernel_compiles_for_sm90(self, dtype):
    if isinstance(
        permute_kernels.permute_kernel, interpreter.InterpretedFunction
    ):
      self.skipTest(
          "TRITON_INTERPRET=1 was set when the kernels were defined, so they "
          "are interpreted functions, which triton.compile cannot take."
      )
    for name, kernel in permute_kernels.KERNELS.items():
      rows = permute_kernels.constexpr_names(name)[3]  # BLOCK_R or BLOCK_T.
      sig, constexprs = permute_kernels.signature(
          name, dtype, T=4096, K=8, D=7168, BLOCK_D=128, **{rows: 32}
      )
      with self.subTest(name):
        # Through triton_aot_compile, which waits for any interpreted launch
        # still running (it patches triton.language for the whole process).
        info = triton_aot_compile.compile_kernel(
            kernel, sig, constexprs, 90, 4, 3
        )
        self.assertGreater(info.registers, 0)


if __name__ == "__main__":
  absltest.main()
