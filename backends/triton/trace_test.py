"""The triton backend traced for the GPU through jax-triton, without a GPU.

`jax.eval_shape` of the backend's grouped GEMM (both layouts), expert FFN
(fused and not) and a whole layer, forward and `jax.grad`: every kernel call
goes through `jax_triton.triton_call` (which traces on a CPU jaxlib; only
lowering needs CUDA), and the results have the contract's shapes and
dtypes, those of the reference backend. Under `launch_record.recording()` the
kernels launched are checked one by one (names, layouts, flags, blocks from
the GPU config table).

The backend is built directly, `TritonBackend()`: its constructor and
methods never call `availability()` (only `backend="auto"` and the
conformance suite's setUp do), so tracing works where it would say "no
GPU". Needs jax-triton importable without a GPU (0.4; 0.3 where jax's CUDA
plugin is installed, as on the py312 leg): elsewhere every test skips with
the reason, and under TRITON_INTERPRET=1 too.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

import moe_core
from backends.triton import backend as triton_backend
from backends.triton import launch
from backends.triton import launch_record
from conformance import cases
from moe_core.kernels import primitive

_M, _C, _N, _E = 96, 64, 80, 4
_SIZES = (30, 0, 41, 17)  # 8 padding rows.


def _spec(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _specs(tree):
  """The tree's leaves as ShapeDtypeStructs (comparable with ==)."""
  return jax.tree.map(lambda a: _spec(a.shape, a.dtype), tree)


def _kernel(call) -> str:
  """A launch's kernel; the gmm kernel with an activation (the gated
  gate/up pass) is "gated gmm_kernel"."""
  gated = call.name == "gmm_kernel" and call.constexprs["ACTIVATION"]
  return f"gated {call.name}" if gated else call.name


class TraceTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    try:
      # pylint: disable-next=g-import-not-at-top,unused-import
      import jax_triton  # noqa: F401
      # pylint: disable-next=g-import-not-at-top,unused-import
      from backends.triton import kernels  # noqa: F401
    except Exception as e:  # pylint: disable=broad-except
      # jax-triton 0.3 raises ValueError, not ImportError, on a CPU jaxlib.
      self.skipTest(
          "tracing through jax-triton needs jax_triton and triton "
          f"importable here, got {type(e).__name__}: {e}"
      )
    ok, reason = launch.compilable()
    if not ok:
      self.skipTest(reason)
    self.backend = triton_backend.TritonBackend(generation="sm90")
    self.reference = moe_core.get_backend("reference")

  def trace(self, fn, *args):
    """eval_shape of fn, asserting each kernel went through triton_call."""
    # pylint: disable-next=g-import-not-at-top
    import jax_triton

    real = jax_triton.triton_call
    traced = []

    # functools.wraps keeps the signature launch inspects (out_type=).
    @functools.wraps(real)
    def spy(*args, **kwargs):
      traced.append(kwargs["kernel"])
      return real(*args, **kwargs)

    # The kernels run inside moe_core.kernels' primitives, at lowering:
    # trace_kernel_calls traces each call, in order, without lowering.
    out = jax.eval_shape(fn, *args)
    with mock.patch.object(jax_triton, "triton_call", spy):
      primitive.trace_kernel_calls(fn, *args)
    with launch_record.recording() as calls:
      primitive.trace_kernel_calls(fn, *args)
    self.assertEqual(traced, [c.kernel for c in calls])
    for call in calls:
      self.assertEqual(call.mode, "gpu")
      if "DOT_F32" in call.constexprs:  # bf16 to the tensor cores.
        self.assertFalse(call.constexprs["DOT_F32"])
    return out, calls

  def assertKernels(self, calls, want: dict):
    self.assertEqual(dict(collections.Counter(map(_kernel, calls))), want)

  # --- grouped_gemm -----------------------------------------------------------

  @parameterized.product(
      transpose_rhs=(False, True), dtype=("bfloat16", "float32")
  )
  def test_grouped_gemm(self, transpose_rhs, dtype):
    rows = _spec((_M, _C), dtype)
    weights = _spec((_E, _N, _C) if transpose_rhs else (_E, _C, _N), dtype)
    sizes = jnp.asarray(_SIZES, jnp.int32)

    def forward(be):
      return lambda r, w: be.grouped_gemm(
          r, w, sizes, transpose_rhs=transpose_rhs
      )

    def grads(be):
      return jax.grad(
          lambda r, w: forward(be)(r, w).astype(jnp.float32).sum(), (0, 1)
      )

    out, calls = self.trace(forward(self.backend), rows, weights)
    self.assertEqual(
        out, jax.eval_shape(forward(self.reference), rows, weights)
    )
    self.assertEqual(out, _spec((_M, _N), dtype))
    (call,) = calls
    self.assertEqual(_kernel(call), "gmm_kernel")
    self.assertEqual(call.constexprs["TRANSPOSE_W"], transpose_rhs)
    self.assertFalse(call.constexprs["HAS_ROW_SCALE"])
    config = self.backend.runner.config("fwd", _M, _C, _N, _E, dtype)
    block_m = call.constexprs["BLOCK_M"]
    self.assertEqual(
        (block_m, call.constexprs["BLOCK_N"], call.constexprs["BLOCK_K"]),
        (config.block_m, config.block_n, config.block_k),
    )
    self.assertEqual(
        (call.num_warps, call.num_stages), (config.num_warps, config.num_stages)
    )
    # The tile list: T = cdiv(M, BLOCK_M) + E entries, int32, after x, w,
    # w_up (unread: w again) and the row scale.
    num_tiles = -(-_M // block_m) + _E
    self.assertEqual(
        call.grid, (num_tiles, -(-_N // call.constexprs["BLOCK_N"]))
    )
    self.assertEqual(call.in_avals[1], call.in_avals[2])
    self.assertEqual(
        call.in_avals[4:],
        (
            _spec((_E + 1,), "int32"),
            _spec((num_tiles,), "int32"),
            _spec((num_tiles,), "int32"),
            _spec((1,), "int32"),
        ),
    )

    d, calls = self.trace(grads(self.backend), rows, weights)
    self.assertEqual(d, jax.eval_shape(grads(self.reference), rows, weights))
    self.assertEqual(d, (rows, weights))
    self.assertKernels(calls, {"gmm_kernel": 2, "tgmm_kernel": 1})
    gmms = [c for c in calls if _kernel(c) == "gmm_kernel"]
    self.assertEqual(
        [c.constexprs["TRANSPOSE_W"] for c in gmms],
        [transpose_rhs, not transpose_rhs],
    )
    (tgmm,) = [c for c in calls if c.name == "tgmm_kernel"]
    self.assertEqual(tgmm.out_types, (weights,))
    self.assertEqual(tgmm.grid[0], _E)

  # --- expert_ffn -------------------------------------------------------------

  @parameterized.parameters(True, False)
  def test_expert_ffn(self, fuse_activation):
    be = triton_backend.TritonBackend(fuse_activation=fuse_activation)
    d, f = _C, _N
    cfg = moe_core.MoEConfig(
        num_experts=_E, top_k=2, hidden_size=d, expert_ffn_size=f
    )
    rows = _spec((_M, d), "bfloat16")
    params = {
        "w_gate": _spec((_E, d, f), "float32"),
        "w_up": _spec((_E, d, f), "float32"),
        "w_down": _spec((_E, f, d), "float32"),
    }
    sizes = jnp.asarray(_SIZES, jnp.int32)

    def forward(b):
      return lambda r, p: b.expert_ffn(r, sizes, p, cfg)

    def grads(b):
      return jax.grad(
          lambda r, p: forward(b)(r, p).astype(jnp.float32).sum(), (0, 1)
      )

    out, calls = self.trace(forward(be), rows, params)
    self.assertEqual(out, jax.eval_shape(forward(self.reference), rows, params))
    self.assertEqual(out, rows)
    if fuse_activation:
      self.assertKernels(calls, {"gated gmm_kernel": 1, "gmm_kernel": 1})
      (gated,) = [c for c in calls if _kernel(c) == "gated gmm_kernel"]
      self.assertEqual(gated.constexprs["ACTIVATION"], cfg.activation)
      self.assertEqual(gated.out_types, (_spec((_M, f), "bfloat16"),))
    else:
      self.assertKernels(calls, {"gmm_kernel": 3})

    grad, calls = self.trace(grads(be), rows, params)
    self.assertEqual(grad, jax.eval_shape(grads(self.reference), rows, params))
    self.assertEqual(grad, (rows, params))
    if fuse_activation:
      # Forward: gated + down. Backward: down's dX and dW; gate and up
      # recomputed, their two dX and two dW.
      self.assertKernels(
          calls, {"gated gmm_kernel": 1, "gmm_kernel": 6, "tgmm_kernel": 3}
      )
    else:
      self.assertKernels(calls, {"gmm_kernel": 6, "tgmm_kernel": 3})

  # --- the layer --------------------------------------------------------------

  @parameterized.parameters(False, True)
  def test_layer(self, fuse_routing_weights):
    be = triton_backend.TritonBackend(
        fuse_activation=True, fuse_routing_weights=fuse_routing_weights
    )
    case = dataclasses.replace(
        cases.LAYER_BY_NAME["base_f32"], dtype="bfloat16"
    )
    params, x, _ = cases.layer_inputs(case)
    params, x = _specs(params), _specs(x)

    def forward(b):
      return lambda p, x: moe_core.moe_layer(p, x, case.cfg, backend=b)[0]

    def grads(b):
      return jax.grad(
          lambda p, x: forward(b)(p, x).astype(jnp.float32).sum(), (0, 1)
      )

    y, calls = self.trace(forward(be), params, x)
    self.assertEqual(y, jax.eval_shape(forward(self.reference), params, x))
    self.assertEqual(y, x)
    self.assertKernels(
        calls,
        {
            "permute_kernel": 1,
            "gated gmm_kernel": 1,
            "gmm_kernel": 1,
            "unpermute_kernel": 1,
        },
    )
    (down,) = [c for c in calls if _kernel(c) == "gmm_kernel"]
    self.assertEqual(down.constexprs["HAS_ROW_SCALE"], fuse_routing_weights)

    grad, calls = self.trace(grads(be), params, x)
    self.assertEqual(grad, jax.eval_shape(grads(self.reference), params, x))
    self.assertEqual(grad, (params, x))
    want = {
        "permute_kernel": 1,
        "permute_bwd_kernel": 1,
        "gated gmm_kernel": 1,
        "unpermute_kernel": 1,
        "unpermute_bwd_rows_kernel": 1,
        # down: forward, dX (fused or not: the row scale's gradient is a
        # row dot of the dX product with h, no recomputed product).
        # gate/up: two recomputed, two dX.
        "gmm_kernel": 2 + 4,
        "tgmm_kernel": 3,
    }
    if not fuse_routing_weights:
      # Fused, the combine's weights are constant ones: no gradient to
      # compute (the routing weights' comes from the down projection's).
      want["unpermute_bwd_weights_kernel"] = 1
    self.assertKernels(calls, want)
    scaled = [
        c.name for c in calls if c.constexprs.get("HAS_ROW_SCALE") is True
    ]
    # The forward's epilogue scales; the derivatives scale elementwise
    # around the dX and dW kernels (h before dW, the dX product after).
    self.assertEqual(scaled, ["gmm_kernel"] if fuse_routing_weights else [])


if __name__ == "__main__":
  absltest.main()
