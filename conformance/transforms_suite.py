"""TransformsSuite: the layer inside what users wrap around it.

Each case puts `moe_layer` (or a Flax module around it) inside one
transformation a user's program applies (export, shard_map, Linen scan,
checked vmap, forward-mode differentiation: the list in `TransformsSuite`)
and checks the result against the same backend without it, or against the
reference.
"""

from __future__ import annotations

import jax
from jax import export
import jax.numpy as jnp
import numpy as np

import moe_core
from conformance import base
from conformance import cases


def _case(dtype: str) -> cases.LayerCase:
  """DeepSeek-style routing (sigmoid, bias, groups) and a gated shared
  expert, 8 tokens in a [2, 4] batch: every stage, and small."""
  cfg = moe_core.MoEConfig(
      num_experts=4,
      top_k=2,
      hidden_size=16,
      expert_ffn_size=8,
      n_group=2,
      topk_group=1,
      routed_scaling_factor=2.0,
      shared_ffn_size=8,
      shared_expert_gate=True,
      **cases.SIGMOID_BIAS_NORM_ROUTER,
  )
  return cases.LayerCase(f"transforms_{dtype}", cfg, (2, 4), dtype=dtype)


def _leaves_close(test, got, want, dtype, kind, msg):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  test.assertEqual(len(got_leaves), len(want_leaves), msg)
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    test.assertClose(
        np.asarray(g, np.float32),
        np.asarray(w, np.float32),
        dtype,
        kind,
        msg=f"{msg}, leaf {i}",
    )


class TransformsSuite(base.BackendTestCase):
  """moe_layer under export, shard_map, Linen scan, checked vmap and
  forward-mode differentiation.

    export      jax.export of the jitted forward and value_and_grad,
                serialised, deserialised and called: equal to the live call.
    shard_map   inside a user's `jax.shard_map` with the default
                `check_vma=True` (mesh variance type-checked).
    Linen scan  `LinenMoE` stacked with `flax.linen.scan`, with and without
                `nn.remat`: equal to the layers applied one by one.
    checked     `moe_core.checked(jax.vmap(layer))` on clean input.
    forward     jax.jvp, jax.linearize and jax.hessian of a small loss:
    mode        against the reference, and jvp against vjp (<ct, J t> =
                <J^T ct, t>, which holds for any correct pair).
  """

  def _transforms_inputs(self):
    case = _case(self.compute_dtype())
    params, x, cotangent = cases.layer_inputs(case)
    return case, params, x, cotangent

  def _skip_if_effects(self, what: str):
    """Skips where the layer's program carries effects: an interpreter's
    ordered host callbacks (Mosaic GPU's), which `what` cannot take.
    Compiled kernels are custom calls without effects."""
    case, params, x, _ = self._transforms_inputs()
    effects = jax.make_jaxpr(self._transforms_layer(case.cfg))(
        params, x
    ).effects
    if effects:
      self.skipTest(
          f"{self.BACKEND} with {self.BACKEND_OPTIONS} runs its kernels with "
          f"effects here ({sorted(type(e).__name__ for e in effects)}: an "
          f"interpreter's host callbacks), which {what} cannot take; its "
          "compiled kernels have none."
      )

  def _transforms_layer(self, cfg):
    def layer(params, x):
      return moe_core.moe_layer(params, x, cfg, backend=self.backend)

    return layer

  def _transforms_loss(self, cfg, cotangent):
    layer = self._transforms_layer(cfg)

    def loss(params, x):
      y, _ = layer(params, x)
      return jnp.sum(y.astype(jnp.float32) * cotangent)

    return loss

  # --- jax.export -----------------------------------------------------------

  def test_exported_layer_serializes_and_matches_live_call(self):
    self._skip_if_effects("jax.export's serialisation")
    case, params, x, cotangent = self._transforms_inputs()
    programs = {
        "forward": self._transforms_layer(case.cfg),
        "value_and_grad": jax.value_and_grad(
            self._transforms_loss(case.cfg, cotangent), argnums=(0, 1)
        ),
    }
    for name, fn in programs.items():
      with self.subTest(name):
        try:
          # Older jax refuses callbacks when exporting, newer when
          # serialising.
          serialized = export.export(jax.jit(fn))(params, x).serialize()
        except NotImplementedError as e:
          if "host_callbacks" not in str(e):
            raise
          self.skipTest(
              f"{self.BACKEND} with {self.BACKEND_OPTIONS} runs its kernels "
              "through host callbacks here (an interpreter), which "
              f"jax.export cannot serialise: {e}"
          )
        restored = export.deserialize(serialized)
        _leaves_close(
            self,
            restored.call(params, x),
            jax.jit(fn)(params, x),
            case.dtype,
            "forward",
            f"{name}: deserialised vs live",
        )

  # --- shard_map ------------------------------------------------------------

  def test_layer_inside_user_shard_map_with_checked_variance(self):
    case, params, x, cotangent = self._transforms_inputs()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec
    layer = self._transforms_layer(case.cfg)

    def per_device(params, x):  # x varies over "data", params do not.
      y, _ = layer(params, x)
      return y

    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(spec(), spec("data")),
        out_specs=spec("data"),
    )  # check_vma=True, the default.

    def loss(fn):
      return lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32) * cotangent)

    got_y = jax.jit(sharded)(params, x)
    want_y = jax.jit(per_device)(params, x)
    self.assertClose(got_y, want_y, case.dtype, msg="y in shard_map")
    got = jax.jit(jax.grad(loss(sharded), (0, 1)))(params, x)
    want = jax.jit(jax.grad(loss(per_device), (0, 1)))(params, x)
    _leaves_close(self, got, want, case.dtype, "gradient", "grads")

  # --- flax.linen.scan ------------------------------------------------------

  def _transforms_linen(self):
    try:
      # pylint: disable-next=g-import-not-at-top
      from flax import linen
      # pylint: disable-next=g-import-not-at-top
      from moe_core import flax as moe_flax
    except ImportError as e:
      self.skipTest(f"flax is not installed (pip install '.[train]'): {e}")
    return linen, moe_flax

  def _assert_linen_scan_matches_unrolled(self, use_remat: bool):
    linen, moe_flax = self._transforms_linen()
    self._skip_if_effects("flax.linen.scan (no effects in a scan body)")
    case, _, x, _ = self._transforms_inputs()
    cfg, backend, dtype = case.cfg, self.backend, jnp.dtype(case.dtype)
    num_layers = 2

    class Block(linen.Module):
      """The residual MoE block a Linen model stacks."""

      @linen.compact
      def __call__(self, h, _):
        y, aux = moe_flax.LinenMoE(cfg, backend=backend, param_dtype=dtype)(h)
        return h + y, aux.load_balancing_loss

    block = linen.remat(Block) if use_remat else Block

    class Stack(linen.Module):

      @linen.compact
      def __call__(self, h):
        scanned = linen.scan(
            block,
            variable_axes={"params": 0, "moe_state": 0},
            split_rngs={"params": True},
            length=num_layers,
        )
        return scanned(name="layers")(h, None)

    stack = Stack()
    variables = stack.init(jax.random.key(0), x)

    def unrolled(variables, h):
      losses = []
      for i in range(num_layers):
        layer_vars = jax.tree.map(lambda v, i=i: v[i], variables)
        h, loss = Block().apply(
            {
                "params": layer_vars["params"]["layers"],
                "moe_state": layer_vars["moe_state"]["layers"],
            },
            h,
            None,
        )
        losses.append(loss)
      return h, jnp.stack(losses)

    def total(apply):
      def f(variables, h):
        out, losses = apply(variables, h)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(losses)

      return f

    got = jax.jit(stack.apply)(variables, x)
    want = jax.jit(unrolled)(variables, x)
    _leaves_close(self, got, want, case.dtype, "forward", "scan vs unrolled")
    got_grads = jax.jit(jax.grad(total(stack.apply)))(variables, x)
    want_grads = jax.jit(jax.grad(total(unrolled)))(variables, x)
    _leaves_close(
        self, got_grads, want_grads, case.dtype, "gradient", "scan grads"
    )

  def test_linen_scan_matches_unrolled_layers(self):
    self._assert_linen_scan_matches_unrolled(use_remat=False)

  def test_linen_scan_with_remat_matches_unrolled_layers(self):
    self._assert_linen_scan_matches_unrolled(use_remat=True)

  # --- checked(vmap) --------------------------------------------------------

  def test_checked_vmap_of_layer_matches_one_call_per_example(self):
    case, params, x, _ = self._transforms_inputs()
    layer = self._transforms_layer(case.cfg)
    batched = jnp.stack([x, x[:, ::-1] * 0.5])  # [2, 2, 4, D]
    got_y, got_aux = moe_core.checked(jax.jit(jax.vmap(layer, (None, 0))))(
        params, batched
    )
    for i in range(batched.shape[0]):
      with self.subTest(f"example {i}"):
        want_y, want_aux = jax.jit(layer)(params, batched[i])
        self.assertClose(got_y[i], want_y, case.dtype, msg="y")
        np.testing.assert_array_equal(
            got_aux.tokens_per_expert[i], want_aux.tokens_per_expert
        )

  # --- Forward mode ---------------------------------------------------------

  def _transforms_tangents(self, params, x):
    keys = jax.random.split(jax.random.key(7), len(params) + 1)
    t_params = {
        name: (
            jnp.zeros_like(value)  # Steers selection only: no derivative.
            if name == "correction_bias"
            else jax.random.normal(k, value.shape, value.dtype)
        )
        for k, (name, value) in zip(keys, sorted(params.items()))
    }
    return t_params, jax.random.normal(keys[-1], x.shape, x.dtype)

  def test_jvp_matches_reference_and_own_vjp(self):
    case, params, x, cotangent = self._transforms_inputs()
    t_params, t_x = self._transforms_tangents(params, x)

    def forward(backend):
      def f(params, x):
        y, _ = moe_core.moe_layer(params, x, case.cfg, backend=backend)
        return y.astype(jnp.float32)

      return f

    y, t_y = jax.jit(
        lambda p, x, tp, tx: jax.jvp(forward(self.backend), (p, x), (tp, tx))
    )(params, x, t_params, t_x)
    # <ct, J t> == <J^T ct, t>: the jvp against this backend's own vjp.
    _, vjp = jax.vjp(forward(self.backend), params, x)
    ct_params, ct_x = jax.jit(vjp)(cotangent)
    lhs = jnp.sum(t_y * cotangent)
    rhs = sum(
        jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))
        for a, b in zip(
            jax.tree.leaves((ct_params, ct_x)), jax.tree.leaves((t_params, t_x))
        )
    )
    scale = float(jnp.sum(jnp.abs(t_y * cotangent))) + 1.0
    tol = self.tolerance(case.dtype, "gradient")
    self.assertLessEqual(
        abs(float(lhs - rhs)),
        (tol.rtol + tol.atol) * scale,
        f"<ct, jvp> = {float(lhs)} but <vjp, t> = {float(rhs)}",
    )
    if self.is_oracle():
      return
    want_y, want_t = jax.jit(
        lambda p, x, tp, tx: jax.jvp(
            forward(moe_core.get_backend("reference")), (p, x), (tp, tx)
        )
    )(params, x, t_params, t_x)
    self.assertClose(y, want_y, case.dtype, msg="jvp primal vs reference")
    self.assertClose(
        t_y, want_t, case.dtype, "gradient", msg="jvp tangent vs reference"
    )

  def test_linearize_matches_jvp(self):
    case, params, x, _ = self._transforms_inputs()
    t_params, t_x = self._transforms_tangents(params, x)
    layer = self._transforms_layer(case.cfg)

    def f(params, x):
      return layer(params, x)[0].astype(jnp.float32)

    _, lin = jax.linearize(f, params, x)
    _, want = jax.jvp(f, (params, x), (t_params, t_x))
    self.assertClose(
        jax.jit(lin)(t_params, t_x),
        want,
        case.dtype,
        "gradient",
        msg="linearize vs jvp",
    )

  def test_hessian_of_small_loss_matches_reference(self):
    self.skip_if_oracle()
    case, params, x, cotangent = self._transforms_inputs()

    def loss(backend):
      # Two scalars scale the input and the down projection: a 2 x 2
      # Hessian that needs the derivative of every backward kernel.
      def f(v):
        scaled = dict(params, w_down=params["w_down"] * v[1].astype(x.dtype))
        y, _ = moe_core.moe_layer(
            scaled, x * v[0].astype(x.dtype), case.cfg, backend=backend
        )
        return jnp.sum(jnp.tanh(y.astype(jnp.float32)) * cotangent)

      return f

    v = jnp.array([1.1, 0.9], jnp.float32)
    got = jax.jit(jax.hessian(loss(self.backend)))(v)
    want = jax.jit(jax.hessian(loss(moe_core.get_backend("reference"))))(v)
    self.assertClose(got, want, case.dtype, "gradient", msg="Hessian")
