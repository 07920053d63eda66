"""Ahead-of-time compiles for GPU topologies, from any host (`moe_core.aot`).

`gpu_topology(target, "SxHxG")` describes GPUs that need not be here,
`Topology.mesh` lays a mesh over them, and `compile` runs XLA's GPU
compiler on a program for them and reads back its memory, FLOPs, kernels
and collectives (`per_step_collective_bytes` and `per_step_matmul_flops`:
per execution, loops counted); `QUICK_OPTIONS` compiles quicker, for checks
that a program compiles and fits. Targets (`TARGETS`): H100 SXM and H200
(sm_90), B200 (sm_100). Needs the CUDA plugin of the installed jax version.
"""

from moe_core.aot.compile import CompiledProgram
from moe_core.aot.compile import QUICK_OPTIONS
from moe_core.aot.compile import collective_bytes
from moe_core.aot.compile import compile  # pylint: disable=redefined-builtin
from moe_core.aot.per_step import PerStep
from moe_core.aot.per_step import MatmulFlops
from moe_core.aot.per_step import per_step_collective_bytes
from moe_core.aot.per_step import per_step_matmul_flops
from moe_core.aot.targets import GpuTarget
from moe_core.aot.targets import TARGETS
from moe_core.aot.targets import target
from moe_core.aot.topology import Topology
from moe_core.aot.topology import cuda_plugin_installed
from moe_core.aot.topology import gpu_topology
from moe_core.aot.topology import parse_topology

__all__ = [
    "CompiledProgram",
    "GpuTarget",
    "MatmulFlops",
    "PerStep",
    "QUICK_OPTIONS",
    "TARGETS",
    "Topology",
    "collective_bytes",
    "compile",
    "cuda_plugin_installed",
    "gpu_topology",
    "parse_topology",
    "per_step_collective_bytes",
    "per_step_matmul_flops",
    "target",
]
