"""Every GPU program of bench/workloads/programs.py through XLA's GPU compiler.

CI's strongest check of GPU code, from a CPU host (bench/compile/ with
its gpu.py, `moe_core.aot`): each program of the table (every variant x
workload, forward and forward+backward, the expert-parallel layer on 8 and
64 GPUs) is compiled for H100 and for B200 at the workloads' CI sizes and must
compile, contain its backend's kernels (and the ragged all-to-all) and fit
the target's HBM. A program the table excepts is counted and listed with
its reason. CI compiles with `aot.QUICK_OPTIONS` (cuBLAS for XLA's own
GEMMs: the backends' kernels compile as under the defaults, at 0.3-0.8x the
time; bench/results/README.md compares the two). Each test compiles one
target's group of workloads in a child process of its own (Mosaic GPU
keeps the first target's arch for the whole process) and prints "gpu
compile: ... N of N compiled, plus K named exceptions", which .ci/run
repeats; the records go to Bazel's undeclared outputs as JSON. Where jax
has no CUDA plugin (the oldest leg) the compile tests skip with that
reason; the checks of the checks run everywhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax

from bench.compile import driver
from bench.compile import gpu
from bench.compile import record_checks
from bench.workloads import programs
from moe_core import aot

# A child process per target and group (each child's start, jax and the
# plugin, costs seconds of CPU; four tests balance the test's four shards).
GROUPS = {
    "layers": ("deepseek_v3", "mixtral_8x7b", "qwen3_30b_a3b"),
    "gemms_and_exchange": (
        "deepseek_v3_gemm",
        "small_k",
        "deepseek_v3_ep8",
        "deepseek_v3_ep64",
    ),
}


# What this run compiles: the targets (comma-separated, or "none") and the
# passes (programs.MODES: "fwd", "fwd_bwd"); each defaults to every one.
# .ci/run compiles both targets' forward+backward programs on the GPU
# machine's jax (py312) and none on the newest leg: a forward+backward
# program holds its forward kernels and needs at least its memory, and two
# legs of every program cost CI about 12 minutes it does not have.
TARGETS_ENV = "DROPLESS_GPU_COMPILE_TARGETS"
PASSES_ENV = "DROPLESS_GPU_COMPILE_PASSES"


def _selected(env: str, choices: tuple[str, ...]) -> tuple[str, ...]:
  """The `choices` that variable `env` names, in their order."""
  given = os.environ.get(env, "")
  if not given.strip():
    return choices
  if given.strip() == "none":
    return ()
  names = [n.strip() for n in given.split(",") if n.strip()]
  unknown = [n for n in names if n not in choices]
  if unknown:
    raise ValueError(
        f'{env}={given!r}: expected "none" or names from '
        f"{list(choices)}, got {unknown}"
    )
  return tuple(c for c in choices if c in names)


def selected_targets() -> tuple[str, ...]:
  """The targets TARGETS_ENV names, in gpu.DEFAULT_TARGETS' order."""
  return _selected(TARGETS_ENV, gpu.DEFAULT_TARGETS)


def selected_passes() -> tuple[str, ...]:
  """The passes PASSES_ENV names, in programs.MODES' order."""
  return _selected(PASSES_ENV, programs.MODES)


def _program(name: str) -> programs.Program:
  (found,) = programs.select(name)
  return found


class CompileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    record_checks.skip_without(
        self,
        aot.cuda_plugin_installed(),
        "compiling for GPUs needs jax's CUDA plugin (jax-cuda13-plugin, "
        "jax-cuda13-pjrt), which this leg does not install",
    )

  def _check(self, label: str, target: str, patterns: str):
    table = programs.select(patterns)
    records, output = driver.compile_apart(
        "gpu", target, patterns, quiet=True, options="quick"
    )
    lines = output.splitlines()
    print("\n".join(l for l in lines if l.startswith(("ok", "FAIL"))))
    if records is None:
      raise AssertionError(f"no records; its output:\n{output[-4000:]}")
    for workload in dict.fromkeys(r["workload"] for r in records):
      mine = [r for r in records if r["workload"] == workload]
      print(
          f"gpu compile: {workload} ({label}) for {target}, jax "
          f"{jax.__version__}: "
          + driver.summary(mine).replace("\n", "\ngpu compile: ")
      )
    record_checks.keep(records, f"gpu_compile_{target}_{label}")
    record_checks.assert_compiled(self, records, [p.name for p in table])
    for r in records:
      self.assertEqual(r["xla_options"], "quick", r["program"])

  @parameterized.named_parameters(
      (f"{target}_{group}", target, group)
      for target in gpu.DEFAULT_TARGETS
      for group in GROUPS
  )
  def test_every_program_compiles(self, target, group):
    if target not in selected_targets():
      why = f"{TARGETS_ENV}={os.environ[TARGETS_ENV]!r} leaves out {target}"
      print(f"skipped: {why}")
      self.skipTest(why)
    patterns = ",".join(
        f"{workload}/*/{compiled}"
        for workload in GROUPS[group]
        for compiled in selected_passes()
    )
    if not patterns:
      self.skipTest(f"{PASSES_ENV} selects no pass")
    self._check(group, target, patterns)


class CheckTest(absltest.TestCase):
  """What the compile test asserts, on stand-ins of compiled programs."""

  def test_targets_env_selects_and_refuses(self):
    with mock.patch.dict(os.environ, {TARGETS_ENV: "b200"}):
      self.assertEqual(selected_targets(), ("b200",))
    with mock.patch.dict(os.environ, {TARGETS_ENV: " b200, h100 "}):
      self.assertEqual(selected_targets(), ("h100", "b200"))
    with mock.patch.dict(os.environ, {TARGETS_ENV: ""}):
      self.assertEqual(selected_targets(), gpu.DEFAULT_TARGETS)
    with mock.patch.dict(os.environ, {TARGETS_ENV: "none"}):
      self.assertEqual(selected_targets(), ())
    with mock.patch.dict(os.environ, {TARGETS_ENV: "h800"}):
      with self.assertRaisesRegex(ValueError, "DROPLESS_GPU_COMPILE_TARGETS"):
        selected_targets()
    with mock.patch.dict(os.environ, {PASSES_ENV: "fwd_bwd"}):
      self.assertEqual(selected_passes(), ("fwd_bwd",))
    with mock.patch.dict(os.environ, {PASSES_ENV: "bwd"}):
      with self.assertRaisesRegex(ValueError, "DROPLESS_GPU_COMPILE_PASSES"):
        selected_passes()

  def test_every_program_name_ends_in_its_pass(self):
    # The passes filter matches a program's name, not its mode.
    for program in programs.programs():
      self.assertEqual(program.name.rsplit("/", 1)[1], program.mode)

  def test_the_groups_hold_every_workload_once(self):
    grouped = [w for group in GROUPS.values() for w in group]
    self.assertCountEqual(grouped, [w.name for w in programs.WORKLOADS])

  def test_a_fallback_to_xla_ops_is_caught(self):
    program = _program("deepseek_v3/mosaic_gpu/fwd_bwd")
    only_triton = types.SimpleNamespace(
        custom_calls={programs.TRITON_CALL: 2}, collective_bytes={}
    )
    self.assertEqual(gpu.missing(program, only_triton), [programs.MOSAIC_CALL])
    both = types.SimpleNamespace(
        custom_calls={programs.TRITON_CALL: 2, programs.MOSAIC_CALL: 4},
        collective_bytes={},
    )
    self.assertEmpty(gpu.missing(program, both))

  def test_an_exchange_without_its_collective_is_caught(self):
    program = _program("deepseek_v3_ep64/pallas/fwd")
    dense = types.SimpleNamespace(
        custom_calls={programs.TRITON_CALL: 2},
        collective_bytes={"all-to-all": 1024},
    )
    self.assertEqual(gpu.missing(program, dense), [programs.RAGGED_ALL_TO_ALL])

  def test_a_second_target_in_one_process_is_refused(self):
    program = _program("small_k/pallas/fwd")
    with mock.patch.object(gpu, "_PROCESS_TARGET", ["h100"]):
      record = driver.compile_one(gpu, program, "b200", "ci", {})
    self.assertEqual(record["status"], "failed")
    self.assertIn("this process compiled for h100", record["error"])

  def test_every_exception_names_programs(self):
    """A row of EXCEPTIONS that matches nothing is stale: delete it."""
    for pattern in programs.EXCEPTIONS:
      matched = [
          p.name
          for p in programs.programs()
          for t in gpu.DEFAULT_TARGETS
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
        driver.summary(records),
        "2 of 3 programs compiled, plus 1 named exceptions\n  1: no TE",
    )


class CommandLineTest(absltest.TestCase):
  """main's usage errors and where its records go; nothing compiles (`run`
  and the child processes are stand-ins recording one exception a target)."""

  def setUp(self):
    super().setUp()
    self.repo = self.enter_context(tempfile.TemporaryDirectory())
    self.tmp = self.enter_context(tempfile.TemporaryDirectory())
    self.enter_context(mock.patch.object(driver, "_REPO", self.repo))
    self.enter_context(mock.patch.object(tempfile, "tempdir", self.tmp))
    self.enter_context(
        mock.patch.object(
            driver,
            "run",
            side_effect=lambda _, targets, *__: [self._record(targets[0])],
        )
    )
    self.enter_context(
        mock.patch.object(
            driver,
            "compile_apart",
            side_effect=lambda _, target, *__, **___: (
                [self._record(target)],
                "",
            ),
        )
    )
    self.committed = os.path.join(
        self.repo, "bench", "results", f"gpu_compile_{jax.__version__}.json"
    )

  def _record(self, target):
    return {"program": "p", "target": target, "status": "exception",
            "reason": "-"}  # fmt: skip

  def _usage_error(self, *argv) -> str:
    """stderr of main(argv), which must exit with status 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
      driver.main(["--platform=gpu", *argv])
    self.assertEqual(e.exception.code, 2)
    return err.getvalue()

  def test_bad_options_are_usage_errors_naming_them(self):
    valid = ", ".join(aot.GPU_TARGETS)
    for targets in ("v5e", "", "h100,h800"):
      with self.subTest(targets=targets):
        self.assertRegex(
            self._usage_error(f"--targets={targets}"),
            f"argument --targets: takes a comma-separated list of {valid}; "
            f"got '{targets}'",
        )
    for shard in ("1", "4/4", "a/b"):
      with self.subTest(shard=shard):
        self.assertRegex(
            self._usage_error(f"--shard={shard}"),
            rf"argument --shard: takes I/N with 0 <= I < N .*got '{shard}'",
        )
    self.assertIn(
        "argument --programs: no program matches",
        self._usage_error("--programs=no_such_workload/*"),
    )

  def test_a_partial_run_leaves_the_committed_records_alone(self):
    with contextlib.redirect_stdout(io.StringIO()) as out:
      self.assertEqual(driver.main(["--platform=gpu", "--targets=h100"]), 0)
    self.assertFalse(os.path.exists(self.committed))
    path = out.getvalue().rsplit("wrote ", 1)[1].strip()
    self.assertTrue(path.startswith(self.tmp), path)

  def test_the_full_default_run_writes_the_committed_records(self):
    with contextlib.redirect_stdout(io.StringIO()):
      self.assertEqual(driver.main(["--platform=gpu"]), 0)
    with open(self.committed) as f:
      targets = [r["target"] for r in json.load(f)["programs"]]
    self.assertEqual(targets, list(gpu.DEFAULT_TARGETS))


if __name__ == "__main__":
  absltest.main()
