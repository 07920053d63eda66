"""Every GPU program of bench/programs.py through XLA's GPU compiler.

CI's strongest check of GPU code, from a CPU host (`bench.gpu_compile`,
`moe_core.aot`): each program of the table (every variant x workload,
forward and forward+backward, the expert-parallel layer on 8 and 64 GPUs)
is compiled for an H100 or a B200 (`leg_target`: each target on one of
the two legs with the plugin) at the workloads' CI sizes, and must compile,
contain its backend's kernels (and the ragged all-to-all) and fit the
target's HBM. A program the table excepts is counted and listed with its
reason. One test per workload (Bazel shards them); each prints its "N of
N compiled" line, and its records go to Bazel's undeclared outputs as
JSON. Where jax has no CUDA plugin (the oldest leg)
the compile tests skip with that reason; the checks of the checks run
everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax

from bench import gpu_compile
from bench import programs


def _plugin_missing() -> str | None:
  """Why this leg cannot compile for a GPU, or None."""
  try:
    if importlib.util.find_spec("jax_plugins.xla_cuda13") is not None:
      return None
  except ModuleNotFoundError:  # No jax_plugins package at all.
    pass
  return (
      "compiling for GPUs needs jax's CUDA plugin (jax-cuda13-plugin, "
      "jax-cuda13-pjrt), which this leg does not install"
  )


def _program(name: str) -> programs.Program:
  (found,) = programs.select(name)
  return found


# One target a process (bench/gpu_compile.py: Mosaic GPU keeps the first
# target's arch), and compiling every program twice would cost two legs'
# CPU: each leg compiles every program for one target, B200 on the newest
# leg (jax >= 0.12), H100 on the GPU machine's (jax 0.11.2, an H200 is
# Hopper too). DROPLESS_GPU_COMPILE_TARGET=h100|b200|h200 picks another.
TARGET_ENV = "DROPLESS_GPU_COMPILE_TARGET"


def leg_target() -> str:
  """The target this leg compiles for."""
  if os.environ.get(TARGET_ENV):
    return os.environ[TARGET_ENV]
  newest = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 12)
  return "b200" if newest else "h100"


class CompileTest(parameterized.TestCase):

  @parameterized.named_parameters(
      *((w.name, w.name) for w in programs.WORKLOADS)
  )
  def test_every_program_compiles_with_its_kernels(self, workload):
    why = _plugin_missing()
    if why:
      print(f"skipped: {why}")
      self.skipTest(why)
    table = tuple(p for p in programs.programs() if p.workload.name == workload)
    target = leg_target()
    records = gpu_compile.run((target,), "ci", table)
    print(
        f"{workload} for {target}, jax {jax.__version__}: "
        + gpu_compile.summary(records)
    )
    out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
    if out_dir:
      seconds = sum(r.get("compile_seconds", 0) for r in records)
      path = os.path.join(out_dir, f"gpu_compile_{target}_{workload}.json")
      gpu_compile.write(path, records, seconds)
    self.assertEqual([r["program"] for r in records], [p.name for p in table])
    failed = [gpu_compile.line(r) for r in records if r["status"] == "failed"]
    self.assertEmpty(failed)
    for r in records:
      if r["status"] == "ok":
        self.assertTrue(r["fits"], r["program"])
        self.assertGreater(r["peak_bytes"], 0, r["program"])


class CheckTest(absltest.TestCase):
  """What the compile test asserts, on stand-ins of compiled programs."""

  def test_a_fallback_to_xla_ops_is_caught(self):
    program = _program("deepseek_v3/mosaic_gpu/fwd_bwd")
    only_triton = types.SimpleNamespace(
        custom_calls={programs.TRITON_CALL: 2}, collective_bytes={}
    )
    self.assertEqual(
        gpu_compile.missing(program, only_triton), [programs.MOSAIC_CALL]
    )
    both = types.SimpleNamespace(
        custom_calls={programs.TRITON_CALL: 2, programs.MOSAIC_CALL: 4},
        collective_bytes={},
    )
    self.assertEmpty(gpu_compile.missing(program, both))

  def test_an_exchange_without_its_collective_is_caught(self):
    program = _program("deepseek_v3_ep64/pallas/fwd")
    dense = types.SimpleNamespace(
        custom_calls={programs.TRITON_CALL: 2},
        collective_bytes={"all-to-all": 1024},
    )
    self.assertEqual(
        gpu_compile.missing(program, dense), [programs.RAGGED_ALL_TO_ALL]
    )

  def test_a_second_target_in_one_process_is_refused(self):
    program = _program("small_k/pallas/fwd")
    with mock.patch.object(gpu_compile, "_PROCESS_TARGET", ["h100"]):
      record = gpu_compile.compile_one(program, "b200", "ci", {})
    self.assertEqual(record["status"], "failed")
    self.assertIn("this process compiled for h100", record["error"])

  def test_every_exception_names_programs(self):
    """A row of EXCEPTIONS that matches nothing is stale: delete it."""
    for pattern in programs.EXCEPTIONS:
      matched = [
          p.name
          for p in programs.programs()
          for t in gpu_compile.TARGETS
          if programs.exception(t, p) == programs.EXCEPTIONS[pattern]
      ]
      self.assertNotEmpty(matched, pattern)

  def test_summary_counts_compiled_failed_and_excepted(self):
    records = [
        {"status": "ok"},
        {"status": "ok"},
        {"status": "failed", "error": "x"},
        {"status": "exception", "reason": "no TE"},
    ]
    self.assertEqual(
        gpu_compile.summary(records),
        "2 of 3 programs compiled, plus 1 named exceptions\n  1: no TE",
    )


if __name__ == "__main__":
  absltest.main()
