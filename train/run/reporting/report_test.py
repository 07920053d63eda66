"""The end-of-run report where matplotlib is missing: one line, no error."""

import io
import json
import os
import sys
import types
from unittest import mock

from absl import flags
from absl.testing import absltest
import numpy as np

from train import main
from train.presets import sizing
from train.run.reporting import mfu
from train.run.reporting import report
from train.run.reporting import step_log
from train.testing import small_runs


def setUpModule():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


def _history(run, steps: int) -> dict:
  history = step_log.new_history()
  layers = run.model.num_moe_layers
  for step in range(1, steps + 1):
    step_log.log_step(
        history,
        run,
        step,
        {
            "loss": 3.0 - 0.1 * step,
            "total_loss": 3.0,
            "grad_norm": 1.0,
            "tokens_per_expert": np.full(
                (layers, run.model.moe.num_experts), 4
            ),
            "dropped": np.zeros(layers),
            "invalid": np.zeros(layers, np.int32),
        },
        0.25,
    )
  return history


class PlotWithoutMatplotlibTest(absltest.TestCase):

  def test_unavailable_says_why_in_one_line(self):
    self.assertIsNone(report.plot_unavailable())  # Installed here.
    with mock.patch.dict(sys.modules, {"matplotlib": None}):
      line = report.plot_unavailable()
    self.assertNotIn("\n", line)
    for text in ("plot skipped", "matplotlib", "--noplot"):
      self.assertIn(text, line)

  def test_the_report_skips_the_plot_and_writes_the_summary(self):
    out_dir = small_runs.temp_dir(self)
    run = small_runs.small_run(out_dir, plot=True)
    history = _history(run, 3)
    summary = report.run_summary(
        run,
        small_runs.corpus(),
        history,
        steps=3,
        backend="xla",
        wall_seconds=1.0,
        checkpoint_path=None,
        interrupted=None,
    )
    out = io.StringIO()
    with mock.patch.dict(sys.modules, {"matplotlib": None}):
      got = main._report(
          run, types.SimpleNamespace(history=history), summary, out
      )
    self.assertNotIn("plot", got)
    self.assertFalse(os.path.exists(os.path.join(out_dir, "training.png")))
    skipped = [l for l in out.getvalue().splitlines() if "plot skipped" in l]
    self.assertLen(skipped, 1)
    with open(os.path.join(out_dir, "summary.json")) as f:
      self.assertEqual(json.load(f)["steps"], 3)

  def test_the_report_draws_the_plot_with_matplotlib(self):
    out_dir = small_runs.temp_dir(self)
    run = small_runs.small_run(out_dir, plot=True)
    history = _history(run, 3)
    summary = report.run_summary(
        run,
        small_runs.corpus(),
        history,
        steps=3,
        backend="xla",
        wall_seconds=1.0,
        checkpoint_path=None,
        interrupted=None,
    )
    out = io.StringIO()
    got = main._report(
        run, types.SimpleNamespace(history=history), summary, out
    )
    self.assertTrue(os.path.exists(got["plot"]))
    self.assertNotIn("plot skipped", out.getvalue())


class SummaryMfuTest(absltest.TestCase):

  def _summary(self, peak):
    run = small_runs.small_run("/unused")
    return run, report.run_summary(
        run,
        small_runs.corpus(),
        _history(run, 5),
        steps=5,
        backend="xla",
        wall_seconds=1.0,
        checkpoint_path=None,
        interrupted=None,
        peak=peak,
    )

  def test_median_mfu_against_the_peak(self):
    run, summary = self._summary(mfu.peak_of("TPU v5 lite"))
    # Every step took 0.25 s: batch_size x seq_len / 0.25 tokens/s.
    tokens_per_s = run.batch_size * run.seq_len / 0.25
    flops = sizing.flops_per_token(run.model, run.seq_len)["train"]
    self.assertEqual(summary["model_flops_per_token"], flops)
    want = tokens_per_s * flops / 197e12
    self.assertAlmostEqual(summary["mfu_median"], want)
    self.assertEqual(summary["peak_flops_per_device"], 197e12)

  def test_no_peak_no_mfu(self):
    _, summary = self._summary(None)
    self.assertIsNone(summary["mfu_median"])
    self.assertIsNone(summary["peak_flops_per_device"])


if __name__ == "__main__":
  absltest.main()
