"""One owner per --output_dir: the lock, and what a trainer does with it.

The lock's own tests take it in this process and in child processes (a
one-line `python -c`, no JAX): a second taker is refused in one line naming
the directory and the holder; a killed holder's lock does not block; on a
filesystem without file locks (flock patched to fail with ENOLCK) the
recorded host and pid decide. The trainer's tests check that a second run
on a live run's directory is refused before it deletes or writes anything,
that a fresh run deletes only the checkpoints this program wrote, and (two
processes through tools/launch_local.py, about 15 s) that process 0 holds
the lock for the run.
"""

import errno
import fcntl
import io
import json
import os
import signal
import socket
import subprocess
import sys
from unittest import mock

from absl.testing import absltest

from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_meta
from train.checkpoints import output_lock
from train.run.training import trainer
from train.testing import small_runs

# The workspace root: this file is train/<package>/<name>.py.
_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
_LAUNCHER = os.path.join(_ROOT, "tools", "launch_local.py")
_WORKER = os.path.join(_ROOT, "train", "testing", "output_lock_worker.py")

# A child that takes the lock, says so, and waits to be killed.
_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from train.checkpoints import output_lock
lock = output_lock.OutputDirLock({directory!r}).acquire()
print("LOCKED", flush=True)
time.sleep(120)
"""


def _start_holder(test_case, directory: str) -> subprocess.Popen:
  """A child process holding `directory`'s lock (killed after the test)."""
  proc = subprocess.Popen(
      [sys.executable, "-c", _HOLDER.format(root=_ROOT, directory=directory)],
      stdout=subprocess.PIPE,
      text=True,
  )
  test_case.addCleanup(proc.wait)
  test_case.addCleanup(proc.kill)
  test_case.assertEqual(proc.stdout.readline().strip(), "LOCKED")
  return proc


def _dead_pid() -> int:
  """The pid of a child that has exited (not reused this soon)."""
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


def _write_record(directory: str, host: str, pid: int) -> None:
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, output_lock.LOCK_FILE), "w") as f:
    json.dump({"host": host, "pid": pid, "since": "2026-12-04T10:00:00"}, f)


class LockTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = os.path.join(small_runs.temp_dir(self), "out")

  def _refusal(self) -> str:
    with self.assertRaises(output_lock.OutputDirBusyError) as raised:
      output_lock.OutputDirLock(self.dir).acquire()
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    self.assertIn(f"--output_dir={self.dir!r}", message)
    return message

  def test_second_taker_in_this_process_is_refused_until_released(self):
    lock = output_lock.OutputDirLock(self.dir).acquire()
    message = self._refusal()
    self.assertIn(f"pid {os.getpid()} on host {socket.gethostname()}", message)
    self.assertIn(os.path.join(self.dir, output_lock.LOCK_FILE), message)
    lock.release()
    output_lock.OutputDirLock(self.dir).acquire().release()

  def test_holder_in_another_process_is_named_and_its_death_frees_the_lock(
      self,
  ):
    holder = _start_holder(self, self.dir)
    message = self._refusal()
    self.assertIn(f"pid {holder.pid} on host {socket.gethostname()}", message)
    self.assertIn("wait for that run to end or stop it", message)
    # SIGKILL: the holder cannot clean up; the OS drops its lock, and its
    # record, left in the file, does not block.
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with open(os.path.join(self.dir, output_lock.LOCK_FILE)) as f:
      self.assertEqual(json.load(f)["pid"], holder.pid)
    with output_lock.OutputDirLock(self.dir) as lock:
      self.assertEqual(lock.note, "")
      with open(lock.path) as f:
        self.assertEqual(json.load(f)["pid"], os.getpid())

  def test_release_leaves_no_record(self):
    with output_lock.OutputDirLock(self.dir) as lock:
      path = lock.path
    self.assertEqual(os.path.getsize(path), 0)

  def test_without_file_locks_the_recorded_holder_decides(self):
    no_locks = OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    with mock.patch.object(fcntl, "flock", side_effect=no_locks):
      # A live holder on this host (this test's parent process) blocks.
      _write_record(self.dir, socket.gethostname(), os.getppid())
      self.assertIn(f"pid {os.getppid()}", self._refusal())
      # One on another host cannot be checked: refused, naming the file.
      _write_record(self.dir, "elsewhere.example", os.getpid())
      message = self._refusal()
      self.assertIn("host elsewhere.example", message)
      self.assertIn("no file locks", message)
      self.assertIn(
          f"delete {os.path.join(self.dir, output_lock.LOCK_FILE)!r}", message
      )
      # A dead one on this host is stale: taken over, with a note.
      _write_record(self.dir, socket.gethostname(), _dead_pid())
      with output_lock.OutputDirLock(self.dir) as lock:
        self.assertIn("without file locks", lock.note)
        self.assertIn("pid", lock.note)
        # And it now blocks others the same way.
        self.assertIn(f"pid {os.getpid()}", self._refusal())
      # Released: an empty record blocks nobody.
      output_lock.OutputDirLock(self.dir).acquire().release()


class LockFileTest(absltest.TestCase):
  """The lock file is never written through a link nor over a file this
  program did not write; each refusal, and any OSError at the lock, is an
  OutputDirLockError (an OSError) of one line naming the directory, the
  file and the cause."""

  def setUp(self):
    super().setUp()
    self.root = small_runs.temp_dir(self)
    self.dir = os.path.join(self.root, "out")
    os.makedirs(self.dir)
    self.path = os.path.join(self.dir, output_lock.LOCK_FILE)

  def _unusable(self, cause: str) -> str:
    with self.assertRaises(output_lock.OutputDirLockError) as raised:
      output_lock.OutputDirLock(self.dir).acquire()
    self.assertIsInstance(raised.exception, OSError)
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    self.assertIn(f"--output_dir={self.dir!r}", message)
    self.assertIn(f"cannot take its lock {self.path!r}", message)
    self.assertIn(cause, message)
    return message

  def _file(self, name: str, content: bytes) -> str:
    path = os.path.join(self.root, name)
    with open(path, "wb") as f:
      f.write(content)
    return path

  def _assert_content(self, path: str, content: bytes):
    with open(path, "rb") as f:
      self.assertEqual(f.read(), content, path)

  def test_symbolic_link_is_refused_and_its_target_left_alone(self):
    # Found: the lock followed the link and emptied the file it points to.
    target = self._file("precious.txt", b"the user's data\n")
    os.symlink(target, self.path)
    message = self._unusable(f"it is a symbolic link (to {target!r})")
    self.assertIn("never writes through a link", message)
    self._assert_content(target, b"the user's data\n")
    # A dangling link: nothing is created where it points.
    os.remove(self.path)
    missing = os.path.join(self.root, "missing")
    os.symlink(missing, self.path)
    self._unusable("symbolic link")
    self.assertFalse(os.path.exists(missing))

  def test_file_it_did_not_write_is_refused_not_emptied(self):
    with open(self.path, "wb") as f:
      f.write(b"not a lock record")
    self._unusable("holds 17 bytes that are not a training run's record")
    self._assert_content(self.path, b"not a lock record")

  def test_hard_link_is_refused_and_the_other_name_left_alone(self):
    other = self._file("empty_but_mine", b"")
    os.link(other, self.path)
    self._unusable("it has 2 names (hard links)")
    self._assert_content(other, b"")

  def test_not_a_regular_file_is_refused(self):
    os.mkfifo(self.path)
    self._unusable("it is not a regular file")

  def test_os_error_names_the_directory_and_its_cause(self):
    os.mkdir(self.path)  # open(O_RDWR) of a directory: EISDIR.
    self._unusable("Is a directory")
    # The directory cannot be made: a file is in the way.
    self.dir = self._file("a_file", b"")
    self.path = os.path.join(self.dir, output_lock.LOCK_FILE)
    self._unusable("exists")

  def test_its_own_record_and_an_empty_file_are_taken(self):
    _write_record(self.dir, socket.gethostname(), _dead_pid())
    output_lock.OutputDirLock(self.dir).acquire().release()
    self._assert_content(self.path, b"")
    output_lock.OutputDirLock(self.dir).acquire().release()


class TrainerOwnsOutputDirTest(absltest.TestCase):

  def test_second_run_is_refused_before_it_deletes_or_writes_anything(self):
    out = small_runs.temp_dir(self)
    run = small_runs.small_run(
        out, steps=2, checkpoint_every=1, keep_checkpoints=0
    )
    live = trainer.Trainer(run, small_runs.corpus(), out=None)
    live.prepare_output_dir()
    live.fit()  # Still open: the run holds its directory.
    self.addCleanup(live.close)
    with open(os.path.join(out, "metrics.jsonl"), "rb") as f:
      log = f.read()
    saved = checkpoint_dirs.list_checkpoints(live.checkpoint_dir)
    self.assertLen(saved, 2)

    second = trainer.Trainer(run, small_runs.corpus(), out=io.StringIO())
    for start in (second.prepare_output_dir, second.fit):
      with self.assertRaises(output_lock.OutputDirBusyError) as raised:
        start()
      message = str(raised.exception)
      self.assertNotIn("\n", message)
      self.assertIn(f"--output_dir={out!r}", message)
      self.assertIn(
          f"pid {os.getpid()} on host {socket.gethostname()}", message
      )
    # The live run's checkpoints and log are as it left them.
    self.assertEqual(
        checkpoint_dirs.list_checkpoints(live.checkpoint_dir), saved
    )
    with open(os.path.join(out, "metrics.jsonl"), "rb") as f:
      self.assertEqual(f.read(), log)
    self.assertNotIn("starting fresh", second.out.getvalue())

    live.close()  # The run ends: the directory is free again.
    second.prepare_output_dir()
    second.close()

  def test_fresh_run_removes_only_its_own_checkpoints(self):
    out = small_runs.temp_dir(self)
    run = small_runs.small_run(
        out, steps=2, checkpoint_every=1, keep_checkpoints=0
    )
    small_runs.fit(run)
    checkpoints = os.path.join(out, "checkpoints")
    # The user's files beside the checkpoints, and in the output directory.
    os.makedirs(os.path.join(checkpoints, "my_notes"))
    for path in ("checkpoints/README.txt", "checkpoints/my_notes/a", "mine"):
      with open(os.path.join(out, path), "w") as f:
        f.write("the user's")

    log = io.StringIO()
    tr = trainer.Trainer(run, small_runs.corpus(), out=log)
    tr.prepare_output_dir()
    tr.close()
    self.assertIn("starting fresh: removing 2 checkpoint(s)", log.getvalue())
    self.assertCountEqual(os.listdir(checkpoints), ["README.txt", "my_notes"])
    for path in ("checkpoints/README.txt", "checkpoints/my_notes/a", "mine"):
      self.assertTrue(os.path.isfile(os.path.join(out, path)), path)

  def test_fresh_run_refuses_beside_step_dirs_it_did_not_write(self):
    out = small_runs.temp_dir(self)
    foreign = os.path.join(out, "checkpoints", "step_00000001")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "weights.bin"), "wb") as f:
      f.write(b"not ours")
    self.assertFalse(checkpoint_dirs.is_ours(foreign))
    tr = trainer.Trainer(
        small_runs.small_run(out), small_runs.corpus(), out=None
    )
    with self.assertRaisesRegex(
        checkpoint_meta.CheckpointError,
        r"holds \['step_00000001'\] .*which this program did not write",
    ):
      tr.prepare_output_dir()
    self.assertTrue(os.path.isfile(os.path.join(foreign, "weights.bin")))
    # The refusal gave the directory back.
    output_lock.OutputDirLock(out).acquire().release()


def _launch(output_dir: str) -> tuple[int, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for name in (
      "XLA_FLAGS",
      "JAX_COORDINATOR_ADDRESS",
      "JAX_NUM_PROCESSES",
      "JAX_PROCESS_ID",
  ):
    env.pop(name, None)
  proc = subprocess.run(
      [
          sys.executable,
          _LAUNCHER,
          "--num_processes=2",
          "--timeout_s=150",
          "--",
          sys.executable,
          _WORKER,
          f"--output_dir={output_dir}",
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      timeout=200,
      check=False,
  )
  return proc.returncode, proc.stdout


class TwoProcessesTest(absltest.TestCase):

  def test_process_0_holds_the_lock_and_a_busy_dir_stops_both(self):
    out = os.path.join(small_runs.temp_dir(self), "out")
    code, output = _launch(out)
    self.assertEqual(code, 0, output[-4000:])
    results = {}
    for line in output.splitlines():
      if "] RESULT " in line:
        result = json.loads(line.split("RESULT ", 1)[1])
        results[result["process"]] = result
    self.assertEqual(results[0]["holds_lock"], True)
    self.assertEqual(results[1]["holds_lock"], False)
    self.assertIsNone(results[0]["refused"])
    self.assertIn("is in use by another training run", results[1]["refused"])

    # Held by another run (this test): both processes stop, process 0
    # naming the holder, process 1 pointing at process 0.
    with output_lock.OutputDirLock(out):
      code, output = _launch(out)
    self.assertNotEqual(code, 0, output[-4000:])
    refusals = [l for l in output.splitlines() if "] REFUSED " in l]
    self.assertLen(refusals, 2, output[-4000:])
    (p0,) = [l for l in refusals if l.startswith("[p0]")]
    (p1,) = [l for l in refusals if l.startswith("[p1]")]
    self.assertIn(f"pid {os.getpid()} on host {socket.gethostname()}", p0)
    self.assertIn("process 0 of this run could not take", p1)


if __name__ == "__main__":
  absltest.main()
