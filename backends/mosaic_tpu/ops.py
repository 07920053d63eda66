"""The mosaic_tpu kernels as differentiable ops (`moe_core.kernels`).

grouped_gemm   y = x @ w[g]              dX: gmm(dy, w^T)   dW: tgmm(x, dy)
gate_up        gate, up = x @ wg[g], x @ wu[g] in one pass over x
gated_gate_up  h = act(x @ wg[g]) * (x @ wu[g]), the activation in the
               epilogue; the derivatives through the activation's
down_weighted  out[r] = s[r] * (h[r] @ wd[g]), the routing weight in the
               epilogue (the down projection of `routed_experts`)
Forward and reverse mode alike: `TpuKernels` are the raw kernels,
`moe_core.kernels.grouped_matmul` and `expert_ops` their derivatives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from backends.mosaic_tpu import kernels
from backends.mosaic_tpu import tiling
from moe_core import backend
from moe_core import checks
from moe_core import validation
from moe_core.kernels import expert_ops
from moe_core.kernels import interpret as interpret_lib
from moe_core.kernels import permutation
from moe_core.kernels import tile_backend


def _debug_interpreter():
  """The TPU interpreter, which raises on out-of-bounds accesses and races
  (interpret="debug"): slow, for small shapes."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu

  return pltpu.InterpretParams(detect_races=True)


# The dtypes the kernels multiply (MosaicTpuBackend.dtypes).
DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16))

# The backend's `interpret` option (`moe_core.kernels.interpret`): compiled
# when lowered for a TPU; True is Pallas' HLO interpreter, "debug" or a
# `pltpu.InterpretParams` the TPU interpreter.
INTERPRETER = interpret_lib.Interpreter(
    names=(("debug", _debug_interpreter),),
    params=(("InterpretParams", "a pltpu.InterpretParams"),),
    compiled_for="tpu",
)


@dataclasses.dataclass(frozen=True)
class Launch(interpret_lib.InterpretedLaunch):
  """What every op needs besides its arrays (static, hashable).

  Attributes:
    tiles: the caller's tiles per kind; unset kinds use the table.
    interpret: False (compiled for a TPU), True, an InterpretParams, or
      None: auto, decided when a kernel is traced.
    generation: the TPU generation whose table and VMEM apply; None: the
      one lowered for (`tiling.generation()`).
    dynamic_grid: run only the visits used (a traced grid bound).
  """

  tiles: tiling.TileConfig = tiling.TileConfig()
  interpret: Any = False
  interpreter: ClassVar[interpret_lib.Interpreter] = INTERPRETER
  generation: str | None = None
  dynamic_grid: bool = True

  def kernel_launch(self) -> kernels.KernelLaunch:
    """The kernels' launch settings for the program traced now.

    Raises:
      NotImplementedError: compiled for a TPU the tile table does not know
        (`tiling.generation`), unless `generation` names one.
    """
    interpret = self.kernel_interpret
    return kernels.KernelLaunch(
        interpret=interpret,
        generation=self.generation
        or tiling.generation(compiled=interpret is False),
        dynamic_grid=self.dynamic_grid,
    )

  def choose(
      self, call: tiling.Call, launch: kernels.KernelLaunch
  ) -> tiling.Tiles:
    return tiling.choose(self.tiles, call, launch.generation)

  def gmm(self, kind, lhs, rhs, group_sizes, **options):
    """One `kernels.gmm` call with the tiles of `kind` ("fwd"/"dgrad").

    `options`: `kernels.gmm`'s keyword arguments besides tiles and launch.
    """
    launch = self.kernel_launch()
    tiles = self.choose(_gmm_call(kind, lhs, rhs, **options), launch)
    return kernels.gmm(
        list(lhs), list(rhs), group_sizes, tiles=tiles, launch=launch, **options
    )

  def tgmm(self, lhs, rhs, group_sizes, *, num_groups, out_dtype, poison=None):
    """One `kernels.tgmm` call with the "wgrad" tiles."""
    launch = self.kernel_launch()
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    tiles = self.choose(
        tiling.Call(
            kind="wgrad",
            m=lhs.shape[0],
            k=lhs.shape[1],
            n=rhs[0].shape[1],
            num_groups=num_groups,
            itemsize=jnp.dtype(lhs.dtype).itemsize,
            out_itemsize=out_dtype.itemsize,
            num_rhs=len(rhs),
            num_accs=len(rhs),
            num_outputs=len(rhs),
        ),
        launch,
    )
    return kernels.tgmm(
        lhs,
        list(rhs),
        group_sizes,
        tiles=tiles,
        launch=launch,
        num_groups=num_groups,
        out_dtype=out_dtype,
        poison=poison,
    )


def _gmm_call(
    kind,
    lhs,
    rhs,
    *,
    transpose_rhs=False,
    products=((0, 0, 0),),
    num_outputs=1,
    out_dtype=None,
    **unsized,
) -> tiling.Call:
  """The shape of a `kernels.gmm` call, which its tiles are fitted to.

  The arguments are `kernels.gmm`'s, with its defaults; `unsized` (the
  epilogue, row_scale and group_offset) does not change the blocks.
  """
  del unsized
  m, k = lhs[0].shape
  return tiling.Call(
      kind=kind,
      m=m,
      k=k,
      n=rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2],
      num_groups=rhs[0].shape[0],
      itemsize=jnp.dtype(lhs[0].dtype).itemsize,
      out_itemsize=jnp.dtype(out_dtype or lhs[0].dtype).itemsize,
      num_lhs=len(lhs),
      num_rhs=len(rhs),
      num_accs=1 + max(a for _, _, a in products),
      num_outputs=num_outputs,
  )


@dataclasses.dataclass(frozen=True)
class TpuKernels(tile_backend.LaunchKernels):
  """The gmm and tgmm kernels as `GroupedKernels`: products summed in one
  pass (gate and up read the rows once; their dX is one call, their dW one
  tgmm with two outputs); `fused_gmm`'s `epilogue` fuses the activation,
  and both write NaN where `poison` is set (no pass over the outputs)."""

  launch: Launch
  takes_poison: ClassVar[bool] = True


# Gated activations the Mosaic TPU lowering computes on the accumulators.
EPILOGUE_ACTIVATIONS = tile_backend.PALLAS_EPILOGUE_ACTIVATIONS

# grouped_gemm(rows, weights, group_sizes, transpose_rhs, out_dtype, launch),
# gate_up(rows, w_gate, w_up, group_sizes, launch) and
# gated_gate_up(rows, w_gate, w_up, group_sizes, activation, launch):
# `tile_backend.TileOps`.
grouped_gemm, gate_up, gated_gate_up = tile_backend.TileOps(
    TpuKernels, EPILOGUE_ACTIVATIONS
).functions()


@dataclasses.dataclass(frozen=True)
class _RowScaledGmm:
  """gmm with each row's float32 accumulator scaled before the cast."""

  launch: Launch

  def __call__(self, lhs, rhs, group_sizes, row_scale):
    return self.launch.gmm(
        "fwd", [lhs], [rhs], group_sizes, row_scale=row_scale
    )


def down_weighted(h, w_down, group_sizes, row_scale, launch: Launch):
  """out[r] = row_scale[r] * (h[r] @ w_down[g]): [M, F] -> [M, D].

  The scale multiplies the float32 accumulator before the cast, so the
  combine that follows needs unit weights. Rows past sum(group_sizes) come
  out as zeros with zero gradient in h and row_scale
  (`expert_ops.row_scaled_gmm`).

  Args:
    h: [M, F] sorted by group.
    w_down: [E, F, D] of h's dtype.
    group_sizes: [E] int32, sum <= M.
    row_scale: [M] float32.
    launch: tiles and interpret mode.
  """
  return expert_ops.row_scaled_gmm(
      TpuKernels(launch),
      _RowScaledGmm(launch),
      h,
      w_down,
      group_sizes,
      row_scale,
  )


def grouped_gemm_with_offset(
    rows, weights, group_sizes, group_offset, launch: Launch, out_dtype=None
):
  """rows [M, C] x weights [E, C, N] over the groups [group_offset,
  group_offset + E) of group_sizes [G]: [M, N], the other rows zeros.

  The forward alone (no derivatives): for expert parallelism where every
  device holds all the rows sorted by global group and computes only its
  own experts' (`kernels.gmm`'s group_offset).

  Args:
    rows: [M, C] float32 or bfloat16, sorted by global group.
    weights: [E, C, N] of rows' dtype: groups group_offset.. of G >= E.
    group_sizes: [G] integer, sum <= M.
    group_offset: an int in [0, G - E], or an integer scalar array (traced
      too).
    launch: tiles and interpret mode.
    out_dtype: None (rows' dtype) or a floating dtype.

  Raises:
    TypeError, ValueError: a bad argument, named; a concrete group_offset
      or group_sizes out of range. Traced ones make the whole output NaN
      (docs/api.md, "Guarantees"; `moe_core.checked` raises instead).
  """
  validation.check_grouped_gemm(rows, weights, group_sizes, global_groups=True)
  if weights.dtype != rows.dtype or rows.dtype not in DTYPES:
    raise TypeError(
        "grouped_gemm_with_offset needs rows and weights of one dtype, "
        f"float32 or bfloat16, got rows {rows.dtype.name}, weights "
        f"{weights.dtype.name}."
    )
  out_dtype = validation.check_out_dtype(out_dtype, rows.dtype)
  if not isinstance(launch, Launch):
    raise TypeError(f"launch must be an ops.Launch, got {type(launch)}.")
  num_local = weights.shape[0]
  offset, bad_offset = _checked_offset(
      group_offset, group_sizes.shape[0], num_local
  )
  sizes, bad_sizes = group_sizes, False
  if group_sizes.shape[0]:  # G = 0 (and E = 0): no sizes to be bad.
    sizes, bad_sizes = backend.sanitised_group_sizes(sizes, rows.shape[0])
  # The kernel writes the NaN of a traced fault itself (its poison flag):
  # no pass over the output.
  (out,) = launch.gmm(
      "fwd",
      [rows],
      [weights],
      sizes,
      out_dtype=out_dtype,
      group_offset=offset,
      poison=jnp.asarray(bad_offset | bad_sizes, bool),
  )
  return out


def _checked_offset(group_offset, num_groups: int, num_local: int):
  """(int32 offset for the kernels, scalar bool: it was out of range).

  The offset must lie in [0, num_groups - num_local]: past that, the
  visit list's slice of the group bounds would be clamped (a negative
  offset wrapped), and other groups' rows computed against these weights.
  A concrete offset out of range raises; a traced one is flagged, and 0
  (a valid offset) goes to the kernels in its place.
  """
  if isinstance(group_offset, (bool, np.bool_)) or not (
      isinstance(group_offset, (int, np.integer))
      or (
          hasattr(group_offset, "dtype")
          and jnp.issubdtype(group_offset.dtype, jnp.integer)
      )
  ):
    raise TypeError(
        "group_offset must be an int or an integer scalar array, got "
        f"{group_offset!r}."
    )
  if np.ndim(group_offset) != 0:
    raise ValueError(
        "group_offset must be a scalar, got "
        f"group_offset.shape={tuple(group_offset.shape)}."
    )
  high = num_groups - num_local
  wanted = (
      f"group_offset must lie in [0, G - E = {high}] (G={num_groups} groups "
      f"in group_sizes, E={num_local} in weights), got "
  )
  value = validation.concrete_value(group_offset)
  if value is not None and not 0 <= int(value) <= high:
    raise ValueError(f"{wanted}{int(value)}.")
  offset = jnp.asarray(group_offset)
  bad = (offset < 0) | (offset > high)
  checks.debug_check(~bad, wanted + "{}.", offset)
  return jnp.where(bad, 0, offset).astype(jnp.int32), bad


@dataclasses.dataclass(frozen=True)
class TpuPermutationKernels(permutation.PermutationKernels):
  """Dispatch and combine as gathers, forward and backward.

  The library's defaults: each of the five ops (gather, scatter, combine,
  spread, row_dots) is a gather and a sum over K, so neither direction has
  a scatter, which a TPU serialises (autodiff of an XLA gather would give
  one). The sums over K run one choice at a time: a [T, D] gather per k,
  each fused into the running sum, never the [T, K, D] array of every
  copy, whose K (4 or 8) sits on the sublane axis of a TPU tile and is
  padded to 8 (float32) in a relayout copy (deviceless v5e compile of
  combine's forward and backward at T=8192, K=4, D=1024: XLA's bytes
  accessed 0.77x, its temporaries 0.34x). The products are on the vector
  units in float32: an einsum would put a K-long contraction on the MXU at
  full float32 precision (six bf16 passes).
  """

  def scatter(self, rows, plan, *, top_k):
    y = None
    for _, v in self._choices(rows, plan, top_k, mask_dropped=False):
      y = v if y is None else y + v
    return y.astype(rows.dtype)

  def combine(self, rows, weights, plan, *, top_k, nan_invalid):
    w = weights.astype(jnp.float32)
    y = None
    for k, v in self._choices(rows, plan, top_k, nan_invalid=nan_invalid):
      term = w[:, k : k + 1] * v
      y = term if y is None else y + term
    return y.astype(rows.dtype)

  def row_dots(self, dy, rows, plan, *, top_k, nan_invalid):
    dy = dy.astype(jnp.float32)
    return jnp.stack(
        [
            jnp.sum(dy * v, axis=1)
            for _, v in self._choices(
                rows, plan, top_k, nan_invalid=nan_invalid
            )
        ],
        axis=1,
    )

  def _choices(self, rows, plan, top_k, *, mask_dropped=True, nan_invalid=None):
    """(k, v_k [T, D] float32) for k < K: choice k's copy of each token,
    0 where invalid or (mask_dropped) dropped, then NaN where invalid if
    `nan_invalid` (False: 0; None: as masked): `_values`' and `_per_copy`'s
    rows, one choice at a time."""
    t = plan.position.shape[0] // top_k
    position = plan.position.reshape(t, top_k)
    invalid = (plan.invalid != 0).reshape(t, top_k)
    skip = invalid
    if mask_dropped:
      skip = skip | (plan.kept == 0).reshape(t, top_k)
    fill = jnp.asarray(jnp.nan if nan_invalid else 0.0, jnp.float32)
    for k in range(top_k):
      v = rows[position[:, k]].astype(jnp.float32)
      v = jnp.where(skip[:, k : k + 1], 0.0, v)
      if nan_invalid is not None:
        v = jnp.where(invalid[:, k : k + 1], fill, v)
      yield k, v
