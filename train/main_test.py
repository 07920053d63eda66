"""The program end to end: flags in, logs, plot, summary and checkpoints out."""

import io
import json
import os

from absl import app
from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

from train import main
from train.testing import small_runs


def setUpModule():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


class MainTest(absltest.TestCase):

  def test_trains_reports_and_resumes(self):
    out_dir = small_runs.temp_dir(self)
    common = dict(
        model="tiny_dsv3",
        moe_backend="xla",
        batch_size=2,
        seq_len=32,
        eval_every=2,
        eval_batches=1,
        checkpoint_every=2,
        log_every=1,
        output_dir=out_dir,
        progress=False,
    )
    with flagsaver.flagsaver(steps=3, **common):
      log = io.StringIO()
      summary = main.train(log)
    text = log.getvalue()
    self.assertIn("unigram byte entropy 3.2", text)
    self.assertIn("backend xla", text)
    self.assertIn("load min/max over mean L1:", text)
    self.assertIn("held-out loss", text)
    self.assertEqual(summary["steps"], 3)
    self.assertEqual(summary["max_dropped_fraction"], 0.0)

    with open(os.path.join(out_dir, "summary.json")) as f:
      saved = json.load(f)
    self.assertEqual(
        saved["final_held_out_loss"], summary["final_held_out_loss"]
    )
    with open(os.path.join(out_dir, "training.png"), "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    self.assertEqual([r["step"] for r in records], [1, 2, 3])
    # tiny_dsv3: layer 0 dense, layers 1-3 MoE.
    self.assertLen(records[0]["load_max"], 3)
    self.assertEqual(records[0]["dropped_fraction"], [0.0, 0.0, 0.0])
    self.assertTrue(
        os.path.isdir(os.path.join(out_dir, "checkpoints", "step_00000003"))
    )

    with flagsaver.flagsaver(steps=4, resume=True, **common):
      log = io.StringIO()
      summary = main.train(log)
    self.assertIn("resumed from", log.getvalue())
    self.assertIn("at step 3", log.getvalue())
    self.assertEqual(summary["steps"], 4)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
      self.assertEqual([json.loads(line)["step"] for line in f], [1, 2, 3, 4])

    # The example: the recorded step edited by hand. The resume is
    # refused, one line naming the file and the field, before any training.
    meta_path = os.path.join(
        out_dir, "checkpoints", "step_00000004", "meta", "meta.json"
    )
    with open(meta_path) as f:
      meta = json.load(f)
    meta["step"] = -5
    with open(meta_path, "w") as f:
      json.dump(meta, f)
    with flagsaver.flagsaver(steps=6, resume=True, **common):
      with self.assertRaisesRegex(
          app.UsageError,
          r"step_00000004' is corrupt or was edited: meta/meta.json field "
          r"'step' has checksum",
      ):
        main.train(io.StringIO())
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
      self.assertLen(f.readlines(), 4)


if __name__ == "__main__":
  absltest.main()
