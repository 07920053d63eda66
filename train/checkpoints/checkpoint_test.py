"""Checkpoints: exact resume, and clear refusals of bad checkpoints."""

import copy
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train.checkpoints import checkpoint
from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_meta
from train.checkpoints import checksum
from train.run.reporting import step_log
from train.run.training import trainer
from train.testing import small_runs


class ResumeTest(absltest.TestCase):

  def test_interrupted_and_resumed_run_equals_uninterrupted_run(self):
    steps = 6
    straight, _ = small_runs.fit(
        small_runs.small_run(
            small_runs.temp_dir(self), steps=steps, eval_every=3
        )
    )

    out = small_runs.temp_dir(self)
    run = small_runs.small_run(out, steps=steps, eval_every=3)
    first, summary = small_runs.fit(run, interrupt_after=4)
    self.assertEqual(summary["interrupted"], "KeyboardInterrupt")
    self.assertEqual(first.step, 4)
    self.assertEqual(
        checkpoint_dirs.latest(os.path.join(out, "checkpoints")),
        os.path.join(out, "checkpoints", "step_00000004"),
    )

    resumed, summary = small_runs.fit(dataclasses.replace(run, resume=True))
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
    out = small_runs.temp_dir(self)
    run = dataclasses.replace(run, output_dir=out, checkpoint_every=4)
    small_runs.fit(run, interrupt_after=5)
    shutil.rmtree(os.path.join(out, "checkpoints", "step_00000005"))
    resumed, _ = small_runs.fit(dataclasses.replace(run, resume=True))
    self.assertEqual(resumed.history["loss"], straight.history["loss"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    self.assertEqual([r["step"] for r in records], list(range(1, steps + 1)))
    self.assertEqual([r["loss"] for r in records], straight.history["loss"])

  def test_log_on_disk_keeps_every_step_while_a_resumed_run_trains(self):
    # What a SIGKILL would leave: the file as it is on disk mid-run.
    out = small_runs.temp_dir(self)
    run = small_runs.small_run(out, steps=6, eval_every=3)
    small_runs.fit(run, interrupt_after=3)
    tr = trainer.Trainer(
        dataclasses.replace(run, resume=True), small_runs.corpus(), out=None
    )
    tr.prepare_output_dir()
    real_step, on_disk = tr.train_step, []

    def step_reading_the_log(batch):
      with open(os.path.join(out, "metrics.jsonl")) as f:
        on_disk.append([json.loads(line)["step"] for line in f])
      return real_step(batch)

    tr.train_step = step_reading_the_log
    tr.fit()
    tr.close()
    # Before steps 4, 5 and 6: the steps before the resume, then each new
    # one as soon as it is taken.
    self.assertEqual(on_disk, [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]])

  def test_ctrl_c_finishes_the_step_then_checkpoints_and_resumes_exactly(self):
    steps = 5
    straight, _ = small_runs.fit(
        small_runs.small_run(
            small_runs.temp_dir(self), steps=steps, eval_every=3
        )
    )
    out = small_runs.temp_dir(self)
    run = small_runs.small_run(out, steps=steps, eval_every=3)
    tr = trainer.Trainer(run, small_runs.corpus(), out=None)
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
    tr.close()  # Gives back the output directory, for the resume below.
    self.assertIs(signal.getsignal(signal.SIGINT), before)
    self.assertEqual(summary["interrupted"], "SIGINT")
    self.assertEqual(tr.step, 3)
    self.assertEqual(tr.history["loss"], straight.history["loss"][:3])
    self.assertEqual(
        checkpoint_dirs.latest(os.path.join(out, "checkpoints")),
        os.path.join(out, "checkpoints", "step_00000003"),
    )

    resumed, _ = small_runs.fit(dataclasses.replace(run, resume=True))
    self.assertEqual(resumed.history["loss"], straight.history["loss"])
    for a, b in zip(
        jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state)
    ):
      np.testing.assert_array_equal(a, b)

  def test_resume_without_a_checkpoint_is_an_error(self):
    run = small_runs.small_run(small_runs.temp_dir(self), resume=True)
    tr = trainer.Trainer(run, small_runs.corpus(), out=None)
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"--resume: no checkpoint in .*; run without",
    ):
      tr.prepare_output_dir()


class RefusalTest(absltest.TestCase):
  """One small saved run, then damaged or mismatched copies of it."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._dir = tempfile.TemporaryDirectory(prefix="dropless_ckpt_test_")
    cls.run_config = small_runs.small_run(
        cls._dir.name, steps=1, checkpoint_every=1
    )
    cls.trainer, _ = small_runs.fit(cls.run_config)
    cls.path = checkpoint_dirs.latest(
        os.path.join(cls._dir.name, "checkpoints")
    )

  @classmethod
  def tearDownClass(cls):
    cls._dir.cleanup()
    super().tearDownClass()

  def _copy(self):
    target = os.path.join(small_runs.temp_dir(self), "step_00000001")
    shutil.copytree(self.path, target)
    return target

  def _restore(self, path, run=None):
    tr = self.trainer
    run = run or self.run_config
    return checkpoint.restore(
        path,
        tr.state,
        fingerprint=run.fingerprint(tr.corpus.name, tr.corpus.sha256),
    )

  def test_intact_checkpoint_restores_exactly(self):
    state, meta = self._restore(self._copy())
    self.assertEqual(meta["step"], 1)
    for a, b in zip(
        jax.tree.leaves(state), jax.tree.leaves(self.trainer.state)
    ):
      np.testing.assert_array_equal(a, b)
      self.assertEqual(a.dtype, b.dtype)

  def test_overwritten_leaf_values_are_refused_by_their_checksum(self):
    # Replace the stored arrays with those of a save whose first leaf holds
    # other values: every file is well-formed, only the checksum can tell.
    path = self._copy()
    leaves, treedef = jax.tree.flatten(self.trainer.state)
    leaves[0] = np.asarray(leaves[0]) + np.ones((), leaves[0].dtype)
    other = checkpoint.save(
        small_runs.temp_dir(self),
        1,
        jax.tree.unflatten(treedef, leaves),
        fingerprint=self.trainer.fingerprint,
    )
    shutil.rmtree(os.path.join(path, checkpoint_dirs.ARRAYS))
    shutil.copytree(
        os.path.join(other, checkpoint_dirs.ARRAYS),
        os.path.join(path, checkpoint_dirs.ARRAYS),
    )
    first_path = jax.tree_util.keystr(
        jax.tree_util.tree_flatten_with_path(self.trainer.state)[0][0][0]
    )
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"is corrupt: leaf "
        + re.escape(first_path)
        + r" has checksum \d+, the checkpoint recorded \d+",
    ):
      self._restore(path)

  def test_flipped_byte_in_the_array_data_is_refused(self):
    path = self._copy()
    files = [
        os.path.join(root, name)
        for root, _, names in os.walk(
            os.path.join(path, checkpoint_dirs.ARRAYS)
        )
        for name in names
    ]
    data = max(files, key=os.path.getsize)  # The bulk of the leaves' bytes.
    with open(data, "r+b") as f:
      f.seek(os.path.getsize(data) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0xFF]))
    # Compressed chunks may fail to decode, or decode to other values.
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"is (incomplete or )?corrupt: (cannot read state/|leaf .* has "
        r"checksum)",
    ):
      self._restore(path)

  def test_truncated_meta_is_refused(self):
    path = self._copy()
    meta = os.path.join(path, checkpoint_dirs.META)
    with open(meta) as f:
      text = f.read()
    with open(meta, "w") as f:
      f.write(text[: len(text) // 2])
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"is corrupt: meta/meta.json is not valid JSON",
    ):
      self._restore(path)

  def _edit_meta(self, path, edit):
    """Applies `edit` (a function of the meta dict) to meta.json in place."""
    meta_path = os.path.join(path, checkpoint_dirs.META)
    with open(meta_path) as f:
      meta = json.load(f)
    edit(meta)
    with open(meta_path, "w") as f:
      json.dump(meta, f)

  def test_edited_step_is_refused_by_its_checksum(self):
    path = self._copy()
    self._edit_meta(path, lambda meta: meta.update(step=-5))
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"step_00000001' is corrupt or was edited: meta/meta.json field "
        r"'step' has checksum \d+, the checkpoint recorded \d+",
    ):
      self._restore(path)

  def test_edited_fingerprint_is_refused_by_its_checksum(self):
    path = self._copy()
    self._edit_meta(path, lambda meta: meta["fingerprint"].update(batch_size=2))
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError, r"field 'fingerprint' has checksum"
    ):
      self._restore(path)

  def test_edited_data_position_is_refused_by_its_checksum(self):
    path = self._copy()
    with open(os.path.join(path, checkpoint_dirs.META)) as f:
      data = json.load(f)["extra"]["data"]
    self.assertIsInstance(data, dict)
    edited = {k: (v + 1 if isinstance(v, int) else v) for k, v in data.items()}
    self.assertNotEqual(edited, data)
    self._edit_meta(path, lambda meta: meta["extra"].update(data=edited))
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError, r"field 'extra' has checksum"
    ):
      self._restore(path)

  def test_removed_or_added_meta_field_is_refused(self):
    path = self._copy()
    self._edit_meta(path, lambda meta: meta.update(note="hand-made"))
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"has the fields \[.*'note'.*\], its checksums cover \[",
    ):
      self._restore(path)
    self._edit_meta(path, lambda meta: meta.pop("field_checksums"))
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError, r"lacks 'field_checksums'"
    ):
      self._restore(path)

  def test_checkpoint_renamed_to_another_step_is_refused(self):
    path = os.path.join(os.path.dirname(self._copy()), "step_00000007")
    os.rename(os.path.join(os.path.dirname(path), "step_00000001"), path)
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"meta/meta.json records step 1, but the directory is named "
        r"'step_00000007'; expected 'step_00000001'",
    ):
      self._restore(path)

  def test_format_version_2_is_refused(self):
    path = self._copy()

    def as_version_2(meta):
      meta["format_version"] = 2
      del meta["field_checksums"]

    self._edit_meta(path, as_version_2)
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"has format version 2 \(its meta.json has no checksums\); this "
        r"program reads version 3",
    ):
      self._restore(path)

  def test_optimizer_state_of_another_step_is_refused(self):
    # A whole, consistent checkpoint of "step 2" holding the state of step
    # 1: only the optimiser's own step counters can tell.
    tr = self.trainer
    path = checkpoint.save(
        small_runs.temp_dir(self),
        2,
        tr.state,
        fingerprint=tr.fingerprint,
        extra={"data": tr.sampler.state()},
    )
    resumed = trainer.Trainer(self.run_config, small_runs.corpus(), out=None)
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"records step 2, but the step counters of the optimiser state in "
        r"state/ say \{.*count': 1",
    ):
      resumed.restore_checkpoint(path)
    self.assertEqual(resumed.step, 0)

  def test_resume_removes_leftovers_of_killed_saves(self):
    out = small_runs.temp_dir(self)
    checkpoints = os.path.join(out, "checkpoints")
    shutil.copytree(os.path.dirname(self.path), checkpoints)
    unfinished = os.path.join(checkpoints, "step_00000002.orbax-checkpoint-tmp")
    os.makedirs(os.path.join(unfinished, "state"))
    log = io.StringIO()
    tr = trainer.Trainer(
        dataclasses.replace(self.run_config, output_dir=out, resume=True),
        small_runs.corpus(),
        out=log,
    )
    tr.prepare_output_dir()
    self.assertEqual(tr.step, 1)
    self.assertIn(
        "removed step_00000002.orbax-checkpoint-tmp, left by an interrupted "
        "save",
        log.getvalue(),
    )
    self.assertEqual(os.listdir(checkpoints), ["step_00000001"])

  def test_missing_arrays_are_refused(self):
    path = self._copy()
    shutil.rmtree(os.path.join(path, checkpoint_dirs.ARRAYS))
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError, r"is incomplete: state/ is missing"
    ):
      self._restore(path)

  def test_missing_array_file_is_refused(self):
    path = self._copy()
    os.remove(os.path.join(path, checkpoint_dirs.ARRAYS, "manifest.ocdbt"))
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"is incomplete or corrupt: cannot read state/",
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
        checkpoint_meta.CheckpointError,
        r"different run configuration.*model\.moe\.num_experts: checkpoint "
        r"has 8, this run has 4",
    ):
      self._restore(self._copy(), other)

  def test_other_batch_size_is_refused(self):
    other = dataclasses.replace(self.run_config, batch_size=2)
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"batch_size: checkpoint has 4, this run has 2",
    ):
      self._restore(self._copy(), other)

  def test_other_state_structure_is_refused(self):
    template = dict(self.trainer.state)
    template["extra_leaf"] = np.zeros(3, np.float32)
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"different state structure: missing " r"\[\"\['extra_leaf'\]\"\]",
    ):
      checkpoint.restore(
          self._copy(),
          template,
          fingerprint=self.trainer.fingerprint,
      )

  def test_other_leaf_shape_is_refused(self):
    template = jax.tree.map(lambda x: x, self.trainer.state)
    leaves, treedef = jax.tree.flatten(template)
    leaves[0] = np.zeros((7,) + np.shape(leaves[0]), np.float32)
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError, r"leaf .* must be float32\[7, "
    ):
      checkpoint.restore(
          self._copy(),
          jax.tree.unflatten(treedef, leaves),
          fingerprint=self.trainer.fingerprint,
      )

  def test_resume_with_changed_hyperparameters_says_so(self):
    out = io.StringIO()
    run = dataclasses.replace(self.run_config, weight_decay=0.5, grad_clip=2.0)
    tr = trainer.Trainer(run, small_runs.corpus(), out=out)
    tr.restore_checkpoint(self._copy())
    self.assertEqual(tr.step, 1)
    note = out.getvalue()
    self.assertIn("will not match an uninterrupted one", note)
    self.assertIn("'weight_decay': (0.1, 0.5)", note)
    self.assertIn("'grad_clip': (1.0, 2.0)", note)
    self.assertNotIn("learning_rate", note)

  def test_resume_refuses_a_corrupt_latest_checkpoint(self):
    out = small_runs.temp_dir(self)
    shutil.copytree(
        os.path.dirname(self.path), os.path.join(out, "checkpoints")
    )
    os.remove(
        os.path.join(out, "checkpoints", "step_00000001", checkpoint_dirs.META)
    )
    tr = trainer.Trainer(
        dataclasses.replace(self.run_config, output_dir=out, resume=True),
        small_runs.corpus(),
        out=None,
    )
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError, "meta.json is missing"
    ):
      tr.prepare_output_dir()


class AtomicityTest(absltest.TestCase):

  def test_unfinished_save_is_invisible_and_old_ones_are_pruned(self):
    directory = small_runs.temp_dir(self)
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    for step in (1, 2, 3):
      checkpoint.save(directory, step, state, fingerprint={}, keep=2)
    # A save killed before Orbax's final rename leaves its temporary
    # directory behind, with part of the files.
    unfinished = os.path.join(directory, "step_00000004.orbax-checkpoint-tmp")
    shutil.copytree(checkpoint_dirs.step_dir(directory, 3), unfinished)
    os.remove(os.path.join(unfinished, checkpoint_dirs.META))
    self.assertEqual(
        [s for s, _ in checkpoint_dirs.list_checkpoints(directory)], [2, 3]
    )
    self.assertTrue(checkpoint_dirs.latest(directory).endswith("step_00000003"))
    # Saving that step again replaces the leftover with a whole checkpoint.
    checkpoint.save(directory, 4, state, fingerprint={}, keep=2)
    self.assertEqual(
        sorted(os.listdir(directory)),
        ["step_00000003", "step_00000004"],
    )
    _, meta = checkpoint.restore(
        checkpoint_dirs.latest(directory), state, fingerprint={}
    )
    self.assertEqual(meta["step"], 4)

  def test_leftovers_of_killed_saves_are_ignored_then_cleaned(self):
    directory = small_runs.temp_dir(self)
    state = {"w": np.arange(6, dtype=np.float32)}
    for step in (1, 2):
      checkpoint.save(directory, step, state, fingerprint={})
    # Step 3 was being saved again: its old copy was moved aside, and the
    # new one never landed. Step 2's old copy too, but its new one landed.
    elsewhere = checkpoint.save(
        small_runs.temp_dir(self), 3, state, fingerprint={}
    )
    os.rename(elsewhere, os.path.join(directory, ".replaced-step_00000003-ab"))
    shutil.copytree(
        checkpoint_dirs.step_dir(directory, 2),
        os.path.join(directory, ".replaced-step_00000002-cd"),
    )
    # An unfinished save, a half-deleted checkpoint, and a user's file.
    leftovers = ["step_00000004.orbax-checkpoint-tmp", ".deleting-step_0-ef"]
    for name in leftovers:
      shutil.copytree(
          checkpoint_dirs.step_dir(directory, 1), os.path.join(directory, name)
      )
    with open(os.path.join(directory, "notes.txt"), "w") as f:
      f.write("kept")
    self.assertEqual(
        [s for s, _ in checkpoint_dirs.list_checkpoints(directory)], [1, 2]
    )

    done = checkpoint_dirs.remove_leftovers(directory)

    self.assertEqual(
        sorted(os.listdir(directory)),
        ["notes.txt", "step_00000001", "step_00000002", "step_00000003"],
    )
    self.assertLen(done, 4)
    self.assertIn(
        "put back step_00000003 from .replaced-step_00000003-ab: a save of "
        "the same step was interrupted",
        done,
    )
    for name in leftovers + [".replaced-step_00000002-cd"]:
      self.assertIn(
          f"removed {name}, left by an interrupted save or deletion", done
      )
    _, meta = checkpoint.restore(
        checkpoint_dirs.latest(directory), state, fingerprint={}
    )
    self.assertEqual(meta["step"], 3)
    self.assertEqual(checkpoint_dirs.remove_leftovers(directory), [])

  def test_negative_or_non_int_step_is_refused(self):
    state = {"w": np.zeros(2, np.float32)}
    with self.assertRaisesRegex(
        ValueError, r"step: expected an int >= 0, got -5"
    ):
      checkpoint.save(small_runs.temp_dir(self), -5, state, fingerprint={})
    with self.assertRaisesRegex(TypeError, r"step: expected an int, got 1.5"):
      checkpoint.save(small_runs.temp_dir(self), 1.5, state, fingerprint={})

  def test_saving_a_step_again_replaces_it(self):
    directory = small_runs.temp_dir(self)
    old = {"w": np.zeros(4, np.float32)}
    new = {"w": np.arange(4, dtype=np.float32)}
    checkpoint.save(directory, 5, old, fingerprint={}, extra={"v": "old"})
    path = checkpoint.save(
        directory, 5, new, fingerprint={}, extra={"v": "new"}
    )
    self.assertEqual(os.listdir(directory), ["step_00000005"])
    restored, meta = checkpoint.restore(path, old, fingerprint={})
    self.assertEqual(meta["extra"], {"v": "new"})
    np.testing.assert_array_equal(restored["w"], new["w"])

  def test_bfloat16_round_trips(self):
    directory = small_runs.temp_dir(self)
    state = {"w": jnp.linspace(-3, 3, 11).astype(jnp.bfloat16)}
    path = checkpoint.save(directory, 1, state, fingerprint={"a": 1})
    restored, _ = checkpoint.restore(path, state, fingerprint={"a": 1})
    self.assertEqual(restored["w"].dtype, jnp.bfloat16)
    np.testing.assert_array_equal(restored["w"], state["w"])

  def test_negative_keep_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"keep: expected .* got -1"):
      checkpoint.Checkpointer("unused", fingerprint={}, keep=-1)


class MetricsLogTest(absltest.TestCase):
  """metrics.jsonl after a kill: kept lines, a cut last line, leftovers."""

  def _log(self, text: str) -> str:
    path = os.path.join(small_runs.temp_dir(self), "metrics.jsonl")
    with open(path, "w") as f:
      f.write(text)
    return path

  def _steps(self, path) -> list[int]:
    with open(path) as f:
      return [json.loads(line)["step"] for line in f]

  def test_cut_last_line_is_dropped_with_a_warning(self):
    lines = "".join(json.dumps({"step": s, "loss": 1.5}) + "\n" for s in (1, 2))
    path = self._log(lines + '{"step": 3, "lo')
    with self.assertLogs("absl", "WARNING") as logs:
      log = step_log.MetricsLog(path, resume_step=3)
    self.assertRegex(
        logs.output[0],
        re.escape(path) + r": dropped line 3, cut short by an interrupted "
        r"write",
    )
    with log:
      log.append({"step": 3, "loss": 1.0})
    self.assertEqual(self._steps(path), [1, 2, 3])

  def test_resume_keeps_the_lines_up_to_its_step(self):
    lines = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4))
    path = self._log(lines)
    with step_log.MetricsLog(path, resume_step=2) as log:
      log.append({"step": 3, "loss": 0.5})
    self.assertEqual(self._steps(path), [1, 2, 3])
    # The rewrite went through a temporary file, now gone.
    self.assertEqual(os.listdir(os.path.dirname(path)), ["metrics.jsonl"])

  def test_leftover_of_a_killed_rewrite_is_removed(self):
    path = self._log(json.dumps({"step": 1}) + "\n")
    leftover = os.path.join(os.path.dirname(path), ".metrics.jsonl.0a1b.tmp")
    with open(leftover, "w") as f:
      f.write("{")
    with self.assertLogs("absl", "WARNING") as logs:
      step_log.MetricsLog(path, resume_step=1).close()
    self.assertIn("removed .metrics.jsonl.0a1b.tmp", logs.output[0])
    self.assertEqual(os.listdir(os.path.dirname(path)), ["metrics.jsonl"])
    self.assertEqual(self._steps(path), [1])

  def test_bad_line_before_the_last_is_an_error(self):
    path = self._log('{"step": 1}\nnot json\n{"step": 3}\n')
    with self.assertRaisesRegex(
        ValueError,
        re.escape(path) + r": line 2 is not a metrics record .*only the "
        r"last line may be cut short",
    ):
      step_log.MetricsLog(path, resume_step=3)

  def test_fresh_log_starts_empty(self):
    path = self._log(json.dumps({"step": 1}) + "\n")
    step_log.MetricsLog(path).close()
    with open(path) as f:
      self.assertEqual(f.read(), "")


def _bits(x) -> np.ndarray:
  """x's bytes, to compare values bit for bit (NaN payloads, -0.0)."""
  return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


class ShardedTest(absltest.TestCase):
  """A state sharded over a (data=2, expert=4) mesh of 8 CPU devices."""

  def setUp(self):
    super().setUp()
    if jax.device_count() < 8:
      self.fail(
          "needs 8 devices: run under pytest (conftest.py) or set XLA_FLAGS="
          "--xla_force_host_platform_device_count=8"
      )
    devices = np.array(jax.devices()[:8])
    self.mesh = Mesh(devices.reshape(2, 4), ("data", "expert"))
    rng = np.random.default_rng(0)
    specs = {
        "experts": P("expert"),
        "embed": P(None, "data"),
        "norm": P(),
        "count": P(),
    }
    values = {
        "experts": rng.standard_normal((8, 6, 4), np.float32),
        "embed": rng.standard_normal((16, 6), np.float32).astype(jnp.bfloat16),
        "norm": np.array([1.5, -0.0, np.inf, np.nan], np.float32),
        "count": np.array(7, np.int32),
    }
    self.values = values
    self.state = {
        k: jax.device_put(v, NamedSharding(self.mesh, specs[k]))
        for k, v in values.items()
    }

  def _target(self, sharding_of):
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding_of(k))
        for k, v in self.values.items()
    }

  def _assert_restored(self, restored, target):
    for key, value in self.values.items():
      self.assertEqual(restored[key].sharding, target[key].sharding, key)
      self.assertEqual(restored[key].dtype, value.dtype, key)
      np.testing.assert_array_equal(_bits(restored[key]), _bits(value), key)

  def test_same_mesh_restores_bit_for_bit(self):
    path = checkpoint.save(
        small_runs.temp_dir(self), 3, self.state, fingerprint={"run": 1}
    )
    target = self._target(lambda k: self.state[k].sharding)
    restored, meta = checkpoint.restore(path, target, fingerprint={"run": 1})
    self.assertEqual(meta["step"], 3)
    self._assert_restored(restored, target)

  def test_restores_onto_another_mesh_and_onto_one_device(self):
    path = checkpoint.save(
        small_runs.temp_dir(self), 3, self.state, fingerprint={}
    )
    flat = Mesh(np.array(jax.devices()[:8])[::-1], ("expert",))
    target = self._target(
        lambda k: NamedSharding(flat, P("expert") if k == "experts" else P())
    )
    restored, _ = checkpoint.restore(path, target, fingerprint={})
    self._assert_restored(restored, target)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    target = self._target(lambda k: one)
    restored, _ = checkpoint.restore(path, target, fingerprint={})
    self._assert_restored(restored, target)
    # Numpy templates (no sharding) restore as numpy.
    restored, _ = checkpoint.restore(path, self.values, fingerprint={})
    for key, value in self.values.items():
      self.assertIsInstance(restored[key], np.ndarray)
      np.testing.assert_array_equal(_bits(restored[key]), _bits(value))

  def test_async_save_lands_after_wait_and_prunes(self):
    directory = small_runs.temp_dir(self)
    with checkpoint.Checkpointer(
        directory, fingerprint={}, keep=2, async_save=True
    ) as saver:
      for step in (1, 2, 3):
        state = jax.tree.map(jnp.copy, self.state)
        saver.save(step, state, {"step": step})
        # The caller may free (or donate) the arrays once save returns.
        for leaf in jax.tree.leaves(state):
          leaf.delete()
      saver.wait()
      self.assertEqual(
          [s for s, _ in checkpoint_dirs.list_checkpoints(directory)], [2, 3]
      )
      target = self._target(lambda k: self.state[k].sharding)
      restored, meta = saver.restore(checkpoint_dirs.latest(directory), target)
    self.assertEqual(meta["extra"], {"step": 3})
    self._assert_restored(restored, target)
    self.assertEqual(
        sorted(os.listdir(directory)),
        ["step_00000002", "step_00000003"],
    )

  def test_checksum_is_independent_of_sharding(self):
    layouts = [
        self.state,
        self.values,  # numpy, summed on the host
        {
            k: jax.device_put(v, jax.devices()[2])
            for k, v in self.values.items()
        },
        {
            k: jax.device_put(
                v,
                NamedSharding(
                    Mesh(np.array(jax.devices()[:4]), ("x",)),
                    P("x") if k == "experts" else P(),
                ),
            )
            for k, v in self.values.items()
        },
    ]
    sums = [checksum.checksums(jax.tree.leaves(s)) for s in layouts]
    for other in sums[1:]:
      self.assertEqual(other, sums[0])

  def test_checksum_sees_any_one_changed_element_and_swaps(self):
    experts = self.values["experts"]
    base = checksum.checksums([self.state["experts"]])[0]
    bits = experts.view(np.uint32)
    rng = np.random.default_rng(1)
    for _ in range(8):
      changed = bits.copy()
      index = tuple(rng.integers(0, n) for n in bits.shape)
      changed[index] ^= np.uint32(1) << np.uint32(rng.integers(0, 32))
      sharded = jax.device_put(
          changed.view(np.float32), self.state["experts"].sharding
      )
      self.assertNotEqual(checksum.checksums([sharded])[0], base, index)
    swapped = experts.copy()
    swapped[[0, 7]] = swapped[[7, 0]]
    self.assertNotEqual(checksum.checksums([swapped])[0], base)


if __name__ == "__main__":
  absltest.main()
