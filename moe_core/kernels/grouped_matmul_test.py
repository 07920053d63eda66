"""grouped_matmul's rules (jvp, transpose, vmap, shard_map) against autodiff
of the same math in plain JAX, with kernels JAX itself cannot differentiate
in reverse mode (a while loop over the groups)."""

from __future__ import annotations

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import export
import jax.numpy as jnp
import numpy as np

from moe_core.kernels import grouped_matmul as gm


def _masks(group_sizes, num_rows):
  """[E, M] bool: row m belongs to group e."""
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  row = jnp.arange(num_rows)
  return (row >= starts[:, None]) & (row < ends[:, None])


@dataclasses.dataclass(frozen=True)
class LoopKernels(gm.GroupedKernels):
  """One group per while-loop step: reverse-mode autodiff cannot go
  through it, so every derivative below comes from the primitive's rules."""

  def gmm(self, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
    masks = _masks(group_sizes, lhs.shape[0])
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]

    def body(state):
      e, out = state
      w = rhs[e].T if transpose_rhs else rhs[e]
      x = jnp.where(masks[e][:, None], lhs, 0)
      y = jnp.dot(x, w, preferred_element_type=jnp.float32)
      return e + 1, out + jnp.where(masks[e][:, None], y, 0)

    _, out = jax.lax.while_loop(
        lambda s: s[0] < rhs.shape[0],
        body,
        (0, jnp.zeros((lhs.shape[0], n), jnp.float32)),
    )
    return out.astype(out_dtype)

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype):
    masks = _masks(group_sizes, lhs.shape[0])

    def body(state):
      e, out = state
      x = jnp.where(masks[e][:, None], lhs, 0)
      y = jnp.where(masks[e][:, None], rhs, 0)
      return e + 1, out.at[e].set(
          jnp.dot(x.T, y, preferred_element_type=jnp.float32)
      )

    _, out = jax.lax.while_loop(
        lambda s: s[0] < num_groups,
        body,
        (
            0,
            jnp.zeros((num_groups, lhs.shape[1], rhs.shape[1]), jnp.float32),
        ),
    )
    return out.astype(out_dtype)


KERNELS = LoopKernels()


def oracle_gmm(lhs, rhs, group_sizes, transpose_rhs=False):
  """The same product as plain JAX ops (differentiable by JAX)."""
  masks = _masks(group_sizes, lhs.shape[0])
  out = 0.0
  for e in range(rhs.shape[0]):
    w = rhs[e].T if transpose_rhs else rhs[e]
    x = jnp.where(masks[e][:, None], lhs, 0)
    out = out + jnp.where(masks[e][:, None], x @ w, 0)
  return out


def oracle_tgmm(lhs, rhs, group_sizes, num_groups):
  masks = _masks(group_sizes, lhs.shape[0])
  return jnp.stack(
      [
          jnp.where(masks[e][:, None], lhs, 0).T
          @ jnp.where(masks[e][:, None], rhs, 0)
          for e in range(num_groups)
      ]
  )


def _inputs(m=7, c=3, n=4, e=3, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  lhs = jax.random.normal(keys[0], (m, c))
  rhs = jax.random.normal(keys[1], (e, c, n))
  group_sizes = jnp.array([2, 0, 3], jnp.int32)[:e]  # 5 of 7 rows used.
  cotangent = jax.random.normal(keys[2], (m, n))
  return lhs, rhs, group_sizes, cotangent


def _close(got, want, tol=1e-5):
  np.testing.assert_allclose(
      np.asarray(got), np.asarray(want), rtol=tol, atol=tol
  )


def _close_with_grads(ours, want, args, value_tol=1e-5, grad_tol=1e-4):
  """ours(*args) ~ want(*args), and so are their gradients in every arg."""
  _close(ours(*args), want(*args), value_tol)
  argnums = tuple(range(len(args)))
  for g, w in zip(
      jax.grad(ours, argnums)(*args), jax.grad(want, argnums)(*args)
  ):
    _close(g, w, grad_tol)


class GroupedMatmulTest(parameterized.TestCase):

  @parameterized.parameters(False, True)
  def test_forward_and_gradients_match_autodiff(self, transpose_rhs):
    lhs, rhs, sizes, ct = _inputs()
    if transpose_rhs:
      rhs = jnp.swapaxes(rhs, 1, 2)

    def loss(fn):
      return lambda x, w: jnp.sum(fn(x, w) * ct)

    ours = lambda x, w: gm.gmm(
        KERNELS, x, w, sizes, transpose_rhs=transpose_rhs
    )
    want = lambda x, w: oracle_gmm(x, w, sizes, transpose_rhs)
    _close(jax.jit(ours)(lhs, rhs), want(lhs, rhs))
    got_grads = jax.jit(jax.grad(loss(ours), (0, 1)))(lhs, rhs)
    want_grads = jax.grad(loss(want), (0, 1))(lhs, rhs)
    for g, w in zip(got_grads, want_grads):
      _close(g, w)
    # Rows past the groups: zero output, zero gradient.
    np.testing.assert_array_equal(got_grads[0][5:], 0)

  def test_tgmm_forward_and_gradients(self):
    lhs, _, sizes, dy = _inputs()
    ct = jax.random.normal(jax.random.key(9), (3, 3, 4))
    ours = lambda a, b: gm.tgmm(KERNELS, a, b, sizes, num_groups=3)
    want = lambda a, b: oracle_tgmm(a, b, sizes, 3)
    _close(ours(lhs, dy), want(lhs, dy))
    for g, w in zip(
        jax.grad(lambda a, b: jnp.sum(ours(a, b) * ct), (0, 1))(lhs, dy),
        jax.grad(lambda a, b: jnp.sum(want(a, b) * ct), (0, 1))(lhs, dy),
    ):
      _close(g, w)

  def test_forward_mode_jvp_linearize_and_hessian(self):
    lhs, rhs, sizes, ct = _inputs()
    t_lhs, t_rhs = jax.random.normal(jax.random.key(5), lhs.shape), rhs * 0.5
    ours = lambda x, w: gm.gmm(KERNELS, x, w, sizes)
    want = lambda x, w: oracle_gmm(x, w, sizes)
    got = jax.jvp(ours, (lhs, rhs), (t_lhs, t_rhs))
    exp = jax.jvp(want, (lhs, rhs), (t_lhs, t_rhs))
    _close(got[0], exp[0])
    _close(got[1], exp[1])
    _, lin = jax.linearize(ours, lhs, rhs)
    _close(lin(t_lhs, t_rhs), exp[1])

    # A loss that is not linear in its input: the Hessian needs the jvp of
    # the transposes (forward over reverse).
    def loss(fn):
      return lambda v: jnp.sum(jnp.tanh(fn(lhs * v[0], rhs * v[1])) * ct)

    v = jnp.array([0.7, 1.3])
    _close(
        jax.jit(jax.hessian(loss(ours)))(v), jax.hessian(loss(want))(v), 1e-4
    )

  def test_products_sum_in_one_call_and_differentiate(self):
    lhs, rhs, sizes, ct = _inputs()
    rhs2 = rhs[:, :, ::-1] * 2.0

    def ours(x, w1, w2):
      gate, up = gm.grouped_products(
          KERNELS,
          "gmm",
          (x,),
          (w1, w2),
          sizes,
          products=((0, 0, 0), (0, 1, 1)),
          out_dtypes=(jnp.float32, jnp.float32),
      )
      return jnp.sum(jax.nn.silu(gate) * up * ct)

    def want(x, w1, w2):
      gate, up = oracle_gmm(x, w1, sizes), oracle_gmm(x, w2, sizes)
      return jnp.sum(jax.nn.silu(gate) * up * ct)

    _close_with_grads(ours, want, (lhs, rhs, rhs2))

  def test_tgmm_products_sum_per_output_and_differentiate(self):
    lhs, _, sizes, dy = _inputs()
    dy2 = dy[:, ::-1] * 0.5
    ct = jax.random.normal(jax.random.key(5), (2, 3, 3, 4))

    def ours(a, b1, b2):
      # out0 = a^T b1 + a^T b2 per group (one accumulation), out1 = a^T b2.
      out0, out1 = gm.grouped_products(
          KERNELS,
          "tgmm",
          (a,),
          (b1, b2),
          sizes,
          products=((0, 0, 0), (0, 1, 0), (0, 1, 1)),
          out_dtypes=(jnp.float32, jnp.float32),
          num_groups=3,
      )
      return jnp.sum(jnp.stack([out0, out1]) * ct)

    def want(a, b1, b2):
      out1 = oracle_tgmm(a, b2, sizes, 3)
      out0 = oracle_tgmm(a, b1, sizes, 3) + out1
      return jnp.sum(jnp.stack([out0, out1]) * ct)

    _close_with_grads(ours, want, (lhs, dy, dy2), value_tol=1e-4)

  def test_vmap_and_vmap_of_grad(self):
    batch = [_inputs(seed=s) for s in range(3)]
    lhs = jnp.stack([b[0] for b in batch])
    rhs = jnp.stack([b[1] for b in batch])
    sizes = jnp.array([[2, 0, 3], [0, 7, 0], [1, 1, 1]], jnp.int32)
    ct = jnp.stack([b[3] for b in batch])

    def loss(fn):
      return lambda x, w, s, c: jnp.sum(fn(x, w, s) * c)

    ours = lambda x, w, s: gm.gmm(KERNELS, x, w, s)
    _close(
        jax.vmap(ours)(lhs, rhs, sizes), jax.vmap(oracle_gmm)(lhs, rhs, sizes)
    )
    for g, w in zip(
        jax.vmap(jax.grad(loss(ours), (0, 1)))(lhs, rhs, sizes, ct),
        jax.vmap(jax.grad(loss(oracle_gmm), (0, 1)))(lhs, rhs, sizes, ct),
    ):
      _close(g, w)
    # Only the rows batched, the weights shared.
    _close(
        jax.vmap(ours, (0, None, 0))(lhs, rhs[0], sizes),
        jax.vmap(oracle_gmm, (0, None, 0))(lhs, rhs[0], sizes),
    )

  def test_shard_map_with_checked_variance(self):
    lhs, rhs, sizes, ct = _inputs()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec

    def loss(x, w):
      y = gm.gmm(KERNELS, x, w, sizes)  # x varies over "data", w does not.
      return jax.lax.psum(jnp.sum(y * ct), "data")

    f = jax.shard_map(
        jax.value_and_grad(loss, (0, 1)),
        mesh=mesh,
        in_specs=(spec("data"), spec()),
        out_specs=(spec(), (spec("data"), spec())),
    )
    value, grads = jax.jit(f)(lhs, rhs)
    want_value, want_grads = jax.value_and_grad(
        lambda x, w: jnp.sum(oracle_gmm(x, w, sizes) * ct), (0, 1)
    )(lhs, rhs)
    _close(value, want_value)
    for g, w in zip(grads, want_grads):
      _close(g, w)

  def test_export_serializes_forward_and_gradient(self):
    lhs, rhs, sizes, ct = _inputs()

    def f(x, w):
      return jax.value_and_grad(
          lambda x, w: jnp.sum(gm.gmm(KERNELS, x, w, sizes) * ct), (0, 1)
      )(x, w)

    exported = export.export(jax.jit(f))(lhs, rhs)
    text = exported.mlir_module()
    self.assertNotIn("dropless_grouped_matmul", text)
    restored = export.deserialize(exported.serialize())
    got, want = restored.call(lhs, rhs), f(lhs, rhs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(g, w)

  def test_remat_and_scan(self):
    lhs, rhs, sizes, ct = _inputs()
    stack = jnp.stack([rhs[:, :, :3], rhs[:, :, 1:] * 0.5])  # [2, E, C, C]

    def layers(fn):
      def loss(x, ws):
        def layer(h, w):
          return jax.checkpoint(lambda h, w: jnp.tanh(fn(h, w)))(h, w), None

        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h)

      return loss

    ours = layers(lambda x, w: gm.gmm(KERNELS, x, w, sizes))
    want = layers(lambda x, w: oracle_gmm(x, w, sizes))
    for g, w in zip(
        jax.jit(jax.grad(ours, (0, 1)))(lhs, stack),
        jax.grad(want, (0, 1))(lhs, stack),
    ):
      _close(g, w)

  def test_nan_in_unused_rows_stays_out(self):
    lhs, rhs, sizes, ct = _inputs()
    lhs = lhs.at[6].set(jnp.nan)
    y, grads = jax.value_and_grad(
        lambda x, w: jnp.sum(gm.gmm(KERNELS, x, w, sizes) * ct), (0, 1)
    )(lhs, rhs)
    self.assertTrue(np.isfinite(y))
    self.assertTrue(np.isfinite(grads[1]).all())

  def test_bad_calls_name_the_problem(self):
    lhs, rhs, sizes, _ = _inputs()
    with self.assertRaisesRegex(TypeError, "share one dtype"):
      gm.gmm(KERNELS, lhs.astype(jnp.bfloat16), rhs, sizes)
    with self.assertRaisesRegex(TypeError, "kernels must be a GroupedKernels"):
      gm.gmm(object(), lhs, rhs, sizes)
    with self.assertRaisesRegex(ValueError, "gmm needs at least one rhs"):
      gm.grouped_products(
          KERNELS, "gmm", (lhs,), (), sizes, products=(), out_dtypes=()
      )
    with self.assertRaisesRegex(ValueError, "every one of the 2 outputs"):
      gm.grouped_products(
          KERNELS,
          "gmm",
          (lhs,),
          (rhs,),
          sizes,
          products=((0, 0, 0),),
          out_dtypes=(jnp.float32, jnp.float32),
      )

  @parameterized.named_parameters(
      (
          "unknown_kind",
          "mm",
          {},
          ValueError,
          r"kind must be 'gmm' or 'tgmm', got 'mm'\.",
      ),
      (
          "gmm_groups_not_the_rhs",
          "gmm",
          dict(num_groups=4),
          ValueError,
          r"gmm's num_groups must be the rhs' 3 groups \(or None\), got 4\.",
      ),
      ("tgmm_without_groups", "tgmm", {}, TypeError, "tgmm needs num_groups"),
      (
          "tgmm_transposed",
          "tgmm",
          dict(transpose_rhs=True, num_groups=3),
          ValueError,
          "tgmm takes no transpose_rhs",
      ),
  )
  def test_bad_kind_options_name_the_problem(
      self, kind, options, error, message
  ):
    lhs, rhs, sizes, _ = _inputs()
    with self.assertRaisesRegex(error, message):
      gm.grouped_products(
          KERNELS,
          kind,
          (lhs,),
          (rhs if kind == "gmm" else lhs,),
          sizes,
          products=((0, 0, 0),),
          out_dtypes=(jnp.float32,),
          **options,
      )


if __name__ == "__main__":
  absltest.main()
