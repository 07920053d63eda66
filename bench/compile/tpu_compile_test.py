"""TPU programs of bench/workloads/tpu_programs.py through XLA's TPU compiler.

CI's check of TPU code from a CPU host (bench/compile/ with its tpu.py,
`moe_core.aot`, libtpu): for each of v5e, v6e, v5p and tpu7x, CI's
selection of the table (`tpu_programs.CI`: every TPU kernel program on one
chip, XLA's grouped GEMM and a layer, one expert-parallel layer) must
compile (a kernel over the generation's VMEM or a program over its HBM
fails there), hold the `dropless_tpu_*` kernels its backend promises by
name and, expert-parallel, the ragged all-to-all, and fit. A program the
table excepts is counted and listed with its reason: while the TPU kernel
backend is not in the tree its programs are such exceptions. Each test
prints "tpu compile: <target>: N of N compiled, plus K named exceptions",
which .ci/run repeats; the records go to Bazel's undeclared outputs as
JSON. Where the leg has no libtpu the compile tests skip with that reason;
the checks of the checks run everywhere.
"""

from __future__ import annotations

import contextlib
import fnmatch
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
from bench.compile import record_checks
from bench.compile import tpu
from bench.compile import tpu_memory
from bench.workloads import programs
from bench.workloads import tpu_programs
from moe_core import aot
from moe_core import registry


def _program(name: str) -> programs.Program:
  (found,) = tpu_programs.select(name)
  return found


class CompileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    record_checks.skip_without(
        self,
        aot.libtpu_installed(),
        "compiling for TPUs needs libtpu (jax's `tpu` extra), which this "
        "leg does not install",
    )

  @parameterized.parameters(*tpu_programs.TARGETS)
  def test_ci_programs_compile(self, target):
    records = driver.run(tpu, [target], ci_only=True)
    print(
        f"tpu compile: {target}, jax {jax.__version__}: "
        + driver.summary(records).replace("\n", "\ntpu compile: ")
    )
    record_checks.keep(records, f"tpu_compile_{target}")
    expected = [
        p.name for p in tpu_programs.programs() if tpu_programs.in_ci(target, p)
    ]
    record_checks.assert_compiled(self, records, expected)
    for r in records:
      if r["status"] == "ok":
        self.assertLessEqual(r["kernel_vmem_bytes"], r["vmem_bytes"])


class CheckTest(parameterized.TestCase):
  """What the compile test asserts, on stand-ins of compiled programs."""

  def test_xla_ragged_dot_kernels_are_not_ours(self):
    program = _program("deepseek_v3/mosaic_tpu/fwd_bwd")
    xla_only = types.SimpleNamespace(
        tpu_kernels={"ragged-dot-none": 9, "ragged-dot-metadata": 2},
        collective_bytes={},
    )
    self.assertEqual(
        tpu.missing(program, xla_only),
        [tpu_programs.GMM, tpu_programs.TGMM],
    )
    ours = types.SimpleNamespace(
        tpu_kernels={"dropless_tpu_gmm": 3, "dropless_tpu_tgmm": 3},
        collective_bytes={},
    )
    self.assertEmpty(tpu.missing(program, ours))

  def test_an_exchange_without_its_collective_is_caught(self):
    program = _program("deepseek_v3_ep8/xla/fwd")
    dense = types.SimpleNamespace(
        tpu_kernels={}, collective_bytes={"all-to-all": 1024}
    )
    self.assertEqual(
        tpu.missing(program, dense),
        [programs.RAGGED_ALL_TO_ALL],
    )

  @parameterized.parameters(*tpu_programs.TARGETS)
  def test_each_workload_has_its_devices_on_every_target(self, target):
    for workload in tpu_programs.WORKLOADS:
      if workload.kind != "ep_layer":
        continue  # One device of one chip (tpu7x's chip has two).
      self.assertEqual(
          tpu_programs.num_devices(target, workload),
          workload.num_devices,
          f"{target} {workload.name}",
      )

  def test_ci_compiles_every_kernel_program_and_every_exchange_shape(self):
    table = tpu_programs.programs()
    for target in tpu_programs.TARGETS:
      for p in table:
        if p.variant.backend == "mosaic_tpu" and p.workload.kind != "ep_layer":
          self.assertTrue(tpu_programs.in_ci(target, p), f"{target} {p.name}")
    exchanges = {
        p.workload.name
        for t in tpu_programs.TARGETS
        for p in table
        if p.workload.kind == "ep_layer" and tpu_programs.in_ci(t, p)
    }
    self.assertEqual(
        exchanges,
        {w.name for w in tpu_programs.WORKLOADS if w.kind == "ep_layer"},
    )

  def test_every_exception_and_ci_pattern_names_programs(self):
    """A row that matches nothing is stale: delete it."""
    table = tpu_programs.programs()
    keys = [f"{t}/{p.name}" for p in table for t in tpu_programs.TARGETS]
    for pattern in (*tpu_programs.EXCEPTIONS, *tpu_programs.CI):
      self.assertTrue(
          any(fnmatch.fnmatchcase(k, pattern) for k in keys), pattern
      )

  def test_memory_comparison_lines_up_programs(self):
    figures = {k: 1024 for k in tpu_memory.FIELDS}
    here = {
        "where": "here",
        "jax": "0.10.2",
        "device_kind": "TPU v5 lite",
        "programs": [
            {"program": "a", "size": "ci", "status": "ok", **figures},
            {"program": "b", "size": "full", "status": "over_hbm"},
        ],
    }
    chip = {
        **here,
        "where": "chip",
        "programs": [
            {
                "program": "a",
                "size": "ci",
                "status": "ok",
                **figures,
                "temp_bytes": 2048,
                "peak_bytes": 2048,
            },
            {"program": "b", "size": "full", "status": "over_hbm"},
        ],
    }
    text = tpu_memory.compare(here, chip)
    self.assertIn("| a | ci | 0.00 MiB | 0.00 MiB |", text)
    self.assertIn("| b | full | over_hbm | over_hbm |", text)
    self.assertIn("peaks equal: 0; peaks that differ: 1", text)

  def test_kernel_backend_programs_wait_for_the_backend(self):
    program = _program("small_k/mosaic_tpu/fwd")
    reason = tpu_programs.exception("v5e", program)
    if "mosaic_tpu" in registry.registered_backends():
      self.assertIsNone(reason)
    else:
      self.assertIn("not registered", reason)


class CommandLineTest(absltest.TestCase):
  """main's usage errors and where its records go; nothing compiles (`run`
  is a stand-in that records one exception per target)."""

  def setUp(self):
    super().setUp()
    self.repo = self.enter_context(tempfile.TemporaryDirectory())
    self.tmp = self.enter_context(tempfile.TemporaryDirectory())
    self.enter_context(mock.patch.object(driver, "_REPO", self.repo))
    self.enter_context(mock.patch.object(tempfile, "tempdir", self.tmp))
    self.enter_context(mock.patch.object(driver, "run", side_effect=self._run))
    self.committed = os.path.join(
        self.repo, "bench", "results", f"tpu_compile_{jax.__version__}.json"
    )

  def _run(self, platform, targets, size, selected, on_record, *_):
    del platform, size, selected
    records = [
        {"program": "p", "target": t, "status": "exception", "reason": "-"}
        for t in targets
    ]
    for record in records:
      on_record(record)
    return records

  def _main(self, *argv) -> str:
    """main's stdout; fails unless it returns 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      self.assertEqual(driver.main(["--platform=tpu", *argv]), 0)
    return out.getvalue()

  def test_unknown_or_no_targets_are_a_usage_error_naming_them(self):
    for targets in ("v4", "", "v5e,v5q"):
      err = io.StringIO()
      with self.subTest(targets=targets), contextlib.redirect_stderr(err):
        with self.assertRaises(SystemExit) as caught:
          driver.main(["--platform=tpu", f"--targets={targets}"])
        self.assertEqual(caught.exception.code, 2)
        self.assertRegex(
            err.getvalue(),
            r"argument --targets: takes a comma-separated list of "
            + ", ".join(tpu_programs.TARGETS)
            + f"; got '{targets}'",
        )

  def test_unknown_programs_are_a_usage_error(self):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
      driver.main(["--platform=tpu", "--programs=no_such_workload/*"])
    self.assertEqual(e.exception.code, 2)
    self.assertIn("argument --programs: no program matches", err.getvalue())

  def test_tpu_memory_usage_errors(self):
    """tpu_memory's --sizes (a KeyError in every record before) and
    --programs (a traceback), refused before any topology is made."""
    for argv, pattern in (
        (["--sizes=big"], r"argument --sizes: .*ci, full; got 'big'"),
        (["--sizes="], r"argument --sizes: .*got ''"),
        (["--programs=zz"], r"argument --programs: no program matches"),
    ):
      err = io.StringIO()
      with self.subTest(argv=argv), contextlib.redirect_stderr(err):
        with self.assertRaises(SystemExit) as caught:
          tpu_memory.main(argv)
        self.assertEqual(caught.exception.code, 2)
        self.assertRegex(err.getvalue(), pattern)

  def test_a_partial_run_leaves_the_committed_records_alone(self):
    printed = self._main("--targets=v5e")
    self.assertFalse(os.path.exists(self.committed))
    path = printed.rsplit("wrote ", 1)[1].strip()
    self.assertTrue(path.startswith(self.tmp), path)
    with open(path) as f:
      self.assertEqual([r["target"] for r in json.load(f)["programs"]], ["v5e"])

  def test_the_full_default_run_writes_the_committed_records(self):
    self._main()
    with open(self.committed) as f:
      targets = [r["target"] for r in json.load(f)["programs"]]
    self.assertEqual(targets, list(tpu_programs.TARGETS))


if __name__ == "__main__":
  absltest.main()
