"""Checkpoints: exact resume, and clear refusals of bad checkpoints."""

import copy
import dataclasses
import io
import json
import os
import shutil
import signal
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from train import checkpoint
from train import testing
from train import trainer


def _fit(run, interrupt_after=None):
  tr = trainer.Trainer(run, testing.corpus(), out=None)
  tr.prepare_output_dir()
  if interrupt_after is not None:
    # Ctrl-C lands inside step interrupt_after + 1, after its batch was drawn.
    real_step, done = tr.train_step, []

    def interrupted_step(batch):
      if len(done) == interrupt_after:
        raise KeyboardInterrupt
      done.append(None)
      return real_step(batch)

    tr.train_step = interrupted_step
  summary = tr.fit()
  return tr, summary


class ResumeTest(absltest.TestCase):

  def test_interrupted_and_resumed_run_equals_uninterrupted_run(self):
    steps = 6
    straight, _ = _fit(
        testing.small_run(testing.temp_dir(self), steps=steps, eval_every=3)
    )

    out = testing.temp_dir(self)
    run = testing.small_run(out, steps=steps, eval_every=3)
    first, summary = _fit(run, interrupt_after=4)
    self.assertEqual(summary["interrupted"], "KeyboardInterrupt")
    self.assertEqual(first.step, 4)
    self.assertEqual(
        checkpoint.latest(os.path.join(out, "checkpoints")),
        os.path.join(out, "checkpoints", "step_00000004"),
    )

    resumed, summary = _fit(dataclasses.replace(run, resume=True))
    self.assertIsNone(summary["interrupted"])
    self.assertEqual(resumed.step, steps)
    # The same loss at the same step, bit for bit, and the same end state.
    self.assertEqual(resumed.history["step"], list(range(1, steps + 1)))
    self.assertEqual(resumed.history["loss"], straight.history["loss"])
    self.assertEqual(
        resumed.history["eval_loss"], straight.history["eval_loss"]
    )
    for a, b in zip(
        jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state)
    ):
      np.testing.assert_array_equal(a, b)
    with open(os.path.join(out, "metrics.jsonl")) as f:
      logged = [json.loads(line)["step"] for line in f]
    self.assertEqual(logged, list(range(1, steps + 1)))

    # A run killed hard after its step-4 checkpoint: step 5 was logged but
    # not saved. The resumed run redoes step 5 and logs it once.
    out = testing.temp_dir(self)
    run = dataclasses.replace(run, output_dir=out, checkpoint_every=4)
    _fit(run, interrupt_after=5)
    shutil.rmtree(os.path.join(out, "checkpoints", "step_00000005"))
    resumed, _ = _fit(dataclasses.replace(run, resume=True))
    self.assertEqual(resumed.history["loss"], straight.history["loss"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    self.assertEqual([r["step"] for r in records], list(range(1, steps + 1)))
    self.assertEqual([r["loss"] for r in records], straight.history["loss"])

  def test_ctrl_c_finishes_the_step_then_checkpoints_and_resumes_exactly(self):
    steps = 5
    straight, _ = _fit(
        testing.small_run(testing.temp_dir(self), steps=steps, eval_every=3)
    )
    out = testing.temp_dir(self)
    run = testing.small_run(out, steps=steps, eval_every=3)
    tr = trainer.Trainer(run, testing.corpus(), out=None)
    tr.prepare_output_dir()
    # A real SIGINT, delivered while step 3 is in flight (dispatched, its
    # metrics not yet on the host). The program is shared between trainers
    # of equal runs: patch a copy.
    tr.program = copy.copy(tr.program)
    real_step, calls = tr.program.train_step, []

    def step_hit_by_ctrl_c(state, batch):
      calls.append(None)
      result = real_step(state, batch)
      if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGINT)
      return result

    tr.program.train_step = step_hit_by_ctrl_c
    before = signal.getsignal(signal.SIGINT)
    summary = tr.fit(handle_signals=True)
    self.assertIs(signal.getsignal(signal.SIGINT), before)
    self.assertEqual(summary["interrupted"], "SIGINT")
    self.assertEqual(tr.step, 3)
    self.assertEqual(tr.history["loss"], straight.history["loss"][:3])
    self.assertEqual(
        checkpoint.latest(os.path.join(out, "checkpoints")),
        os.path.join(out, "checkpoints", "step_00000003"),
    )

    resumed, _ = _fit(dataclasses.replace(run, resume=True))
    self.assertEqual(resumed.history["loss"], straight.history["loss"])
    for a, b in zip(
        jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state)
    ):
      np.testing.assert_array_equal(a, b)

  def test_resume_without_a_checkpoint_is_an_error(self):
    run = testing.small_run(testing.temp_dir(self), resume=True)
    tr = trainer.Trainer(run, testing.corpus(), out=None)
    with self.assertRaisesRegex(
        checkpoint.CheckpointError,
        r"--resume: no checkpoint in .*; run without",
    ):
      tr.prepare_output_dir()


class RefusalTest(absltest.TestCase):
  """One small saved run, then damaged or mismatched copies of it."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._dir = tempfile.TemporaryDirectory(prefix="dropless_ckpt_test_")
    cls.run_config = testing.small_run(
        cls._dir.name, steps=1, checkpoint_every=1
    )
    cls.trainer, _ = _fit(cls.run_config)
    cls.path = checkpoint.latest(os.path.join(cls._dir.name, "checkpoints"))

  @classmethod
  def tearDownClass(cls):
    cls._dir.cleanup()
    super().tearDownClass()

  def _copy(self):
    target = os.path.join(testing.temp_dir(self), "step_00000001")
    shutil.copytree(self.path, target)
    return target

  def _restore(self, path, run=None):
    tr = self.trainer
    run = run or self.run_config
    return checkpoint.restore(
        path, tr.state, fingerprint=run.fingerprint(tr.corpus.name)
    )

  def test_intact_checkpoint_restores_exactly(self):
    state, meta = self._restore(self._copy())
    self.assertEqual(meta["step"], 1)
    for a, b in zip(
        jax.tree.leaves(state), jax.tree.leaves(self.trainer.state)
    ):
      np.testing.assert_array_equal(a, b)
      self.assertEqual(a.dtype, b.dtype)

  def test_flipped_byte_is_refused(self):
    path = self._copy()
    arrays = os.path.join(path, checkpoint.ARRAYS)
    with open(arrays, "r+b") as f:
      f.seek(os.path.getsize(arrays) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0xFF]))
    with self.assertRaisesRegex(
        checkpoint.CheckpointError, r"is corrupt: sha256 of arrays.npz is"
    ):
      self._restore(path)

  def test_truncated_meta_is_refused(self):
    path = self._copy()
    meta = os.path.join(path, checkpoint.META)
    with open(meta) as f:
      text = f.read()
    with open(meta, "w") as f:
      f.write(text[: len(text) // 2])
    with self.assertRaisesRegex(
        checkpoint.CheckpointError, r"is corrupt: meta.json is not valid JSON"
    ):
      self._restore(path)

  def test_missing_arrays_are_refused(self):
    path = self._copy()
    os.remove(os.path.join(path, checkpoint.ARRAYS))
    with self.assertRaisesRegex(
        checkpoint.CheckpointError, r"is incomplete: arrays.npz is missing"
    ):
      self._restore(path)

  def test_other_model_is_refused_naming_the_difference(self):
    model = self.run_config.model.replace(
        moe=self.run_config.model.moe.replace(
            num_experts=4, n_group=2, topk_group=1
        )
    )
    other = dataclasses.replace(self.run_config, model=model)
    with self.assertRaisesRegex(
        checkpoint.CheckpointError,
        r"different run configuration.*model\.moe\.num_experts: checkpoint "
        r"has 8, this run has 4",
    ):
      self._restore(self._copy(), other)

  def test_other_batch_size_is_refused(self):
    other = dataclasses.replace(self.run_config, batch_size=2)
    with self.assertRaisesRegex(
        checkpoint.CheckpointError,
        r"batch_size: checkpoint has 4, this run has 2",
    ):
      self._restore(self._copy(), other)

  def test_other_state_structure_is_refused(self):
    template = dict(self.trainer.state)
    template["extra_leaf"] = np.zeros(3, np.float32)
    with self.assertRaisesRegex(
        checkpoint.CheckpointError,
        r"different state structure: missing " r"\[\"\['extra_leaf'\]\"\]",
    ):
      checkpoint.restore(
          self._copy(),
          template,
          fingerprint=self.run_config.fingerprint(self.trainer.corpus.name),
      )

  def test_other_leaf_shape_is_refused(self):
    template = jax.tree.map(lambda x: x, self.trainer.state)
    leaves, treedef = jax.tree.flatten(template)
    leaves[0] = np.zeros((7,) + np.shape(leaves[0]), np.float32)
    with self.assertRaisesRegex(
        checkpoint.CheckpointError, r"leaf .* must be float32\[7, "
    ):
      checkpoint.restore(
          self._copy(),
          jax.tree.unflatten(treedef, leaves),
          fingerprint=self.run_config.fingerprint(self.trainer.corpus.name),
      )

  def test_resume_with_changed_hyperparameters_says_so(self):
    out = io.StringIO()
    run = dataclasses.replace(self.run_config, weight_decay=0.5, grad_clip=2.0)
    tr = trainer.Trainer(run, testing.corpus(), out=out)
    tr.restore_checkpoint(self._copy())
    self.assertEqual(tr.step, 1)
    note = out.getvalue()
    self.assertIn("will not match an uninterrupted one", note)
    self.assertIn("'weight_decay': (0.1, 0.5)", note)
    self.assertIn("'grad_clip': (1.0, 2.0)", note)
    self.assertNotIn("learning_rate", note)

  def test_resume_refuses_a_corrupt_latest_checkpoint(self):
    out = testing.temp_dir(self)
    shutil.copytree(
        os.path.dirname(self.path), os.path.join(out, "checkpoints")
    )
    os.remove(
        os.path.join(out, "checkpoints", "step_00000001", checkpoint.META)
    )
    tr = trainer.Trainer(
        dataclasses.replace(self.run_config, output_dir=out, resume=True),
        testing.corpus(),
        out=None,
    )
    with self.assertRaisesRegex(
        checkpoint.CheckpointError, "meta.json is missing"
    ):
      tr.prepare_output_dir()


class AtomicityTest(absltest.TestCase):

  def test_unfinished_save_is_invisible_and_old_ones_are_pruned(self):
    directory = testing.temp_dir(self)
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    for step in (1, 2, 3):
      checkpoint.save(directory, step, state, fingerprint={}, keep=2)
    # A save killed before its rename leaves only a hidden temporary dir.
    os.makedirs(os.path.join(directory, ".tmp-step_00000004-123-abc"))
    self.assertEqual(
        [s for s, _ in checkpoint.list_checkpoints(directory)], [2, 3]
    )
    self.assertTrue(checkpoint.latest(directory).endswith("step_00000003"))

  def test_bfloat16_round_trips(self):
    directory = testing.temp_dir(self)
    state = {"w": jnp.linspace(-3, 3, 11).astype(jnp.bfloat16)}
    path = checkpoint.save(directory, 1, state, fingerprint={"a": 1})
    restored, _ = checkpoint.restore(path, state, fingerprint={"a": 1})
    self.assertEqual(restored["w"].dtype, jnp.bfloat16)
    np.testing.assert_array_equal(restored["w"], state["w"])


if __name__ == "__main__":
  absltest.main()
