"""bench/gpu_check's --dry_run on the CPU: the JSON, the checks, failures.

The GPU session runs gpu_check once, so whatever fails there must still be
reported: here a correctness case that raises, a method whose backward
raises, one with wrong output and a backend that cannot be built each leave
the JSON written, with the error recorded, the other methods timed and
their ratios computed. Shapes and cases are cut down (in-process, by
patching gpu_workloads' tables) so that each run compiles little; mosaic_gpu
(Mosaic GPU's interpreter, seconds a call), triton (Triton's interpreter,
where torch is installed) and the low-precision recipes run in the passing
dry run only (the recipes' failures are checked on their own, on the xla
backend: `QuantizedCorrectnessTest`). The jax-triton wheel gpu_check
carries is imported the way the GPU run imports it, and lowers triton's
timed programs here with the CUDA plugin's bindings stubbed
(`CarriedJaxTritonTest`).
"""

import contextlib
import glob
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from unittest import mock
import zipfile

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.mosaic_gpu import tiling as mosaic_tiling
from backends.pallas import tiling
from bench import gpu_check
from bench import gpu_conformance
from bench import gpu_correctness
from bench import gpu_report
from bench import gpu_timing
from bench import gpu_tolerances
from bench import gpu_workloads
from moe_core import precision

_TINY = {"tokens": 16, "top_k": 2, "hidden": 64, "ffn": 32, "experts": 4}
_TINY_LAYER = {
    "num_experts": 4,
    "top_k": 2,
    "hidden_size": 32,
    "expert_ffn_size": 64,
    "shared_ffn_size": 32,
}
_KEYS = {
    "date",
    "jax",
    "jaxlib",
    "python",
    "triton",
    "jax_triton",
    "jax_triton_from",
    "platform",
    "device",
    "dry_run",
    "workloads",
    "skew",
    "repeats",
    "budget_s",
    "seconds",
    "triton_deprecation_warnings",
    "backends",
    "correctness",
    "conformance",
    "timing",
    "goals",
    "failures",
}
_RATIO_BASELINES = ("dense", "ragged_dot", "pallas")
# A quantised GEMM case: C = 160 leaves fp8_block's 128-wide block and the
# 128x128 weight block (N = 40) part padding; group 1 is empty.
_TINY_QUANTIZED = (48, 160, 40, (20, 0, 17))


@jax.custom_vjp
def _broken_backward(x):
  return x


def _broken_backward_fwd(x):
  return x, None


def _broken_backward_bwd(_, g):
  del g
  raise RuntimeError("simulated backward failure")


_broken_backward.defvjp(_broken_backward_fwd, _broken_backward_bwd)


def _te_installed() -> bool:
  """Whether Transformer Engine is installed here (its rows then run)."""
  return importlib.util.find_spec("transformer_engine") is not None


def _run_dry(test, *extra):
  """Runs gpu_check --dry_run at tiny shapes; returns (exit code, JSON)."""
  out_dir = tempfile.mkdtemp()
  test.addCleanup(shutil.rmtree, out_dir, ignore_errors=True)
  with (
      mock.patch.object(gpu_workloads, "DRY", _TINY),
      mock.patch.object(gpu_workloads, "DRY_TRITON", _TINY),
      mock.patch.object(
          gpu_workloads, "GEMM_CASES", [(64, 32, 48, (10, 0, 23, 21), False)]
      ),
      mock.patch.object(
          gpu_workloads, "FFN_CASES", [(48, 32, 64, (20, 0, 19))]
      ),
      mock.patch.object(gpu_workloads, "LAYER_CONFIG", _TINY_LAYER),
      mock.patch.object(gpu_workloads, "LAYER_BATCH", (2, 16)),
      mock.patch.object(
          gpu_workloads, "QUANTIZED_GEMM_CASES", [_TINY_QUANTIZED]
      ),
  ):
    code = gpu_check.main(["--dry_run", "--out_dir", out_dir, *extra])
  paths = glob.glob(os.path.join(out_dir, "gpu_dryrun_*.json"))
  test.assertLen(paths, 1)
  with open(paths[0]) as fh:
    return code, json.load(fh)


class GpuCheckDryRunTest(absltest.TestCase):

  def test_dry_run_writes_passing_results(self):
    code, report = _run_dry(self)
    self.assertEqual(code, 0, report["failures"])
    self.assertEqual(set(report), _KEYS)
    self.assertEqual(report["failures"], [])
    self.assertEqual(
        [w["name"] for w in report["workloads"]],
        [
            "dry",
            "dry_triton",
            "dry_small_k",
            "dry_precision",
            "dry_grads",
            "dry_routed",
        ],
    )
    for w in report["workloads"]:
      self.assertEqual(sum(w["group_sizes"]), w["rows"])
      self.assertEqual(w["experts"], "all of the model's")
    # The te conformance suite runs on a GPU with TE only; a dry run says
    # why not, in so many words.
    (te_suite,) = report["conformance"]
    self.assertEqual(te_suite["backend"], "te")
    self.assertEqual(te_suite["status"], "skipped")
    self.assertRegex(
        te_suite["reason"],
        "Transformer Engine is not installed on this machine|no GPU",
    )
    # jax 0.10.2's Mosaic GPU interpreter cannot run the kernels: there
    # every mosaic_gpu case and method is skipped, with the backend's reason.
    mosaic_ok, why_not = moe_core.get_backend(
        "mosaic_gpu", interpret=True
    ).availability()
    self.assertIn(
        "MosaicGpuBackend" if mosaic_ok else "Unavailable",
        report["backends"]["mosaic"],
    )
    # Triton's interpreter needs torch: where it is missing, every triton
    # case and method is skipped, with the backend's reason.
    triton_ok, triton_why_not = moe_core.get_backend(
        "triton", interpret=True
    ).availability()
    for field in ("triton", "triton_fused", "triton_routed"):
      self.assertIn(
          "TritonBackend" if triton_ok else "Unavailable",
          report["backends"][field],
      )
    cases = {r["case"].split()[0] for r in report["correctness"]}
    self.assertEqual(
        cases, {"gemm", "expert_ffn", "moe_layer", "quantized_gemm"}
    )
    for r in report["correctness"]:
      self.assertTrue(r["ok"], r)
    # mosaic_gpu: its bf16 GEMM checked, its float32 one skipped, and why.
    mosaic = [r for r in report["correctness"] if r["backend"] == "mosaic_gpu"]
    bf16 = {r["quantity"] for r in mosaic if r["dtype"] == "bfloat16"}
    (float32,) = [r for r in mosaic if r["dtype"] == "float32"]
    self.assertEqual(float32["quantity"], "skipped")
    if mosaic_ok:
      self.assertEqual(bf16, {"out", "d_rows", "d_weights"})
      self.assertIn("NotImplementedError", float32["skipped"])
    else:
      self.assertEqual(bf16, {"skipped"})
      self.assertEqual(float32["skipped"], why_not)
    # triton: its dry cases, a GEMM of each layout (bf16, float32) and the
    # layer with both fusions, each quantity within budget.
    triton = {}
    for r in report["correctness"]:
      if r["backend"] == "triton":
        triton.setdefault((r["case"], r["dtype"]), set()).add(r["quantity"])
    self.assertEqual(
        sorted(triton),
        [
            ("gemm m=40 k=32 n=24 E=3 t=True triton", "float32"),
            ("gemm m=48 k=32 n=40 E=3 t=False triton", "bfloat16"),
            ("moe_layer triton fused_routing", "bfloat16"),
        ],
    )
    for (case, _), quantities in triton.items():
      if not triton_ok:
        self.assertEqual(quantities, {"skipped"}, case)
      elif case.startswith("gemm"):
        self.assertEqual(quantities, {"out", "d_rows", "d_weights"}, case)
      else:
        self.assertContainsSubset(
            {"y", "d x", "d w_down", "d router"}, quantities
        )
    if not triton_ok:
      for r in report["correctness"]:
        if r["backend"] == "triton":
          self.assertEqual(r["skipped"], triton_why_not)
    # te: no kernels off a GPU: its GEMM, FFN and layer cases are skipped,
    # and why; where TE is not installed, in those words.
    te = [r for r in report["correctness"] if r["backend"] == "te"]
    self.assertEqual(
        [r["case"].split()[0] for r in te], ["gemm", "expert_ffn", "moe_layer"]
    )
    self.assertIn("Unavailable", report["backends"]["te"])
    for r in te:
      self.assertEqual(r["quantity"], "skipped", r)
      self.assertIn(r["skipped"], report["backends"]["te"])
      if not _te_installed():
        self.assertEqual(r["skipped"], gpu_workloads.TE_NOT_INSTALLED)
    # Every recipe on pallas and xla, its output within the float32 budget
    # of the reference's (the same quantised operands).
    quantized = [
        r
        for r in report["correctness"]
        if r["case"].startswith("quantized_gemm")
    ]
    self.assertEqual(
        sorted((r["recipe"], r["backend"]) for r in quantized),
        sorted(
            (recipe, backend)
            for recipe in precision.QUANTIZED_RECIPES
            for backend in ("pallas", "xla")
        ),
    )
    for r in quantized:
      self.assertEqual(r["quantity"], "out", r)
      self.assertLessEqual(r["rel_err"], gpu_tolerances.FLOAT32, r)

    self.assertEqual(
        [
            (row["workload"], row["problem"].split()[0])
            for row in report["timing"]
        ],
        [
            ("dry", "gemm_up"),
            ("dry", "gemm_down"),
            ("dry", "expert_ffn"),
            ("dry_triton", "expert_ffn"),
            ("dry_small_k", "gemm_down"),
            ("dry_precision", "gemm_up"),
            ("dry_grads", "gemm_up"),
            ("dry_routed", "routed_experts"),
        ],
    )
    rows = {
        (r["workload"], r["problem"].split()[0]): r for r in report["timing"]
    }
    phases = {w["name"]: w["phases"] for w in report["workloads"]}
    for row in report["timing"]:
      self.assertEqual(row["phases"], phases[row["workload"]])
      for method, entry in row["methods"].items():
        label = f"{row['workload']} {row['problem']} {method}"
        self.assertNotIn("error", entry, label)
        if "skipped" in entry:  # Unavailable here, or not run by design.
          if method.startswith("triton"):
            why = triton_why_not
          else:
            why = dict(gpu_workloads.PRECISION.skipped).get(method, why_not)
          self.assertEqual(entry["skipped"], why, label)
          self.assertIsNone(entry["fwd_time_over_dense"], label)
          continue
        for phase in phases[row["workload"]]:
          self.assertIn(f"{phase}_s", entry, label)
          for base in _RATIO_BASELINES:
            self.assertIn(f"{phase}_time_over_{base}", entry, label)
        if method != "dense":  # The timed outputs, on sampled groups.
          self.assertTrue(entry["check"]["ok"], (label, entry["check"]))
          self.assertLessEqual(
              entry["max_rel_err"], entry["check"]["tolerance"]
          )
    small_k = rows["dry_small_k", "gemm_down"]["methods"]
    self.assertEqual(list(small_k), ["dense", "pallas", "mosaic_gpu"])
    self.assertIsNotNone(small_k["pallas"]["fwd_time_over_dense"])
    self.assertNotIn("fwd_bwd_s", small_k["pallas"])
    goals = {
        g["goal"].split()[-1]: g
        for g in report["goals"]
        if g["method"] == "mosaic_gpu"
    }
    self.assertEqual(goals["K"]["method"], "mosaic_gpu")
    if mosaic_ok:
      self.assertEqual(
          goals["K"]["value"], small_k["mosaic_gpu"]["fwd_time_over_pallas"]
      )
      self.assertIsNotNone(goals["K"]["value"])
      self.assertIsNotNone(goals["throughput"]["met"])
    else:
      self.assertIn("skipped", small_k["mosaic_gpu"])
      self.assertIsNone(goals["K"]["met"])
    # dX alone and dW alone: checked against the oracle's gradients only.
    grads = rows["dry_grads", "gemm_up"]["methods"]
    self.assertEqual(list(grads), ["dense", "triton"])
    self.assertNotIn("fwd_s", grads["dense"])
    if triton_ok:
      self.assertEqual(
          set(grads["triton"]["check"]) & {"out", "d_rows", "d_weights"},
          {"d_rows", "d_weights"},
      )
    # The routed experts: checked on sampled tokens and experts.
    routed = rows["dry_routed", "routed_experts"]["methods"]
    self.assertEqual(list(routed), ["triton_fused_act", "triton_fused_routing"])
    if triton_ok:
      for entry in routed.values():
        self.assertLen(entry["check"]["tokens"], 3)
        self.assertContainsSubset(
            {"out", "d_rows", "d_weights"}, entry["check"]
        )
    # triton's goals, read off its rows (met is judged on any device).
    found = {
        (g["workload"], g["method"], g["goal"].split(":")[0].split()[0]): g
        for g in report["goals"]
        if g["method"].startswith("triton")
    }
    self.assertEqual(
        sorted(found),
        [
            ("dry_grads", "triton", "dW"),
            ("dry_grads", "triton", "dX"),
            ("dry_routed", "triton_fused_routing", "fused"),
            ("dry_triton", "triton", "fwd"),
            ("dry_triton", "triton_fused_act", "fused"),
            ("dry_triton", "triton_fused_act", "fwd"),
        ],
    )
    ffn = rows["dry_triton", "expert_ffn"]["methods"]
    if triton_ok:
      dx = found["dry_grads", "triton", "dX"]
      self.assertAlmostEqual(
          dx["value"], 1.0 / grads["triton"]["dx_time_over_dense"]
      )
      fused = [
          g
          for g in report["goals"]
          if g["goal"].startswith("fused activation: fwd_bwd")
      ]
      self.assertLen(fused, 1)
      self.assertAlmostEqual(
          fused[0]["value"],
          ffn["triton_fused_act"]["fwd_bwd_s"] / ffn["triton"]["fwd_bwd_s"],
      )
      self.assertEqual(fused[0]["met"], fused[0]["value"] < 1)
    else:
      for g in found.values():
        self.assertIsNone(g["value"], g)
    # The recipes' row: forward only, each pallas recipe against the bf16
    # pallas GEMM timed in the same row; xla's skipped, as on the GPU.
    recipes = rows["dry_precision", "gemm_up"]["methods"]
    self.assertEqual(list(recipes), list(gpu_workloads.PRECISION_METHODS))
    self.assertEqual(recipes["pallas"]["fwd_time_over_pallas"], 1.0)
    for method in gpu_workloads.QUANTIZED_PALLAS_METHODS:
      self.assertNotIn("fwd_bwd_s", recipes[method], method)
      self.assertEqual(
          recipes[method]["fwd_time_over_pallas"],
          recipes[method]["fwd_s"] / recipes["pallas"]["fwd_s"],
      )
    for method in gpu_workloads.QUANTIZED_XLA_METHODS:
      self.assertIn("256 groups", recipes[method]["skipped"])
    found = {
        g["method"]: g
        for g in report["goals"]
        if g["workload"] == "dry_precision"
    }
    self.assertEqual(
        sorted(found),
        sorted(gpu_timing.FP8_METHODS + gpu_timing.EMULATED_METHODS),
    )
    for method in gpu_timing.FP8_METHODS:  # Throughput: the inverse ratio.
      self.assertAlmostEqual(
          found[method]["value"],
          1.0 / recipes[method]["fwd_time_over_pallas"],
      )
      self.assertIsNone(found[method]["met"])  # Not judged off Hopper.
    for method in gpu_timing.EMULATED_METHODS:
      self.assertEqual(
          found[method]["value"], recipes[method]["fwd_time_over_pallas"]
      )
      self.assertIsNone(found[method]["target"])

  def test_failures_are_recorded_and_the_rest_still_runs(self):
    real_gemm = gpu_workloads.gemm_methods
    real_ffn = gpu_workloads.ffn_methods
    real_backends = gpu_workloads.backends

    def gemm_methods(bes):
      methods = real_gemm(bes)
      pallas_fn = methods["pallas"]
      methods["pallas"] = lambda x, w, g: _broken_backward(pallas_fn(x, w, g))
      return methods

    def ffn_methods(bes, cfg):
      methods = real_ffn(bes, cfg)
      pallas_fn = methods["pallas"]
      methods["pallas"] = lambda x, p, g: 1.5 * pallas_fn(x, p, g)
      return methods

    def backends(on_gpu):
      # mosaic_gpu cannot be built: each of its cases and methods says so.
      unbuilt = gpu_workloads.Unbuilt("mosaic_gpu", "ImportError: simulated")
      return real_backends(on_gpu)._replace(mosaic=unbuilt)

    def ffn_case(*args, **kwargs):
      raise RuntimeError("simulated Triton compile failure")

    with (
        mock.patch.object(gpu_workloads, "gemm_methods", gemm_methods),
        mock.patch.object(gpu_workloads, "ffn_methods", ffn_methods),
        mock.patch.object(gpu_workloads, "backends", backends),
        mock.patch.object(gpu_correctness, "ffn_case", ffn_case),
        mock.patch.object(
            gpu_correctness, "layer_cases", lambda *args, **kwargs: None
        ),
        mock.patch.object(gpu_correctness, "triton_cases", lambda *args: None),
        mock.patch.object(
            gpu_correctness, "quantized_cases", lambda *args: None
        ),
    ):
      code, report = _run_dry(self, "--workloads", "dry,dry_small_k")
    self.assertEqual(code, 1)
    self.assertEqual(set(report), _KEYS)
    self.assertIn("simulated", report["backends"]["mosaic"])

    errors = [r for r in report["correctness"] if r["quantity"] == "error"]
    ffn_errors = [r for r in errors if r["case"].startswith("expert_ffn")]
    self.assertLen(ffn_errors, 2)  # expert_ffn, plain and fused.
    for r in ffn_errors:
      self.assertFalse(r["ok"])
      self.assertIn(
          "RuntimeError: simulated Triton compile failure", r["error"]
      )
    mosaic_errors = [r for r in errors if r["backend"] == "mosaic_gpu"]
    self.assertLen(mosaic_errors, 2)  # Its GEMM case, bf16 and float32.
    for r in mosaic_errors:
      self.assertIn("mosaic_gpu was not built: ImportError", r["error"])
    self.assertTrue(
        all(
            r["ok"]
            for r in report["correctness"]
            if r["case"].startswith("gemm") and r["backend"] == "pallas"
        )
    )

    gemm_up = report["timing"][0]["methods"]
    self.assertIn("fwd_s", gemm_up["pallas"])
    self.assertNotIn("fwd_bwd_s", gemm_up["pallas"])
    self.assertIn("simulated backward failure", gemm_up["pallas"]["error"])
    self.assertIsNotNone(gemm_up["pallas"]["fwd_time_over_ragged_dot"])
    self.assertIsNone(gemm_up["pallas"]["fwd_bwd_time_over_ragged_dot"])
    self.assertIsNotNone(gemm_up["ragged_dot"]["fwd_bwd_time_over_dense"])
    self.assertIsNone(gemm_up["ragged_dot"]["fwd_bwd_time_over_pallas"])
    # Its forward is still checked.
    self.assertTrue(gemm_up["pallas"]["check"]["ok"])
    self.assertNotIn("d_rows", gemm_up["pallas"]["check"])

    ffn = report["timing"][2]["methods"]
    self.assertFalse(ffn["pallas"]["check"]["ok"])
    self.assertGreater(ffn["pallas"]["max_rel_err"], 0.3)
    self.assertTrue(ffn["pallas_fused_act"]["check"]["ok"])

    small_k = report["timing"][3]["methods"]
    self.assertIn("was not built", small_k["mosaic_gpu"]["error"])
    self.assertIsNotNone(small_k["pallas"]["fwd_time_over_dense"])
    self.assertTrue(all(g["met"] is None for g in report["goals"]))

    failed = "\n".join(report["failures"])
    self.assertIn(
        "dry gemm_up [M,D]x[E,D,F] pallas: fwd_bwd: RuntimeError", failed
    )
    self.assertIn("check dry expert_ffn pallas", failed)
    self.assertIn("correctness expert_ffn pallas", failed)
    self.assertIn(
        "timing dry_small_k gemm_down [M,F]x[E,F,D] mosaic_gpu", failed
    )


def _fake_wheel(directory, body):
  """A pure-Python wheel of a package "jax_triton" (version 9.9.9) whose
  __init__ is `body`, in `directory`; returns its path."""
  path = os.path.join(directory, "jax_triton-9.9.9-py3-none-any.whl")
  with zipfile.ZipFile(path, "w") as wheel:
    wheel.writestr("jax_triton/__init__.py", body)
    wheel.writestr(
        "jax_triton-9.9.9.dist-info/METADATA",
        "Metadata-Version: 2.1\nName: jax-triton\nVersion: 9.9.9\n",
    )
  return path


class ConformancePhaseTest(absltest.TestCase):
  """bench/gpu_conformance: the suite as a child process, its counts."""

  def test_summary_lines_are_parsed(self):
    self.assertEqual(
        gpu_conformance.parse_summary(
            "...\n----\nRan 445 tests in 81.250s\n\nOK (skipped=12)\n"
        ),
        {"ran": 445, "failures": 0, "errors": 0, "skipped": 12},
    )
    self.assertEqual(
        gpu_conformance.parse_summary(
            "Ran 3 tests in 1.0s\n\nFAILED (failures=1, errors=2)\n"
        ),
        {"ran": 3, "failures": 1, "errors": 2, "skipped": 0},
    )
    self.assertIsNone(
        gpu_conformance.parse_summary("Segmentation fault")["ran"]
    )

  def test_unavailable_backend_is_skipped_with_the_reason(self):
    entry = gpu_conformance.run_suite("te", 60, (False, "no TE here"))
    self.assertEqual(
        entry, {"backend": "te", "status": "skipped", "reason": "no TE here"}
    )

  def test_the_real_suite_runs_and_is_counted(self):
    """The te suite as gpu_check starts it; off a GPU every test skips
    (with TE missing or no GPU), so it passes with all of them skipped."""
    entry = gpu_conformance.run_suite("te", 300, (True, ""))
    self.assertEqual(entry["status"], "passed", entry.get("output_tail"))
    self.assertGreater(entry["ran"], 400)
    self.assertEqual(entry["skipped"], entry["ran"])
    self.assertEqual((entry["failures"], entry["errors"]), (0, 0))
    failing = {"backend": "te", "status": "failed", "reason": "exit code 1"}
    self.assertEqual(
        gpu_report.failures({"conformance": [failing]}),
        ["conformance te: exit code 1"],
    )


class VersionsAndLoweringTest(absltest.TestCase):

  def test_versions_are_recorded(self):
    versions = gpu_report.versions()
    self.assertEqual(versions["python"], platform.python_version())
    self.assertEqual(versions["jax"], jax.__version__)
    self.assertIsNotNone(versions["jaxlib"])
    self.assertContainsSubset(
        {"triton", "jax_triton", "jax_triton_from"}, versions
    )

  def _tempdir(self):
    path = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, path, ignore_errors=True)
    return path

  def _hide_installed_jax_triton(self):
    """Makes `import jax_triton` fail as on the GPU machine, until cleanup.

    A None entry in sys.modules stops the import (provide_jax_triton then
    drops it); sys.path and sys.modules are restored afterwards.
    """
    self.enter_context(mock.patch.object(sys, "path", list(sys.path)))
    self.enter_context(mock.patch.dict(sys.modules))
    for name in [n for n in sys.modules if n.split(".")[0] == "jax_triton"]:
      del sys.modules[name]
    sys.modules["jax_triton"] = None

  def test_carried_wheel_is_imported_from_its_zip(self):
    self._hide_installed_jax_triton()
    wheels = self._tempdir()
    wheel = _fake_wheel(wheels, "__version__ = '9.9.9'\n")
    where = gpu_report.provide_jax_triton(wheels)
    self.assertTrue(where.startswith(f"carried: {wheel} (installed: "), where)
    self.assertEqual(sys.path[0], wheel)
    self.assertEqual(sys.modules["jax_triton"].__version__, "9.9.9")
    versions = gpu_report.versions()
    self.assertEqual(versions["jax_triton"], "9.9.9")  # Read in the zip.
    self.assertEqual(versions["jax_triton_from"], where)

  def test_a_carried_wheel_that_fails_leaves_sys_path_as_it_was(self):
    self._hide_installed_jax_triton()
    before = list(sys.path)
    wheels = self._tempdir()
    _fake_wheel(wheels, "raise ImportError('needs the CUDA plugin')\n")
    where = gpu_report.provide_jax_triton(wheels)
    self.assertTrue(where.startswith("not importable: installed: "), where)
    self.assertIn(
        "carried jax_triton-9.9.9-py3-none-any.whl: ImportError: needs the "
        "CUDA plugin",
        where,
    )
    self.assertEqual(sys.path, before)
    self.assertNotIn("jax_triton", sys.modules)

  def test_the_real_carried_wheel_needs_the_cuda_plugin(self):
    """jax-triton 0.3.1 from bench/wheels refuses a CPU jaxlib, cleanly."""
    if jax.default_backend() == "gpu":
      self.skipTest("a GPU jaxlib: the carried wheel would import here")
    # pylint: disable-next=g-import-not-at-top
    from jax._src.lib import gpu_triton

    if hasattr(gpu_triton, "TritonKernel"):
      self.skipTest(
          "the CUDA plugin is installed: the carried wheel imports here "
          "instead of refusing"
      )
    self._hide_installed_jax_triton()
    before = list(sys.path)
    where = gpu_report.provide_jax_triton()
    self.assertIn(
        "carried jax_triton-0.3.1-py3-none-any.whl: ImportError: jax-triton "
        "requires JAX to be installed with GPU support",
        where,
    )
    self.assertEqual(sys.path, before)

  def test_lower_only_lowers_every_program_for_cuda(self):
    """--lower_only at the full D and F, fewer rows: no GPU needed.

    DeepSeek-V3's, the small-K, the recipes' and the routed experts'
    programs: Mixtral's are the same programs at other sizes, and would add
    10 s. triton's are listed as skipped (no CPU lowering).
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      code = gpu_check.main(
          [
              "--lower_only",
              "--tokens",
              "256",
              "--workloads",
              "deepseek_v3,small_k,deepseek_v3_precision,deepseek_v3_routed",
          ]
      )
    log = out.getvalue()
    print(log)
    self.assertEqual(code, 0, log)
    self.assertRegex(log, r"lowered (\d+)/\1 programs for CUDA")
    self.assertIn("Pallas Triton deprecation warnings filtered:", log)
    # mosaic_gpu's programs call Mosaic GPU; its backward also Triton (dW).
    for problem in ("gemm_up", "gemm_down"):
      self.assertRegex(
          log,
          rf"ok   deepseek_v3 {problem} \S+ mosaic_gpu fwd: 1 mosaic_gpu_v2\n",
      )
      self.assertRegex(
          log,
          rf"ok   deepseek_v3 {problem} \S+ mosaic_gpu fwd\+bwd: "
          r"1 triton, 2 mosaic_gpu_v2\n",
      )
    self.assertRegex(
        log,
        r"ok   deepseek_v3 expert_ffn mosaic_gpu_fused_act fwd\+bwd: "
        r"2 triton, 4 mosaic_gpu_v2\n",
    )
    self.assertRegex(log, r"ok   small_k gemm_down \S+ mosaic_gpu fwd: ")
    self.assertNotIn("small_k gemm_down [M,F]x[E,F,D] mosaic_gpu fwd+bwd", log)
    # The recipes' forward programs: a pallas one calls Triton whatever
    # its recipe; xla's, not run at 256 groups, are listed as skipped.
    lowered = re.findall(
        r"ok   deepseek_v3_precision gemm_up \S+ (\S+) (\S+):", log
    )
    pallas = ("pallas",) + gpu_workloads.QUANTIZED_PALLAS_METHODS
    self.assertEqual(lowered, [(m, "fwd") for m in pallas])
    for method in gpu_workloads.QUANTIZED_PALLAS_METHODS:
      self.assertRegex(log, rf" {method} fwd: .*\d+ triton")
    skipped = re.findall(r"skip deepseek_v3_precision gemm_up \S+ (\S+):", log)
    self.assertEqual(skipped, list(gpu_workloads.QUANTIZED_XLA_METHODS))
    # The routed experts on pallas: dispatch, FFN and combine lowered.
    routed = re.findall(r"ok   deepseek_v3_routed \S+ \S+ (\S+) (\S+):", log)
    self.assertEqual(
        routed,
        [
            (m, p)
            for m in ("pallas", "pallas_fused_act")
            for p in ("fwd", "fwd+bwd")
        ],
    )
    # triton: each method skipped, saying why it cannot be lowered here.
    triton = re.findall(r"skip (\S+) .+? (triton\S*): (.*)", log)
    self.assertEqual(
        [(w, m) for w, m, _ in triton],
        [
            ("deepseek_v3", "triton"),
            ("deepseek_v3", "triton"),
            ("deepseek_v3", "triton"),
            ("deepseek_v3", "triton_fused_act"),
            ("deepseek_v3_routed", "triton"),
            ("deepseek_v3_routed", "triton_fused_act"),
            ("deepseek_v3_routed", "triton_fused_routing"),
        ],
    )
    for _, _, why in triton:
      self.assertIn(gpu_workloads.TRITON_NOT_LOWERED, why)
    # te: DeepSeek-V3's two GEMMs and FFN, lowered (forward and
    # forward+backward, calling TE's grouped GEMM) where TE is installed,
    # else each skipped, saying so.
    te_skipped = re.findall(r"skip deepseek_v3 .+? te: (.*)", log)
    te_lowered = re.findall(
        r"ok   deepseek_v3 .+? te (fwd|fwd\+bwd): .*te_", log
    )
    if _te_installed():
      self.assertEqual(te_lowered, ["fwd", "fwd+bwd"] * 3)
      self.assertEqual(te_skipped, [])
    else:
      self.assertEqual(te_skipped, [gpu_workloads.TE_NOT_INSTALLED] * 3)
      self.assertEqual(te_lowered, [])
    # DeepSeek-V3 (22 programs, te's aside), small K (3), the recipes', the
    # routed experts' (4).
    total = 25 + len(pallas) + 4 + len(te_lowered)
    self.assertIn(
        f"lowered {total}/{total} programs for CUDA "
        f"({len(skipped) + len(triton) + len(te_skipped)} methods skipped",
        log,
    )


# Run in a child process: it gives jaxlib's gpu_triton module stand-ins for
# the CUDA plugin's Triton bindings, which must not leak into other tests.
# They only package what jax-triton computed (the kernel's PTX, its launch);
# everything before them, Triton compiling each kernel for sm_90, is real.
_CHILD = textwrap.dedent("""
    import functools
    import json
    import sys

    from jax._src.lib import gpu_triton

    compiled = []

    class Kernel:
      def __init__(self, name, num_warps, num_ctas, shared, ptx, *rest):
        compiled.append([name, num_warps, shared, len(ptx), rest[-1]])

    class Call:
      def __init__(self, *args):
        pass

      def to_proto(self, *args):
        return b""

    for name, value in {
        "get_compute_capability": lambda device: 90,
        "get_serialized_metadata": lambda *args: b"",
        "TritonKernel": Kernel,
        "TritonKernelCall": Call,
        "TritonAutotunedKernelCall": Call,
        "create_array_parameter": lambda *args: args,
        "create_scalar_parameter": lambda *args: args,
    }.items():
      setattr(gpu_triton, name, value)

    from backends.triton import backend
    from bench import gpu_lowering
    from bench import gpu_report
    from bench import gpu_workloads
    from moe_core.testing import cuda_export

    # A CPU has no GPU: the backend says so, but it lowers.
    backend.TritonBackend.availability = lambda self: (True, "")
    # gpu_lowering allows only Pallas' Triton call (jax-triton's is not
    # export-stable either).
    cuda_export.export_for_cuda = functools.partial(
        cuda_export.export_for_cuda,
        disabled_custom_calls=("triton_kernel_call",),
    )
    where = gpu_report.provide_jax_triton()
    import jax_triton

    workloads = []
    for w in gpu_workloads.FULL:
      if w.name in sys.argv[2].split(","):
        workloads.append(w._replace(
            methods=tuple(m for m in w.methods if m.startswith("triton")),
            shape=dict(w.shape, tokens=int(sys.argv[1])),
        ))
    print(json.dumps({
        "from": where,
        "version": jax_triton.__version__,
        "programs": gpu_lowering.lower_only(workloads),
        "kernels": compiled,
    }))
""")
# The GPU's limits per thread block (sm_90): 227 KiB of shared memory.
_SHARED_BYTES = 227 * 1024


class CarriedJaxTritonTest(absltest.TestCase):

  def test_carried_wheel_lowers_the_timed_triton_programs(self):
    """jax-triton 0.3.1 from bench/wheels, at DeepSeek-V3's D, F and E.

    Every triton method of the DeepSeek-V3 rows (GEMMs, FFN, routed
    experts), forward and forward+backward, lowers through the carried
    wheel's lowering rule, each kernel compiled by this machine's Triton to
    PTX for sm_90 within the shared memory of a block. On the py312 leg
    (jax 0.11.2, triton 3.6.0) this is the GPU machine's software but for
    the CUDA plugin.
    """
    if importlib.util.find_spec("triton") is None:
      self.skipTest("triton is not installed: nothing to compile with")
    # pylint: disable-next=g-import-not-at-top
    from jax._src.lib import gpu_triton

    if hasattr(gpu_triton, "TritonKernel"):
      self.skipTest(
          "the CUDA plugin is installed: gpu_check --lower_only lowers "
          "through it"
      )
    wheel = glob.glob(
        os.path.join(gpu_report.WHEELS_DIR, "jax_triton-0.3.1-*.whl")
    )
    self.assertLen(wheel, 1)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The wheel first: the installed jax-triton (0.4 on some legs) must not
    # be the one that imports. Then what this process imports from.
    path = [wheel[0], repo] + [p for p in sys.path if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            "256",
            "deepseek_v3,deepseek_v3_routed",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    self.assertEqual(child.returncode, 0, child.stderr[-3000:])
    found = json.loads(child.stdout.strip().splitlines()[-1])
    self.assertEqual(found["version"], "0.3.1")
    self.assertTrue(found["from"].startswith("installed: "), found["from"])
    self.assertIn(os.path.basename(wheel[0]), found["from"])
    labels = [label for label, _, _ in found["programs"]]
    self.assertLen(labels, 2 * (4 + 3))  # fwd and fwd+bwd of each method.
    for label, ok, detail in found["programs"]:
      self.assertTrue(ok, (label, detail))
      self.assertRegex(detail, r"^\d+ triton_kernel_call$", label)
    names = {name for name, *_ in found["kernels"]}
    self.assertContainsSubset(
        {
            "gmm_kernel",
            "gated_gmm_kernel",
            "tgmm_kernel",
            "permute_kernel",
            "permute_bwd_kernel",
            "unpermute_kernel",
            "unpermute_bwd_rows_kernel",
        },
        names,
    )
    for name, _, shared, ptx_chars, capability in found["kernels"]:
      self.assertEqual(capability, 90, name)
      self.assertGreater(ptx_chars, 0, name)
      self.assertLessEqual(shared, _SHARED_BYTES, name)


class _Wrong:
  """The xla backend, off by one part in a hundred on one recipe, and
  refusing another the way a backend does (NotImplementedError)."""

  def __init__(self, wrong, refused):
    self.xla = moe_core.get_backend("xla", use_ragged_dot=True)
    self.wrong, self.refused = wrong, refused

  def grouped_gemm(self, rows, weights, group_sizes, **kwargs):
    recipe = kwargs.get("precision", "bf16")
    if recipe == self.refused:
      raise NotImplementedError(f"test: precision {recipe!r} not supported")
    out = self.xla.grouped_gemm(rows, weights, group_sizes, **kwargs)
    return 1.01 * out if recipe == self.wrong else out


class QuantizedCorrectnessTest(absltest.TestCase):

  def test_wrong_refused_and_unbuilt_backends_are_recorded(self):
    bes = gpu_workloads.Backends(
        pallas=_Wrong(wrong="mxfp8", refused="nvfp4"),
        pallas_fused=None,
        mosaic=None,
        mosaic_fused=None,
        ragged=gpu_workloads.Unbuilt("xla", "ImportError: simulated"),
    )
    results = []
    with mock.patch.object(
        gpu_workloads, "QUANTIZED_GEMM_CASES", [_TINY_QUANTIZED]
    ):
      gpu_correctness.quantized_cases(
          bes, moe_core.get_backend("reference"), results
      )
    by = {(r["backend"], r["case"].split()[1]): r for r in results}
    self.assertLen(results, 2 * len(precision.QUANTIZED_RECIPES))
    for recipe in ("fp8_tensor", "fp8_block"):  # The same product.
      self.assertTrue(by["pallas", recipe]["ok"], by["pallas", recipe])
    # 1 % off is far past the float32 budget.
    self.assertFalse(by["pallas", "mxfp8"]["ok"])
    self.assertAlmostEqual(by["pallas", "mxfp8"]["rel_err"], 0.01, places=4)
    refused = by["pallas", "nvfp4"]
    self.assertEqual(refused["quantity"], "skipped")
    self.assertTrue(refused["ok"])
    self.assertIn(
        "NotImplementedError: test: precision 'nvfp4'", refused["skipped"]
    )
    for recipe in precision.QUANTIZED_RECIPES:
      entry = by["xla", recipe]
      self.assertEqual(entry["quantity"], "error")
      self.assertIn("xla was not built: ImportError", entry["error"])
    failed = gpu_report.failures({"correctness": results})
    self.assertLen(failed, 1 + len(precision.QUANTIZED_RECIPES))
    self.assertIn(
        "correctness quantized_gemm mxfp8 m=48 k=160 n=40 E=3 pallas "
        "bfloat16 out",
        failed,
    )


class TablesTest(absltest.TestCase):

  def test_correctness_cases_keep_padding_rows(self):
    for m, _, _, sizes, _ in gpu_workloads.GEMM_CASES:
      self.assertLess(sum(sizes), m, sizes)
    for m, _, _, sizes in gpu_workloads.FFN_CASES:
      self.assertLess(sum(sizes), m, sizes)
    for cases in (gpu_workloads.triton_cases(), gpu_workloads.DRY_TRITON_CASES):
      for m, _, _, sizes, _, _ in cases.gemm:
        self.assertLess(sum(sizes), m, sizes)
      for m, _, _, sizes, _ in cases.ffn:
        self.assertLess(sum(sizes), m, sizes)

  def test_triton_is_checked_in_both_dtypes_and_layouts(self):
    cases = gpu_workloads.triton_cases()
    self.assertEqual(
        {(t, dtype) for *_, t, dtype in cases.gemm},
        {(t, d) for t in (False, True) for d in ("bfloat16", "float32")},
    )
    self.assertEqual({c[-1] for c in cases.ffn}, {"bfloat16", "float32"})
    self.assertEqual(
        {v for v, d in cases.layers if d == "bfloat16"},
        set(gpu_workloads.TRITON_LAYERS),
    )
    self.assertIn(("fused_routing", "float32"), cases.layers)

  def test_correctness_covers_the_timed_triton_tiles(self):
    """Every forward and fused gate/up tile triton picks at a timed shape
    (on sm_90, bf16) is among those its correctness cases pick."""
    # pylint: disable-next=g-import-not-at-top
    from backends.triton import configs

    def choose(kind, m, k, n, e):
      return configs.choose(None, "sm90", kind, m, k, n, e, jnp.bfloat16)

    cases = gpu_workloads.triton_cases()
    checked = {
        "fwd": [
            choose("fwd", m, c, n, len(s))
            for m, c, n, s, _, d in cases.gemm
            if d == "bfloat16"
        ],
        "gated": [
            choose("gated", m, dim, f, len(s))
            for m, dim, f, s, d in cases.ffn
            if d == "bfloat16"
        ],
    }
    for workload in gpu_workloads.FULL:
      shape = workload.shape
      m, _, problems = gpu_workloads.problems(
          shape, "random", workload.problems
      )
      for p in problems:
        if p.kind == "gemm":
          (_, c), (e, _, n) = p.rows_shape, p.weights_shape
          timed = [("fwd", choose("fwd", m, c, n, e))]
        else:  # The expert FFN and the routed experts: the gated kernel.
          dims = (m, shape["hidden"], shape["ffn"], shape["experts"])
          timed = [("gated", choose("gated", *dims))]
        for kind, config in timed:
          label = f"{workload.name} {p.name} {kind}"
          self.assertIn(config, checked[kind], label)

  def test_fixed_routing_gives_the_group_sizes(self):
    sizes = np.array([5, 0, 9, 2], np.int32)
    cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=8, expert_ffn_size=8
    )
    aux = gpu_workloads.fixed_routing(jnp.asarray(sizes), 8, cfg)
    ids = np.asarray(aux.expert_ids)
    self.assertEqual(ids.shape, (8, 2))
    np.testing.assert_array_equal(np.bincount(ids.ravel(), minlength=4), sizes)
    weights = np.asarray(aux.combine_weights, np.float64)
    self.assertTrue(np.all(weights > 0))
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    self.assertTrue(np.all(np.asarray(aux.kept)))
    # The same routing every time it is built: the oracle rebuilds it.
    again = gpu_workloads.fixed_routing(jnp.asarray(sizes), 8, cfg)
    np.testing.assert_array_equal(np.asarray(again.expert_ids), ids)

  def test_correctness_covers_the_timed_gpu_tiles(self):
    """Every forward tile choice a timed GEMM makes on a GPU is checked.

    For pallas and mosaic_gpu, plain (GEMM cases) and with two operands
    (the fused gate+up of the FFN cases).
    """

    def pallas_fwd(m, c, n, e, operands=1):
      return tiling.heuristic(
          "fwd",
          m,
          c,
          n,
          e,
          jnp.bfloat16,
          interpret=False,
          num_operands=operands,
      )

    def mosaic_fwd(m, c, n, e, operands=1):
      del c, n  # The table's buckets go by rows per group.
      return mosaic_tiling.choose(
          mosaic_tiling.TileConfig(),
          "fwd",
          m,
          e,
          jnp.bfloat16,
          num_rhs=operands,
          num_accs=operands,
          num_outputs=operands,
      )

    for choose in (pallas_fwd, mosaic_fwd):
      checked = [
          choose(m, c, n, len(s)) for m, c, n, s, _ in gpu_workloads.GEMM_CASES
      ]
      checked_fused = [
          choose(m, d, f, len(s), 2) for m, d, f, s in gpu_workloads.FFN_CASES
      ]
      for workload in gpu_workloads.FULL:
        shape = workload.shape
        _, _, problems = gpu_workloads.problems(
            shape, "random", workload.problems
        )
        for p in problems:
          if p.kind != "gemm":
            continue
          m, c = p.rows_shape
          e, _, n = p.weights_shape
          label = f"{choose.__name__} {workload.name} {p.name}"
          self.assertIn(choose(m, c, n, e), checked, label)
          if p.key == "gemm_up":  # The fused gate+up has this shape.
            self.assertIn(choose(m, c, n, e, 2), checked_fused, label)
    # Mixtral's forward runs pallas' large tiles.
    mixtral = gpu_workloads.MIXTRAL.shape
    self.assertEqual(
        pallas_fwd(
            mixtral["tokens"] * mixtral["top_k"],
            mixtral["hidden"],
            mixtral["ffn"],
            mixtral["experts"],
        ),
        tiling.GPU_TILES["gmm_bf16_large"],
    )

  def test_problems_past_the_deadline_are_skipped(self):
    workload = gpu_workloads.dry_workloads(_TINY)[0]
    _, _, rows = gpu_timing.run_timing(
        workload, 1, "random", bes=None, deadline=0.0
    )
    self.assertLen(rows, 3)
    for row in rows:
      self.assertIn("time budget", row["skipped"])
      self.assertEqual(row["methods"], {})
    self.assertEqual(gpu_report.failures({"timing": rows}), [])

  def test_goals_read_the_ratios(self):
    rows = [
        {
            "workload": "deepseek_v3",
            "problem": "gemm_up",
            "methods": {
                "mosaic_gpu": {"fwd_time_over_dense": 2.0},
                "mosaic_gpu_fused_act": {"fwd_time_over_dense": None},
            },
        },
        {
            "workload": "small_k",
            "problem": "gemm_down",
            "methods": {
                "mosaic_gpu": {
                    "fwd_time_over_dense": 1.25,
                    "fwd_time_over_pallas": 0.9,
                },
            },
        },
    ]
    found = gpu_timing.goals(rows)
    # Throughput over dense is the inverse of the time ratio: 0.5 < 0.6.
    self.assertEqual(
        [(g["workload"], g["method"], g["value"], g["met"]) for g in found],
        [
            ("deepseek_v3", "mosaic_gpu", 0.5, False),
            ("deepseek_v3", "mosaic_gpu_fused_act", None, None),
            ("small_k", "mosaic_gpu", 0.8, True),
            ("small_k", "mosaic_gpu", 0.9, True),
        ],
    )

  def test_triton_goals_read_the_rows(self):
    rows = [
        {
            "workload": "deepseek_v3",
            "problem": "expert_ffn",
            "kind": "ffn",
            "phases": ["fwd", "fwd_bwd"],
            "methods": {
                "dense": {"fwd_time_over_dense": 1.0},
                "triton": {
                    "fwd_time_over_dense": 2.0,
                    "fwd_s": 2.0,
                    "fwd_bwd_s": 6.0,
                },
                "triton_fused_act": {
                    "fwd_time_over_dense": 1.25,
                    "fwd_s": 1.5,
                    "fwd_bwd_s": 6.6,
                },
            },
        },
        {
            "workload": "deepseek_v3_grads",
            "problem": "gemm_up",
            "kind": "gemm",
            "phases": ["dx", "dw"],
            "methods": {
                "dense": {},
                "mosaic_gpu": {"dx_time_over_dense": 1.0},
                "triton": {
                    "dx_time_over_dense": 1.6,
                    "dw_time_over_dense": None,
                },
            },
        },
        {
            "workload": "deepseek_v3_routed",
            "problem": "routed_experts",
            "kind": "routed",
            "phases": ["fwd", "fwd_bwd"],
            "methods": {
                "triton_fused_act": {"fwd_s": 2.0, "fwd_bwd_s": 4.0},
                "triton_fused_routing": {"fwd_s": 1.0, "fwd_bwd_s": 5.0},
            },
        },
    ]
    found = [
        (g["workload"], g["method"], g["goal"].split()[0], g["value"], g["met"])
        for g in gpu_timing.goals(rows)
    ]
    # Throughput over dense: the inverse of the time ratio (0.5 misses 0.6,
    # 0.8 and 0.625 meet it); a fusion's gain: its time over the other's.
    expected = [
        ("deepseek_v3", "triton", "fwd", 0.5, False),
        ("deepseek_v3", "triton_fused_act", "fwd", 0.8, True),
        ("deepseek_v3", "triton_fused_act", "fused", 0.75, True),
        ("deepseek_v3", "triton_fused_act", "fused", 1.1, False),
        ("deepseek_v3_grads", "triton", "dX", 0.625, True),
        ("deepseek_v3_grads", "triton", "dW", None, None),
        ("deepseek_v3_routed", "triton_fused_routing", "fused", 0.5, None),
        ("deepseek_v3_routed", "triton_fused_routing", "fused", 1.25, None),
    ]
    self.assertLen(found, len(expected))
    for got, want in zip(found, expected):
      self.assertEqual(got[:3], want[:3])
      if want[3] is None:
        self.assertIsNone(got[3])
      else:
        self.assertAlmostEqual(got[3], want[3])
      self.assertEqual(got[4], want[4])

  def test_recipe_goals_read_the_ratios(self):
    row = {
        "workload": "deepseek_v3_precision",
        "problem": "gemm_up",
        "methods": {
            "pallas": {"fwd_time_over_pallas": 1.0},
            "pallas_fp8_tensor": {"fwd_time_over_pallas": 0.5},
            "pallas_fp8_block": {"fwd_time_over_pallas": 1.0},
            "pallas_mxfp8": {"fwd_time_over_pallas": 1.25},
            "pallas_nvfp4": {"error": "fwd: boom"},
        },
    }
    for device, judged in (("NVIDIA H200", True), ("cpu", False)):
      found = gpu_timing.goals([row], device)
      # FP8: throughput over bf16's, the inverse of the time ratio (2x and
      # 1x: one meets 1.5x, one misses); judged on Hopper only.
      self.assertEqual(
          [(g["method"], g["value"], g["met"]) for g in found],
          [
              ("pallas_fp8_tensor", 2.0, True if judged else None),
              ("pallas_fp8_block", 1.0, False if judged else None),
              ("pallas_mxfp8", 1.25, None),
              ("pallas_nvfp4", None, None),
          ],
      )
      self.assertEqual([g["target"] for g in found][2:], [None, None])

  def test_hopper_device_kinds(self):
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 480GB"):
      self.assertTrue(gpu_timing.is_hopper(kind), kind)
    for kind in ("NVIDIA A100-SXM4-80GB", "NVIDIA B200", "cpu", None):
      self.assertFalse(gpu_timing.is_hopper(kind), kind)

  def test_recipe_methods_only_where_named(self):
    cfg = gpu_workloads.ffn_config(_TINY)
    bes = gpu_workloads.backends(on_gpu=False)
    self.assertEqual(
        list(gpu_workloads.methods_for("gemm", bes, cfg)),
        list(gpu_workloads.GEMM_METHODS),
    )
    workload = gpu_workloads.PRECISION
    methods = gpu_workloads.methods_for(
        "gemm", bes, cfg, workload.methods, workload.skipped
    )
    self.assertEqual(list(methods), list(gpu_workloads.PRECISION_METHODS))
    for method, fn in methods.items():
      recipe = gpu_workloads.method_recipe(method)
      self.assertEqual(method == "pallas", recipe == "bf16", method)
      self.assertTrue(method.endswith(recipe) or recipe == "bf16", method)
      # xla's quantised GEMMs are not timed at 256 groups: why, recorded.
      skipped = isinstance(fn, gpu_workloads.Skip)
      self.assertEqual(skipped, method.startswith("xla_"), method)
      if skipped:
        self.assertIn("256 groups", fn.reason)

  def test_ratios_tolerate_failed_methods(self):
    row = {
        "methods": {
            "dense": {"fwd_s": 1.0, "fwd_bwd_s": 3.0},
            "ragged_dot": {"error": "fwd: boom"},
            "pallas": {"fwd_s": 2.0, "error": "fwd_bwd: boom"},
        }
    }
    gpu_timing.add_ratios(row)
    pallas = row["methods"]["pallas"]
    # Time over the baseline's time: pallas took twice dense's.
    self.assertEqual(pallas["fwd_time_over_dense"], 2.0)
    self.assertIsNone(pallas["fwd_bwd_time_over_dense"])
    self.assertIsNone(pallas["fwd_time_over_ragged_dot"])


if __name__ == "__main__":
  absltest.main()
