"""expert_ops' fused ops against autodiff of the unfused math: forward and
reverse mode, Hessians, vmap and shard_map, with the fused kernels and the
grouped matmuls both loops JAX cannot differentiate in reverse mode."""

from __future__ import annotations

import dataclasses
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from moe_core import activations
from moe_core.kernels import expert_ops
from moe_core.kernels import grouped_matmul_test as gmt

KERNELS = gmt.LoopKernels()
SIZES = jnp.array([2, 0, 3], jnp.int32)  # 5 of 7 rows in groups.


@dataclasses.dataclass(frozen=True)
class FusedGated:
  keeps_inputs: bool = True

  def __call__(
      self, rows, w_gate, w_up, group_sizes, *, activation, with_inputs
  ):
    gate = KERNELS.gmm(
        rows, w_gate, group_sizes, transpose_rhs=False, out_dtype=jnp.float32
    )
    up = KERNELS.gmm(
        rows, w_up, group_sizes, transpose_rhs=False, out_dtype=jnp.float32
    )
    h = activations.hidden(activation, gate, up).astype(rows.dtype)
    if with_inputs:
      return h, gate.astype(rows.dtype), up.astype(rows.dtype)
    return (h,)


@dataclasses.dataclass(frozen=True)
class RowScaled:

  def __call__(self, lhs, rhs, group_sizes, row_scale):
    out = KERNELS.gmm(
        lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=jnp.float32
    )
    return ((out * row_scale[:, None]).astype(lhs.dtype),)


def _inputs():
  keys = jax.random.split(jax.random.key(0), 5)
  rows = jax.random.normal(keys[0], (7, 4))
  w_gate = jax.random.normal(keys[1], (3, 4, 5)) * 0.5
  w_up = jax.random.normal(keys[2], (3, 4, 5)) * 0.5
  scale = jax.random.uniform(keys[3], (7,), minval=0.5, maxval=1.5)
  return rows, w_gate, w_up, scale


def _close(got, want, tol=1e-4):
  np.testing.assert_allclose(
      np.asarray(got), np.asarray(want), rtol=tol, atol=tol
  )


# The epilogue's activations: a name, and settings with a clamp and options
# (the limit clamps part of gate and up at _inputs' scales).
SETTINGS = {
    "silu": "silu",
    "silu_clamped": activations.Settings("silu", swiglu_limit=0.4),
    "gpt_oss_glu_clamped": activations.Settings(
        "gpt_oss_glu", swiglu_limit=0.4, swiglu_alpha=1.702
    ),
    "softcapped_silu": activations.Settings(
        "softcapped_silu", gate_softcap=0.5, up_softcap=0.7
    ),
}


def _gated_ours(keeps_inputs, activation="silu"):
  def f(rows, w_gate, w_up):
    return expert_ops.gated_gate_up(
        KERNELS,
        FusedGated(keeps_inputs),
        rows,
        w_gate,
        w_up,
        SIZES,
        activation,
    )

  return f


def _gated_want(activation="silu"):
  def f(rows, w_gate, w_up):
    gate = gmt.oracle_gmm(rows, w_gate, SIZES)
    up = gmt.oracle_gmm(rows, w_up, SIZES)
    return activations.hidden(
        expert_ops.epilogue_settings(activation), gate, up
    )

  return f


def _scaled_ours(lhs, rhs, scale):
  return expert_ops.row_scaled_gmm(KERNELS, RowScaled(), lhs, rhs, SIZES, scale)


def _scaled_want(lhs, rhs, scale):
  used = (jnp.arange(lhs.shape[0]) < jnp.sum(SIZES))[:, None]
  return jnp.where(used, gmt.oracle_gmm(lhs, rhs, SIZES) * scale[:, None], 0.0)


class ExpertOpsTest(parameterized.TestCase):

  def _check_all_modes(self, ours, want, args):
    _close(jax.jit(ours)(*args), want(*args))
    ct = jnp.cos(jnp.arange(want(*args).size).reshape(want(*args).shape))
    loss = lambda f: (lambda *a: jnp.sum(f(*a) * ct))
    for g, w in zip(
        jax.jit(jax.grad(loss(ours), range(3)))(*args),
        jax.grad(loss(want), range(3))(*args),
    ):
      _close(g, w)
    tangents = tuple(jnp.sin(a) for a in args)
    got = jax.jvp(ours, args, tangents)
    exp = jax.jvp(want, args, tangents)
    _close(got[1], exp[1])

    def scaled(f):
      return lambda v: jnp.sum(
          jnp.tanh(f(args[0] * v[0], args[1] * v[1], args[2])) * ct
      )

    v = jnp.array([0.9, 1.1])
    _close(jax.jit(jax.hessian(scaled(ours)))(v), jax.hessian(scaled(want))(v))
    batched = tuple(jnp.stack([a, a * 0.5]) for a in args)
    _close(jax.vmap(ours)(*batched), jax.vmap(want)(*batched))

  @parameterized.product(keeps_inputs=(True, False), activation=tuple(SETTINGS))
  def test_gated_gate_up_in_every_mode(self, keeps_inputs, activation):
    rows, w_gate, w_up, _ = _inputs()
    self._check_all_modes(
        _gated_ours(keeps_inputs, SETTINGS[activation]),
        _gated_want(SETTINGS[activation]),
        (rows, w_gate, w_up),
    )

  def test_epilogue_check_names_what_is_missing(self):
    with self.assertRaisesRegex(
        ValueError,
        r"activation must be one of \('silu',\) to run in the kernel "
        r"epilogue, got 'gelu'",
    ):
      expert_ops.check_epilogue_activation("gelu", ("silu",))
    with self.assertRaisesRegex(
        ValueError,
        r"activation 'gpt_oss_glu' reads \['swiglu_alpha'\], which must be "
        r"set in its activations.Settings to run in the kernel epilogue, got "
        r"None",
    ):
      expert_ops.check_epilogue_activation("gpt_oss_glu", ("gpt_oss_glu",))

  def test_row_scaled_gmm_in_every_mode(self):
    rows, w_gate, _, scale = _inputs()
    self._check_all_modes(_scaled_ours, _scaled_want, (rows, w_gate, scale))

  def test_gated_gate_up_in_shard_map_with_checked_variance(self):
    rows, w_gate, w_up, _ = _inputs()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec
    f = jax.shard_map(
        lambda r, wg, wu: jax.lax.psum(
            jnp.sum(_gated_ours(True)(r, wg, wu)), "data"
        ),
        mesh=mesh,
        in_specs=(spec("data"), spec(), spec()),
        out_specs=spec(),
    )
    g = jax.jit(jax.grad(f, (0, 1, 2)))(rows, w_gate, w_up)
    w = jax.grad(lambda *a: jnp.sum(_gated_want()(*a)), (0, 1, 2))(
        rows, w_gate, w_up
    )
    for a, b in zip(g, w):
      _close(a, b)


if __name__ == "__main__":
  absltest.main()
