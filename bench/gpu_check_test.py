"""bench/gpu_check's --dry_run on the CPU: the JSON, the checks, failures.

The GPU session runs gpu_check once, so whatever fails there must still be
reported: here a correctness case that raises, a method whose backward
raises, one with wrong output and a backend that cannot be built each leave
the JSON written, with the error recorded, the other methods timed and
their ratios computed. Shapes and cases are cut down (in-process, by
patching gpu_workloads' tables) so that each run compiles little; mosaic_gpu
(Mosaic GPU's interpreter, seconds a call) runs in the passing dry run
only, on one GEMM case and the small-K row.
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

import moe_core
from backends.mosaic_gpu import tiling as mosaic_tiling
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
    "workloads",
    "skew",
    "repeats",
    "budget_s",
    "seconds",
    "triton_deprecation_warnings",
    "backends",
    "correctness",
    "timing",
    "goals",
    "failures",
}
_RATIO_BASELINES = ("dense", "ragged_dot", "pallas")


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
    self.assertEqual(
        [w["name"] for w in report["workloads"]], ["dry", "dry_small_k"]
    )
    for w in report["workloads"]:
      self.assertEqual(sum(w["group_sizes"]), w["rows"])
      self.assertEqual(w["experts"], "all of the model's")
    # jax 0.10.2's Mosaic GPU interpreter cannot run the kernels: there
    # every mosaic_gpu case and method is skipped, with the backend's reason.
    mosaic_ok, why_not = moe_core.get_backend(
        "mosaic_gpu", interpret=True
    ).availability()
    self.assertIn(
        "MosaicGpuBackend" if mosaic_ok else "Unavailable",
        report["backends"]["mosaic"],
    )
    cases = {r["case"].split()[0] for r in report["correctness"]}
    self.assertEqual(cases, {"gemm", "expert_ffn", "moe_layer"})
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

    self.assertEqual(
        [
            (row["workload"], row["problem"].split()[0])
            for row in report["timing"]
        ],
        [
            ("dry", "gemm_up"),
            ("dry", "gemm_down"),
            ("dry", "expert_ffn"),
            ("dry_small_k", "gemm_down"),
        ],
    )
    phases = {w["name"]: w["phases"] for w in report["workloads"]}
    for row in report["timing"]:
      for method, entry in row["methods"].items():
        label = f"{row['workload']} {row['problem']} {method}"
        self.assertNotIn("error", entry, label)
        if "skipped" in entry:
          self.assertEqual(entry["skipped"], why_not, label)
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
    small_k = report["timing"][3]["methods"]
    self.assertEqual(list(small_k), ["dense", "pallas", "mosaic_gpu"])
    self.assertIsNotNone(small_k["pallas"]["fwd_time_over_dense"])
    self.assertNotIn("fwd_bwd_s", small_k["pallas"])
    goals = {g["goal"].split()[-1]: g for g in report["goals"]}
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
        mock.patch.object(gpu_correctness, "layer_cases", lambda *args: None),
    ):
      code, report = _run_dry(self)
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


class VersionsAndLoweringTest(absltest.TestCase):

  def test_versions_are_recorded(self):
    versions = gpu_report.versions()
    self.assertEqual(versions["python"], platform.python_version())
    self.assertEqual(versions["jax"], jax.__version__)
    self.assertIsNotNone(versions["jaxlib"])
    self.assertContainsSubset({"triton", "jax_triton"}, versions)

  def test_lower_only_lowers_every_program_for_cuda(self):
    """--lower_only at the full D and F, fewer rows: no GPU needed.

    DeepSeek-V3's and the small-K programs: Mixtral's are the same programs
    at other sizes, and would add 10 s.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      code = gpu_check.main(
          [
              "--lower_only",
              "--tokens",
              "256",
              "--workloads",
              "deepseek_v3,small_k",
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


class TablesTest(absltest.TestCase):

  def test_correctness_cases_keep_padding_rows(self):
    for m, _, _, sizes, _ in gpu_workloads.GEMM_CASES:
      self.assertLess(sum(sizes), m, sizes)
    for m, _, _, sizes in gpu_workloads.FFN_CASES:
      self.assertLess(sum(sizes), m, sizes)

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
