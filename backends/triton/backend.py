"""TritonBackend: raw Triton kernels over a tile list, through jax-triton."""

from __future__ import annotations

import types
from typing import ClassVar

import jax.numpy as jnp

from backends.triton import configs as configs_lib
from backends.triton import launch
from backends.triton import ops
from moe_core.kernels import interpret as interpret_lib
from moe_core.kernels import tile_backend

# The backend's `interpret` option (`moe_core.kernels.interpret`): True is
# Triton's interpreter; its setting, the runner's mode.
INTERPRETER = interpret_lib.Interpreter()
_MODES = {interpret_lib.AUTO: "auto", False: "gpu", True: "interpret"}


class TritonBackend(tile_backend.PermutingTileBackend):
  """Grouped GEMMs and the permutation as raw Triton kernels; no host sync.

  Forward and dX run one tile-list gmm kernel, dW a tgmm kernel looping over
  each group's rows; dispatch and combine are gather kernels
  (`permute_kernels`). On NVIDIA GPUs the kernels go through jax-triton; in
  the interpreter every kernel runs in Triton's, on the CPU.

  Args:
    configs: tile sizes and launch settings: None (the table of
      `configs.TABLE` with its heuristic fallback), a `configs.Config` for
      every kernel, or a dict kind -> Config (see `configs.choose`).
    interpret: None: auto, compiled when the program is lowered for a GPU
      (a GPU here, or `moe_core.aot`'s target from any host), interpreted
      otherwise; True: the backend's interpreter, on any platform; False:
      compiled for a GPU, unavailable elsewhere
      (`moe_core.kernels.interpret`). Here True is Triton's interpreter,
      every kernel through a host callback on torch CPU tensors (slow, for
      tests at small shapes; needs torch and triton). Default False: off a
      GPU the backend says to pass interpret=True rather than run that
      slowly (or fail for want of torch) unasked.
    fuse_activation: compute the gated activation (clamp and options
      included) in the gated kernel's epilogue (every activation of
      `ops.GATED_ACTIVATIONS`, without biases); gate and up then exist
      only inside that op, so only the "moe_down" checkpoint name is emitted
      (`checkpoint_names`), as for pallas. Off by default, as for pallas
      and mosaic_gpu: opt-in until a GPU measurement shows it faster.
    generation: "sm90" or "sm100", the config table's rows; None picks by
      the first device's compute capability ("sm90" off a GPU).
    fuse_routing_weights: in `routed_experts`, multiply each row by its
      combine weight in the down GEMM's epilogue and un-permute with unit
      weights (the template's `_routing_weights_in_down`; dropless configs
      with the "unquantized" precision; others run the unfused path).
  """

  name: ClassVar[str] = "triton"
  ops: ClassVar[types.ModuleType] = ops
  # Its fused kernel recomputes gate and up for the derivative
  # (`keeps_inputs` False): the op has no residuals to name.
  fused_checkpoint_names: ClassVar[tuple[str, ...]] = ()
  dtypes: ClassVar[tuple[jnp.dtype, ...]] = tuple(
      jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)
  )

  def __init__(
      self,
      *,
      configs=None,
      interpret: bool | None = False,
      fuse_activation: bool = False,
      generation: str | None = None,
      fuse_routing_weights: bool = False,
  ):
    setting = INTERPRETER.parse(interpret)
    tile_backend.check_bool_options(
        fuse_activation=fuse_activation,
        fuse_routing_weights=fuse_routing_weights,
    )
    if generation is None:
      generation = configs_lib.generation() or "sm90"
    self.runner = launch.Runner(
        mode=_MODES[setting],
        configs=configs,
        generation=generation,
    )
    self.fuse_activation = fuse_activation
    self.fuse_routing_weights = fuse_routing_weights
    self.permutation_kernels = ops.TritonPermutationKernels(self.runner)

  @property
  def interpret(self) -> bool:
    """Whether the kernels traced now run in the interpreter: auto (None)
    resolved (`moe_core.kernels.interpret`)."""
    return self.runner.interpreting

  def __repr__(self) -> str:
    # interpret as given: None for auto.
    given = {v: k for k, v in _MODES.items()}[self.runner.mode]
    return (
        f"TritonBackend(interpret={given}, "
        f"configs={self.runner.configs!r}, "
        f"fuse_activation={self.fuse_activation}, "
        f"generation={self.runner.generation!r}, "
        f"fuse_routing_weights={self.fuse_routing_weights})"
    )

  def availability(self) -> tuple[bool, str]:
    return launch.availability(self.runner)

  @property
  def launch(self) -> launch.Runner:
    """The runner, which every `ops` function takes last."""
    return self.runner

  # --- Dispatch, combine and the routing weights in the down GEMM ----------
  # `PermutingTileBackend`'s, on the permute kernels (`permute_kernels`);
  # rows of a dtype they do not take go through the XLA gather and combine
  # and the plain down GEMM.

  def _permutes(self, dtype) -> bool:
    """Whether the permute kernels take `dtype` (else the XLA gather)."""
    return jnp.dtype(dtype) in self.dtypes
