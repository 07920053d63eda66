"""ReferenceBackend: one expert at a time, masks instead of sorting, float32."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from moe_core import activations
from moe_core import backend
from moe_core import checks
from moe_core import operands
from moe_core import config as config_lib
from moe_core import ffn
from moe_core import norms
from moe_core import precision
from moe_core import quantized_gemm
from moe_core import routing
from moe_core import validation

_HIGHEST = jax.lax.Precision.HIGHEST


def group_row_mask(num_rows: int, group_sizes: jax.Array) -> jax.Array:
  """[E, M] bool: mask[e, r] iff row r belongs to group e."""
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  row = jnp.arange(num_rows)[None, :]
  return (row >= starts[:, None]) & (row < ends[:, None])


def grouped_gemm(
    rows, weights, group_sizes, *, transpose_rhs=False, out_dtype=None
):
  """[M, C] x [E, C, N] -> [M, N]; rows past sum(group_sizes) are zero.

  C is the contracted width; weights are [E, N, C] if `transpose_rhs`.

  Every row is multiplied by every expert and the masks keep the right
  product. Masking the rows before the product (not only after) keeps NaN in
  unused rows out of the weight gradient.
  """
  masks = group_row_mask(rows.shape[0], group_sizes)
  n = weights.shape[1] if transpose_rhs else weights.shape[2]
  out = jnp.zeros((rows.shape[0], n), jnp.float32)
  for e in range(weights.shape[0]):  # One expert at a time, for clarity.
    mine = masks[e][:, None]
    w = weights[e].T if transpose_rhs else weights[e]
    prod = jnp.dot(
        jnp.where(mine, rows, 0).astype(jnp.float32),
        w.astype(jnp.float32),
        precision=_HIGHEST,
    )
    out += jnp.where(mine, prod, 0.0)
  return out.astype(out_dtype or rows.dtype)


def _quantized(x: jax.Array, recipe: str, *, weight: bool) -> jax.Array:
  """x through the recipe and back, in float32 (x itself, unquantized).

  One tensor (one per-tensor scale), blocks along the first axis of a
  weight [C, N] (its contraction) or the last of activations [T, C].
  """
  if recipe == precision.UNQUANTIZED:
    return x.astype(jnp.float32)
  q = precision.quantize(x, recipe, axis=0 if weight else -1, weight=weight)
  return precision.dequantize(q)


def expert_ffn_dense(
    x: jax.Array,
    params: dict,
    expert: int,
    activation: str | activations.Settings,
    recipe: str = precision.UNQUANTIZED,
    mine: jax.Array | None = None,
) -> jax.Array:
  """One expert's FFN on every token, in float32: [T, D] -> [T, D].

  gate = x Wg + bg, up = x Wu + bu, h = f(gate, up) (f(up) and no gate
  when the activation is not gated), out = h Wd + bd; the biases where
  `params` holds b_gate, b_up, b_down. `activation` is a registry name
  (`moe_core.activations`) or its `Settings` (clamp and options).

  With a quantised `recipe`, each GEMM's operands go through it first:
  activations as one tensor of the tokens `mine` ([T] bool: the expert's
  group; the others are zeroed, so they change no scale), each weight as
  one tensor. The products and h are then rounded to x's dtype before they
  are used, as the sorted path stores them. `recipe` is one of
  `moe_core.precision.RECIPES` (or its deprecated alias "bf16").
  """
  recipe = precision.check_recipe(recipe, stacklevel=2)
  settings = (
      activation
      if isinstance(activation, activations.Settings)
      else activations.Settings(activation)
  )
  gated = settings.activation.gated

  def bias(name):
    if name not in params:
      return None
    return params[name][expert].astype(jnp.float32)

  if recipe == precision.UNQUANTIZED:
    x = x.astype(jnp.float32)

    def linear(lhs, name, bias_name):
      out = jnp.dot(
          lhs, params[name][expert].astype(jnp.float32), precision=_HIGHEST
      )
      b = bias(bias_name)
      return out if b is None else out + b

    gate = linear(x, "w_gate", "b_gate") if gated else None
    h = activations.hidden(settings, gate, linear(x, "w_up", "b_up"))
    return linear(h, "w_down", "b_down")
  dtype = x.dtype
  if mine is not None:
    x = jnp.where(mine[:, None], x, jnp.zeros((), dtype))

  def product(lhs, name):
    out = jnp.dot(
        _quantized(lhs, recipe, weight=False),
        _quantized(params[name][expert].astype(dtype), recipe, weight=True),
        precision=_HIGHEST,
    )
    return out.astype(dtype)

  h = ffn.hidden(
      product(x, "w_gate") if gated else None,
      product(x, "w_up"),
      settings,
      gate_bias=bias("b_gate"),
      up_bias=bias("b_up"),
  )
  out = product(h, "w_down").astype(jnp.float32)
  b_down = bias("b_down")
  return (
      out
      if b_down is None
      else (out + b_down).astype(dtype).astype(jnp.float32)
  )


def dense_mixture(
    params: dict, x: jax.Array, aux: routing.MoEAux, cfg: config_lib.MoEConfig
) -> jax.Array:
  """y[t] = sum_e w[t, e] * FFN_e(x[t]) with no dispatch at all
  (sum_e FFN_e(w[t, e] * x[t]) with cfg.routing_weights_on_input; FFN_e's
  output normed where cfg.post_expert_norm). x: [T, W], W =
  cfg.expert_width.

  w[t, e] is the combine weight of the (kept) choices of token t that name
  expert e; every expert runs on every token and the weights pick (a
  select, so NaN in an expert's weights reaches only its tokens). No
  `expert_ffn` runs, so the layer emits no checkpoint names: under the
  "save_moe" policy the oracle recomputes everything, as under "full".
  `expert_ffn` called directly is the base one, with every name.

  An id out of [0, E) would be a zero row of one_hot, dropping its token
  silently: concrete ones raise, traced ones make the token's row NaN.
  """
  validation.check_routed_experts(x, aux, cfg, params)
  return _dense_mixture(params, x, aux, cfg)


def _dense_mixture(params, x, aux, cfg) -> jax.Array:
  """`dense_mixture` on validated arguments."""
  invalid = checks.flag_bad_expert_ids(aux.expert_ids, cfg.num_experts)
  chosen = jax.nn.one_hot(
      aux.expert_ids, cfg.num_experts, dtype=jnp.float32
  )  # [T, K, E]
  # Dropped copies weigh 0, but a NaN weight (an invalid token) stays NaN,
  # as it does in `permute.combine`.
  weights = aux.combine_weights
  kept_weights = jnp.where(aux.kept | jnp.isnan(weights), weights, 0.0)
  token_expert_weight = jnp.einsum(
      "tk,tke->te", kept_weights, chosen, precision=_HIGHEST
  )
  # Which experts each token's copies reach: an expert no copy reaches adds
  # exactly nothing, even if its weights hold NaN (0 * NaN would not).
  reaches = (
      jnp.einsum(
          "tk,tke->te",
          (aux.kept | jnp.isnan(weights)).astype(jnp.float32),
          chosen,
          precision=_HIGHEST,
      )
      > 0
  )
  settings = activations.Settings.from_config(cfg)
  y = jnp.zeros(x.shape, jnp.float32)
  for e in range(cfg.num_experts):
    weight = token_expert_weight[:, e : e + 1]
    if cfg.routing_weights_on_input:
      # Llama 4: FFN_e(w x), the scaled token rounded to x's dtype.
      scaled = (weight * x.astype(jnp.float32)).astype(x.dtype)
      contribution = expert_ffn_dense(
          scaled, params, e, settings, cfg.precision, reaches[:, e]
      )
    else:
      out = expert_ffn_dense(
          x, params, e, settings, cfg.precision, reaches[:, e]
      )
      # Muse Spark's norm of the expert's output, before its weight.
      contribution = weight * norms.post_expert(out, params, cfg)
    y += jnp.where(reaches[:, e : e + 1], contribution, 0.0)
  return checks.nan_rows(jnp.any(invalid, axis=-1), y).astype(x.dtype)


class ReferenceBackend(backend.Backend):
  """The oracle. Runs anywhere, supports everything the API allows."""

  name: ClassVar[str] = "reference"
  precisions: ClassVar[tuple[str, ...]] = precision.RECIPES
  # The oracle multiplies float32 exactly on every platform: a TPU's
  # default for float32 operands is one bfloat16 pass. Its own products say
  # HIGHEST; this covers the shared expert's and the latent projections',
  # which moe_layer computes for every backend.
  matmul_precision: ClassVar[str | None] = "highest"

  def __init__(self) -> None:
    """No options: the oracle has one way of computing everything."""

  def _grouped_gemm(self, gemm: operands.GemmOperands) -> jax.Array:
    return grouped_gemm(
        gemm.rows,
        gemm.weights,
        gemm.group_sizes,
        transpose_rhs=gemm.transpose_rhs,
        out_dtype=gemm.out_dtype,
    )

  def _quantized_grouped_gemm(self, q):
    """Dequantise both operands, then the float32 masked product."""
    return quantized_gemm.dequantized_grouped_gemm(
        q,
        lambda rows, weights, sizes: grouped_gemm(
            rows, weights, sizes, out_dtype=jnp.float32
        ),
    )

  def _routed_experts(self, params, x, aux, cfg):
    """`dense_mixture` (the types are Backend.routed_experts's)."""
    return _dense_mixture(params, x, aux, cfg)
