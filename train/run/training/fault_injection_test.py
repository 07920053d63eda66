"""SIGKILLs a training run during its saves, resumes, and checks the result.

One run of train/testing/fault_injection_worker.py trains SMALL_DSV3 (its
layers scanned, each batch in 2 microbatches) uninterrupted: the
reference. Another run of the same config is killed 10 times at points of
its saves and of its metrics log, and resumed after each kill: once before
its first checkpoint is finalised, then once per phase of the worker, in a
seeded random order and at seeded steps (`_plan`), then right after its
last checkpoint lands, then while a resume saves that step again. After
every kill:

  * a resume is refused (CheckpointError) exactly when no checkpoint was
    finalised; it never starts afresh on its own;
  * otherwise it resumes from the newest finalised checkpoint, after
    restoring every checkpoint listed (checksums verified): a half-written
    one is never taken as complete;
  * metrics.jsonl holds steps 1, 2, ... up to at least the newest
    checkpoint, and at most a last line cut short, which the resume drops
    with a warning naming it.

The finished run must equal the reference bit for bit: its state, loss
history and metrics records (but their timings).

Each worker is a new process (SIGKILL ends it): about 2 s of imports and
2 s of tracing each. The compiled steps are shared through JAX's
persistent compilation cache, compiled at XLA's lowest optimisation level
(the same in every worker, hence the same numbers).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile

from absl.testing import absltest
import numpy as np

from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_meta
from train.testing import fault_injection_worker

_WORKER = os.path.abspath(fault_injection_worker.__file__)
_STEPS = 8
_SEED = 17
# The phases of the seeded kills (see fault_injection_worker.py). The fixed
# ones before and after them add "committed" and "replaced" kills.
_PHASES = ("timer", "item", "finalize", "prune", "log", "trim")
_WORKER_TIMEOUT_S = 180
# Fields of a metrics record that are wall-clock times.
_TIMINGS = ("seconds", "tokens_per_s", "tokens_per_s_per_device")
_REPLACED = re.compile(r"^\.replaced-step_(\d{8})-[0-9a-f]+$")


def _plan(rng: np.random.Generator) -> list[tuple[str, int, float]]:
  """(phase, steps past the resumed one, timer seconds) of the seeded kills:
  one per phase, in a random order."""
  phases = rng.permutation(_PHASES).tolist()
  return [
      (phase, int(rng.integers(1, 3)), round(float(rng.uniform(0, 0.3)), 3))
      for phase in phases
  ]


def _checkpoints(output_dir: str) -> str:
  return os.path.join(output_dir, "checkpoints")


def _log_lines(output_dir: str) -> tuple[list[dict], bool]:
  """(complete records of metrics.jsonl, whether a cut last line follows)."""
  path = os.path.join(output_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return [], False
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  # Only the last piece lacks a newline; empty if the file ends with one.
  return [json.loads(line) for line in lines[:-1]], bool(lines[-1])


def _resume_step(checkpoint_dir: str) -> int | None:
  """The step a resume must start from; None if nothing to resume.

  The newest finalised checkpoint, or an older copy of it that a killed
  re-save moved aside (the resume puts it back).
  """
  steps = [s for s, _ in checkpoint_dirs.list_checkpoints(checkpoint_dir)]
  if os.path.isdir(checkpoint_dir):
    steps += [
        int(m[1])
        for m in map(_REPLACED.match, os.listdir(checkpoint_dir))
        if m is not None
    ]
  return max(steps, default=None)


def _comparable(records: list[dict]) -> list[dict]:
  return [{k: v for k, v in r.items() if k not in _TIMINGS} for r in records]


class FaultInjectionTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    root = tempfile.TemporaryDirectory(prefix="dropless_fault_test_")
    self.addCleanup(root.cleanup)
    self.root = root.name
    self.env = dict(os.environ)
    self.env.update(
        JAX_PLATFORMS="cpu",
        # One device; the lowest optimisation level compiles twice as fast.
        XLA_FLAGS=(
            "--xla_backend_optimization_level=0 "
            "--xla_llvm_disable_expensive_passes=true"
        ),
        JAX_COMPILATION_CACHE_DIR=os.path.join(self.root, "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )

  def _worker(self, output_dir, *flags):
    """Runs one worker; returns (exit code, its output)."""
    proc = subprocess.run(
        [
            sys.executable,
            _WORKER,
            f"--output_dir={output_dir}",
            f"--steps={_STEPS}",
            *flags,
        ],
        env=self.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=_WORKER_TIMEOUT_S,
        check=False,
    )
    return proc.returncode, proc.stdout

  def _kill_flag(self, planned, output_dir) -> str:
    """--kill for a planned kill, made reachable from where the run is."""
    phase, ahead, seconds = planned
    start = _resume_step(_checkpoints(output_dir))
    step = min(start + ahead, _STEPS)
    if start == _STEPS:  # Only the final save is left: it saves again.
      phase = "replaced"
    elif phase == "prune":
      # The first prune comes with the third checkpoint in the directory.
      saved = len(checkpoint_dirs.list_checkpoints(_checkpoints(output_dir)))
      if start + 3 - saved > _STEPS:
        phase = "committed"
    elif phase == "trim":
      records, cut = _log_lines(output_dir)
      if not (cut or records[-1]["step"] > start):
        phase = "log"  # The resume has nothing to trim.
    return f"--kill={phase}:{step}:{seconds}"

  def _run_killed(self, output_dir, *flags) -> None:
    """Runs a worker that must die by SIGKILL; checks what it left."""
    code, output = self._worker(output_dir, *flags)
    self.assertEqual(code, -signal.SIGKILL, f"{flags}:\n{output[-3000:]}")
    self._check_left_by_kill(output_dir)

  def _check_left_by_kill(self, output_dir) -> None:
    """Every finalised checkpoint's meta verifies (its arrays are verified
    by the next resume); the log holds steps 1, 2, ... up to at least the
    newest checkpoint, and at most a cut last line."""
    checkpoint_dir = _checkpoints(output_dir)
    for _, path in checkpoint_dirs.list_checkpoints(checkpoint_dir):
      checkpoint_meta.read_meta(path)
    steps = [r["step"] for r in _log_lines(output_dir)[0]]
    self.assertEqual(steps, list(range(1, len(steps) + 1)))
    self.assertGreaterEqual(len(steps), _resume_step(checkpoint_dir) or 0)

  def _run_resumed(self, output_dir, *flags) -> tuple[int, str]:
    """Runs a worker with --resume; checks where it resumed from."""
    checkpoint_dir = _checkpoints(output_dir)
    start = _resume_step(checkpoint_dir)
    records, cut = _log_lines(output_dir)
    code, output = self._worker(output_dir, "--resume", *flags)
    context = f"{flags}:\n{output[-3000:]}"
    self.assertIn(
        f"resumed from {checkpoint_dirs.step_dir(checkpoint_dir, start)} at "
        f"step {start}\n",
        output,
        context,
    )
    if cut:
      line = len(records) + 1
      self.assertIn(f"metrics.jsonl: dropped line {line}", output, context)
    return code, output

  def _run_resumed_and_killed(self, output_dir, kill_flag) -> None:
    code, output = self._run_resumed(output_dir, kill_flag)
    self.assertEqual(code, -signal.SIGKILL, f"{kill_flag}:\n{output[-3000:]}")
    self._check_left_by_kill(output_dir)

  def _assert_refused(self, output_dir):
    """Nothing was finalised: --resume is refused, and writes nothing."""
    records, _ = _log_lines(output_dir)
    code, output = self._worker(output_dir, "--resume")
    self.assertEqual(
        code, fault_injection_worker.REFUSED_EXIT_CODE, output[-3000:]
    )
    self.assertIn("REFUSED CheckpointError: --resume: no checkpoint", output)
    self.assertEqual(_log_lines(output_dir)[0], records)
    self.assertEqual(
        checkpoint_dirs.list_checkpoints(_checkpoints(output_dir)), []
    )

  def _assert_same_run(self, output_dir, npz, reference_dir, reference_npz):
    """State, loss history and metrics records equal, bit for bit."""
    with np.load(reference_npz) as expected, np.load(npz) as found:
      self.assertEqual(sorted(found.files), sorted(expected.files))
      for name in expected.files:
        self.assertEqual(found[name].dtype, expected[name].dtype, name)
        self.assertEqual(found[name].shape, expected[name].shape, name)
        self.assertEqual(found[name].tobytes(), expected[name].tobytes(), name)
    records, cut = _log_lines(output_dir)
    self.assertFalse(cut)
    self.assertLen(records, _STEPS)
    self.assertEqual(
        _comparable(records), _comparable(_log_lines(reference_dir)[0])
    )

  def test_killed_saves_resume_exactly_or_are_refused(self):
    reference_dir = os.path.join(self.root, "reference")
    reference_npz = os.path.join(self.root, "reference.npz")
    code, output = self._worker(reference_dir, f"--final={reference_npz}")
    self.assertEqual(code, 0, output[-3000:])

    out = os.path.join(self.root, "killed")
    # Killed before its first checkpoint is finalised: nothing to resume.
    self._run_killed(out, "--kill=finalize:1:0")
    self._assert_refused(out)
    # Started afresh on purpose, as a user would; killed past step 2, when
    # checkpoint 1 is finalised (each save first waits for the one before).
    self._run_killed(out, "--kill=committed:3:0")
    kills = 2
    for kill in _plan(np.random.default_rng(_SEED)):
      self._run_resumed_and_killed(out, self._kill_flag(kill, out))
      kills += 1
    # Killed right after the last checkpoint landed; then while its resume
    # saves that step again, with the old copy moved aside.
    for phase in ("committed", "replaced"):
      self._run_resumed_and_killed(out, f"--kill={phase}:{_STEPS}:0")
      kills += 1
    final_npz = os.path.join(self.root, "final.npz")
    code, output = self._run_resumed(out, f"--final={final_npz}")
    self.assertEqual(code, 0, output[-3000:])
    self.assertGreaterEqual(kills, 10)
    self._assert_same_run(out, final_npz, reference_dir, reference_npz)


if __name__ == "__main__":
  absltest.main()
