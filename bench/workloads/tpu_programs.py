"""The TPU programs: backend variant x workload x (fwd | fwd_bwd) x target.

The same workloads as the GPU table (`bench.workloads.programs`), on TPU v5e,
v6e, v5p and tpu7x: each model's layer and grouped GEMMs on one chip, and the
expert-parallel layer over several chips of one slice, a pod-sized slice, and
two slices. Variants: the TPU kernel backend (`mosaic_tpu`, whose pallas_calls
are named `dropless_tpu_*`) and `xla` (lax.ragged_dot, which XLA's TPU compiler
also turns into Mosaic kernels of its own: kernels are told apart by name, not
by call target). A program that cannot be compiled here is an exception with its
reason (`exception`).
"""

from __future__ import annotations

import fnmatch
import importlib.util

from bench.workloads import programs as programs_lib
from moe_core import aot
from moe_core import registry

TARGETS = ("v5e", "v6e", "v5p", "tpu7x")
# The kernel backend's pallas_calls are named with this prefix.
KERNEL_PREFIX = "dropless_tpu_"
GMM = KERNEL_PREFIX + "gmm"  # [M, K] x [E, K, N]: forward, and dX.
TGMM = KERNEL_PREFIX + "tgmm"  # dW: per group, rows^T x cotangent.
# backend -> mode -> names of Mosaic kernels its executable must contain
# (a prefix of one each): without them it fell back to XLA's own ops.
# xla has none of its own (XLA's ragged_dot kernels are XLA's).
KERNELS: dict[str, dict[str, tuple[str, ...]]] = {
    "mosaic_tpu": {"fwd": (GMM,), "fwd_bwd": (GMM, TGMM)},
    "xla": {"fwd": (), "fwd_bwd": ()},
}
BACKENDS = ("mosaic_tpu", "xla")

# The expert-parallel workloads' chips per target: a host's worth (8
# devices), a pod's slice (64), and two slices of 8 over the data-centre
# network ("/2"). tpu7x has two devices a chip.
EP_TOPOLOGIES: dict[str, dict[str, str]] = {
    "deepseek_v3_ep8": {
        "v5e": "2x4",
        "v6e": "2x4",
        "v5p": "2x2x2",
        "tpu7x": "2x2x1",
    },
    "deepseek_v3_ep64": {
        "v5e": "8x8",
        "v6e": "8x8",
        "v5p": "4x4x4",
        "tpu7x": "4x4x2",
    },
    "deepseek_v3_ep16_2slices": {
        "v5e": "2x4/2",
        "v6e": "2x4/2",
        "v5p": "2x2x2/2",
        "tpu7x": "2x2x1/2",
    },
}
ONE_CHIP = {"v5e": "1x1", "v6e": "1x1", "v5p": "1x1x1", "tpu7x": "1x1x1"}

# Every GPU workload, and two slices of 8 devices each (16 experts a
# device: the exchange crosses slices over DCN, where XLA splits it).
WORKLOADS = programs_lib.WORKLOADS + (
    programs_lib.Workload(
        "deepseek_v3_ep16_2slices",
        "deepseek_v3",
        "ep_layer",
        programs_lib.DSV3,
        programs_lib.Size(64, 512, 128),
        "2x1x8",
    ),
)

# Programs that are not compiled, and why: fnmatch pattern over
# "<target>/<workload>/<variant>/<mode>" -> reason. Delete a row when what
# it names is fixed.
EXCEPTIONS: dict[str, str] = {
    "v5e/deepseek_v3_ep64/*/*": (
        "XLA's TPU compiler has no ragged all-to-all on a v5e slice of more "
        "than 16 chips (RET_CHECK 'Ragged all-to-all is currently not "
        "supported in limited ICI routing setting', libtpu 0.0.50; 4x4 "
        "compiles, 4x8, 8x8 and 16x16 do not): the expert-parallel layer's "
        "ragged exchange does not compile there"
    ),
}

# What CI compiles (bench/compile/tpu_compile_test.py), fnmatch patterns over
# "<target>/<workload>/<variant>/<mode>": every TPU kernel program on one
# chip of every generation, where tiles meet each generation's VMEM; the
# grouped GEMM and a layer on XLA's own kernels; and one expert-parallel
# layer forward a generation, over the shapes of the table (a host's 8,
# a 64-device slice, two slices). The whole table (`python -m
# bench.compile.driver --platform=tpu`, about 10 minutes here) is run by
# hand and its records kept in bench/results/.
CI = (
    "*/deepseek_v3/mosaic_tpu*/*",
    "*/mixtral_8x7b/mosaic_tpu*/*",
    "*/qwen3_30b_a3b/mosaic_tpu*/*",
    "*/deepseek_v3_gemm/mosaic_tpu*/*",
    "*/small_k/mosaic_tpu*/*",
    "*/deepseek_v3_gemm/xla/fwd_bwd",
    "*/qwen3_30b_a3b/xla/fwd_bwd",
    "v5e/deepseek_v3_ep16_2slices/*/fwd",
    "v6e/deepseek_v3_ep64/*/fwd",
    "v5p/deepseek_v3_ep8/*/fwd",
    "tpu7x/deepseek_v3_ep8/*/fwd",
)


def in_ci(target: str, program: programs_lib.Program) -> bool:
  """Whether CI compiles `program` for `target` (`CI`)."""
  key = f"{target}/{program.name}"
  return any(fnmatch.fnmatchcase(key, pattern) for pattern in CI)


def topology(target: str, workload: programs_lib.Workload) -> str:
  """The chips `workload` compiles for on `target` ("2x4", "2x2x1/2")."""
  if workload.kind != "ep_layer":
    return ONE_CHIP[target]
  return EP_TOPOLOGIES[workload.name][target]


def _unavailable(backend: str) -> str | None:
  """Why `backend` cannot build here, or None."""
  if backend not in registry.registered_backends():
    return (
        f"backend {backend!r} is not registered in this tree (the Mosaic "
        "TPU kernel backend, backends/mosaic_tpu/, is being written)"
    )
  target = registry._REGISTRY[backend]  # pylint: disable=protected-access
  if isinstance(target, str):
    module = target.partition(":")[0]
    try:
      found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
      found = False
    if not found:
      return f"backend {backend!r}: {module} is not importable here"
  return None


def exception(target: str, program: programs_lib.Program) -> str | None:
  """Why `program` is not compiled for `target`, or None."""
  reason = _unavailable(program.variant.backend)
  if reason is not None:
    return reason
  key = f"{target}/{program.name}"
  for pattern, why in EXCEPTIONS.items():
    if fnmatch.fnmatchcase(key, pattern):
      return why
  return None


def variants() -> tuple[programs_lib.Variant, ...]:
  """Each TPU backend's default variant and its quantised recipes' GEMMs."""
  found = []
  for name in BACKENDS:
    found.append(programs_lib.Variant(name, name))
    if _unavailable(name) is None:
      found += [
          programs_lib.Variant(
              f"{name}_{r}", name, precision=r, kinds=("gemm",), modes=("fwd",)
          )
          for r in programs_lib._recipes(name)  # pylint: disable=protected-access
      ]
  return tuple(found)


def programs() -> tuple[programs_lib.Program, ...]:
  """Every TPU program, workload by workload (the same for each target)."""
  return programs_lib.programs(workloads=WORKLOADS, table=variants())


def select(patterns: str) -> tuple[programs_lib.Program, ...]:
  """The TPU programs matching comma-separated fnmatch `patterns`."""
  return programs_lib.select(patterns, programs())


def kernels(program: programs_lib.Program) -> tuple[str, ...]:
  """Mosaic kernel names (prefixes) `program`'s executable must contain."""
  return KERNELS.get(program.variant.backend, {}).get(program.mode, ())


def num_devices(target: str, workload: programs_lib.Workload) -> int:
  return aot.num_devices(target, topology(target, workload))
