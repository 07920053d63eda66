"""Joins the processes of one training run through JAX's distributed runtime.

initialize() joins the run that process_spec.py describes (a no-op for
a single process) and must come before any other JAX call;
is_main_process() picks process 0 to write the reports, barrier() and
all_true() keep the processes in step, shutdown() leaves. The runtime's own
timeouts (both flags) bound failures: a process that never joins makes every
other exit --distributed_init_timeout seconds after it called initialize(),
with one line on stderr naming the address, the timeout and the likely
cause, and exit code JOIN_FAILED_EXIT_CODE; one that dies after joining
makes the others abort (JAX ends them from C++ with SIGABRT, "Terminating
process because the JAX distributed service detected fatal errors") within
about --distributed_heartbeat_timeout seconds, once the coordination
service notices the missing heartbeats. Measured on one machine (2
processes, tools/launch_local.py, distributed_test.py): the survivor
exits 5.8-6.1 s after the death with a 5 s heartbeat timeout, 10.3 s after
it with 10 s; a dead coordinator (process 0) is noticed at once, 0.2-0.3 s
(its connections close).
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from train.parallel import process_spec

# The exit code of a process that could not join within its timeout.
JOIN_FAILED_EXIT_CODE = 3

# JAX's own join deadline is set this much later than ours, so that our
# one-line error, not JAX's C++ abort with a stack trace, ends a failed join.
_JAX_DEADLINE_MARGIN_S = 10


def _coordinator_accepts_connections(address: str) -> bool:
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
      return True
  except OSError:
    return False


def _address_source(spec: process_spec.ProcessSpec) -> str:
  """Where the coordinator address came from, for error lines."""
  if spec.cluster:
    return f"{spec.cluster} job step, coordinator {spec.coordinator_address}"
  return f"--coordinator_address={spec.coordinator_address}"


def _join_failure(spec: process_spec.ProcessSpec) -> str:
  """The one-line reason a join timed out, with the likeliest cause."""
  head = (
      f"{_address_source(spec)}: process "
      f"{spec.process_id} of {spec.num_processes} could not join the run "
      f"within --distributed_init_timeout={spec.init_timeout_s} s"
  )
  if spec.process_id == 0:
    cause = (
        "this process is the coordinator and some of the other processes "
        "never connected: they were not started, crashed before joining, "
        "were given another address or --num_processes, or cannot reach "
        "this host"
    )
  elif not _coordinator_accepts_connections(spec.coordinator_address):
    cause = (
        "nothing accepts connections at that address: process 0 (the "
        "coordinator) is not running, or the host or port is wrong or "
        "blocked"
    )
  else:
    cause = (
        "the coordinator is reachable but not every process joined: one "
        "was not started or crashed, or they disagree on --num_processes"
    )
  return f"{head}: {cause}."


def _exit_unless_joined(
    spec: process_spec.ProcessSpec, joined: threading.Event
) -> None:
  # JAX gives a failed join no Python exception: it aborts the process from
  # C++. Hence this watchdog ends the process first, with one clear line.
  if joined.wait(spec.init_timeout_s):
    return
  message = _join_failure(spec)
  try:
    sys.stdout.flush()
  except Exception:  # pylint: disable=broad-except
    pass
  os.write(2, f"RuntimeError: {message}\n".encode())
  os._exit(JOIN_FAILED_EXIT_CODE)  # pylint: disable=protected-access


_joined: process_spec.ProcessSpec | None = None


def initialize(spec: process_spec.ProcessSpec | None) -> None:
  """Joins the run; a no-op for None (a single process).

  Must run before anything that initialises JAX's backend (jax.devices(),
  any computation). Selects gloo for CPU collectives across processes (the
  option only concerns the CPU client), then blocks until all
  spec.num_processes processes have joined.

  Args:
    spec: from process_spec.resolve() or process_spec.spec_from_flags().

  Raises:
    RuntimeError: one line, when JAX refuses to start (e.g. its backend is
      already initialised, or the host name does not resolve). A join that
      times out ends the process instead, after spec.init_timeout_s seconds,
      with a one-line error on stderr and exit code JOIN_FAILED_EXIT_CODE:
      JAX itself would abort the process from C++.
  """
  global _joined
  if spec is None:
    return
  if _joined is not None:
    if _joined == spec:
      return
    raise RuntimeError(
        f"--coordinator_address: this process already joined a run "
        f"({_joined}); it cannot join another ({spec})."
    )
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  joined = threading.Event()
  watchdog = threading.Thread(
      target=_exit_unless_joined,
      args=(spec, joined),
      name="distributed-join-watchdog",
      daemon=True,
  )
  watchdog.start()
  if spec.cluster:
    # JAX's own detection reads the job's variables (resolve() checked them
    # and found what it will find) and sets local_device_ids to the task's
    # SLURM_LOCALID: one GPU per task.
    where = dict(cluster_detection_method=spec.cluster)
  else:
    where = dict(
        coordinator_address=spec.coordinator_address,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        cluster_detection_method="deactivate",
    )
  try:
    jax.distributed.initialize(
        initialization_timeout=spec.init_timeout_s + _JAX_DEADLINE_MARGIN_S,
        heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
        **where,
    )
  except Exception as e:  # pylint: disable=broad-except
    first_line = (str(e).strip().splitlines() or [""])[0]
    raise RuntimeError(
        f"{_address_source(spec)}: process "
        f"{spec.process_id} of {spec.num_processes} could not join the run: "
        f"{type(e).__name__}: {first_line}"
    ) from e
  finally:
    joined.set()
  _joined = spec


def join_on_cpu_devices(local_devices: int) -> None:
  """A test worker's start: JAX on `local_devices` simulated CPU devices
  in this process, then `initialize` with the run that process_spec's
  flags (parsed by now) describe.

  Must run before JAX starts. Replaces any device count XLA_FLAGS already
  gives (its other flags stay) and selects the CPU unless JAX_PLATFORMS
  names a platform.
  """
  count_flag = "--xla_force_host_platform_device_count"
  kept = [
      flag
      for flag in os.environ.get("XLA_FLAGS", "").split()
      if not flag.startswith(count_flag)
  ]
  os.environ["XLA_FLAGS"] = " ".join(kept + [f"{count_flag}={local_devices}"])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  initialize(process_spec.spec_from_flags())


def process_index() -> int:
  """This process's id in the run (0 for a single process)."""
  import jax  # pylint: disable=g-import-not-at-top

  return jax.process_index()


def is_main_process() -> bool:
  """True in process 0, the one that writes logs, plots and the summary.

  Starts JAX's backend: in a multi-process run, call it after initialize().
  """
  return process_index() == 0


def barrier(name: str) -> None:
  """Every process of a multi-process run waits here for the others.

  A no-op with one process. `name` must be the same in every process.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def all_true(flag: bool) -> bool:
  """Whether `flag` is true in every process of the run.

  Every process must call it at the same point (it gathers one int from
  each); with one process it returns `flag` and communicates nothing. It
  lets all processes stop together where only some found a fault (the
  output directory's lock, a checkpoint that cannot be written), instead
  of leaving the others waiting at the next barrier.
  """
  import jax  # pylint: disable=g-import-not-at-top

  if jax.process_count() == 1:
    return bool(flag)
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  gathered = multihost_utils.process_allgather(np.int32(bool(flag)))
  return bool(np.all(np.asarray(gathered)))


def shutdown() -> None:
  """Leaves the run (waits for the others at a barrier); safe to repeat."""
  global _joined
  if _joined is None:
    return
  import jax  # pylint: disable=g-import-not-at-top

  jax.distributed.shutdown()
  _joined = None
