"""Ahead-of-time compiles for GPU and TPU topologies, from any host.

`gpu_topology(target, "SxHxG")` describes GPUs that need not be here,
`tpu_topology(target, "AxB[xC][/S]")` TPUs (`named_topology("v5e:2x2")`
either), `Topology.mesh` lays a mesh over them, and `compile` runs XLA's
GPU or TPU compiler on a program for them and reads back its memory,
FLOPs, kernels (Mosaic TPU kernels by name: `tpu_kernels`) and
collectives (`per_step_collective_bytes` and `per_step_matmul_flops`: per
execution, loops counted); `QUICK_OPTIONS` compiles GPU programs quicker,
for checks that a program compiles and fits. Targets (`TARGETS`): H100 SXM
and H200 (sm_90), B200 (sm_100) (`GPU_TARGETS`); TPU v5e, v6e, v5p and
tpu7x (`TPU_TARGETS`). GPUs need the CUDA plugin of the installed jax
version, TPUs its libtpu (`cuda_plugin_installed`, `libtpu_installed`).
"""

from moe_core.aot.compile import CompiledProgram
from moe_core.aot.compile import HbmOomError
from moe_core.aot.compile import QUICK_OPTIONS
from moe_core.aot.compile import collective_bytes
from moe_core.aot.compile import compile  # pylint: disable=redefined-builtin
from moe_core.aot.compile import tpu_kernels
from moe_core.aot.per_step import PerStep
from moe_core.aot.per_step import MatmulFlops
from moe_core.aot.per_step import per_step_collective_bytes
from moe_core.aot.per_step import per_step_matmul_flops
from moe_core.aot.targets import GPU_TARGETS
from moe_core.aot.targets import GpuTarget
from moe_core.aot.targets import TARGETS
from moe_core.aot.targets import TPU_TARGETS
from moe_core.aot.targets import TpuTarget
from moe_core.aot.targets import is_tpu
from moe_core.aot.targets import target
from moe_core.aot.topology import Topology
from moe_core.aot.topology import TpuTopology
from moe_core.aot.topology import cuda_plugin_installed
from moe_core.aot.topology import gpu_topology
from moe_core.aot.topology import libtpu_installed
from moe_core.aot.topology import named_topology
from moe_core.aot.topology import num_devices
from moe_core.aot.topology import parse_topology
from moe_core.aot.topology import parse_tpu_topology
from moe_core.aot.topology import tpu_topology

__all__ = [
    "CompiledProgram",
    "GPU_TARGETS",
    "GpuTarget",
    "HbmOomError",
    "MatmulFlops",
    "PerStep",
    "QUICK_OPTIONS",
    "TARGETS",
    "TPU_TARGETS",
    "Topology",
    "TpuTarget",
    "TpuTopology",
    "collective_bytes",
    "compile",
    "cuda_plugin_installed",
    "gpu_topology",
    "is_tpu",
    "libtpu_installed",
    "named_topology",
    "num_devices",
    "parse_topology",
    "parse_tpu_topology",
    "per_step_collective_bytes",
    "per_step_matmul_flops",
    "target",
    "tpu_kernels",
    "tpu_topology",
]
