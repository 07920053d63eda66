"""bench/tpu_check on the CPU: its --dry_run phase by phase, and its tables.

The TPU session runs tpu_check a few times against a short device budget,
so this is its rehearsal: each phase's dry run (kernels interpreted, tiny
shapes), whose JSON must hold every measurement, the failed tile recorded
beside the ones that ran, and mosaic_tpu interpreted where it imports
(skipped, saying why, where it does not). Then what needs no compile: the
sweep's best tiles, the ratios, the training logs, the markdown.
"""

import json
import os
import shutil
import tempfile

from absl.testing import absltest
import numpy as np

from bench.micro import gemm_methods
from bench.on_device import gpu_conformance
from bench.on_device import tpu_check
from bench.on_device import tpu_report
from bench.on_device import tpu_timing

_OURS_MISSING = gemm_methods.our_status(interpret=True)


def _dry_run(test, *flags):
  """(exit code, the JSON, its folder) of `tpu_check --dry_run` with
  `flags`. Their deadlines are generous: a loaded CI machine took 195 s
  for the training dry run that takes 50 s alone."""
  out_dir = tempfile.mkdtemp()
  test.addCleanup(shutil.rmtree, out_dir, ignore_errors=True)
  code = tpu_check.main(["--dry_run", f"--out_dir={out_dir}", *flags])
  with open(os.path.join(out_dir, tpu_check.REPORT_NAME)) as fh:
    return code, json.load(fh), out_dir


class DryRunTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if _OURS_MISSING:
      print(f"mosaic_tpu is not rehearsed: {_OURS_MISSING}")

  def test_sweep_records_tiles_and_the_failed_one(self):
    code, report, _ = _dry_run(self, "--phases=sweep", "--deadline_s=600")
    self.assertEqual(code, 0, report.get("failures"))
    self.assertEqual(report["phases"]["sweep"]["status"], "done")
    self.assertEqual(report["device"], "cpu")
    rows = report["sweep"]["rows"]
    megablox = [r for r in rows if r["impl"] == "megablox"]
    failed = [r for r in megablox if "error" in r]
    self.assertLen(failed, len(gemm_methods.PASSES))  # (384, ...): one a pass.
    self.assertIn("divisible", failed[0]["error"])
    timed = [r for r in rows if "even" in r]
    self.assertNotEmpty(timed)
    for r in timed:
      self.assertGreater(r["zipf"]["tflops"], 0, r)
    best = {
        (b["impl"], b["routing"], b["pass"]) for b in report["sweep"]["best"]
    }
    impls = ["megablox"] + ([] if _OURS_MISSING else [gemm_methods.OURS])
    for impl in impls:
      for routing in (*gemm_methods.ROUTINGS, "all"):
        for p in gemm_methods.PASSES:
          self.assertIn((impl, routing, p), best)
    if _OURS_MISSING:
      self.assertIn(gemm_methods.OURS, report["sweep"]["skipped"])

  def test_timing_times_every_method_and_layer(self):
    code, report, _ = _dry_run(self, "--phases=timing", "--deadline_s=600")
    self.assertEqual(code, 0, report.get("failures"))
    methods = ["dense", "ragged_dot", "xla", "megablox"]
    if not _OURS_MISSING:
      methods.append(gemm_methods.OURS)
    gemm = {(r["variant"], r["routing"], r["mode"]): r for r in report["gemm"]}
    for v in methods:
      for routing in gemm_methods.ROUTINGS:
        for p in gemm_methods.PASSES:
          row = gemm[v, routing, p]
          self.assertGreater(row["tflops"], 0, row)
          self.assertIsNotNone(row[f"{p}_time_over_dense"], row)
    if _OURS_MISSING:
      self.assertIn(
          "backend missing", gemm[gemm_methods.OURS, "even", "fwd"]["skipped"]
      )
    layer = {r["variant"]: r for r in report["layer"]}
    for v in ("dense_ffn", "xla", "megablox") + (
        () if _OURS_MISSING else (gemm_methods.OURS,)
    ):
      self.assertGreater(layer[v]["seconds"], 0, layer[v])
      self.assertIsNotNone(layer[v]["fwd_bwd_time_over_dense_ffn"])
    if not _OURS_MISSING:
      zipf = layer[f"{gemm_methods.OURS}@zipf"]
      self.assertGreater(zipf["seconds"], 0, zipf)
      self.assertIsNotNone(
          zipf[f"fwd_bwd_time_over_{gemm_methods.OURS}@uniform"]
      )
      # The dry layer: 4 experts, top-2, so a share of at most 1/2.
      self.assertGreater(
          zipf["largest_group_share"],
          layer[f"{gemm_methods.OURS}@uniform"]["largest_group_share"],
      )
      self.assertLessEqual(zipf["largest_group_share"], 0.5)
    self.assertTrue(report["ratios"])

  def test_conformance_runs_each_backend_in_turn(self):
    code, report, _ = _dry_run(self, "--phases=conformance", "--deadline_s=600")
    self.assertEqual(code, 0, report.get("failures"))
    entries = {e["variant"]: e for e in report["conformance"]}
    self.assertEqual(entries["xla"]["status"], "passed", str(entries["xla"]))
    self.assertEqual(entries["xla"]["ran"], 1)
    if _OURS_MISSING:
      self.assertEqual(entries[gemm_methods.OURS]["status"], "skipped")
      self.assertIn("backend missing", entries[gemm_methods.OURS]["reason"])
    else:
      self.assertEqual(entries[gemm_methods.OURS]["status"], "passed")

  def test_a_filter_matching_no_test_is_no_pass(self):
    # -k matches test methods: a suite's class name selects nothing.
    _, report, _ = _dry_run(
        self,
        "--phases=conformance",
        "--conformance_backends=xla",
        "--conformance_filter=LayerSuite",
        "--deadline_s=600",
    )
    (entry,) = report["conformance"]
    self.assertEqual(entry["ran"], 0, entry)
    self.assertEqual(entry["status"], "failed", entry)
    self.assertEqual(entry["reason"], "ran no test")

  def test_train_runs_and_keeps_its_logs(self):
    code, report, out_dir = _dry_run(self, "--phases=train", "--deadline_s=600")
    self.assertEqual(code, 0, report.get("failures"))
    (train,) = report["train"]
    self.assertEqual(train["backend"], "xla")
    self.assertEqual(train["returncode"], 0, train["tail"])
    self.assertEqual(train["steps_done"], train["steps"])
    self.assertGreater(train["tokens_per_s"], 0)
    self.assertLen(train["losses"], train["steps"])
    self.assertIn("dry run", report["phases"]["train"]["preset_fallback"])
    self.assertTrue(
        os.path.exists(os.path.join(out_dir, "train_xla", "summary.json"))
    )

  def test_past_the_deadline_every_phase_is_skipped_and_written(self):
    code, report, _ = _dry_run(self, "--deadline_s=0")
    self.assertEqual(code, 0)
    self.assertEqual(list(report["phases"]), list(tpu_check.PHASES))
    for entry in report["phases"].values():
      self.assertEqual(entry["status"], "skipped: past the deadline")


class TableTest(absltest.TestCase):

  def test_best_tiles_per_routing_and_over_both(self):
    rows = [
        {
            "impl": "megablox",
            "shape": "s",
            "pass": "fwd",
            "tile": [1, 2, 3],
            "even": {"seconds": 1.0, "tflops": 2.0},
            "zipf": {"seconds": 4.0, "tflops": 0.5},
        },
        {
            "impl": "megablox",
            "shape": "s",
            "pass": "fwd",
            "tile": [4, 5, 6],
            "even": {"seconds": 2.0, "tflops": 1.0},
            "zipf": {"seconds": 2.5, "tflops": 0.8},
        },
        {
            "impl": "megablox",
            "shape": "s",
            "pass": "fwd",
            "tile": [7, 8, 9],
            "error": "ValueError: VMEM",
        },
    ]
    best = {b["routing"]: b["tile"] for b in tpu_timing.best_tiles(rows)}
    self.assertEqual(
        best, {"even": [1, 2, 3], "zipf": [4, 5, 6], "all": [4, 5, 6]}
    )
    report = {"sweep": {"best": tpu_timing.best_tiles(rows)}}
    self.assertEqual(
        tpu_timing.swept_tiles(report, "megablox", "s"), {"fwd": (4, 5, 6)}
    )
    self.assertEqual(tpu_timing.swept_tiles(report, "mosaic_tpu", "s"), {})

  def test_layer_expert_ids_draw_distinct_experts_by_routing(self):
    layer = gemm_methods.Layer("t", 32, 8, 128, 128, 4096)
    for routing in gemm_methods.LAYER_ROUTINGS:
      ids = gemm_methods.layer_expert_ids(layer, routing)
      self.assertEqual(ids.shape, (4096, 8))
      self.assertTrue(((ids >= 0) & (ids < 32)).all())
      # Each token's K experts are distinct.
      self.assertTrue((np.diff(np.sort(ids, axis=1), axis=1) > 0).all())
    share = lambda r: np.sort(
        np.bincount(
            gemm_methods.layer_expert_ids(layer, r).ravel(), minlength=32
        )
    )[::-1] / (4096 * 8)
    uniform, zipf = share("uniform"), share("zipf")
    self.assertLess(uniform[0], 1.2 / 32)
    # Zipf(1.5) without replacement: its head capped at 1/K, its tail far
    # below the uniform share.
    self.assertGreater(zipf[0], 0.11)
    self.assertLessEqual(zipf[0], 1 / 8)
    self.assertLess(zipf[-1], 0.3 / 32)
    with self.assertRaisesRegex(ValueError, "routing must be one of"):
      gemm_methods.layer_expert_ids(layer, "even")

  def test_our_tile_forms(self):
    self.assertEqual(
        gemm_methods.our_tile((512, 256, 1024)),
        {"bm": 512, "bk": 256, "bn": 1024},
    )
    self.assertEqual(gemm_methods.our_tile({"bm": 128}), {"bm": 128})
    cands, source = gemm_methods.our_candidates(gemm_methods.GEMMS[0], "dw")
    self.assertNotEmpty(cands)
    self.assertIsInstance(cands[0], dict, source)

  def test_megablox_candidates_fit_and_start_at_the_prior(self):
    gemm = gemm_methods.GEMMS[0]  # Mixtral up.
    for p in gemm_methods.PASSES:
      cands = gemm_methods.megablox_candidates(gemm, p)
      self.assertEqual(cands[0], gemm_methods.MEGABLOX_PRIOR)
      for tm, tk, tn in cands:
        self.assertEqual(gemm.m % tm, 0)
        self.assertLessEqual(
            gemm_methods._block_bytes(tm, tk, tn),
            gemm_methods.MEGABLOX_VMEM_BYTES,
        )
    qwen = [g for g in gemm_methods.GEMMS if g.name == "qwen3_30b_up"][0]
    self.assertIn(
        768, {t[2] for t in gemm_methods.megablox_candidates(qwen, "fwd")}
    )

  def test_read_training_and_ratio(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    with open(os.path.join(tmp, "metrics.jsonl"), "w") as fh:
      for step, (loss, tps) in enumerate(
          [(5.0, 10.0), (4.5, 90.0), (4.0, 100.0), (3.5, 110.0)], 1
      ):
        fh.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": tps}))
        fh.write("\n")
    got = tpu_check.read_training(tmp, peak_flops=1e12)
    self.assertEqual(got["steps_done"], 4)
    self.assertEqual(got["tokens_per_s"], 110.0)  # Steps 3 and 4: upper.
    self.assertTrue(got["loss_falls"])
    with open(os.path.join(tmp, "summary.json"), "w") as fh:
      json.dump({"tokens_per_s_median": 100.0, "params_active": 1e9}, fh)
    got = tpu_check.read_training(tmp, peak_flops=1e12)
    self.assertAlmostEqual(got["mfu_6n"], 0.6)
    ratio = tpu_check.train_ratio(
        [
            {"backend": "mosaic_tpu", "tokens_per_s": 200.0},
            {"backend": "xla", "tokens_per_s": 100.0},
        ]
    )
    self.assertEqual(ratio, {"step_time_over_xla": 0.5})

  def test_child_argv_drops_the_parents_own_flags(self):
    argv = [
        "--dry_run",
        "--out_dir",
        "/a",
        "--child=sweep",
        "--quick",
        "--out_dir=/b",
    ]
    self.assertEqual(
        tpu_check._without(argv, ("--child", "--out_dir")),
        ["--dry_run", "--quick"],
    )

  def test_killed_conformance_child_counts_its_verbose_lines(self):
    out = (
        "test_a (m.C.test_a) ... ok\n"
        "test_b (m.C.test_b) ... a warning\nFAIL\n"
        "test_c (m.C.test_c) ... skipped 'no'\n"
    )
    entry = gpu_conformance._merge([(None, out)])
    self.assertEqual(entry["status"], "incomplete")
    self.assertEqual(
        (entry["ran"], entry["failures"], entry["skipped"]), (3, 1, 1)
    )
    self.assertEqual(entry["failed_tests"], ["test_b"])

  def test_markdown_has_every_section(self):
    report = {
        "git_commit": "abc",
        "device": "TPU v5 lite",
        "jax": "0.10.2",
        "seconds": 1.0,
        "phases": {
            "train": {"status": "done", "ratio": {"step_time_over_xla": 0.8}}
        },
        "sweep": {
            "best": [
                {
                    "impl": "megablox",
                    "shape": "s",
                    "routing": "even",
                    "pass": "fwd",
                    "tile": [1, 2, 3],
                    "tflops": 9.0,
                }
            ]
        },
        "gemm": [
            {
                "workload": "s/even",
                "mode": "fwd",
                "variant": "dense",
                "seconds": 1.0,
                "tflops": 100.0,
            },
            {
                "workload": "s/even",
                "mode": "fwd",
                "variant": "mosaic_tpu",
                "seconds": 2.0,
                "tflops": 50.0,
                "fwd_time_over_dense": 2.0,
            },
        ],
        "layer": [
            {
                "workload": "l",
                "mode": "fwd_bwd",
                "variant": "mosaic_tpu",
                "seconds": 0.002,
                "fwd_bwd_time_over_dense_ffn": 1.2,
            }
        ],
        "conformance": [
            {
                "variant": "xla",
                "status": "passed",
                "ran": 3,
                "failures": 0,
                "errors": 0,
                "skipped": 1,
            }
        ],
        "train": [
            {
                "backend": "xla",
                "preset": "p",
                "steps": 3,
                "steps_done": 3,
                "tokens_per_s": 1000.0,
            }
        ],
    }
    text = tpu_report.markdown(report)
    for heading in (
        "Tile sweep",
        "Grouped GEMM",
        "MoE layer",
        "Conformance",
        "Training",
    ):
      self.assertIn(heading, text)
    self.assertIn("| s/even | fwd | 100 | 50 | 2.00 |", text)
    self.assertIn("step time / xla: 0.80", text)
    kinds = [r["kind"] for r in tpu_report.ratio_table(report)]
    self.assertEqual(kinds, ["gemm", "layer", "train"])


if __name__ == "__main__":
  absltest.main()
