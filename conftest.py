"""pytest: list why tests were skipped (even without -rs); count warnings."""

import collections
import os
import sys

# Before any test module imports JAX: 8 CPU devices, so the expert-parallel
# tests run under plain pytest too (Bazel sets this per target instead).
if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=8"
  )
# And the quick CPU compile Bazel's CPU targets get (bazel/moe.bzl's
# QUICK_CPU_XLA_FLAGS: LLVM at -O0; compiling dominates the tests' time).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += (
      " --xla_backend_optimization_level=0"
      " --xla_llvm_disable_expensive_passes=true"
  )


# The platform the programs start on (`train.platforms`): the CPU where no
# accelerator is attached (the legs carry the CUDA plugin, to compile for
# GPUs, moe_core.aot, whose start-up check would otherwise fail loudly on
# every import of jax; Bazel's targets set it the same way), the TPU and then
# the CPU on a TPU host (the chip's tests, such as the flash attention's,
# ran on its host CPU and skipped before), JAX's choice on a GPU host.
# JAX_PLATFORMS, when set, wins.
from train import platforms as _platforms  # pylint: disable=g-import-not-at-top

_platforms.set_default_platforms()


def pytest_terminal_summary(terminalreporter):
  reasons = collections.Counter()
  for report in terminalreporter.stats.get("skipped", []):
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reasons[reason.removeprefix("Skipped: ")] += 1
  if reasons:
    terminalreporter.write_sep("-", "skip reasons")
    for reason, count in reasons.most_common():
      terminalreporter.write_line(f"{count} tests: {reason}")
  # jax >= 0.11 warns at every Pallas Triton lowering; the CUDA-lowering tests
  # swallow and count those warnings (moe_core/compat.py).
  compat = sys.modules.get("moe_core.compat")
  if compat is not None and compat.triton_deprecations_filtered():
    terminalreporter.write_line(
        "Pallas Triton deprecation warnings filtered: "
        f"{compat.triton_deprecations_filtered()}"
    )
