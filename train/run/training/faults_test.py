"""The training program's faults: each ends the run in one line, safely.

Faults are staged, not waited for: a full disk by replacing
`checkpoint_failures.free_bytes` (the documented hook of the save's space
check) or by handing Orbax's background commit a future that fails with
ENOSPC; a diverging run by --learning_rate=1e30; the device's memory by a
train step that raises XLA's RESOURCE_EXHAUSTED; a signal by os.kill from
inside the final evaluation. Most tests drive a Trainer of
small_runs.SMALL_DSV3 (one compile of its steps, shared); `MainTest` runs
`train.main` in this process with that model in place of the default
preset, and two subprocesses check what a user sees on a terminal.
"""

import contextlib
import copy
import dataclasses
import errno
import io
import os
import signal
import subprocess
import sys
from unittest import mock

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from train import main
from train import presets
from train import train_flags
from train.checkpoints import checkpoint
from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_failures
from train.checkpoints import checkpoint_meta
from train.checkpoints import output_lock
from train.run.inputs import data as data_lib
from train.run.reporting import cost_report
from train.run.step import step_builder
from train.run.training import trainer
from train.run.training import training_faults
from train.testing import small_runs

# The workspace root: this file is train/run/<room>/<name>.py.
_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
# Every run here has this many steps: runs that differ only in host-side
# settings share one compiled program.
_STEPS = 4
_OOM = (
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 32212254720 "
    "bytes."
)


def setUpModule():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


def _run(output_dir: str, **overrides):
  return small_runs.small_run(output_dir, steps=_STEPS, **overrides)


def _trainer(run, out=None) -> trainer.Trainer:
  tr = trainer.Trainer(run, small_runs.corpus(), out=out)
  tr.prepare_output_dir()
  return tr


def _entries(directory: str) -> list[str]:
  return sorted(os.listdir(directory))


class _FailingCommit:
  """An Orbax commit future whose write failed: the disk is full."""

  def result(self, timeout=None):
    del timeout
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  def cancel(self):
    return False


class DiskFullTest(absltest.TestCase):

  def test_full_disk_stops_the_run_at_its_step_and_keeps_the_checkpoints(
      self,
  ):
    out = small_runs.temp_dir(self)
    run = _run(out, checkpoint_every=1, keep_checkpoints=1)
    real_free_bytes, calls = checkpoint_failures.free_bytes, []

    def free_bytes(directory):
      calls.append(directory)  # One call per save: the third finds 1000 B.
      return real_free_bytes(directory) if len(calls) < 3 else 1000

    tr = _trainer(run)
    with mock.patch.object(checkpoint_failures, "free_bytes", free_bytes):
      with self.assertRaises(checkpoint_failures.CheckpointSaveError) as raised:
        tr.fit()
    tr.close()
    error = raised.exception
    message = str(error)
    self.assertNotIn("\n", message)
    # Noticed at the step whose save failed, before writing anything.
    self.assertEqual((error.step, tr.step), (3, 3))
    self.assertIn(f"step 3 in {tr.checkpoint_dir!r}", message)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(tr.state))
    self.assertBetween(error.needed, state_bytes, state_bytes + 2**20)
    self.assertIn(f"({error.needed:,} bytes", message)
    self.assertIn("has 1000 B free", message)
    self.assertIn("intact (newest: step_00000002)", message)
    self.assertEqual(_entries(tr.checkpoint_dir), ["step_00000002"])

    # The checkpoint left resumes the run exactly.
    resumed, _ = small_runs.fit(dataclasses.replace(run, resume=True))
    straight, _ = small_runs.fit(_run(small_runs.temp_dir(self)))
    self.assertEqual(resumed.history["loss"], straight.history["loss"])

  def test_failed_background_write_stops_the_run_at_the_next_step(self):
    out = small_runs.temp_dir(self)
    run = _run(out, checkpoint_every=1, keep_checkpoints=1)
    real_async_save = ocp.handlers.StandardCheckpointHandler.async_save
    saves = []

    async def async_save(handler, *args, **kwargs):
      futures = await real_async_save(handler, *args, **kwargs)
      saves.append(None)
      if len(saves) == 2:  # The arrays of step 2's checkpoint.
        return list(futures or []) + [_FailingCommit()]
      return futures

    tr = _trainer(run)
    with mock.patch.object(
        ocp.handlers.StandardCheckpointHandler, "async_save", async_save
    ):
      # Orbax logs the failure with a traceback from each thread it went
      # through; the checkpointer raises it once, in one line, instead.
      with self.assertNoLogs("absl", level="ERROR"):
        with self.assertRaises(
            checkpoint_failures.CheckpointSaveError
        ) as raised:
          tr.fit()
    tr.close()
    error = raised.exception
    message = str(error)
    self.assertNotIn("\n", message)
    # The save of step 2 failed in the background, during step 3.
    self.assertEqual((error.step, tr.step), (2, 3))
    self.assertIn(
        f"the checkpoint of step 2 could not be written to "
        f"{tr.checkpoint_dir!r}: no space left on device; it needs about",
        message,
    )
    self.assertIn(f"({error.needed:,} bytes uncompressed)", message)
    self.assertIn("intact (newest: step_00000001)", message)
    # What the failed save wrote is gone; step 1 was not pruned.
    self.assertEqual(_entries(tr.checkpoint_dir), ["step_00000001"])
    checkpoint.restore(
        os.path.join(tr.checkpoint_dir, "step_00000001"),
        tr.state,
        fingerprint=tr.fingerprint,
    )


class NonFiniteTest(absltest.TestCase):

  def test_diverging_run_stops_naming_the_step_and_saves_only_finite_states(
      self,
  ):
    out = small_runs.temp_dir(self)
    run = _run(out, learning_rate=1e30, checkpoint_every=1, keep_checkpoints=0)
    tr = _trainer(run)
    with self.assertRaises(training_faults.NonFiniteError) as raised:
      tr.fit()
    tr.close()
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    # The failed step is named and not kept: the state is the step before.
    self.assertStartsWith(message, f"step {tr.step + 1}: ")
    self.assertIn("--learning_rate (now 1e+30)", message)
    self.assertGreaterEqual(tr.step, 1)
    self.assertEqual(tr.non_finite_leaves(), [])
    saved = checkpoint_dirs.list_checkpoints(tr.checkpoint_dir)
    self.assertEqual([s for s, _ in saved], list(range(1, tr.step + 1)))
    for _, path in saved:
      state, _ = checkpoint.restore(path, tr.state, fingerprint=tr.fingerprint)
      self.assertEqual(tr.non_finite_leaves(state), [], path)
    with open(os.path.join(out, "metrics.jsonl")) as f:
      self.assertLen(f.readlines(), tr.step)

  def test_non_finite_state_is_neither_saved_nor_resumed(self):
    out = small_runs.temp_dir(self)
    tr = _trainer(_run(out))
    tr.state = jax.tree.map(
        lambda x: x * jnp.nan if x.ndim >= 2 else x, tr.state
    )
    with self.assertRaisesRegex(
        training_faults.NonFiniteError,
        r"^step 0: not saving a checkpoint of a state with NaN or Inf values",
    ):
      tr.save_checkpoint()
    tr.close()
    self.assertFalse(os.path.exists(tr.checkpoint_dir))
    # A checkpoint of such a state, as an older program could write one,
    # is refused when resumed, naming it and a leaf.
    path = checkpoint.save(
        tr.checkpoint_dir,
        0,
        tr.state,
        fingerprint=tr.fingerprint,
        extra={"data": tr.sampler.state()},
    )
    resumed = trainer.Trainer(
        _run(out, resume=True), small_runs.corpus(), out=None
    )
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        rf"checkpoint {path!r} holds NaN or Inf values \(\d+ leaves, first "
        # The scanned layers' correction biases are matrices, [L, E], too.
        r"\['(bias|params|opt_state)'\]",
    ):
      resumed.prepare_output_dir()


class OutOfMemoryTest(absltest.TestCase):

  def test_resource_exhausted_names_the_estimate_and_the_flags(self):
    tr = _trainer(_run(small_runs.temp_dir(self)))
    tr.program = copy.copy(tr.program)  # Shared between trainers: a copy.

    def out_of_memory(state, batch):
      del state, batch
      raise jax.errors.JaxRuntimeError(_OOM)

    tr.program.train_step = out_of_memory
    with self.assertRaises(training_faults.OutOfMemoryError) as raised:
      tr.fit()
    tr.close()
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    self.assertStartsWith(message, f"out of device memory at step 1 ({_OOM})")
    self.assertIsNotNone(tr.memory)
    self.assertIn(
        "the compiled train step needs "
        f"{cost_report.human_bytes(tr.memory.total)} per device (XLA; the "
        "analytic estimate is ",
        message,
    )
    for flag in (
        "--batch_size (now 4)",
        "--seq_len (now 32)",
        "--remat=full (now none)",
        "--mesh (now data=1;",
    ):
      self.assertIn(flag, message)

  def test_dry_run_memory_is_that_of_the_step_the_run_compiles(self):
    with _small_default_preset(), flagsaver.flagsaver(**_main_flags(self)):
      text = main.dry_run(io.StringIO())
      run = train_flags.run_config_from_flags()
    tr = trainer.Trainer(run, small_runs.corpus(), out=None)
    memory = tr.step_memory()
    self.assertIsNotNone(memory)
    self.assertEqual(step_builder.compiled_step_memory(run), memory)
    self.assertIn(
        "compiled train step (XLA memory_analysis): "
        f"{cost_report.human_bytes(memory.total)} per device = arguments "
        f"{cost_report.human_bytes(memory.arguments)}",
        text,
    )
    # The analytic estimate stays, beside it.
    self.assertRegex(text, r"total [\d.]+ [KMG]iB \(analytic estimate\)")
    self.assertRegex(
        text, r"; analytic estimate [\d.]+ [KMG]iB \(XLA's is [\d.]+x it\)"
    )


class DataFingerprintTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.out = small_runs.temp_dir(self)
    self.data = os.path.join(small_runs.temp_dir(self), "text.txt")
    with open(self.data, "wb") as f:
      f.write(small_runs.corpus().train[:60000].tobytes())

  def _saved_at_step_0(self, fingerprint=None) -> trainer.Trainer:
    run = _run(self.out, data=self.data)
    tr = trainer.Trainer(run, data_lib.load(self.data), out=None)
    checkpoint.save(
        tr.checkpoint_dir,
        0,
        tr.state,
        fingerprint=fingerprint or tr.fingerprint,
        extra={"data": tr.sampler.state()},
    )
    return tr

  def _resume(self, log=None) -> trainer.Trainer:
    run = _run(self.out, data=self.data, resume=True)
    return trainer.Trainer(run, data_lib.load(self.data), out=log)

  def test_changed_contents_under_the_same_path_are_refused(self):
    saved = self._saved_at_step_0()
    with open(self.data, "r+b") as f:  # Same path, same size, one byte.
      f.seek(1234)
      f.write(b"#")
    resumed = self._resume()
    self.assertNotEqual(resumed.corpus.sha256, saved.corpus.sha256)
    with self.assertRaises(checkpoint_meta.CheckpointError) as raised:
      resumed.prepare_output_dir()
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    self.assertStartsWith(message, f"--data={self.data!r} changed since")
    self.assertIn(saved.corpus.sha256[:16], message)
    self.assertIn(resumed.corpus.sha256[:16], message)
    # The same contents resume.
    with open(self.data, "wb") as f:
      f.write(small_runs.corpus().train[:60000].tobytes())
    resumed = self._resume()
    resumed.prepare_output_dir()
    resumed.close()

  def test_checkpoint_without_a_digest_resumes_with_a_note(self):
    run = _run(self.out, data=self.data)
    old = run.fingerprint(self.data)  # As saved before the digest.
    self.assertNotIn("data_sha256", old)
    self._saved_at_step_0(fingerprint=old)
    log = io.StringIO()
    resumed = self._resume(log)
    resumed.prepare_output_dir()
    resumed.close()
    self.assertIn("records no digest of its text", log.getvalue())
    self.assertIn("resumed from", log.getvalue())

  def _saved_with_recipe(self, name: str) -> None:
    """A checkpoint of this run whose fingerprint records recipe `name`."""
    run = _run(self.out, data=self.data)
    fingerprint = run.fingerprint(self.data, data_lib.load(self.data).sha256)
    self.assertEqual(fingerprint["model"]["moe"]["precision"], "unquantized")
    fingerprint["model"]["moe"]["precision"] = name
    self._saved_at_step_0(fingerprint=fingerprint)

  def test_checkpoint_naming_the_recipe_bf16_resumes(self):
    # Saved before "bf16" was renamed "unquantized": the same recipe.
    self._saved_with_recipe("bf16")
    log = io.StringIO()
    resumed = self._resume(log)
    resumed.prepare_output_dir()
    resumed.close()
    self.assertIn("resumed from", log.getvalue())

  def test_checkpoint_of_another_recipe_is_still_refused(self):
    self._saved_with_recipe("mxfp8")
    resumed = self._resume()
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        "model.moe.precision: checkpoint has 'mxfp8', this run has "
        "'unquantized'",
    ):
      resumed.prepare_output_dir()


@contextlib.contextmanager
def _small_default_preset():
  with mock.patch.dict(
      presets.PRESETS, {presets.DEFAULT_PRESET: small_runs.SMALL_PRESET}
  ):
    yield


def _main_flags(test_case, **overrides) -> dict:
  """train.main's flags for a run of SMALL_DSV3 like `_run`'s."""
  values = dict(
      moe_backend="xla",
      steps=_STEPS,
      batch_size=4,
      seq_len=32,
      eval_every=1000,
      eval_batches=2,
      checkpoint_every=0,
      log_every=1000,
      output_dir=small_runs.temp_dir(test_case),
      progress=False,
      plot=False,
  )
  values.update(overrides)
  return values


class MainTest(absltest.TestCase):
  """What train.main prints for each fault: one line, status 1."""

  def _main_fails(self, **flag_values) -> str:
    """Runs main.main; returns its one stderr line (it must exit 1)."""
    stderr = io.StringIO()
    with (
        _small_default_preset(),
        flagsaver.flagsaver(**_main_flags(self, **flag_values)),
    ):
      with contextlib.redirect_stderr(stderr):
        with self.assertRaises(SystemExit) as raised:
          main.main(["train.main"])
    self.assertEqual(raised.exception.code, 1)
    lines = stderr.getvalue().splitlines()
    self.assertLen(lines, 1, stderr.getvalue())
    self.assertStartsWith(lines[0], "error: ")
    return lines[0]

  def test_usage_errors(self):
    line = self._main_fails(resume=True)
    self.assertIn("--resume: no checkpoint in", line)
    self.assertIn("run without --resume to start a new run", line)
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      with self.assertRaises(SystemExit):
        main.main(["train.main", "stray"])
    self.assertEqual(
        stderr.getvalue(),
        "error: unexpected arguments ['stray']: this program takes only "
        "flags, --name=value (--help lists them).\n",
    )

  def test_busy_output_dir(self):
    out = small_runs.temp_dir(self)
    with output_lock.OutputDirLock(out):
      line = self._main_fails(output_dir=out)
    self.assertIn(f"--output_dir={out!r} is in use by another training", line)
    self.assertIn(f"pid {os.getpid()}", line)

  def test_lock_os_error(self):
    # Found: an OSError at the lock (here its file is a directory) printed
    # a traceback.
    out = small_runs.temp_dir(self)
    lock = os.path.join(out, output_lock.LOCK_FILE)
    os.mkdir(lock)
    line = self._main_fails(output_dir=out)
    self.assertIn(f"--output_dir={out!r}: cannot take its lock {lock!r}", line)
    self.assertIn("Is a directory", line)

  def test_full_disk(self):
    with mock.patch.object(checkpoint_failures, "free_bytes", return_value=0):
      line = self._main_fails()
    self.assertIn(f"cannot save the checkpoint of step {_STEPS}", line)
    self.assertIn("No earlier checkpoint was saved", line)

  def test_out_of_memory(self):
    oom = jax.errors.JaxRuntimeError(_OOM)
    with mock.patch.object(trainer.Trainer, "train_step", side_effect=oom):
      line = self._main_fails()
    self.assertIn("out of device memory at step 1", line)
    self.assertIn("--batch_size (now 4)", line)

  def test_signal_after_the_last_step_finishes_the_run(self):
    real_evaluate = trainer.Trainer.evaluate

    def evaluate(tr):
      if tr.step == tr.run.steps:  # The final evaluation.
        os.kill(os.getpid(), signal.SIGTERM)
      return real_evaluate(tr)

    flag_values = _main_flags(self)
    stdout = io.StringIO()
    with _small_default_preset(), flagsaver.flagsaver(**flag_values):
      with mock.patch.object(trainer.Trainer, "evaluate", evaluate):
        with contextlib.redirect_stdout(stdout):
          main.main(["train.main"])  # Returns: exit status 0.
    self.assertIn(
        "note: SIGTERM arrived after the last step; the run finished as "
        "usual",
        stdout.getvalue(),
    )
    summary = os.path.join(flag_values["output_dir"], "summary.json")
    self.assertTrue(os.path.isfile(summary))
    self.assertTrue(
        os.path.isdir(
            os.path.join(
                flag_values["output_dir"], "checkpoints", f"step_{_STEPS:08d}"
            )
        )
    )


def _run_main(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = os.pathsep.join(
      filter(None, [_ROOT, env.get("PYTHONPATH")])
  )
  return subprocess.run(
      [sys.executable, "-m", "train.main", *args],
      cwd=_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )


class TerminalTest(absltest.TestCase):
  """The program as a user starts it: a usage error, and --help."""

  def test_usage_error_is_one_line_without_the_flag_list(self):
    proc = _run_main(
        "--mesh=data=2",
        "--batch_size=3",
        f"--output_dir={small_runs.temp_dir(self)}",
    )
    self.assertEqual(proc.returncode, 1, proc.stderr[-3000:])
    self.assertEqual(
        proc.stderr,
        "error: --batch_size=3 must be divisible by the data-parallel size "
        "data x fsdp x expert = 2 of --mesh=data=2.\n",
    )

  def test_help_still_lists_the_flags(self):
    proc = _run_main("--help")
    # absl prints the help on stdout and ends --help with status 1.
    self.assertEqual(proc.returncode, 1, proc.stderr[-3000:])
    self.assertEqual(proc.stderr, "")
    for flag in ("--batch_size", "--output_dir", "--dry_run", "--resume"):
      self.assertIn(flag, proc.stdout)


if __name__ == "__main__":
  absltest.main()
