r"""Runs N copies of a command as one multi-process JAX run on this machine.

Each copy gets the variables of a JAX multi-process run (or, with
--env=slurm, those srun gives the tasks of a one-node job step) and every
output line is printed with a "[p<i>] " prefix; signals are passed on,
the other copies are stopped when one fails, and the launcher exits with
the first non-zero exit code (`launch`). Usage:
    python tools/launch_local.py --num_processes=2 -- \
        python -m train.main --mesh=data=2,expert=4 --steps=20
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

# Short join and heartbeat timeouts: all copies start at once, here.
DEFAULT_INIT_TIMEOUT_S = 60
DEFAULT_HEARTBEAT_TIMEOUT_S = 10
# Longer than the heartbeat timeout plus its detection lag (measured: the
# survivors end about 1 s past one heartbeat timeout after a death).
DEFAULT_GRACE_S = 30
_POLL_S = 0.1


_JAX_VARIABLES = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JAX_COORDINATOR_PORT",
)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# JAX's SLURM detection puts the coordinator at this port plus the job id
# modulo 4096 (jax._src.clusters.slurm_cluster).
SLURM_PORT_BASE = 65535 - 2**12 + 1


def free_slurm_job_id(port: int = 0) -> int:
  """A job id whose derived coordinator port is free (or is `port`)."""
  for _ in range(200):
    candidate = port or random.randrange(SLURM_PORT_BASE, 65536)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      try:
        s.bind(("127.0.0.1", candidate))
      except OSError:
        if port:
          break
        continue
    # Any job id with this residue; a realistic size, as SLURM's are.
    return 4096 * 1000 + candidate - SLURM_PORT_BASE
  raise RuntimeError("no free port for a SLURM job id in 61440..65535")


def slurm_environment(num_processes: int, index: int, job_id: int):
  """The variables srun sets for task `index` of a one-node job step."""
  return dict(
      SLURM_JOB_ID=str(job_id),
      SLURM_STEP_ID="0",
      SLURM_STEP_NODELIST="localhost",
      SLURM_NODELIST="localhost",
      SLURM_STEP_NUM_NODES="1",
      SLURM_NNODES="1",
      SLURM_NODEID="0",
      SLURM_NTASKS=str(num_processes),
      SLURM_STEP_NUM_TASKS=str(num_processes),
      SLURM_PROCID=str(index),
      SLURM_LOCALID=str(index),
  )


def _parse(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      usage="%(prog)s --num_processes=N [options] -- CMD [ARGS...]",
  )
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument(
      "--grace_s",
      type=float,
      default=DEFAULT_GRACE_S,
      help="after the first failure, seconds to wait for the others before "
      "killing them",
  )
  parser.add_argument(
      "--timeout_s",
      type=float,
      default=0,
      help="kill every copy after this many seconds (0: no limit)",
  )
  parser.add_argument(
      "--port", type=int, default=0, help="coordinator port (0: a free one)"
  )
  parser.add_argument(
      "--init_timeout_s", type=int, default=DEFAULT_INIT_TIMEOUT_S
  )
  parser.add_argument(
      "--heartbeat_timeout_s", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_S
  )
  parser.add_argument(
      "--env",
      choices=("jax", "slurm"),
      default="jax",
      help="the variables each copy gets: JAX's JAX_COORDINATOR_ADDRESS, "
      "JAX_NUM_PROCESSES and JAX_PROCESS_ID, or those of a SLURM job step",
  )
  parser.add_argument(
      "--no_timeout_flags",
      action="store_true",
      help="do not add --distributed_*_timeout flags to the command",
  )
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after --, e.g. -- python -m x")
  if args.num_processes < 1:
    parser.error(
        f"--num_processes must be an integer >= 1; got {args.num_processes}"
    )
  for name in ("grace_s", "timeout_s"):
    if getattr(args, name) < 0:
      parser.error(f"--{name} must be >= 0; got {getattr(args, name)}")
  for name in ("init_timeout_s", "heartbeat_timeout_s"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
  if not 0 <= args.port <= 65535:
    parser.error(f"--port must be in [0, 65535]; got {args.port}")
  args.command = command
  return args


def with_timeout_flags(command, init_timeout_s, heartbeat_timeout_s):
  """command plus the timeout flags it does not set itself.

  They go before a lone "--" if there is one (after it, absl would take
  them for positional arguments).
  """
  extra = []
  for flag, value in (
      ("--distributed_init_timeout", init_timeout_s),
      ("--distributed_heartbeat_timeout", heartbeat_timeout_s),
  ):
    if not any(a == flag or a.startswith(flag + "=") for a in command):
      extra.append(f"{flag}={value}")
  end = command.index("--") if "--" in command[1:] else len(command)
  return command[:end] + extra + command[end:]


def _die_with_parent():
  # Linux: the copy gets SIGKILL if the launcher itself is killed, so no
  # copy outlives it (prctl(PR_SET_PDEATHSIG, SIGKILL)).
  if sys.platform.startswith("linux"):
    import ctypes  # pylint: disable=g-import-not-at-top

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class _Copy:
  """One running copy: its process and the thread that prefixes its output."""

  def __init__(self, index, command, env, out, lock):
    self.index = index
    self.proc = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Its own process group, killed as one.
        preexec_fn=_die_with_parent,
    )
    self.code = None
    self.ended_s = None
    self.killed = False
    self._out = out
    self._lock = lock
    # Started once every copy is: preexec_fn is unsafe with threads about.
    self.reader = threading.Thread(target=self._copy_output, daemon=True)

  def _copy_output(self):
    prefix = f"[p{self.index}] ".encode()
    for line in iter(self.proc.stdout.readline, b""):
      if not line.endswith(b"\n"):
        line += b"\n"
      with self._lock:
        self._out.write(prefix + line)
        self._out.flush()
    self.proc.stdout.close()

  def signal_group(self, sig):
    try:
      os.killpg(self.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
      pass  # Already gone.


def _exit_code(code: int) -> int:
  return 128 - code if code < 0 else code


def launch(args, out=None) -> int:
  """Runs the copies to the end; returns the launcher's exit code.

  Each copy gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<a free port>,
  JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=i (what train/parallel/process_spec.py
  reads); with --env=slurm it gets instead what srun gives each task of a
  one-node job step (`slurm_environment`), the job id chosen so that the
  port JAX derives from it is free (`free_slurm_job_id`), which rehearses
  a SLURM launch on one machine; and, unless the command sets them itself
  or --no_timeout_flags is given, short --distributed_init_timeout and
  --distributed_heartbeat_timeout (`with_timeout_flags`): the processes of
  one machine start together. Every output line (stdout and stderr
  together) is printed with a "[p<i>] " prefix.

  Ctrl-C or SIGTERM is passed on to every copy (a second one kills them).
  When a copy exits non-zero, the others get --grace_s seconds to end on
  their own (JAX's heartbeat ends them within about the heartbeat
  timeout), then they are killed with their process groups. The exit code
  is the first non-zero one of a copy (128 + N for a copy ended by signal
  N), 0 when all succeeded, after one summary line with every copy's exit
  code and time.
  """
  out = out or sys.stdout.buffer
  lock = threading.Lock()

  def say(message):
    with lock:
      out.write(f"[launch_local] {message}\n".encode())
      out.flush()

  if args.env == "slurm":
    job_id = free_slurm_job_id(args.port)
    port = job_id % 2**12 + SLURM_PORT_BASE
    coordinator = f"localhost:{port} (SLURM job {job_id})"
  else:
    port = args.port or free_port()
    coordinator = f"127.0.0.1:{port}"
  command = args.command
  if not args.no_timeout_flags:
    command = with_timeout_flags(
        command, args.init_timeout_s, args.heartbeat_timeout_s
    )
  say(
      f"{args.num_processes} processes, coordinator {coordinator}: "
      + " ".join(command)
  )
  copies = []
  start = time.monotonic()
  signals = []
  previous = {
      sig: signal.signal(sig, lambda sig, _: signals.append(sig))
      for sig in (signal.SIGINT, signal.SIGTERM)
  }
  try:
    for i in range(args.num_processes):
      env = dict(os.environ)
      if args.env == "slurm":
        for name in list(env):
          if name.startswith("SLURM_") or name in _JAX_VARIABLES:
            del env[name]
        env.update(slurm_environment(args.num_processes, i, job_id))
      else:
        env.update(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=str(args.num_processes),
            JAX_PROCESS_ID=str(i),
        )
      env["PYTHONUNBUFFERED"] = "1"
      try:
        copies.append(_Copy(i, command, env, out, lock))
      except OSError as e:
        say(f"cannot start {command[0]!r}: {e}; stopping the others")
        return 127  # The shell's code for a command it cannot run.
    for c in copies:
      c.reader.start()
    first_failure = None
    kill_at = None
    timed_out = False
    forwarded = 0
    while True:
      now = time.monotonic()
      for c in copies:
        if c.code is None and c.proc.poll() is not None:
          c.code, c.ended_s = c.proc.returncode, now - start
          if c.code != 0 and first_failure is None:
            first_failure = c
            kill_at = now + args.grace_s
            say(
                f"p{c.index} exited with {c.code} after {c.ended_s:.1f} s; "
                f"the others get {args.grace_s:g} s to end"
            )
      running = [c for c in copies if c.code is None]
      if not running:
        break
      while forwarded < len(signals):
        sig = signals[forwarded]
        forwarded += 1
        # A second signal: kill now; the first: pass it on, with grace.
        if forwarded > 1:
          kill_at = now
        else:
          kill_at = min(kill_at or now + args.grace_s, now + args.grace_s)
          say(f"passing {signal.Signals(sig).name} on to every process")
          for c in running:
            c.signal_group(sig)
      if args.timeout_s and now - start > args.timeout_s and not timed_out:
        say(f"--timeout_s={args.timeout_s:g} passed; killing every process")
        timed_out, kill_at = True, now
      if kill_at is not None and now >= kill_at:
        for c in running:
          c.killed = True
          c.signal_group(signal.SIGKILL)
        for c in running:
          c.proc.wait()
        continue
      time.sleep(_POLL_S)
  finally:
    for c in copies:
      if c.proc.poll() is None:  # Only if the launcher itself failed.
        c.signal_group(signal.SIGKILL)
        c.proc.wait()
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  for c in copies:
    if c.reader.ident is not None:  # Started.
      c.reader.join(timeout=5)
  failures = sorted((c for c in copies if c.code), key=lambda c: c.ended_s)
  code = _exit_code(failures[0].code) if failures else 0
  parts = []
  for c in copies:
    note = ", killed" if c.killed else ""
    if c is (failures[0] if failures else None):
      note += ", first failure"
    parts.append(f"p{c.index}={c.code} ({c.ended_s:.1f} s{note})")
  say(f"exit codes: {' '.join(parts)}; exiting with {code}")
  return code


def main(argv=None) -> int:
  return launch(_parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
  sys.exit(main())
