"""Grouped matmuls as one JAX primitive, differentiable in both directions.

A backend hands its raw (non-differentiable) kernels to this module as a
`GroupedKernels`; `gmm` (lhs [M, C] x rhs [E, C, N] -> [M, N]), `tgmm` (per
group lhs_g^T @ rhs_g: [M, A] x [M, B] -> [E, A, B]) and their multi-product
form `grouped_products` then work under every transformation: jit, grad,
forward mode (jvp, linearize, hessian), vmap, shard_map with
`check_vma=True`, remat, scan and jax.export. Both products are bilinear,
which is why a primitive and not a custom VJP (reverse mode only): the
tangent of either is the same primitive, and the transpose with respect to
one operand is the other product, so reverse mode runs the backend's dX and
dW kernels and every order of differentiation composes (docs/transforms.md).
Over 400 lines because it is one job: one primitive and the rules that make
it work under every transformation (abstract eval, JVP, transpose), which
share its binding of the kernels.
"""

from __future__ import annotations

import functools
from typing import Callable, ClassVar, NamedTuple, Sequence

import jax
from jax.interpreters import ad
import jax.numpy as jnp
import numpy as np

from moe_core.kernels import primitive

# (lhs index, rhs index, output index) triples.
Products = tuple[tuple[int, int, int], ...]
ONE_PRODUCT: Products = ((0, 0, 0),)


class GroupedKernels:
  """A backend's raw grouped-matmul kernels.

  Subclasses must be hashable and compare by value (frozen dataclasses):
  an instance is a static parameter of the primitive, part of jit's cache
  key. The kernels see operands of one dtype, int32 group sizes that are
  valid (non-negative, sum <= M: `Backend` sanitises them), and need not be
  differentiable. A backend implements either
    * `gmm` and `tgmm`, one product per call, or
    * `fused_gmm` and `fused_tgmm`, kernels that sum several products in
      one pass (the gate and up projections against one read of the rows;
      their dX as one accumulation; their dW from one read of the rows).
  The multi-product entry points use the fused kernels where the call's
  shape fits them and sum single products otherwise.
  """

  # fused_gmm(lhs, rhs, group_sizes, *, products, transpose_rhs,
  #           num_outputs, out_dtype) -> tuple of num_outputs arrays:
  #   acc[o] += lhs[l] @ rhs[r][group] for each (l, r, o), one out dtype.
  fused_gmm: Callable[..., tuple[jax.Array, ...]] | None = None
  # fused_tgmm(lhs, rhs, group_sizes, *, num_groups, out_dtype) -> tuple:
  #   one lhs [M, A], rhs a sequence of [M, B_i]: out[i] = lhs_g^T rhs[i]_g.
  fused_tgmm: Callable[..., tuple[jax.Array, ...]] | None = None
  # Whether fused_gmm and fused_tgmm also take `poison` (a bool scalar on
  # the device: every output NaN when set), applied as they write their
  # outputs; otherwise a poisoned call is poisoned after them, a pass over
  # each output.
  takes_poison: ClassVar[bool] = False

  def gmm(
      self,
      lhs: jax.Array,
      rhs: jax.Array,
      group_sizes: jax.Array,
      *,
      transpose_rhs: bool,
      out_dtype: np.dtype,
  ) -> jax.Array:
    """lhs [M, C] x rhs [E, C, N] ([E, N, C] transposed) -> [M, N].

    Rows at or past sum(group_sizes) must come out zero without reading
    lhs there (it may hold NaN). Accumulate in float32.
    """
    if self.fused_gmm is None:
      raise NotImplementedError(
          f"{type(self).__name__} implements neither gmm nor fused_gmm."
      )
    (out,) = self.fused_gmm(
        (lhs,),
        (rhs,),
        group_sizes,
        products=ONE_PRODUCT,
        transpose_rhs=transpose_rhs,
        num_outputs=1,
        out_dtype=out_dtype,
    )
    return out

  def tgmm(
      self,
      lhs: jax.Array,
      rhs: jax.Array,
      group_sizes: jax.Array,
      *,
      num_groups: int,
      out_dtype: np.dtype,
  ) -> jax.Array:
    """Per group lhs_g^T rhs_g: [M, A] x [M, B] -> [E, A, B].

    Rows at or past sum(group_sizes) must not contribute, NaN or not; an
    empty group gives zeros. Accumulate in float32.
    """
    if self.fused_tgmm is None:
      raise NotImplementedError(
          f"{type(self).__name__} implements neither tgmm nor fused_tgmm."
      )
    (out,) = self.fused_tgmm(
        lhs, (rhs,), group_sizes, num_groups=num_groups, out_dtype=out_dtype
    )
    return out

  def gmm_products(
      self,
      lhs,
      rhs,
      group_sizes,
      *,
      products,
      transpose_rhs,
      out_dtypes,
      poison=None,
  ) -> tuple[jax.Array, ...]:
    """Each out[o] = the sum of its products: one `fused_gmm` call where
    the outputs share a dtype, else one `gmm` per product. The arguments
    are `grouped_products`' for kind "gmm"; `poison` only where
    `takes_poison` (a fused call then takes it)."""
    if self.fused_gmm is not None and len(set(out_dtypes)) == 1:
      return self.fused_gmm(
          tuple(lhs),
          tuple(rhs),
          group_sizes,
          products=products,
          transpose_rhs=transpose_rhs,
          num_outputs=len(out_dtypes),
          out_dtype=out_dtypes[0],
          **_poison_option(poison),
      )
    one_product = functools.partial(self.gmm, transpose_rhs=transpose_rhs)
    return _poisoned(
        _sum_products(one_product, lhs, rhs, group_sizes, products, out_dtypes),
        poison,
    )

  def tgmm_products(
      self,
      lhs,
      rhs,
      group_sizes,
      *,
      products,
      num_groups,
      out_dtypes,
      poison=None,
  ) -> tuple[jax.Array, ...]:
    """Each out[o] = the sum of its products: one `fused_tgmm` call where
    one lhs meets one rhs per output in one dtype, else one `tgmm` each.
    The arguments are `grouped_products`' for kind "tgmm"; `poison` as
    `gmm_products`'."""
    by_output = sorted(products, key=lambda p: p[2])
    if (
        self.fused_tgmm is not None
        and len({l for l, _, _ in products}) == 1
        and [o for _, _, o in by_output] == list(range(len(out_dtypes)))
        and len(set(out_dtypes)) == 1
    ):
      return self.fused_tgmm(
          lhs[products[0][0]],
          tuple(rhs[r] for _, r, _ in by_output),
          group_sizes,
          num_groups=num_groups,
          out_dtype=out_dtypes[0],
          **_poison_option(poison),
      )
    one_product = functools.partial(self.tgmm, num_groups=num_groups)
    return _poisoned(
        _sum_products(one_product, lhs, rhs, group_sizes, products, out_dtypes),
        poison,
    )


def _poisoned(outs, poison):
  """Each output all NaN where the bool scalar `poison` is set (None: as
  they are)."""
  if poison is None:
    return tuple(outs)
  return tuple(
      jnp.where(poison, jnp.asarray(jnp.nan, o.dtype), o) for o in outs
  )


def _poison_option(poison) -> dict:
  """The fused kernels' keyword for `poison`: none when there is none."""
  return {} if poison is None else {"poison": poison}


def _sum_products(
    one_product, lhs, rhs, group_sizes, products: Products, out_dtypes
):
  """out[o] = sum of one_product(lhs[l], rhs[r], group_sizes, out_dtype=)
  over o's products, summed in float32 where there is more than one."""

  def product(l, r, dtype):
    return one_product(lhs[l], rhs[r], group_sizes, out_dtype=dtype)

  outs = []
  for o, dtype in enumerate(out_dtypes):
    mine = [(l, r) for l, r, out in products if out == o]
    if len(mine) == 1:
      outs.append(product(*mine[0], dtype))
      continue
    total = sum(product(l, r, np.dtype(np.float32)) for l, r in mine)
    outs.append(total.astype(dtype))
  return tuple(outs)


# --- The public entry points -------------------------------------------------


def gmm(
    kernels: GroupedKernels,
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    out_dtype=None,
    poison: jax.Array | None = None,
) -> jax.Array:
  """lhs [M, C] x rhs [E, C, N] ([E, N, C] transposed) -> [M, N].

  Rows at or past sum(group_sizes) come out zero and get zero gradient.
  `poison` (a bool scalar, or None): see `grouped_products`.
  """
  return _single_product(
      "gmm",
      kernels,
      lhs,
      rhs,
      group_sizes,
      out_dtype,
      transpose_rhs=transpose_rhs,
      poison=poison,
  )


def tgmm(
    kernels: GroupedKernels,
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    num_groups: int,
    out_dtype=None,
) -> jax.Array:
  """Per group lhs_g^T rhs_g: [M, A] x [M, B] -> [E, A, B]."""
  return _single_product(
      "tgmm",
      kernels,
      lhs,
      rhs,
      group_sizes,
      out_dtype,
      num_groups=num_groups,
  )


def _single_product(kind, kernels, lhs, rhs, group_sizes, out_dtype, **options):
  """One product of `kind`: one lhs, one rhs, one output (out_dtype or
  lhs's)."""
  (out,) = grouped_products(
      kernels,
      kind,
      (lhs,),
      (rhs,),
      group_sizes,
      products=ONE_PRODUCT,
      out_dtypes=(out_dtype or lhs.dtype,),
      **options,
  )
  return out


def grouped_products(
    kernels: GroupedKernels,
    kind: str,
    lhs: Sequence[jax.Array],
    rhs: Sequence[jax.Array],
    group_sizes: jax.Array,
    *,
    products: Products,
    out_dtypes: Sequence,
    transpose_rhs: bool = False,
    num_groups: int | None = None,
    poison: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
  """Sums of grouped products, one per output, in one differentiable call.

  kind "gmm": out[o] = sum over (l, r, o) in products of lhs[l] @
  rhs[r][group]. Every lhs is [M, C], every rhs [E, C, N] ([E, N, C] with
  transpose_rhs), each output [M, N]; num_groups, if given, must be E.

  kind "tgmm": out[o][g] = sum over (l, r, o) in products of lhs[l]_g^T
  rhs[r]_g. Every lhs is [M, A], every rhs [M, B], each output
  [num_groups, A, B]; num_groups is required, transpose_rhs must be False.

  Rows are sorted by group, group g owning the rows [sum(gs[:g]),
  sum(gs[:g+1])); gmm's rows at or past sum(group_sizes) come out zero, and
  tgmm leaves them unread. All operands share one dtype; there is one output
  per entry of `out_dtypes`, and every output has at least one product.

  `poison`, a bool scalar on the device (or None), makes every output all
  NaN when set, and every tangent and cotangent of the call too (the
  derivatives are calls of this primitive with the same poison): the
  documented outcome of bad group sizes, applied by the kernels as they
  write where the backend's `takes_poison`, else after them.
  """
  lhs, rhs = tuple(lhs), tuple(rhs)
  num_groups = _num_groups(kind, rhs, transpose_rhs, num_groups)
  if not isinstance(kernels, GroupedKernels):
    raise TypeError(
        f"kernels must be a GroupedKernels, got {type(kernels).__name__}."
    )
  products = tuple(tuple(int(i) for i in p) for p in products)
  out_dtypes = tuple(np.dtype(d) for d in out_dtypes)
  dtypes = {jnp.dtype(x.dtype) for x in lhs + rhs}
  if len(dtypes) != 1:
    raise TypeError(
        f"{kind} operands must share one dtype, got "
        f"{sorted(d.name for d in dtypes)}."
    )
  for l, r, o in products:
    if not (
        0 <= l < len(lhs) and 0 <= r < len(rhs) and 0 <= o < len(out_dtypes)
    ):
      raise ValueError(
          f"product {(l, r, o)} indexes past {len(lhs)} lhs, {len(rhs)} rhs "
          f"or {len(out_dtypes)} outputs."
      )
  if {o for _, _, o in products} != set(range(len(out_dtypes))):
    raise ValueError(
        f"every one of the {len(out_dtypes)} outputs needs a product, got "
        f"products={products}."
    )
  params = _Params(
      kernels,
      kind,
      products,
      len(lhs),
      bool(transpose_rhs),
      num_groups,
      out_dtypes,
      poison is not None,
  )
  tail = (group_sizes.astype(jnp.int32),)
  if poison is not None:
    tail += (jnp.asarray(poison, bool).reshape(()),)
  return tuple(params.bind(lhs + rhs + tail))


def _num_groups(kind, rhs, transpose_rhs, num_groups) -> int:
  """E of a `grouped_products` call; raises on an option `kind` refuses."""
  if kind == "gmm":
    if not rhs:
      raise ValueError("gmm needs at least one rhs, got none.")
    if num_groups not in (None, rhs[0].shape[0]):
      raise ValueError(
          f"gmm's num_groups must be the rhs' {rhs[0].shape[0]} groups (or "
          f"None), got {num_groups!r}."
      )
    return rhs[0].shape[0]
  if kind == "tgmm":
    if transpose_rhs:
      raise ValueError("tgmm takes no transpose_rhs, got True.")
    if num_groups is None:
      raise TypeError("tgmm needs num_groups, the number of groups E.")
    return int(num_groups)
  raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}.")


# --- The primitive -----------------------------------------------------------


class _Params(NamedTuple):
  """The primitive's parameters; every bind passes all of them.

  Attributes:
    kernels: the backend's `GroupedKernels`.
    kind: "gmm" or "tgmm".
    products: (lhs index, rhs index, output index) triples.
    num_lhs: how many operands are lhs; the rhs follow, then group_sizes
      (and the poison flag, when poisoned): the tail, not differentiated.
    transpose_rhs: gmm's rhs are [E, N, C].
    num_groups: E.
    out_dtypes: one per output.
    poisoned: the last operand is the bool poison flag.
  """

  kernels: GroupedKernels
  kind: str
  products: Products
  num_lhs: int
  transpose_rhs: bool
  num_groups: int
  out_dtypes: tuple[np.dtype, ...]
  poisoned: bool = False

  def bind(self, operands) -> list[jax.Array]:
    """The primitive on `operands`, made to share their mesh variance."""
    operands = primitive.match_variance(operands)
    return grouped_matmul_p.bind(*operands, **self._asdict())


def _split(operands, p: _Params):
  """(lhs, rhs, tail) of the flat operand list: tail is (group_sizes,) or
  (group_sizes, poison)."""
  tail = 2 if p.poisoned else 1
  return (
      tuple(operands[: p.num_lhs]),
      tuple(operands[p.num_lhs : -tail]),
      tuple(operands[-tail:]),
  )


def _out_shapes(avals, **params):
  """[(shape, dtype)] of each output, from the operands' shapes."""
  p = _Params(**params)
  lhs, rhs, _ = _split(avals, p)
  shapes = [None] * len(p.out_dtypes)
  for l, r, o in p.products:
    if p.kind == "gmm":
      n = rhs[r].shape[1] if p.transpose_rhs else rhs[r].shape[2]
      shape = (lhs[l].shape[0], n)
    else:
      shape = (p.num_groups, lhs[l].shape[1], rhs[r].shape[1])
    if shapes[o] is not None and shapes[o] != shape:
      raise ValueError(
          f"{p.kind} output {o} gets products of shapes {shapes[o]} and "
          f"{shape}."
      )
    shapes[o] = shape
  return list(zip(shapes, p.out_dtypes))


def _call_kernels(*operands, **params):
  """The backend's kernels on the operands: what the primitive computes."""
  p = _Params(**params)
  lhs, rhs, (group_sizes, *poison) = _split(operands, p)
  poison = poison[0] if poison else None
  if p.kind == "gmm":
    call = functools.partial(
        p.kernels.gmm_products, transpose_rhs=p.transpose_rhs
    )
  else:
    call = functools.partial(p.kernels.tgmm_products, num_groups=p.num_groups)
  outs = call(
      lhs,
      rhs,
      group_sizes,
      products=p.products,
      out_dtypes=p.out_dtypes,
      **_poison_option(poison if p.kernels.takes_poison else None),
  )
  if not p.kernels.takes_poison:
    outs = _poisoned(outs, poison)
  return [out.astype(dtype) for out, dtype in zip(outs, p.out_dtypes)]


grouped_matmul_p = primitive.kernel_primitive(
    "dropless_grouped_matmul", _call_kernels, _out_shapes
)


# --- Differentiation ---------------------------------------------------------


def _bind_terms(
    terms,
    tail,
    out_avals,
    *,
    kind,
    transpose_rhs,
    compute_dtype,
    params,
):
  """One primitive call summing `terms` [(lhs, rhs, out index)] per output.

  Operands are cast to `compute_dtype`, the primal operands' (a cotangent
  arrives in its output's dtype, which may be wider). Outputs without a
  term are None. `params` are the differentiated call's `_Params`: its
  kernels, num_groups and poison carry over, with its `tail` operands.
  """
  if not terms:
    return [None] * len(out_avals)
  lhs, rhs, products = [], [], []

  def index(operands, x):
    for i, y in enumerate(operands):
      if y is x:
        return i
    operands.append(x)
    return len(operands) - 1

  used = sorted({o for _, _, o in terms})
  renumber = {o: i for i, o in enumerate(used)}
  for l, r, o in terms:
    products.append((index(lhs, l), index(rhs, r), renumber[o]))
  outs = params._replace(
      kind=kind,
      products=tuple(products),
      num_lhs=len(lhs),
      transpose_rhs=transpose_rhs,
      out_dtypes=tuple(out_avals[o].dtype for o in used),
  ).bind(tuple(x.astype(compute_dtype) for x in lhs + rhs) + tuple(tail))
  result = [None] * len(out_avals)
  for o, out in zip(used, outs):
    result[o] = out
  return result


def _jvp(primals, tangents, **params):
  params = _Params(**params)
  lhs, rhs, tail = _split(primals, params)
  d_lhs, d_rhs, _ = _split(tangents, params)
  out = grouped_matmul_p.bind(*primals, **params._asdict())
  # d(lhs @ rhs) = dlhs @ rhs + lhs @ drhs, both in one call (one float32
  # accumulation per output, as the fused kernels do it).
  terms = []
  for l, r, o in params.products:
    if type(d_lhs[l]) is not ad.Zero:
      terms.append((d_lhs[l], rhs[r], o))
    if type(d_rhs[r]) is not ad.Zero:
      terms.append((lhs[l], d_rhs[r], o))
  out_avals = [jax.typeof(x) for x in out]
  tangent = _bind_terms(
      terms,
      tail,
      out_avals,
      kind=params.kind,
      transpose_rhs=params.transpose_rhs,
      compute_dtype=jax.typeof(primals[0]).dtype,
      params=params,
  )
  tangent = [
      ad.Zero(a.to_tangent_aval()) if t is None else t
      for t, a in zip(tangent, out_avals)
  ]
  return out, tangent


def _aval(x):
  return x.aval if ad.is_undefined_primal(x) else jax.typeof(x)


def _transpose(cotangents, *operands, **params):
  """The transposes are the other product, bound as this primitive.

  gmm's lhs: a gmm against the transposed rhs; gmm's rhs: a tgmm; tgmm's
  operands: gmms.
  """
  params = _Params(**params)
  kind, transposed = params.kind, params.transpose_rhs
  lhs, rhs, tail = _split(operands, params)
  lhs_terms, rhs_terms = [], []
  for l, r, o in params.products:
    ct = cotangents[o]
    if type(ct) is ad.Zero:
      continue
    lhs_linear = ad.is_undefined_primal(lhs[l])
    rhs_linear = ad.is_undefined_primal(rhs[r])
    if lhs_linear and rhs_linear:
      raise ValueError(
          "grouped_matmul is bilinear: it cannot be transposed with respect "
          "to both of a product's operands."
      )
    # gmm:   out = L R      ct_L = ct R^T (gmm)    ct_R = L^T ct (tgmm)
    # gmm^T: out = L R^T    ct_L = ct R   (gmm)    ct_R = ct^T L (tgmm)
    # tgmm:  out = L^T R    ct_L = R ct^T (gmm^T)  ct_R = L ct   (gmm)
    if lhs_linear:
      if kind == "gmm":
        lhs_terms.append((ct, rhs[r], l))
      else:
        lhs_terms.append((rhs[r], ct, l))
    if rhs_linear:
      if kind == "gmm" and not transposed:
        rhs_terms.append((lhs[l], ct, r))
      elif kind == "gmm":
        rhs_terms.append((ct, lhs[l], r))
      else:
        rhs_terms.append((lhs[l], ct, r))
  lhs_avals = [_aval(x) for x in lhs]
  rhs_avals = [_aval(x) for x in rhs]
  # Every operand has one dtype (checked at the first bind).
  compute_dtype = lhs_avals[0].dtype
  ct_lhs = _bind_terms(
      lhs_terms,
      tail,
      lhs_avals,
      kind="gmm",
      transpose_rhs=(not transposed) if kind == "gmm" else True,
      compute_dtype=compute_dtype,
      params=params,
  )
  ct_rhs = _bind_terms(
      rhs_terms,
      tail,
      rhs_avals,
      kind="tgmm" if kind == "gmm" else "gmm",
      transpose_rhs=False,
      compute_dtype=compute_dtype,
      params=params,
  )
  return [
      *(
          None if not ad.is_undefined_primal(x) else ct
          for x, ct in zip(lhs, ct_lhs)
      ),
      *(
          None if not ad.is_undefined_primal(x) else ct
          for x, ct in zip(rhs, ct_rhs)
      ),
      *(None for _ in tail),
  ]


ad.primitive_jvps[grouped_matmul_p] = _jvp
ad.primitive_transposes[grouped_matmul_p] = _transpose
