"""Joining processes (distributed.py) and tools/launch_local.py.

The resolve() tests (process_spec.py) need no process. The launcher
tests run tiny python -c commands. The multi-process tests start 2 copies of
train/testing/distributed_worker.py (2 CPU devices each) through the
launcher and check a cross-process psum and all_gather against the formula,
and that a dead or missing process ends the run within the runtime's
timeouts, with every process ended (the launcher's summary line lists each
one's exit code and time).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized

from train.parallel import distributed
from train.parallel import process_spec

# The workspace root: this file is train/<package>/<name>.py.
_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
_LAUNCHER = os.path.join(_ROOT, "tools", "launch_local.py")
_WORKER = os.path.join(_ROOT, "train", "testing", "distributed_worker.py")

# The short runtime timeouts of the failure tests, in seconds.
_INIT_TIMEOUT_S = 5
_HEARTBEAT_TIMEOUT_S = 5
# The launcher waits this long after a failure before killing the rest: a
# survivor that ends within it ended on its own, through the heartbeat.
_GRACE_S = 30
# Every launch is killed past this (the launcher's --timeout_s), then fails.
_LAUNCH_LIMIT_S = 120
_SUMMARY = re.compile(r"p(\d+)=(-?\d+) \(([\d.]+) s([^)]*)\)")


def setUpModule():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(num_processes, command, *launcher_flags):
  """Runs the launcher; returns (exit code, output, {index: (code, s, note)}).

  Args:
    num_processes: copies to start.
    command: the command of every copy.
    *launcher_flags: more launcher flags (--grace_s=..., ...).
  """
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # The worker sets its own device count.
  env["JAX_PLATFORMS"] = "cpu"
  for name in list(env):
    if name.startswith("SLURM_") or name in (
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "JAX_COORDINATOR_PORT",
    ):
      del env[name]
  proc = subprocess.run(
      [
          sys.executable,
          _LAUNCHER,
          f"--num_processes={num_processes}",
          f"--timeout_s={_LAUNCH_LIMIT_S}",
          *launcher_flags,
          "--",
          *command,
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      timeout=_LAUNCH_LIMIT_S + 30,
      check=False,
  )
  summary = [
      line for line in proc.stdout.splitlines() if " exit codes: " in line
  ]
  assert len(summary) == 1, proc.stdout[-4000:]
  ended = {
      int(i): (int(code), float(seconds), note)
      for i, code, seconds, note in _SUMMARY.findall(summary[0])
  }
  return proc.returncode, proc.stdout, ended


def _worker(*flags_):
  return [sys.executable, _WORKER, "--local_devices=2", *flags_]


class ResolveTest(parameterized.TestCase):

  def test_nothing_set_is_a_single_process(self):
    self.assertIsNone(process_spec.resolve(environ={}))

  def test_environment_alone(self):
    env = {
        "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "3",
    }
    spec = process_spec.resolve(
        environ=env, init_timeout_s=7, heartbeat_timeout_s=9
    )
    self.assertEqual(
        spec,
        process_spec.ProcessSpec("10.0.0.1:1234", 4, 3, 7, 9),
    )

  def test_each_flag_wins_over_its_variable(self):
    env = {
        "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "3",
    }
    self.assertEqual(
        process_spec.resolve("host-a:99", environ=env).coordinator_address,
        "host-a:99",
    )
    spec = process_spec.resolve(num_processes=8, process_id=5, environ=env)
    self.assertEqual(
        (spec.coordinator_address, spec.num_processes, spec.process_id),
        ("10.0.0.1:1234", 8, 5),
    )
    # A flag of 0 is a value, not "unset".
    self.assertEqual(
        process_spec.resolve(process_id=0, environ=env).process_id, 0
    )

  def test_empty_variables_are_unset(self):
    env = {"JAX_COORDINATOR_ADDRESS": "", "JAX_NUM_PROCESSES": " "}
    self.assertIsNone(process_spec.resolve(environ=env))

  def test_one_process(self):
    self.assertIsNone(process_spec.resolve(num_processes=1, environ={}))
    spec = process_spec.resolve("[::1]:80", 1, environ={})
    self.assertEqual((spec.num_processes, spec.process_id), (1, 0))

  @parameterized.parameters(
      "localhost",
      "localhost:",
      ":1234",
      "host:0",
      "host:65536",
      "host:http",
      "::1:80",
      "my host:80",
  )
  def test_bad_address_flag(self, address):
    with self.assertRaisesRegex(ValueError, "HOST:PORT") as caught:
      process_spec.resolve(address, 2, 0, environ={})
    message = str(caught.exception)
    self.assertStartsWith(message, "--coordinator_address must be HOST:PORT")
    self.assertIn(repr(address), message)
    self.assertNotIn("\n", message)

  @parameterized.named_parameters(
      (
          "count_zero",
          dict(coordinator_address="h:1", num_processes=0, process_id=0),
          {},
          "--num_processes must be an integer >= 1; got 0.",
      ),
      (
          "count_not_a_number",
          {},
          {"JAX_NUM_PROCESSES": "two", "JAX_COORDINATOR_ADDRESS": "h:1"},
          "JAX_NUM_PROCESSES (environment) must be an integer >= 1; "
          "got 'two'.",
      ),
      (
          "id_too_large",
          dict(coordinator_address="h:1", num_processes=2, process_id=2),
          {},
          "--process_id must be in [0, 2) for --num_processes=2; got 2.",
      ),
      (
          "id_negative_from_env",
          dict(coordinator_address="h:1", num_processes=2),
          {"JAX_PROCESS_ID": "-1"},
          "JAX_PROCESS_ID (environment) must be in [0, 2) for "
          "--num_processes=2; got -1.",
      ),
      (
          "bad_address_from_env",
          dict(num_processes=2, process_id=0),
          {"JAX_COORDINATOR_ADDRESS": "nohost"},
          "JAX_COORDINATOR_ADDRESS (environment) must be HOST:PORT",
      ),
      (
          "no_count",
          dict(coordinator_address="h:1"),
          {},
          "--num_processes (or $JAX_NUM_PROCESSES) must be set",
      ),
      (
          "no_address",
          dict(num_processes=2, process_id=1),
          {},
          "--coordinator_address (or $JAX_COORDINATOR_ADDRESS) must be set "
          "when --num_processes=2",
      ),
      (
          "no_address_nor_id",
          {},
          {"JAX_NUM_PROCESSES": "3"},
          "--coordinator_address (or $JAX_COORDINATOR_ADDRESS) and "
          "--process_id (or $JAX_PROCESS_ID) must be set when "
          "JAX_NUM_PROCESSES (environment)=3",
      ),
  )
  def test_bad_input(self, kwargs, env, expected):
    with self.assertRaises(ValueError) as caught:
      process_spec.resolve(**kwargs, environ=env)
    self.assertStartsWith(str(caught.exception), expected)
    self.assertNotIn("\n", str(caught.exception))

  @parameterized.parameters(
      ("init_timeout_s", "--distributed_init_timeout"),
      ("heartbeat_timeout_s", "--distributed_heartbeat_timeout"),
  )
  def test_bad_timeout(self, keyword, flag):
    for value in (0, -5, "soon"):
      with self.assertRaisesRegex(
          ValueError,
          f"^{flag} must be a whole number of seconds >= 1; got "
          f"{re.escape(repr(value))}.$",
      ):
        process_spec.resolve("h:1", 2, 0, environ={}, **{keyword: value})

  def test_spec_from_flags(self):
    with flagsaver.flagsaver(
        coordinator_address="127.0.0.1:5000",
        num_processes=2,
        process_id=1,
        distributed_init_timeout=11,
        distributed_heartbeat_timeout=12,
    ):
      self.assertEqual(
          process_spec.spec_from_flags(),
          process_spec.ProcessSpec("127.0.0.1:5000", 2, 1, 11, 12),
      )

  def test_single_process_needs_no_join(self):
    distributed.initialize(None)  # Does nothing.
    self.assertTrue(distributed.is_main_process())
    distributed.shutdown()  # Nothing joined: does nothing.

  def test_initialize_after_the_backend_started_is_one_line(self):
    import jax  # pylint: disable=g-import-not-at-top

    jax.devices()  # The backend is up: JAX refuses to join.
    spec = process_spec.ProcessSpec(f"127.0.0.1:{_free_port()}", 2, 0, 5, 5)
    with self.assertRaisesRegex(
        RuntimeError,
        r"^--coordinator_address=127\.0\.0\.1:\d+: process 0 of 2 could "
        r"not join the run: RuntimeError: .*before any JAX",
    ) as caught:
      distributed.initialize(spec)
    self.assertNotIn("\n", str(caught.exception))


def _slurm(**changes):
  """The variables srun sets for task 1 of 4 of job 70001, with changes."""
  env = {
      "SLURM_JOB_ID": "70001",
      "SLURM_STEP_NODELIST": "gpu[017-020]",
      "SLURM_NTASKS": "4",
      "SLURM_PROCID": "1",
      "SLURM_LOCALID": "1",
  }
  env.update(changes)
  return {k: v for k, v in env.items() if v is not None}


class SlurmTest(parameterized.TestCase):
  """A SLURM job step is read as JAX's own detection reads it."""

  def test_task_of_a_job_step(self):
    spec = process_spec.resolve(environ=_slurm())
    # The first node of the step; 61440 + 70001 mod 4096 (JAX's formula).
    self.assertEqual(spec.coordinator_address, f"gpu017:{61440 + 70001 % 4096}")
    self.assertEqual((spec.num_processes, spec.process_id), (4, 1))
    self.assertEqual(spec.cluster, "slurm")
    self.assertIn("(from slurm)", str(spec))

  @parameterized.parameters(
      ("node7", "node7"),
      ("node7,gpu2", "node7"),
      ("node[007-015],gpu2", "node007"),
      ("node[007,009-011]", "node007"),
      ("a-b[3-4]", "a-b3"),
      ("node7,gpu[2-3]", "node7"),
  )
  def test_first_node_is_the_coordinator_as_in_jax(self, nodes, host):
    env = _slurm(SLURM_STEP_NODELIST=nodes)
    ours = process_spec.slurm_coordinator_address(env)
    self.assertEqual(ours.rpartition(":")[0], host)
    # JAX's own detection, on the same variables, agrees.
    # pylint: disable-next=g-import-not-at-top
    from jax._src.clusters import slurm_cluster

    with mock.patch.dict(os.environ, env, clear=True):
      self.assertEqual(
          slurm_cluster.SlurmCluster.get_coordinator_address(None, None), ours
      )

  def test_coordinator_port_variable_wins(self):
    spec = process_spec.resolve(environ=_slurm(JAX_COORDINATOR_PORT="4321"))
    self.assertEqual(spec.coordinator_address, "gpu017:4321")

  def test_flags_and_jax_variables_win_over_slurm(self):
    spec = process_spec.resolve("h:1", 2, 0, environ=_slurm())
    self.assertEqual((spec.coordinator_address, spec.cluster), ("h:1", None))
    env = _slurm(
        JAX_COORDINATOR_ADDRESS="h:2", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1"
    )
    self.assertEqual(
        process_spec.resolve(environ=env).coordinator_address, "h:2"
    )

  def test_one_task_or_no_step_is_a_single_process(self):
    self.assertIsNone(
        process_spec.resolve(environ=_slurm(SLURM_NTASKS="1", SLURM_PROCID="0"))
    )
    # A batch script itself, or salloc: the job's variables, no step.
    batch = {"SLURM_JOB_ID": "70001", "SLURM_NTASKS": "1"}
    self.assertIsNone(process_spec.resolve(environ=batch))
    self.assertIsNone(process_spec.resolve(environ={"SLURM_JOB_ID": "5"}))

  @parameterized.named_parameters(
      (
          "not_under_srun",
          {"SLURM_JOB_ID": "70001", "SLURM_NTASKS": "8"},
          "SLURM_STEP_NODELIST, SLURM_PROCID, SLURM_LOCALID must be set in a "
          "SLURM job of SLURM_NTASKS=8 tasks: start each task with srun",
      ),
      (
          "task_id_too_large",
          _slurm(SLURM_PROCID="4"),
          "SLURM_PROCID (environment) must be in [0, 4) for SLURM_NTASKS=4; "
          "got 4.",
      ),
      (
          "count_not_a_number",
          _slurm(SLURM_NTASKS="4(x2)"),
          "SLURM_NTASKS (environment) must be an integer >= 1; got '4(x2)'.",
      ),
      (
          "local_id_negative",
          _slurm(SLURM_LOCALID="-1"),
          "SLURM_LOCALID (environment) must be an integer >= 0; got -1.",
      ),
      (
          "job_id_not_a_number",
          _slurm(SLURM_JOB_ID="abc"),
          "SLURM_JOB_ID (environment) must be SLURM's integer job id; got "
          "'abc'.",
      ),
      (
          "bad_port",
          _slurm(JAX_COORDINATOR_PORT="99999"),
          "JAX_COORDINATOR_PORT (environment) with SLURM_STEP_NODELIST must "
          "be HOST:PORT",
      ),
  )
  def test_mis_set_variable_is_one_line(self, env, expected):
    with self.assertRaises(ValueError) as caught:
      process_spec.resolve(environ=env)
    self.assertStartsWith(str(caught.exception), expected)
    self.assertNotIn("\n", str(caught.exception))


class LauncherTest(absltest.TestCase):

  def test_sets_the_environment_and_prefixes_output(self):
    show = (
        "import os; e = os.environ; print(e['JAX_PROCESS_ID'], "
        "e['JAX_NUM_PROCESSES'], e['JAX_COORDINATOR_ADDRESS'])"
    )
    code, output, ended = _launch(
        3, [sys.executable, "-c", show], "--no_timeout_flags"
    )
    self.assertEqual(code, 0, output)
    self.assertEqual({i: c[0] for i, c in ended.items()}, {0: 0, 1: 0, 2: 0})
    addresses = set()
    for i in range(3):
      (line,) = [l for l in output.splitlines() if l.startswith(f"[p{i}] ")]
      index, count, address = line.split()[1:]
      self.assertEqual((index, count), (str(i), "3"))
      self.assertRegex(address, r"^127\.0\.0\.1:\d+$")
      addresses.add(address)
    self.assertLen(addresses, 1)

  def test_adds_the_timeout_flags_the_command_lacks(self):
    code, output, _ = _launch(
        1,
        [
            sys.executable,
            "-c",
            "import sys; print(sys.argv[1:])",
            "--distributed_heartbeat_timeout=3",
        ],
        "--init_timeout_s=17",
    )
    self.assertEqual(code, 0, output)
    self.assertIn(
        "[p0] ['--distributed_heartbeat_timeout=3', "
        "'--distributed_init_timeout=17']",
        output,
    )

  def test_first_failure_sets_the_exit_code_and_the_rest_are_killed(self):
    # p1 fails with 5 at once; p0 would sleep for 10 minutes; p2 succeeds.
    script = (
        "import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); "
        "time.sleep(600) if i == 0 else sys.exit(5 if i == 1 else 0)"
    )
    start = time.monotonic()
    code, output, ended = _launch(
        3, [sys.executable, "-c", script], "--grace_s=1", "--no_timeout_flags"
    )
    self.assertEqual(code, 5, output)
    self.assertEqual(ended[1][0], 5)
    self.assertIn("first failure", ended[1][2])
    self.assertEqual(ended[2][0], 0)
    self.assertEqual(ended[0][0], -signal.SIGKILL)
    self.assertIn("killed", ended[0][2])
    # Killed after the 1 s grace, far from the sleep's 600 s.
    self.assertLess(time.monotonic() - start, _LAUNCH_LIMIT_S)

  def test_sigterm_is_passed_on(self):
    script = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, "
        "lambda *_: sys.exit(7)); print('ready', flush=True); time.sleep(600)"
    )
    env = dict(os.environ)
    proc = subprocess.Popen(
        [
            sys.executable,
            _LAUNCHER,
            "--num_processes=2",
            "--no_timeout_flags",
            f"--timeout_s={_LAUNCH_LIMIT_S}",
            "--",
            sys.executable,
            "-c",
            script,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready = 0
    lines = []
    while ready < 2:
      line = proc.stdout.readline()
      self.assertTrue(line, "".join(lines))
      lines.append(line)
      ready += line.endswith("] ready\n")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=_LAUNCH_LIMIT_S)
    output = "".join(lines) + rest
    self.assertEqual(proc.returncode, 7, output)
    self.assertRegex(output, r"exit codes: p0=7 \(.*\) p1=7 \(")
    self.assertNotIn("killed", output)

  def test_bad_arguments(self):
    for args, expected in (
        (["--num_processes=0", "--", "true"], "--num_processes must be"),
        (["--num_processes=2"], "give the command to run after --"),
    ):
      proc = subprocess.run(
          [sys.executable, _LAUNCHER, *args],
          capture_output=True,
          text=True,
          check=False,
          timeout=60,
      )
      self.assertEqual(proc.returncode, 2, proc.stderr)
      self.assertIn(expected, proc.stderr)


class MultiProcessTest(parameterized.TestCase):

  def test_two_processes_reduce_and_gather_across_processes(self):
    code, output, ended = _launch(2, _worker())
    self.assertEqual(code, 0, output[-4000:])
    self.assertEqual({i: c[0] for i, c in ended.items()}, {0: 0, 1: 0})
    # Device d (4 in all, 2 per process) holds the row [d, d**2].
    rows = [[float(d), float(d * d)] for d in range(4)]
    want_sum = [0.0 + 1 + 2 + 3, 0.0 + 1 + 4 + 9]
    for i in range(2):
      (line,) = [
          l for l in output.splitlines() if l.startswith(f"[p{i}] RESULT ")
      ]
      result = json.loads(line.split("RESULT ", 1)[1])
      self.assertEqual(result["process"], i)
      self.assertEqual(result["num_processes"], 2)
      self.assertEqual(result["num_devices"], 4)
      self.assertEqual(result["main"], i == 0)
      self.assertEqual(result["psum"], want_sum)
      self.assertEqual(result["all_gather"], [rows] * 4)

  def test_slurm_job_step_joins_through_jax_detection(self):
    """2 tasks with srun's variables only: JAX's detection joins them."""
    code, output, ended = _launch(2, _worker(), "--env=slurm")
    self.assertEqual(code, 0, output[-4000:])
    self.assertEqual({i: c[0] for i, c in ended.items()}, {0: 0, 1: 0})
    want_sum = [0.0 + 1 + 2 + 3, 0.0 + 1 + 4 + 9]
    for i in range(2):
      (line,) = [
          l for l in output.splitlines() if l.startswith(f"[p{i}] RESULT ")
      ]
      result = json.loads(line.split("RESULT ", 1)[1])
      self.assertEqual((result["process"], result["num_processes"]), (i, 2))
      self.assertEqual(result["psum"], want_sum)

  def test_slurm_task_count_larger_than_the_step_fails_in_one_line(self):
    """SLURM_NTASKS says 3, srun started 2: one line each, no hang."""
    code, output, ended = _launch(
        2,
        ["env", "SLURM_NTASKS=3", *_worker()],
        "--env=slurm",
        f"--init_timeout_s={_INIT_TIMEOUT_S}",
    )
    self.assertEqual(code, distributed.JOIN_FAILED_EXIT_CODE, output[-4000:])
    errors = [l for l in output.splitlines() if "RuntimeError:" in l]
    self.assertLen(errors, 2, output[-4000:])
    for line in errors:
      self.assertRegex(
          line,
          r"RuntimeError: slurm job step, coordinator localhost:\d+: process "
          rf"\d of 3 could not join the run within "
          rf"--distributed_init_timeout={_INIT_TIMEOUT_S} s",
      )
    self.assertNotIn("Check failure stack trace", output)
    self.assertLess(max(c[1] for c in ended.values()), _INIT_TIMEOUT_S + 60)

  @parameterized.named_parameters(("worker_dies", 1), ("coordinator_dies", 0))
  def test_a_process_that_dies_ends_the_run(self, dying):
    code, output, ended = _launch(
        2,
        _worker(f"--die_process={dying}"),
        f"--grace_s={_GRACE_S}",
        f"--heartbeat_timeout_s={_HEARTBEAT_TIMEOUT_S}",
    )
    survivor = 1 - dying
    self.assertEqual(code, 17, output[-4000:])
    died_code, died_s, note = ended[dying]
    self.assertEqual(died_code, 17)
    self.assertIn("first failure", note)
    survivor_code, survivor_s, survivor_note = ended[survivor]
    self.assertNotEqual(survivor_code, 0, output[-4000:])
    # It ended on its own, within the grace, not killed by the launcher.
    self.assertNotIn("killed", survivor_note, output[-4000:])
    self.assertLess(survivor_s - died_s, _GRACE_S)
    self.assertRegex(
        output,
        r"stopped sending heartbeats|Terminating process because the JAX "
        r"distributed service detected fatal errors",
    )
    print(
        f"process {dying} died at {died_s:.1f} s; process {survivor} exited "
        f"{survivor_code} {survivor_s - died_s:.1f} s later (heartbeat "
        f"timeout {_HEARTBEAT_TIMEOUT_S} s)"
    )

  @parameterized.named_parameters(
      # Process 0 of 2 alone: the coordinator waits for a peer that never
      # comes. Process 1 of 2 alone: nothing listens at the address.
      ("missing_peer", 0, "some of the other processes never connected"),
      ("no_coordinator", 1, "nothing accepts connections at that address"),
  )
  def test_a_run_that_cannot_join_fails_in_one_line(self, process_id, cause):
    # One copy, told (by flags, which win over the launcher's environment)
    # that it is process_id of 2.
    code, output, ended = _launch(
        1,
        _worker("--num_processes=2", f"--process_id={process_id}"),
        f"--init_timeout_s={_INIT_TIMEOUT_S}",
    )
    self.assertEqual(code, distributed.JOIN_FAILED_EXIT_CODE, output[-4000:])
    errors = [l for l in output.splitlines() if "RuntimeError:" in l]
    self.assertLen(errors, 1, output[-4000:])
    self.assertRegex(
        errors[0],
        rf"^\[p0\] RuntimeError: --coordinator_address=127\.0\.0\.1:\d+: "
        rf"process {process_id} of 2 could not join the run within "
        rf"--distributed_init_timeout={_INIT_TIMEOUT_S} s: .*{cause}",
    )
    # Our line, not JAX's own abort (a C++ stack trace) after its deadline.
    self.assertNotIn("Check failure stack trace", output)
    # Bounded by the join timeout plus the start of python and jax.
    self.assertLess(ended[0][1], _INIT_TIMEOUT_S + 60)
    print(f"process {process_id} alone: exit {code} after {ended[0][1]:.1f} s")


if __name__ == "__main__":
  absltest.main()
