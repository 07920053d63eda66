"""PallasBackend: tile-list Pallas kernels; Triton on GPU, interpret on CPU."""

from __future__ import annotations

from typing import ClassVar

import jax
from jax import ad_checkpoint
import jax.numpy as jnp

from backends.pallas import ops
from backends.pallas import tiling
from moe_core import backend
from moe_core import ffn
from moe_core import validation

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _resolve_interpret(interpret):
  """None: interpret on the CPU; "debug": the bounds-checking interpreter."""
  if interpret is None:
    # The CPU has no Pallas lowering: run the same kernels interpreted there.
    return jax.default_backend() == "cpu"
  if interpret == "debug":
    # Imported here: only this debug mode needs the TPU interpreter.
    # pylint: disable-next=g-import-not-at-top
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()
  if isinstance(interpret, bool):
    return interpret
  if type(interpret).__name__ == "InterpretParams":
    return interpret
  raise ValueError(
      "interpret must be None (automatic), True, False, 'debug' "
      f"or a pltpu.InterpretParams, got {interpret!r}."
  )


class PallasBackend(backend.Backend):
  """Grouped GEMMs as Pallas kernels over a tile list; no host sync, no padding.

  Args:
    tiles: block sizes and Triton settings: None (the shape heuristic of
      `tiling.heuristic`), a `tiling.Tiles` for every kernel, a
      `tiling.TileConfig` (per kernel: fwd, dgrad, wgrad) or the dict form of
      either (`tiling.TileConfig.parse`).
    interpret: None runs the kernels interpreted on the CPU and compiled
      (Triton) on the GPU; True / False force it; "debug" uses the
      bounds-checking interpreter (slow: small shapes only).
    fuse_activation: compute act(gate) * up in the gate/up kernel's epilogue
      (for the activations in `ops.EPILOGUE_ACTIVATIONS`; others, such as the
      exact "gelu", run unfused). The gate and up outputs then exist only
      inside that op, so the "moe_gate"/"moe_up" checkpoint names are not
      emitted.
  """

  name: ClassVar[str] = "pallas"

  def __init__(
      self, *, tiles=None, interpret=None, fuse_activation: bool = False
  ):
    if not isinstance(fuse_activation, bool):
      raise TypeError(
          "fuse_activation must be a bool, got "
          f"{type(fuse_activation).__name__}."
      )
    self.launch = ops.Launch(
        tiles=tiling.TileConfig.parse(tiles),
        interpret=_resolve_interpret(interpret),
    )
    self.fuse_activation = fuse_activation

  @property
  def interpret(self):
    return self.launch.interpret

  def __repr__(self) -> str:
    return (
        f"PallasBackend(interpret={self.interpret!r}, "
        f"tiles={self.launch.tiles!r}, "
        f"fuse_activation={self.fuse_activation})"
    )

  def availability(self) -> tuple[bool, str]:
    if self.launch.interpreting:
      return True, ""
    platform = jax.default_backend()
    if platform == "gpu":
      return True, ""
    return False, (
        f"pallas: the kernels lower through Triton for GPUs only, "
        f"not {platform}; pass interpret=True to interpret them."
    )

  def _check_dtype(self, dtype):
    if jnp.dtype(dtype) not in _DTYPES:
      raise NotImplementedError(
          f"pallas: {jnp.dtype(dtype).name} operands are not supported "
          f"(supported: {[jnp.dtype(d).name for d in _DTYPES]})."
      )

  def _grouped_gemm(
      self, rows, weights, group_sizes, *, transpose_rhs, out_dtype
  ):
    self._check_dtype(rows.dtype)
    return ops.grouped_gemm(
        rows,
        weights,
        group_sizes,
        transpose_rhs,
        jnp.dtype(out_dtype),
        self.launch,
    )

  def expert_ffn(self, rows, group_sizes, params, cfg):
    """Gate and up in one kernel pass over the rows, then down.

    With `fuse_activation` (and an activation the epilogue supports) the
    activation runs in that kernel's epilogue; otherwise gate and up come
    out, named for checkpoint policies, and the activation runs in XLA.
    """
    validation.check_expert_ffn(rows, group_sizes, params, cfg)
    self._check_dtype(rows.dtype)
    w_gate, w_up, w_down = (
        params[n].astype(rows.dtype) for n in ("w_gate", "w_up", "w_down")
    )
    group_sizes = group_sizes.astype(jnp.int32)
    if self.fuse_activation and cfg.activation in ops.EPILOGUE_ACTIVATIONS:
      h = ops.gated_gate_up(
          rows, w_gate, w_up, group_sizes, cfg.activation, self.launch
      )
    else:
      gate, up = ops.gate_up(rows, w_gate, w_up, group_sizes, self.launch)
      gate = ad_checkpoint.checkpoint_name(gate, backend.GATE_NAME)
      up = ad_checkpoint.checkpoint_name(up, backend.UP_NAME)
      h = ffn.gated(gate, up, cfg.activation)
    out = self.grouped_gemm(h, w_down, group_sizes)
    return ad_checkpoint.checkpoint_name(out, backend.DOWN_NAME)
