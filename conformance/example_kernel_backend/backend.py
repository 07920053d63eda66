"""ExampleKernelBackend: a backend that is its kernels and a tile table.

A template: copy this folder, rename the class and `name`, and replace
kernels.py's two kernels (and tiles.py's table) by yours. The grouped GEMM,
its gradients and everything built on it (dispatch, the expert FFN,
combine, the routed block) come from `GroupedKernelsBackend` and
`moe_core.Backend`.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_core.kernels import interpret as interpret_lib
from moe_core.kernels import kernels_backend

from . import kernels
from . import tiles


class ExampleKernelBackend(kernels_backend.GroupedKernelsBackend):
  """Pallas gmm and tgmm: lowered on a GPU, interpreted elsewhere."""

  # The registry name, as in moe_core/registry.py's table.
  name = "example_kernel"
  # The operand dtypes the kernels take; others raise NotImplementedError
  # before they run, so "auto" tries the next backend.
  dtypes = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

  def availability(self) -> tuple[bool, str]:
    # Off a GPU the kernels run in Pallas' interpreter: slow but everywhere.
    # A backend for one platform says why not elsewhere instead.
    return True, ""

  def grouped_kernels(self) -> kernels.ExampleKernels:
    return kernels.ExampleKernels(
        table=tiles.TileTable(),
        # No Pallas lowering off the GPU: interpret the same kernels there.
        # Asked when the GEMM is traced, so a program compiled ahead of time
        # for a GPU from a CPU (`moe_core.aot`) gets the compiled kernels.
        interpret=interpret_lib.interprets(interpret_lib.AUTO),
    )
