"""bench/gpu_check's --dry_run on the CPU: the JSON, the checks, failures.

The GPU session runs gpu_check once, so whatever fails there must still be
reported: here a correctness case that raises, a method whose backward
raises and one with wrong output each leave the JSON written, with the
error recorded, the other methods timed and their ratios computed.
Shapes and cases are cut down (in-process, by patching gpu_workloads'
tables) so that each run compiles little.
"""

import contextlib
import glob
import io
import json
import os
import platform
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp

from backends.pallas import tiling
from bench import gpu_check
from bench import gpu_correctness
from bench import gpu_report
from bench import gpu_timing
from bench import gpu_workloads

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
    "platform",
    "device",
    "dry_run",
    "shape",
    "rows",
    "group_sizes",
    "skew",
    "repeats",
    "seconds",
    "triton_deprecation_warnings",
    "correctness",
    "timing",
    "failures",
}


@jax.custom_vjp
def _broken_backward(x):
  return x


def _broken_backward_fwd(x):
  return x, None


def _broken_backward_bwd(_, g):
  del g
  raise RuntimeError("simulated backward failure")


_broken_backward.defvjp(_broken_backward_fwd, _broken_backward_bwd)


def _run_dry(test, *extra):
  """Runs gpu_check --dry_run at tiny shapes; returns (exit code, JSON)."""
  out_dir = tempfile.mkdtemp()
  test.addCleanup(shutil.rmtree, out_dir, ignore_errors=True)
  with (
      mock.patch.object(gpu_workloads, "DRY", _TINY),
      mock.patch.object(
          gpu_workloads, "GEMM_CASES", [(64, 32, 48, (10, 0, 23, 21), False)]
      ),
      mock.patch.object(
          gpu_workloads, "FFN_CASES", [(48, 32, 64, (20, 0, 19))]
      ),
      mock.patch.object(gpu_workloads, "LAYER_CONFIG", _TINY_LAYER),
      mock.patch.object(gpu_workloads, "LAYER_BATCH", (2, 16)),
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
    cases = {r["case"].split()[0] for r in report["correctness"]}
    self.assertEqual(cases, {"gemm", "expert_ffn", "moe_layer"})
    for r in report["correctness"]:
      self.assertTrue(r["ok"], r)
    self.assertEqual(
        [row["problem"].split()[0] for row in report["timing"]],
        ["gemm_up", "gemm_down", "expert_ffn"],
    )
    for row in report["timing"]:
      for method, entry in row["methods"].items():
        label = f"{row['problem']} {method}"
        self.assertNotIn("error", entry, label)
        for key in (
            "fwd_s",
            "fwd_bwd_s",
            "fwd_time_over_dense",
            "fwd_bwd_time_over_dense",
            "fwd_time_over_ragged_dot",
            "fwd_bwd_time_over_ragged_dot",
        ):
          self.assertIn(key, entry, label)
        if method != "dense":  # The timed outputs, on sampled groups.
          self.assertTrue(entry["check"]["ok"], (label, entry["check"]))
          self.assertLessEqual(
              entry["max_rel_err"], entry["check"]["tolerance"]
          )

  def test_failures_are_recorded_and_the_rest_still_runs(self):
    real_gemm = gpu_workloads.gemm_methods
    real_ffn = gpu_workloads.ffn_methods

    def gemm_methods(pallas, xla):
      methods = real_gemm(pallas, xla)
      pallas_fn = methods["pallas"]
      methods["pallas"] = lambda x, w, g: _broken_backward(pallas_fn(x, w, g))
      return methods

    def ffn_methods(pallas, fused, xla, cfg):
      methods = real_ffn(pallas, fused, xla, cfg)
      pallas_fn = methods["pallas"]
      methods["pallas"] = lambda x, p, g: 1.5 * pallas_fn(x, p, g)
      return methods

    def ffn_case(*args, **kwargs):
      raise RuntimeError("simulated Triton compile failure")

    with (
        mock.patch.object(gpu_workloads, "gemm_methods", gemm_methods),
        mock.patch.object(gpu_workloads, "ffn_methods", ffn_methods),
        mock.patch.object(gpu_correctness, "ffn_case", ffn_case),
        mock.patch.object(gpu_correctness, "layer_cases", lambda *args: None),
    ):
      code, report = _run_dry(self)
    self.assertEqual(code, 1)
    self.assertEqual(set(report), _KEYS)

    errors = [r for r in report["correctness"] if r["quantity"] == "error"]
    self.assertLen(errors, 2)  # expert_ffn, plain and fused.
    for r in errors:
      self.assertFalse(r["ok"])
      self.assertIn(
          "RuntimeError: simulated Triton compile failure", r["error"]
      )
    self.assertTrue(
        all(
            r["ok"]
            for r in report["correctness"]
            if r["case"].startswith("gemm")
        )
    )

    gemm_up = report["timing"][0]["methods"]
    self.assertIn("fwd_s", gemm_up["pallas"])
    self.assertNotIn("fwd_bwd_s", gemm_up["pallas"])
    self.assertIn("simulated backward failure", gemm_up["pallas"]["error"])
    self.assertIsNotNone(gemm_up["pallas"]["fwd_time_over_ragged_dot"])
    self.assertIsNone(gemm_up["pallas"]["fwd_bwd_time_over_ragged_dot"])
    self.assertIsNotNone(gemm_up["xla"]["fwd_bwd_time_over_ragged_dot"])
    self.assertIsNotNone(gemm_up["xla"]["fwd_bwd_time_over_dense"])
    # Its forward is still checked.
    self.assertTrue(gemm_up["pallas"]["check"]["ok"])
    self.assertNotIn("d_rows", gemm_up["pallas"]["check"])

    ffn = report["timing"][2]["methods"]
    self.assertFalse(ffn["pallas"]["check"]["ok"])
    self.assertGreater(ffn["pallas"]["max_rel_err"], 0.3)
    self.assertTrue(ffn["pallas_fused_act"]["check"]["ok"])

    failed = "\n".join(report["failures"])
    self.assertIn("gemm_up [M,D]x[E,D,F] pallas: fwd_bwd: RuntimeError", failed)
    self.assertIn("check expert_ffn pallas", failed)
    self.assertIn("correctness expert_ffn pallas", failed)


class VersionsAndLoweringTest(absltest.TestCase):

  def test_versions_are_recorded(self):
    versions = gpu_report.versions()
    self.assertEqual(versions["python"], platform.python_version())
    self.assertEqual(versions["jax"], jax.__version__)
    self.assertIsNotNone(versions["jaxlib"])
    self.assertContainsSubset({"triton", "jax_triton"}, versions)

  def test_lower_only_lowers_every_program_for_cuda(self):
    """--lower_only at the full D and F, fewer rows: no GPU needed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      code = gpu_check.main(["--lower_only", "--tokens", "256"])
    log = out.getvalue()
    print(log)
    self.assertEqual(code, 0, log)
    self.assertRegex(log, r"lowered (\d+)/\1 programs for CUDA")
    self.assertIn("Pallas Triton deprecation warnings filtered:", log)


class TablesTest(absltest.TestCase):

  def test_correctness_cases_keep_padding_rows(self):
    for m, _, _, sizes, _ in gpu_workloads.GEMM_CASES:
      self.assertLess(sum(sizes), m, sizes)
    for m, _, _, sizes in gpu_workloads.FFN_CASES:
      self.assertLess(sum(sizes), m, sizes)

  def test_correctness_covers_the_timed_gpu_tiles(self):
    """A GEMM and an FFN case run the tiles the timed shapes run on a GPU."""

    def gpu_fwd(m, c, n, e, operands=1):
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

    full = gpu_workloads.FULL
    rows = full["tokens"] * full["top_k"]
    timed = gpu_fwd(rows, full["hidden"], full["ffn"], full["experts"])
    timed_fused = gpu_fwd(rows, full["hidden"], full["ffn"], full["experts"], 2)
    self.assertEqual(timed, tiling.GPU_TILES["gmm_bf16_large"])
    self.assertIn(
        timed,
        [
            gpu_fwd(m, c, n, len(s))
            for m, c, n, s, _ in gpu_workloads.GEMM_CASES
        ],
    )
    self.assertIn(
        timed_fused,
        [gpu_fwd(m, d, f, len(s), 2) for m, d, f, s in gpu_workloads.FFN_CASES],
    )

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
