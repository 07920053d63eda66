"""StagesSuite: dispatch, expert FFN and combine, each on its own."""

from __future__ import annotations

import dataclasses

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from conformance import base
from conformance import cases
from conformance import oracles
from conformance import tolerances


def _route(cfg):
  x, router, _, _, _ = cases.permute_inputs(cfg)
  return x, moe_core.route(x, router, cfg)


class StagesSuite(base.BackendTestCase):
  """The stages of `Backend.routed_experts`, against the math."""

  @parameterized.named_parameters(
      ("dropless", cases.PERMUTE_CFG), ("capacity", cases.PERMUTE_CAPACITY_CFG)
  )
  def test_dispatch_groups_copies_by_expert(self, cfg):
    x, aux = _route(cfg)
    got = self.backend.dispatch(x, aux, cfg)
    ids = np.asarray(aux.expert_ids).reshape(-1)  # Assignment a = t*K + k.
    kept = np.asarray(aux.kept).reshape(-1)
    if cfg.dropless:
      self.assertTrue(kept.all())
    else:
      self.assertFalse(kept.all(), "the case should drop some copies")
    group_sizes = np.asarray(got.group_sizes)
    self.assertEqual(group_sizes.dtype, np.int32)
    np.testing.assert_array_equal(
        group_sizes, np.bincount(ids[kept], minlength=cfg.num_experts)
    )
    assignment = np.asarray(got.assignment)
    position = np.asarray(got.position)
    m = ids.size
    np.testing.assert_array_equal(np.sort(assignment), np.arange(m))
    np.testing.assert_array_equal(position[assignment], np.arange(m))
    owner = oracles.group_of_rows(group_sizes, m)
    used = int(group_sizes.sum())
    # Row r holds a copy of its own expert, kept, in token order within the
    # expert; the dropped copies come after every group.
    np.testing.assert_array_equal(ids[assignment[:used]], owner[:used])
    self.assertTrue(kept[assignment[:used]].all())
    self.assertFalse(kept[assignment[used:]].any())
    for e in range(cfg.num_experts):
      mine = assignment[:used][owner[:used] == e]
      np.testing.assert_array_equal(mine, np.sort(mine))
    np.testing.assert_array_equal(
        np.asarray(got.rows)[:used],
        np.asarray(x)[assignment[:used] // cfg.top_k],
    )

  def test_combine_gradients_match_the_formula(self):
    """y[t] = sum_k kept w[t, k] out[pos(t, k)]: value, d out and d w.

    Rows of dropped copies hold NaN; none of it may reach y or a gradient.
    """
    cfg = cases.PERMUTE_CAPACITY_CFG
    x, aux = _route(cfg)
    _, _, expert_out, weights, cotangent = cases.permute_inputs(cfg)
    k = cfg.top_k
    kept = np.asarray(aux.kept)
    combines = {
        "backend.combine": (
            self.backend.dispatch(x, aux, cfg),
            lambda out, w, disp: self.backend.combine(
                out, disp, dataclasses.replace(aux, combine_weights=w), cfg
            ),
        ),
        "moe_core.combine": (
            moe_core.dispatch(x, aux.expert_ids, cfg.num_experts, aux.kept),
            lambda out, w, disp: moe_core.combine(out, disp, w, aux.kept),
        ),
    }
    for name, (dispatched, combine) in combines.items():
      with self.subTest(name):
        position = np.asarray(dispatched.position).reshape(-1, k)  # [T, K]
        used = int(np.asarray(dispatched.group_sizes).sum())
        out = np.array(expert_out)
        out[used:] = np.nan  # Rows of dropped copies.
        out = jnp.asarray(out)

        def value_and_grads(
            out, weights, combine=combine, dispatched=dispatched
        ):
          y, vjp = jax.vjp(lambda o, w: combine(o, w, dispatched), out, weights)
          return (y,) + vjp(cotangent)

        y, d_out, d_w = jax.jit(value_and_grads)(out, weights)

        gathered = oracles.f64(out)[position]  # [T, K, D]
        gathered[~kept] = 0.0
        kept_w = np.where(kept, oracles.f64(weights), 0.0)
        ct = oracles.f64(cotangent)
        want_y = np.einsum("tk,tkd->td", kept_w, gathered)
        want_d_w = np.einsum("td,tkd->tk", ct, gathered)
        want_d_out = np.zeros_like(oracles.f64(out))
        want_d_out[position[kept]] = (kept_w[..., None] * ct[:, None, :])[kept]

        self.assertClose(y, want_y, "float32", msg=f"{name} value")
        self.assertClose(
            d_w, want_d_w, "float32", "gradient", msg=f"{name} d weights"
        )
        self.assertAllZero(
            np.asarray(d_w)[~kept], msg=f"{name} d weights of dropped copies"
        )
        self.assertClose(
            d_out, want_d_out, "float32", "gradient", msg=f"{name} d expert_out"
        )
        self.assertAllZero(
            np.asarray(d_out)[used:], msg=f"{name} d expert_out of dropped rows"
        )

  @parameterized.named_parameters(
      (prefix + variant, dtype, variant)
      for prefix, dtype in (("f32", "float32"), ("bf16", "bfloat16"))
      for variant in cases.FFN_STAGE_CFGS
      if not variant or dtype == "float32"
  )
  def test_expert_ffn_matches_per_row_math(self, dtype, variant):
    """Each row through its expert's FFN; NaN padding rows give exact 0."""
    self.skip_unless_computes(dtype)
    cfg = cases.FFN_STAGE_CFGS[variant]
    rows, _, params, _ = cases.ffn_inputs(dtype, cfg)
    used = sum(cases.FFN_GROUP_SIZES)
    # Through swiglu_limit's clamp on a TPU or GPU, at full float32
    # products (tolerances.clamp_gradient_precision says why).
    precision = tolerances.clamp_gradient_precision(cfg, dtype)
    out, d_rows, d_params = base.cached(
        self._key("expert_ffn", dtype, variant, precision),
        lambda: _with_precision(
            precision, lambda: _ffn_and_grads(self.backend, dtype, cfg)
        ),
    )
    # The oracle would be compared with itself (the same cache key): for it
    # only the numpy forward and the exact zeros are checked here, and its
    # gradients by finite differences in reference/gradient_check_test.py.
    oracle = self.is_oracle()
    if not oracle:
      ref_out, ref_d_rows, ref_d_params = base.cached(
          ("reference", "{}", "expert_ffn", dtype, variant),
          lambda: _ffn_and_grads(moe_core.get_backend("reference"), dtype, cfg),
      )

    owner = oracles.group_of_rows(cases.FFN_GROUP_SIZES, cases.FFN_ROWS)
    want = np.zeros((cases.FFN_ROWS, cfg.hidden_size))
    for r in range(used):
      want[r] = oracles.expert_ffn(rows[r : r + 1], params, owner[r], cfg)[0]
    with self.subTest("forward"):
      self.assertEqual(out.dtype, rows.dtype)
      self.assertClose(out, want, dtype, msg="expert_ffn vs numpy")
      if not oracle:
        self.assertClose(out, ref_out, dtype, msg="expert_ffn vs reference")
      self.assertAllZero(out[used:], msg="NaN padding rows")
    with self.subTest("d_rows"):
      self.assertEqual(d_rows.dtype, rows.dtype)
      if not oracle:
        self.assertClose(
            d_rows, ref_d_rows, dtype, "gradient", msg="d rows vs reference"
        )
      self.assertAllZero(d_rows[used:], msg="d NaN padding rows")
    for name in sorted(params):
      with self.subTest(name):
        if not oracle:
          self.assertClose(
              d_params[name],
              ref_d_params[name],
              dtype,
              "gradient",
              msg=f"d {name} vs reference",
          )
        self.assertAllZero(
            d_params[name][1], msg=f"d {name} of the empty expert 1"
        )


def _with_precision(precision, compute):
  """compute() under jax.default_matmul_precision(precision), if given."""
  if precision is None:
    return compute()
  with jax.default_matmul_precision(precision):
    return compute()


def _ffn_and_grads(backend, dtype, cfg=cases.FFN_CFG):
  """Backend.expert_ffn on cases.ffn_inputs(dtype, cfg), jitted, and its
  vjp: numpy (out, d_rows, d_params)."""
  rows, group_sizes, params, cotangent = cases.ffn_inputs(dtype, cfg)

  def fn(rows, params):
    out, vjp = jax.vjp(
        lambda r, p: backend.expert_ffn(r, group_sizes, p, cfg),
        rows,
        params,
    )
    return (out,) + vjp(cotangent)

  out, d_rows, d_params = jax.jit(fn)(rows, params)
  return (
      np.asarray(out),
      np.asarray(d_rows),
      {n: np.asarray(g) for n, g in d_params.items()},
  )
