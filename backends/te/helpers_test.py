"""Transformer Engine on a CPU: the import, and TE's pure-JAX MoE helpers.

No TE primitive runs on a CPU, but these do, and the te backend relies on
them: `permutation.pure_jax_token_dispatch` / `pure_jax_token_combine` (its
dispatch and combine) and `compute_ragged_all_to_all_params` /
`compute_reverse_ragged_all_to_all_params` (the offsets of a ragged
all-to-all). Each is checked numerically against `moe_core` (permute,
parallel) and the `reference` backend, forward and under `jax.grad`, on
random routing, an expert with no tokens, tokens whose K experts all live on
one device, and a token count that is a multiple of nothing.

Runs in the TE environment (tools/setup_te.sh, tools/test_te.sh); on every
other leg each test skips with the reason (and fails instead when
DROPLESS_EXPECT_TE=1, as tools/test_te.sh sets).
"""

from __future__ import annotations

import dataclasses
import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.te import _te
from backends.testing.te_required import require_te
from conformance import tolerances
from moe_core import permute
from moe_core.parallel import exchange
from moe_core.parallel import ragged
from reference import backend as reference_backend

_E, _K, _D, _F = 8, 2, 16, 24
# Routing cases: name -> number of tokens.
_CASES = {
    "random": 32,
    # Expert _E - 1 gets nothing: with alignment padding, TE parks its
    # spare padding slots on the last expert, the edge most likely to break.
    "empty_expert": 32,
    # With 4 devices of 2 experts each, every token's K experts sit on one
    # device, so some devices receive nothing from a sender.
    "one_device": 32,
    # 13 tokens: T*K = 26 is no multiple of E, of an alignment or of ep.
    "odd_tokens": 13,
}
_DTYPES = ("float32", "bfloat16")


def _expert_ids(case: str, num_tokens: int, seed: int = 0) -> np.ndarray:
  """[T, K] int32 distinct experts per token, as the case describes."""
  rng = np.random.default_rng(seed)
  scores = rng.standard_normal((num_tokens, _E))
  if case == "empty_expert":
    scores[:, _E - 1] = -np.inf
  elif case == "one_device":
    # Device d (of 4) holds experts 2d and 2d + 1: token t picks both of
    # device t % 4's.
    device = np.arange(num_tokens) % 4
    scores = np.full((num_tokens, _E), -np.inf)
    scores[np.arange(num_tokens), 2 * device] = 1.0
    scores[np.arange(num_tokens), 2 * device + 1] = 0.5
  return np.argsort(-scores, axis=1, kind="stable")[:, :_K].astype(np.int32)


def _inputs(case: str, dtype: str, seed: int = 0):
  """(x [T, D], expert_ids [T, K] int32, weights [T, K] float32)."""
  num_tokens = _CASES[case]
  rng = np.random.default_rng(seed + 1)
  x = rng.standard_normal((num_tokens, _D)).astype(np.float32)
  weights = rng.uniform(0.1, 1.0, (num_tokens, _K)).astype(np.float32)
  return (
      jnp.asarray(x, dtype),
      jnp.asarray(_expert_ids(case, num_tokens, seed)),
      jnp.asarray(weights),
  )


def _assert_close(test, actual, expected, dtype, kind="forward"):
  tol = tolerances.lookup(dtype, kind)
  problem = tolerances.violation(actual, expected, tol)
  test.assertIsNone(problem, f"{dtype} {kind}: {problem}")


def _named():
  """named_parameters over case x dtype: (name, case, dtype)."""
  out = []
  for case in _CASES:
    for dtype in _DTYPES:
      out.append((f"_{case}_{dtype}", case, dtype))
  return out


class ImportTest(absltest.TestCase):
  """TE imports here, and the backend's view of it agrees."""

  def setUp(self):
    super().setUp()
    require_te(self)

  def test_transformer_engine_jax_imports(self):
    # pylint: disable-next=g-import-not-at-top
    import transformer_engine.jax as te_jax

    self.assertIs(_te.import_te(), te_jax)
    self.assertEqual(_te.installed(), (True, ""))
    if jax.default_backend() == "cpu":
      # Installed, but nothing of TE runs on a CPU: the backend says why.
      ok, reason = moe_core.get_backend("te").availability()
      self.assertFalse(ok)
      self.assertIn("no GPU", reason)

  def test_ffi_targets_are_registered(self):
    # pylint: disable-next=g-import-not-at-top
    import transformer_engine_jax

    registered = set(transformer_engine_jax.registrations())
    self.assertNotEmpty(registered)
    # The targets the te backend lowers to (router, grouped GEMM in both
    # paths, grouped quantisation for FP8/MXFP8).
    for target in (
        "te_fused_topk_with_score_function_forward_ffi",
        "te_fused_topk_with_score_function_backward_ffi",
        "te_grouped_gemm_ffi",
        "te_grouped_gemm_v2_ffi",
        "te_grouped_quantize_ffi",
    ):
      self.assertIn(target, registered)
    self.assertCountEqual(_te.custom_call_targets(), registered)


class AvailabilityTest(parameterized.TestCase):
  """`_te.availability` by the first device's capability (no TE needed)."""

  def _availability(self, capability, platform="gpu", **kwargs):
    device = types.SimpleNamespace(
        platform=platform,
        device_kind="NVIDIA X",
        compute_capability=capability,
        core_count=132,
    )
    with (
        mock.patch.object(_te, "installed", return_value=(True, "")),
        mock.patch.object(jax, "devices", return_value=[device]),
    ):
      return _te.availability(**kwargs)

  def test_any_cuda_gpu(self):
    self.assertEqual(self._availability("8.0"), (True, ""))

  def test_off_a_gpu(self):
    self.assertEqual(
        self._availability(None, platform="cpu"),
        (False, "no GPU: this device is cpu."),
    )

  def test_no_cuda_capability(self):
    ok, reason = self._availability(None)
    self.assertFalse(ok)
    self.assertIn("NVIDIA X reports no CUDA compute capability", reason)

  @parameterized.parameters(("9.0", True), ("10.0", True), ("8.9", False))
  def test_minimum_capability(self, capability, want):
    ok, reason = self._availability(
        capability, min_compute_capability=90, feature="FP8"
    )
    self.assertEqual(ok, want)
    if not want:
      self.assertEqual(
          reason,
          "GPU sm_89 (NVIDIA X) is older than sm_90, which FP8 needs.",
      )


class PureJaxPermutationTest(parameterized.TestCase):
  """`pure_jax_token_dispatch` / `_combine` against moe_core.permute."""

  def setUp(self):
    super().setUp()
    require_te(self)
    # pylint: disable-next=g-import-not-at-top
    from transformer_engine.jax import permutation

    self.permutation = permutation
    self.reference = reference_backend.ReferenceBackend()

  def dispatch(self, x, expert_ids, align_size=0):
    return self.permutation.pure_jax_token_dispatch(
        x, expert_ids, _E, _K, align_size=align_size
    )

  def combine(self, out, state, weights):
    num_tokens = weights.shape[0]
    y = self.permutation.pure_jax_token_combine(
        out, state, weights, _K, num_tokens, 1
    )
    return y.reshape(num_tokens, -1)

  @parameterized.named_parameters(*_named())
  def test_dispatch_equals_moe_core_dispatch(self, case, dtype):
    x, ids, _ = _inputs(case, dtype)
    rows, state, sizes = self.dispatch(x, ids)
    want = permute.dispatch(x, ids, _E)
    # Both sort the T*K copies stably by expert: the same rows, bit for bit,
    # in the same order (by token within an expert, as Dispatched promises).
    self.assertEqual(rows.dtype, x.dtype)
    np.testing.assert_array_equal(rows, want.rows)
    np.testing.assert_array_equal(sizes, want.group_sizes)
    np.testing.assert_array_equal(state.sorted_indices, want.assignment)
    self.assertEqual(state.padding_size, 0)
    self.assertEqual(state.num_real_tokens, ids.size)
    if case == "empty_expert":
      self.assertEqual(int(sizes[_E - 1]), 0)

  @parameterized.named_parameters(*_named())
  def test_combine_is_the_weighted_sum_of_chosen_experts(self, case, dtype):
    x, ids, weights = _inputs(case, dtype)
    _, state, _ = self.dispatch(x, ids)
    rng = np.random.default_rng(3)
    out = rng.standard_normal((ids.size, _D)).astype(np.float32)
    out = jnp.asarray(out, dtype)
    # By hand: row r of `out` is the copy state.sorted_indices[r], i.e.
    # token a // K's choice a % K.
    per_copy = np.zeros((ids.size, _D))
    per_copy[np.asarray(state.sorted_indices)] = np.asarray(out, np.float64)
    want = np.einsum(
        "tk,tkd->td",
        np.asarray(weights, np.float64),
        per_copy.reshape(-1, _K, _D),
    )
    # TE sums in the rows' dtype; the contract sums in float32, so the
    # backend hands it float32 rows. Both orders are checked.
    y32 = self.combine(out.astype(jnp.float32), state, weights)
    _assert_close(self, y32, want, "float32")
    _assert_close(self, self.combine(out, state, weights), want, dtype)
    moe = permute.combine(out, permute.dispatch(x, ids, _E), weights)
    _assert_close(self, y32.astype(dtype), moe, dtype)

  @parameterized.named_parameters(*_named())
  def test_routed_block_matches_reference(self, case, dtype):
    cfg = moe_core.MoEConfig(
        num_experts=_E, top_k=_K, hidden_size=_D, expert_ffn_size=_F
    )
    params = moe_core.init_params(jax.random.key(0), cfg)
    x, ids, weights = _inputs(case, dtype)
    # The routing decided by hand (the case), not by the router: an aux
    # with those experts and weights.
    aux = moe_core.route(x, params["router"], cfg)
    aux = _with_choices(aux, ids, weights)
    want = self.reference.routed_experts(params, x, aux, cfg)
    rows, state, sizes = self.dispatch(x, ids)
    out = self.reference.expert_ffn(rows, sizes, params, cfg)
    got = self.combine(out.astype(jnp.float32), state, weights)
    _assert_close(self, got.astype(dtype), want, dtype)

  @parameterized.named_parameters(*_named())
  def test_gradients_match_moe_core_permute(self, case, dtype):
    x, ids, weights = _inputs(case, dtype)
    rng = np.random.default_rng(5)
    w = jnp.asarray(0.3 * rng.standard_normal((_E, _D, _D)), dtype)
    cotangent = jnp.asarray(rng.standard_normal((x.shape[0], _D)), dtype)

    def experts(rows, sizes, w):
      return reference_backend.grouped_gemm(rows, w, sizes)

    def te_loss(x, w, weights):
      rows, state, sizes = self.dispatch(x, ids)
      y = self.combine(
          experts(rows, sizes, w).astype(jnp.float32), state, weights
      )
      return jnp.sum(y * cotangent.astype(jnp.float32))

    def moe_loss(x, w, weights):
      d = permute.dispatch(x, ids, _E)
      out = experts(d.rows, d.group_sizes, w).astype(jnp.float32)
      y = permute.combine(out, d, weights)
      return jnp.sum(y * cotangent.astype(jnp.float32))

    got = jax.jit(jax.grad(te_loss, argnums=(0, 1, 2)))(x, w, weights)
    want = jax.jit(jax.grad(moe_loss, argnums=(0, 1, 2)))(x, w, weights)
    for name, g, h in zip(("x", "w", "combine_weights"), got, want):
      with self.subTest(name):
        self.assertEqual(g.dtype, h.dtype)
        _assert_close(self, g, h, dtype, "gradient")

  @parameterized.named_parameters(
      ("_random", "random"), ("_empty_last_expert", "empty_expert")
  )
  def test_aligned_dispatch_pads_each_group_with_zero_rows(self, case):
    align = 4
    x, ids, weights = _inputs(case, "float32")
    rows, state, sizes = self.dispatch(x, ids, align_size=align)
    want = permute.dispatch(x, ids, _E)
    counts = np.asarray(want.group_sizes)
    sizes = np.asarray(sizes)
    np.testing.assert_array_equal(sizes, -(-counts // align) * align)
    self.assertEqual(state.padding_size, _E * (align - 1))
    self.assertEqual(rows.shape, (ids.size + _E * (align - 1), _D))
    # Each group: its real rows in moe_core's order, then zero rows.
    got_start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    want_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rows = np.asarray(rows)
    for e in range(_E):
      real = rows[got_start[e] : got_start[e] + counts[e]]
      pad = rows[got_start[e] + counts[e] : got_start[e] + sizes[e]]
      np.testing.assert_array_equal(
          real, want.rows[want_start[e] : want_start[e] + counts[e]]
      )
      np.testing.assert_array_equal(pad, np.zeros_like(pad))
    # The unpermute drops the padding: the weighted sum as without it.
    out = jnp.asarray(
        np.random.default_rng(4).standard_normal((rows.shape[0], _D)),
        jnp.float32,
    )
    got = self.combine(out, state, weights)
    unpadded = np.concatenate(
        [out[got_start[e] : got_start[e] + counts[e]] for e in range(_E)]
    )
    want_y = permute.combine(jnp.asarray(unpadded), want, weights)
    _assert_close(self, got, want_y, "float32")


class BackendPermutationTest(parameterized.TestCase):
  """backends.te.permutation's combine (TE's helper, never differentiated:
  moe_core's permutation ops differentiate it) against moe_core.permute's
  under every transformation: values, jvp, grad, a Hessian and vmap."""

  def setUp(self):
    super().setUp()
    require_te(self)
    # pylint: disable-next=g-import-not-at-top
    from backends.te import permutation

    self.te = permutation

  def inputs(self, case, with_drops):
    x, ids, weights = _inputs(case, "float32")
    kept = None
    if with_drops:
      # Every third copy dropped by capacity.
      kept = jnp.asarray(np.arange(ids.size).reshape(ids.shape) % 3 != 0)
    rng = np.random.default_rng(6)
    w = jnp.asarray(0.3 * rng.standard_normal((_E, _D, _D)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((x.shape[0], _D)))
    return x, ids, weights, kept, w, cotangent

  def block(self, dispatch, combine, ids, kept):
    """(x, w, weights) -> [T, D]: dispatch, a grouped GEMM, combine."""

    def f(x, w, weights):
      d = dispatch(x, ids, _E, kept)
      out = reference_backend.grouped_gemm(d.rows, w, d.group_sizes)
      return combine(jnp.tanh(out), d, weights, kept)

    return f

  def blocks(self, ids, kept):
    return (
        self.block(permute.dispatch, self.te.combine, ids, kept),
        self.block(permute.dispatch, permute.combine, ids, kept),
    )

  @parameterized.named_parameters(
      ("_random", "random", False),
      ("_odd_tokens_with_drops", "odd_tokens", True),
      ("_empty_expert_with_drops", "empty_expert", True),
  )
  def test_values_jvp_and_grad_match_moe_core(self, case, with_drops):
    x, ids, weights, kept, w, cotangent = self.inputs(case, with_drops)
    te_block, moe_block = self.blocks(ids, kept)
    primals = (x, w, weights)
    tangents = tuple(
        jnp.asarray(np.random.default_rng(i).standard_normal(p.shape), p.dtype)
        for i, p in enumerate(primals)
    )
    got = jax.jit(lambda p, t: jax.jvp(te_block, p, t))(primals, tangents)
    want = jax.jvp(moe_block, primals, tangents)
    for what, g, h in zip(("value", "tangent"), got, want):
      with self.subTest(what):
        _assert_close(self, g, h, "float32", "gradient")

    def loss(block):
      return lambda *a: jnp.sum(block(*a) * cotangent)

    got = jax.jit(jax.grad(loss(te_block), argnums=(0, 1, 2)))(*primals)
    want = jax.grad(loss(moe_block), argnums=(0, 1, 2))(*primals)
    for name, g, h in zip(("x", "w", "weights"), got, want):
      with self.subTest(name):
        _assert_close(self, g, h, "float32", "gradient")

  def test_hessian_vector_product_matches_moe_core(self):
    x, ids, weights, kept, w, cotangent = self.inputs("random", True)

    def loss(block):
      def f(v):
        y = block(x * v[0], w * v[1], weights * v[2])
        return jnp.sum(jnp.tanh(y) * cotangent)

      return f

    te_block, moe_block = self.blocks(ids, kept)
    got = jax.jit(_hessian_vector_product(loss(te_block)))()
    want = _hessian_vector_product(loss(moe_block))()
    _assert_close(self, got, want, "float32", "gradient")

  def test_vmap_matches_one_call_per_example(self):
    x, ids, weights, kept, w, _ = self.inputs("random", True)
    te_block, _ = self.blocks(ids, kept)
    xs = jnp.stack([x, -0.5 * x])
    got = jax.jit(jax.vmap(te_block, (0, None, None)))(xs, w, weights)
    for i in range(xs.shape[0]):
      _assert_close(self, got[i], te_block(xs[i], w, weights), "float32")


class RaggedAllToAllParamsTest(parameterized.TestCase):
  """TE's ragged all-to-all offsets against moe_core.parallel's layout."""

  EP = 4

  def setUp(self):
    super().setUp()
    require_te(self)
    # pylint: disable-next=g-import-not-at-top
    from transformer_engine.jax import permutation

    self.permutation = permutation

  def counts(self, case: str) -> np.ndarray:
    """[ep, E] int32: copies each device sends each expert, by routing."""
    rows = []
    for shard in range(self.EP):
      ids = _expert_ids(case, _CASES[case], seed=shard)
      rows.append(np.bincount(ids.reshape(-1), minlength=_E))
    return np.stack(rows).astype(np.int32)

  def by_hand(self, counts: np.ndarray, me: int):
    """(input_offsets, send_sizes, output_offsets, recv_sizes) of `me`."""
    local = _E // self.EP
    sends = counts.reshape(self.EP, self.EP, local).sum(-1)  # [src, dst]
    send_sizes = sends[me]
    input_offsets = np.cumsum(send_sizes) - send_sizes
    recv_sizes = sends[:, me]
    # Receivers stack their sources in device order.
    output_offsets = np.array([sends[:me, dst].sum() for dst in range(self.EP)])
    return input_offsets, send_sizes, output_offsets, recv_sizes

  def moe_core_layout(self, counts: np.ndarray, me: int) -> exchange.Layout:
    """The drop-free `Layout` moe_core's ragged exchange builds for `me`."""
    local = _E // self.EP
    wanted = jnp.asarray(counts.reshape(self.EP, self.EP, local).sum(-1))
    capacity = int(wanted.sum())  # Nothing is dropped.
    fits, dst_first = ragged.RaggedExchange().admit(wanted, capacity)
    src_first = exchange.exclusive_cumsum(wanted, axis=1)
    return exchange.Layout(
        send_sizes=fits[me],
        send_offsets=src_first[me],
        recv_sizes=fits[:, me],
        recv_offsets=dst_first[:, me],
        peer_recv_offsets=dst_first[me],
        peer_send_offsets=src_first[:, me],
        capacity=capacity,
    )

  @parameterized.named_parameters(*((f"_{c}", c) for c in _CASES))
  def test_forward_params(self, case):
    counts = self.counts(case)
    params = jax.jit(
        self.permutation.compute_ragged_all_to_all_params, static_argnums=2
    )
    for me in range(self.EP):
      # A traced shard id, as jax.lax.axis_index gives inside shard_map.
      got = params(jnp.asarray(counts), jnp.int32(me), self.EP)
      layout = self.moe_core_layout(counts, me)
      want = {
          "by hand": self.by_hand(counts, me),
          "moe_core": (
              layout.send_offsets,
              layout.send_sizes,
              layout.peer_recv_offsets,
              layout.recv_sizes,
          ),
      }
      for source, expected in want.items():
        for name, g, w in zip(_PARAM_NAMES, got, expected):
          with self.subTest(shard=me, against=source, param=name):
            np.testing.assert_array_equal(g, w)

  @parameterized.named_parameters(*((f"_{c}", c) for c in _CASES))
  def test_reverse_params_undo_the_forward(self, case):
    counts = self.counts(case)
    params = jax.jit(
        self.permutation.compute_reverse_ragged_all_to_all_params,
        static_argnums=2,
    )
    for me in range(self.EP):
      got = params(jnp.asarray(counts), jnp.int32(me), self.EP)
      layout = self.moe_core_layout(counts, me)
      # moe_core's send_back: take each peer's rows where they landed here,
      # put them back where that peer took them from.
      want = (
          layout.recv_offsets,
          layout.recv_sizes,
          layout.peer_send_offsets,
          layout.send_sizes,
      )
      for name, g, w in zip(_PARAM_NAMES, got, want):
        with self.subTest(shard=me, param=name):
          np.testing.assert_array_equal(g, w)

  @parameterized.named_parameters(*((f"_{c}", c) for c in _CASES))
  def test_round_trip_moves_every_row_home(self, case):
    # The params drive a real exchange (moe_core's all_gather emulation of
    # ragged_all_to_all, which XLA:CPU lacks) inside shard_map: each
    # device's rows reach their experts' devices, stacked by source, and the
    # reverse brings every row back to where it started.
    if jax.device_count() < self.EP:
      self.skipTest(f"needs {self.EP} devices, got {jax.device_count()}")
    counts = self.counts(case)
    rows_per_device = int(counts.sum(1).max())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: self.EP]), ("ep",))
    p = jax.sharding.PartitionSpec
    # Row values name their sender and position: 1000 * device + row + 1.
    start = 1000 * np.arange(self.EP)[:, None] + np.arange(rows_per_device) + 1
    sent_rows = np.where(
        np.arange(rows_per_device) < counts.sum(1)[:, None], start, 0
    ).astype(np.float32)
    capacity = int(counts.sum())
    permutation = self.permutation

    def body(rows, all_counts):
      me = jax.lax.axis_index("ep")
      fwd = permutation.compute_ragged_all_to_all_params(
          all_counts, me, self.EP
      )
      rev = permutation.compute_reverse_ragged_all_to_all_params(
          all_counts, me, self.EP
      )
      received = ragged.emulated_ragged_all_to_all(
          rows[0, :, None],
          jnp.zeros((capacity, 1), rows.dtype),
          *fwd,
          axis_name="ep",
      )
      back = ragged.emulated_ragged_all_to_all(
          received,
          jnp.zeros((rows.shape[1], 1), rows.dtype),
          *rev,
          axis_name="ep",
      )
      return received[None, :, 0], back[None, :, 0]

    received, back = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(p("ep"), p()),
            out_specs=(p("ep"), p("ep")),
            check_vma=False,
        )
    )(jnp.asarray(sent_rows), jnp.asarray(counts))
    np.testing.assert_array_equal(back, sent_rows)
    local = _E // self.EP
    sends = counts.reshape(self.EP, self.EP, local).sum(-1)
    for dst in range(self.EP):
      expected = []
      for src in range(self.EP):
        first = sends[src, :dst].sum()
        expected.extend(start[src, first : first + sends[src, dst]])
      expected += [0] * (capacity - len(expected))
      with self.subTest(device=dst):
        np.testing.assert_array_equal(received[dst], expected)


# Configs TE's fused router computes (routing.route's semantics), by name.
_ROUTER_CONFIGS = {
    "softmax": dict(),
    "softmax_renormalised": dict(norm_topk_prob=True),
    "sigmoid_top1": dict(score_func="sigmoid", top_k=1),
    "deepseek_v3_no_groups": dict(
        score_func="sigmoid",
        norm_topk_prob=True,
        norm_epsilon=1e-20,
        correction_bias=True,
        routed_scaling_factor=2.5,
    ),
    "capacity": dict(capacity_factor=1.0),
}


def _emulated_fused_topk(
    logits,
    topk,
    use_pre_softmax=False,
    num_groups=-1,
    group_topk=-1,
    scaling_factor=1.0,
    score_function="softmax",
    expert_bias=None,
    **unused,
):
  """TE's `router.fused_topk_with_score_function` in plain JAX, no groups.

  Its documented pipeline (transformer_engine/jax/router.py): scores =
  score_function(logits); experts chosen by top-k of scores (+ expert_bias,
  sigmoid only); softmax either before the top-k (`use_pre_softmax`) or
  over the K chosen logits after it; sigmoid weights divided by their sum +
  1e-20 when topk > 1 (TE always renormalises them then); times
  scaling_factor. Returns (probs [T, E], nonzero at the chosen experts
  only, routing_map [T, E] bool).
  """
  del unused
  if num_groups > 0 or group_topk > 0:
    raise NotImplementedError("the emulation has no expert groups")
  name = getattr(score_function, "name", score_function).lower()
  if name == "softmax":
    scores = jax.nn.softmax(logits, axis=-1) if use_pre_softmax else logits
    selection = scores
  else:
    scores = jax.nn.sigmoid(logits)
    selection = scores if expert_bias is None else scores + expert_bias
  _, ids = jax.lax.top_k(selection, topk)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if name == "softmax" and not use_pre_softmax:
    weights = jax.nn.softmax(weights, axis=-1)
  elif name == "sigmoid" and topk > 1:
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
  weights = weights * scaling_factor
  rows = jnp.arange(logits.shape[0])[:, None]
  probs = jnp.zeros_like(logits).at[rows, ids].set(weights)
  routing_map = jnp.zeros(logits.shape, bool).at[rows, ids].set(True)
  return probs, routing_map


def _hessian_vector_product(f):
  """() -> H u at v for f of a vector v: forward mode over reverse mode,
  every second-order rule of a Hessian without jax.hessian's vmap."""
  v = jnp.array([1.1, 0.9, 1.2], jnp.float32)
  u = jnp.array([0.3, -0.7, 0.5], jnp.float32)
  return lambda: jax.jvp(jax.grad(f), (v,), (u,))[1]


def _emulated_backward(ct, logits, bias, spec):
  """TE's router backward kernel (`router.te_backward`) as the VJP of the
  emulation: d_logits [T, E] from the probs' cotangent ct [T, E]."""
  kwargs = dataclasses.asdict(spec)
  topk = kwargs.pop("topk")
  if bias.size:
    kwargs["expert_bias"] = bias
  _, vjp = jax.vjp(lambda l: _emulated_fused_topk(l, topk, **kwargs)[0], logits)
  return vjp(ct)[0]


class RouterChoiceTest(parameterized.TestCase):
  """Which router switches TE's fused router takes (pure Python: runs
  without TE). Refusals name the switch; `TEBackend._route` then uses the
  library's router."""

  def cfg(self, **fields):
    base = dict(num_experts=_E, top_k=_K, hidden_size=_D, expert_ffn_size=_F)
    return moe_core.MoEConfig(**{**base, **fields})

  @parameterized.named_parameters(
      ("sqrtsoftplus", dict(score_func="sqrtsoftplus"), "sqrtsoftplus"),
      ("sparsemixer", dict(score_func="sparsemixer"), "sparsemixer"),
      (
          "bias_on_logits",
          dict(
              score_func="sigmoid",
              correction_bias=True,
              correction_bias_on="logits",
              norm_topk_prob=True,
              norm_epsilon=1e-20,
          ),
          "correction_bias_on='logits'",
      ),
      ("zero_experts", dict(num_zero_experts=2), "num_zero_experts=2"),
      ("hash", dict(hash_vocab_size=4), "hash_vocab_size=4"),
  )
  def test_refuses_naming_the_switch(self, fields, switch):
    # pylint: disable-next=g-import-not-at-top
    from backends.te import router as router_lib

    fused, why = router_lib.choice(self.cfg(**fields))
    self.assertFalse(fused)
    self.assertIn(switch, why)

  def test_takes_the_switches_in_its_logits_and_weights(self):
    # pylint: disable-next=g-import-not-at-top
    from backends.te import router as router_lib

    cfg = self.cfg(
        norm_topk_prob=True,
        router_bias=True,
        router_logit_softcap=3.0,
        router_input_norm=True,
        router_input_scale=0.5,
        expert_input_norm=True,
        expert_output_scale=True,
    )
    self.assertEqual(router_lib.choice(cfg), (True, ""))


class FusedRouterAuxTest(parameterized.TestCase):
  """The te backend's MoEAux from TE's router outputs, against route().

  TE's fused kernels cannot run here; an emulation of what the forward
  returns (dense [T, E] probabilities and a routing map) and of the
  backward (its VJP) stand in for them, and everything the backend builds
  from those (ids best first, weights, capacity, invalid tokens, counts,
  losses, gradients, forward-mode derivatives, Hessians, vmap) must equal
  `moe_core.routing.route` for every config `router_choice` accepts.
  """

  def setUp(self):
    super().setUp()
    require_te(self)
    # pylint: disable-next=g-import-not-at-top
    from transformer_engine.jax import router as te_router
    # pylint: disable-next=g-import-not-at-top
    from backends.te import router as router_lib

    patcher = mock.patch.object(
        te_router,
        "fused_topk_with_score_function",
        side_effect=_emulated_fused_topk,
    )
    self.fused_topk = patcher.start()
    self.addCleanup(patcher.stop)
    # (Not asserted called: moe_core's kernel primitives cache their
    # traces; unpatched, TE's kernel would fail to lower on the CPU.)
    backward = mock.patch.object(
        router_lib, "te_backward", side_effect=_emulated_backward
    )
    backward.start()
    self.addCleanup(backward.stop)
    self.backend = moe_core.get_backend("te")

  def inputs(self, cfg, nan_token=False):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((_CASES["odd_tokens"], _D)).astype(np.float32)
    if nan_token:
      x[3, 5] = np.nan
    router = 0.5 * rng.standard_normal((_D, cfg.num_experts))
    bias = None
    if cfg.correction_bias:
      bias = jnp.asarray(0.05 * rng.standard_normal(cfg.num_experts))
      bias = bias.astype(jnp.float32)
    return jnp.asarray(x), jnp.asarray(router, jnp.float32), bias

  def cfg(self, name):
    base = dict(num_experts=_E, top_k=_K, hidden_size=_D, expert_ffn_size=_F)
    return moe_core.MoEConfig(**{**base, **_ROUTER_CONFIGS[name]})

  @parameterized.named_parameters(
      *((f"_{n}", n, False) for n in _ROUTER_CONFIGS),
      ("_nan_token", "softmax", True),
  )
  def test_aux_equals_routing_route(self, name, nan_token):
    cfg = self.cfg(name)
    fused, why = self.backend.router_choice(cfg)
    self.assertTrue(fused, why)
    x, router, bias = self.inputs(cfg, nan_token)
    got = jax.jit(self.backend.route, static_argnums=2)(x, router, cfg, bias)
    self.fused_topk.assert_called_once()
    want = moe_core.route(x, router, cfg, bias)
    valid = np.all(np.isfinite(np.asarray(x)), axis=1)
    self.assertEqual(valid.all(), not nan_token)
    for field in dataclasses.fields(want):
      g = np.asarray(getattr(got, field.name))
      w = np.asarray(getattr(want, field.name))
      with self.subTest(field.name):
        self.assertEqual(g.dtype, w.dtype)
        self.assertEqual(g.shape, w.shape)
        if field.name == "expert_ids":
          # An invalid token's experts are unspecified (its weights NaN).
          np.testing.assert_array_equal(g[valid], w[valid])
        elif g.dtype.kind == "f":
          np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
        else:
          np.testing.assert_array_equal(g, w)

  @parameterized.named_parameters(*((f"_{n}", n) for n in _ROUTER_CONFIGS))
  def test_gradients_equal_routing_route(self, name):
    cfg = self.cfg(name)
    x, router, bias = self.inputs(cfg)
    cotangent = jnp.asarray(
        np.random.default_rng(8).standard_normal((x.shape[0], cfg.top_k)),
        jnp.float32,
    )

    def loss(route, x, router):
      aux = route(x, router, cfg, bias)
      return (
          jnp.sum(aux.combine_weights * cotangent)
          + aux.load_balancing_loss
          + aux.router_z_loss
      )

    got = jax.grad(lambda *a: loss(self.backend.route, *a), (0, 1))(x, router)
    self.fused_topk.assert_called()
    want = jax.grad(lambda *a: loss(moe_core.route, *a), (0, 1))(x, router)
    for what, g, w in zip(("x", "router"), got, want):
      with self.subTest(what):
        _assert_close(self, g, w, "float32", "gradient")

  def aux_loss(self, cfg, bias, cotangent):
    """(route, x, router) -> a scalar of every differentiable MoEAux field."""

    def loss(route, x, router):
      aux = route(x, router, cfg, bias)
      return (
          jnp.sum(aux.combine_weights * cotangent)
          + jnp.sum(jnp.tanh(aux.router_probs))
          + aux.load_balancing_loss
          + aux.router_z_loss
      )

    return loss

  @parameterized.named_parameters(*((f"_{n}", n) for n in _ROUTER_CONFIGS))
  def test_forward_mode_equals_routing_route(self, name):
    cfg = self.cfg(name)
    x, router, bias = self.inputs(cfg)
    rng = np.random.default_rng(9)
    cotangent = jnp.asarray(
        rng.standard_normal((x.shape[0], cfg.top_k)), jnp.float32
    )
    t_x, t_router = (
        jnp.asarray(rng.standard_normal(a.shape), jnp.float32)
        for a in (x, router)
    )
    loss = self.aux_loss(cfg, bias, cotangent)

    def te_loss(x, router):
      return loss(self.backend.route, x, router)

    def moe_loss(x, router):
      return loss(moe_core.route, x, router)

    primals, tangents = (x, router), (t_x, t_router)
    got = jax.jit(lambda p, t: jax.jvp(te_loss, p, t))(primals, tangents)
    want = jax.jit(lambda p, t: jax.jvp(moe_loss, p, t))(primals, tangents)
    with self.subTest("jvp"):
      _assert_close(self, got[1], want[1], "float32", "gradient")
    _, lin = jax.linearize(te_loss, *primals)
    with self.subTest("linearize"):
      _assert_close(
          self, jax.jit(lin)(*tangents), want[1], "float32", "gradient"
      )
    # The jvp (plain JAX) against the emulated backward kernel's grad.
    grads = jax.jit(jax.grad(te_loss, argnums=(0, 1)))(*primals)
    dot = sum(jnp.sum(g * t) for g, t in zip(grads, tangents))
    with self.subTest("jvp vs grad"):
      _assert_close(self, dot, got[1], "float32", "gradient")

  @parameterized.named_parameters(
      ("_softmax", "softmax"), ("_deepseek_v3", "deepseek_v3_no_groups")
  )
  def test_hessian_and_vmap_equal_routing_route(self, name):
    cfg = self.cfg(name)
    x, router, bias = self.inputs(cfg)
    cotangent = jnp.asarray(
        np.random.default_rng(10).standard_normal((x.shape[0], cfg.top_k)),
        jnp.float32,
    )
    loss = self.aux_loss(cfg, bias, cotangent)

    def scaled(route):
      return lambda v: loss(route, x * v[0], router * v[1] * v[2])

    got = jax.jit(_hessian_vector_product(scaled(self.backend.route)))()
    want = _hessian_vector_product(scaled(moe_core.route))()
    with self.subTest("hessian"):
      _assert_close(self, got, want, "float32", "gradient")
    xs = jnp.stack([x, -0.5 * x])
    batched = jax.jit(
        jax.vmap(lambda x: self.backend.route(x, router, cfg, bias))
    )(xs)
    for i in range(xs.shape[0]):
      want_aux = moe_core.route(xs[i], router, cfg, bias)
      with self.subTest(f"vmap example {i}"):
        np.testing.assert_array_equal(
            batched.expert_ids[i], want_aux.expert_ids
        )
        _assert_close(
            self,
            batched.combine_weights[i],
            want_aux.combine_weights,
            "float32",
        )


_PARAM_NAMES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def _with_choices(aux: moe_core.MoEAux, ids, weights) -> moe_core.MoEAux:
  """`aux` with the given experts [T, K] and combine weights [T, K]."""
  return dataclasses.replace(
      aux,
      expert_ids=ids,
      combine_weights=weights,
      tokens_per_expert=jnp.bincount(ids.reshape(-1), length=_E).astype(
          jnp.int32
      ),
  )


if __name__ == "__main__":
  absltest.main()
