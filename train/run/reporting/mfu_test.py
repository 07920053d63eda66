"""MFU: the peaks by device kind, the per-step record and its console line."""

from absl.testing import absltest
import numpy as np

from train.run.reporting import mfu
from train.run.reporting import step_log
from train.testing import small_runs


class PeakOfTest(absltest.TestCase):

  def test_tpus_by_the_kind_jax_reports(self):
    # jax/_src/tpu_info.py: a v5e reports "TPU v5 lite", a v5p "TPU v5",
    # a v6e "TPU v6 lite"; the marketing names are accepted too.
    for kind, name, per_device in (
        ("TPU v5 lite", "TPU v5e", 197e12),
        ("TPU v5e", "TPU v5e", 197e12),
        ("tpu  V5 Lite", "TPU v5e", 197e12),
        ("TPU v5", "TPU v5p", 459e12),
        ("TPU v5p", "TPU v5p", 459e12),
        ("TPU v6 lite", "TPU v6e", 918e12),
        # Two devices (TensorCores) per chip of 2,307 TFLOP/s.
        ("TPU7x", "TPU7x", 2307e12 / 2),
    ):
      with self.subTest(kind):
        peak = mfu.peak_of(kind)
        self.assertEqual(peak.name, name)
        self.assertEqual(peak.flops_per_device, per_device)

  def test_gpus_by_a_fragment_of_their_kind(self):
    self.assertEqual(
        mfu.peak_of("NVIDIA H100 80GB HBM3").flops_per_chip, 989e12
    )
    self.assertEqual(mfu.peak_of("NVIDIA H200").flops_per_chip, 989e12)
    self.assertEqual(mfu.peak_of("NVIDIA B200").flops_per_chip, 2250e12)

  def test_unknown_kinds_have_no_peak(self):
    for kind in ("cpu", "", "TPU v4", "NVIDIA GB200", "NVIDIA A100-SXM4-80GB"):
      with self.subTest(kind):
        self.assertIsNone(mfu.peak_of(kind))

  def test_describe_says_once_why_there_is_no_mfu(self):
    line = mfu.describe("cpu", None, 1e6)
    self.assertIn("not reported", line)
    self.assertIn("'cpu'", line)
    line = mfu.describe("TPU v5 lite", mfu.peak_of("TPU v5 lite"), 6e9)
    self.assertIn("TPU v5e", line)
    self.assertIn("197.0 TFLOP/s", line)


class StepRecordTest(absltest.TestCase):

  def _record(self, peak):
    run = small_runs.small_run("/unused")
    layers = run.model.num_moe_layers
    experts = run.model.moe.num_experts
    metrics = {
        "loss": 2.0,
        "total_loss": 2.0,
        "grad_norm": 1.0,
        "tokens_per_expert": np.full((layers, experts), 4),
        "dropped": np.zeros(layers),
        "invalid": np.zeros(layers, np.int32),
    }
    record = step_log.log_step(
        step_log.new_history(),
        run,
        1,
        metrics,
        0.5,
        flops_per_token=6e9,
        peak=peak,
    )
    return run, record

  def test_mfu_is_model_flops_over_the_peak(self):
    peak = mfu.peak_of("TPU v5 lite")
    run, record = self._record(peak)
    # One device: batch_size x seq_len tokens in 0.5 s, 6e9 FLOPs each.
    tokens_per_s = run.batch_size * run.seq_len / 0.5
    self.assertAlmostEqual(record["mfu"], tokens_per_s * 6e9 / 197e12)
    self.assertIn(
        f" MFU {record['mfu']:.1%}", step_log.format_record(run, record)
    )

  def test_no_peak_no_mfu(self):
    run, record = self._record(None)
    self.assertNotIn("mfu", record)
    self.assertNotIn("MFU", step_log.format_record(run, record))


if __name__ == "__main__":
  absltest.main()
