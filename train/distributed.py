"""Joins the processes of one training run through JAX's distributed runtime.

A run of N processes (one per host, or N on one machine through
tools/launch_local.py) names a coordinator, process 0's HOST:PORT, and gives
every process its id. The flags below win; else the standard environment
variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID are
read; with none of them set, a SLURM job step (srun) is detected the way
jax.distributed.initialize() detects it (SLURM_JOB_ID, SLURM_STEP_NODELIST,
SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID: one process per task, the first
node of the step is the coordinator, the port derives from the job id unless
JAX_COORDINATOR_PORT is set); else the run is a single process and nothing
is joined:

    spec = distributed.spec_from_flags()   # None for a single process
    distributed.initialize(spec)           # before any other JAX call
    ...
    if distributed.is_main_process():      # process 0 writes the reports
      ...
    distributed.shutdown()

Failure bounds (the runtime's own timeouts, both flags):
  * a process that never joins (not started, wrong address, crashed before
    joining) makes every other process exit --distributed_init_timeout
    seconds after it called initialize(), with one line on stderr naming
    --coordinator_address, the address, the timeout and the likely cause, and
    exit code JOIN_FAILED_EXIT_CODE;
  * a process that dies after joining makes the others abort (JAX ends them
    from C++ with SIGABRT, "Terminating process because the JAX distributed
    service detected fatal errors") within about
    --distributed_heartbeat_timeout seconds: the coordination service notices
    the missing heartbeats and tells the survivors. Measured on one machine
    (2 processes, tools/launch_local.py, train/distributed_test.py): the
    survivor exits 5.8-6.1 s after the death with a 5 s heartbeat timeout,
    10.3 s after it with 10 s; a dead coordinator (process 0) is noticed at
    once, 0.2-0.3 s (its connections close).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
from typing import Mapping

from absl import flags

# Defaults for a real cluster, JAX's own: hosts may start minutes apart.
DEFAULT_INIT_TIMEOUT_S = 300
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
# The exit code of a process that could not join within its timeout.
JOIN_FAILED_EXIT_CODE = 3

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

# JAX's own join deadline is set this much later than ours, so that our
# one-line error, not JAX's C++ abort with a stack trace, ends a failed join.
_JAX_DEADLINE_MARGIN_S = 10

_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address",
    None,
    "HOST:PORT of process 0 of a multi-process run (default: "
    f"${ENV_COORDINATOR_ADDRESS}; unset: a single process).",
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    None,
    f"Processes in the run (default: ${ENV_NUM_PROCESSES}, else 1).",
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id",
    None,
    f"This process's id in [0, --num_processes) (default: ${ENV_PROCESS_ID}).",
)
_INIT_TIMEOUT = flags.DEFINE_integer(
    "distributed_init_timeout",
    DEFAULT_INIT_TIMEOUT_S,
    "Seconds to wait for every process to join before giving up.",
)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "distributed_heartbeat_timeout",
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    "Seconds without a heartbeat after which a process counts as dead and "
    "the others stop.",
)


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
  """Where this process stands in a multi-process run.

  Attributes:
    coordinator_address: HOST:PORT where process 0 serves the coordination
      service and the others connect.
    num_processes: processes in the run, >= 1.
    process_id: this process's id, in [0, num_processes).
    init_timeout_s: seconds to wait for all processes to join.
    heartbeat_timeout_s: seconds of silence after which a process is dead.
  """

  coordinator_address: str
  num_processes: int
  process_id: int
  init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S
  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
  cluster: str | None = None

  def __str__(self) -> str:
    where = f" (from {self.cluster})" if self.cluster else ""
    return (
        f"process {self.process_id} of {self.num_processes}, coordinator "
        f"{self.coordinator_address}{where}"
    )


def _from_flag_or_env(value, flag_name, environ, env_name):
  """(value, the name to blame in errors); env values are str, "" is unset."""
  if value is not None:
    return value, flag_name
  raw = environ.get(env_name, "").strip()
  if raw:
    return raw, f"{env_name} (environment)"
  return None, None


def _as_int(value, source: str, expected: str) -> int:
  if isinstance(value, bool):
    raise ValueError(f"{source} must be {expected}; got {value!r}.")
  if isinstance(value, int):
    return value
  try:
    return int(str(value).strip())
  except ValueError:
    raise ValueError(f"{source} must be {expected}; got {value!r}.") from None


def _check_address(address, source: str) -> str:
  expected = "HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:1234"
  if not isinstance(address, str):
    raise ValueError(f"{source} must be {expected}; got {address!r}.")
  host, colon, port = address.rpartition(":")
  bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
  if (
      not colon
      or not host
      or any(c.isspace() for c in address)
      or not port.isdigit()
      or not 1 <= int(port) <= 65535
      or (":" in host and not bracketed)  # IPv6 hosts need [brackets].
  ):
    raise ValueError(f"{source} must be {expected}; got {address!r}.")
  return address


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    environ: Mapping[str, str] = os.environ,
) -> ProcessSpec | None:
  """The run's ProcessSpec from flag values, else the environment.

  Each of the three is taken from its argument when not None, else from
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES or JAX_PROCESS_ID.

  Args:
    coordinator_address: HOST:PORT of process 0, or None.
    num_processes: processes in the run, or None.
    process_id: this process's id, or None.
    init_timeout_s: seconds to wait for all processes to join.
    heartbeat_timeout_s: seconds of silence after which a process is dead.
    environ: where the environment variables are read.

  Returns:
    The spec, or None for a single process: none of the three set, or
    one process and no coordinator address.

  Raises:
    ValueError: one line naming the flag or variable at fault, what it must
      be and what it is.
  """
  address, address_src = _from_flag_or_env(
      coordinator_address,
      "--coordinator_address",
      environ,
      ENV_COORDINATOR_ADDRESS,
  )
  count, count_src = _from_flag_or_env(
      num_processes, "--num_processes", environ, ENV_NUM_PROCESSES
  )
  index, index_src = _from_flag_or_env(
      process_id, "--process_id", environ, ENV_PROCESS_ID
  )
  for value, name in (
      (init_timeout_s, "--distributed_init_timeout"),
      (heartbeat_timeout_s, "--distributed_heartbeat_timeout"),
  ):
    if _as_int(value, name, "a whole number of seconds >= 1") < 1:
      raise ValueError(
          f"{name} must be a whole number of seconds >= 1; got {value!r}."
      )
  if address is None and count is None and index is None:
    return _from_slurm(environ, init_timeout_s, heartbeat_timeout_s)
  if count is None:
    given = address_src or index_src
    raise ValueError(
        f"--num_processes (or ${ENV_NUM_PROCESSES}) must be set to the run's "
        f"process count when {given} is set; it is unset."
    )
  count = _as_int(count, count_src, "an integer >= 1")
  if count < 1:
    raise ValueError(f"{count_src} must be an integer >= 1; got {count}.")
  if index is not None:
    index = _as_int(index, index_src, f"an integer in [0, {count})")
    if not 0 <= index < count:
      raise ValueError(
          f"{index_src} must be in [0, {count}) for {count_src}={count}; "
          f"got {index}."
      )
  if address is not None:
    address = _check_address(address, address_src)
  if count > 1:
    missing = [
        f"{flag} (or ${env})"
        for value, flag, env in (
            (address, "--coordinator_address", ENV_COORDINATOR_ADDRESS),
            (index, "--process_id", ENV_PROCESS_ID),
        )
        if value is None
    ]
    if missing:
      verb = "it is" if len(missing) == 1 else "they are"
      raise ValueError(
          f"{' and '.join(missing)} must be set when {count_src}={count} "
          "(a multi-process run needs the coordinator address, the process "
          f"count and this process's id); {verb} unset."
      )
  elif address is None:
    return None  # One process, nothing to join.
  return ProcessSpec(
      coordinator_address=address,
      num_processes=count,
      process_id=0 if index is None else index,
      init_timeout_s=int(init_timeout_s),
      heartbeat_timeout_s=int(heartbeat_timeout_s),
  )


# What JAX's SLURM detection reads (jax._src.clusters.slurm_cluster), and
# the SLURM_JOB_ID-derived coordinator port range it uses.
_SLURM_JOB_ID = "SLURM_JOB_ID"
_SLURM_NODELIST = "SLURM_STEP_NODELIST"
_SLURM_NTASKS = "SLURM_NTASKS"
_SLURM_PROCID = "SLURM_PROCID"
_SLURM_LOCALID = "SLURM_LOCALID"
_SLURM_VARIABLES = (
    _SLURM_JOB_ID,
    _SLURM_NODELIST,
    _SLURM_NTASKS,
    _SLURM_PROCID,
    _SLURM_LOCALID,
)
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"


def slurm_coordinator_address(environ: Mapping[str, str]) -> str:
  """HOST:PORT that JAX's SLURM detection picks: the step's first node.

  The node list's forms: "node7", "node7,gpu2", "node[007-015],gpu2" and
  "node[007,009-011]" (the first node is node007). The port is
  $JAX_COORDINATOR_PORT, else 61440 + SLURM_JOB_ID mod 4096, as in JAX.
  """
  nodes = environ[_SLURM_NODELIST].strip()
  head, bracket, rest = nodes.partition("[")
  if "," in head:  # "node7,gpu2" or "node7,gpu[2-3]": the first name.
    host = head.split(",", 1)[0]
  elif bracket:  # "node[007-015],...": the prefix and the first number.
    first = rest.split("]", 1)[0].split(",", 1)[0].split("-", 1)[0]
    host = head + first
  else:
    host = head
  if not host or any(c.isspace() for c in host):
    raise ValueError(
        f"{_SLURM_NODELIST} (environment) must be SLURM's node list, e.g. "
        f"node[001-128]; got {nodes!r}."
    )
  port = environ.get(ENV_COORDINATOR_PORT, "").strip()
  if not port:
    job = _as_int(
        environ[_SLURM_JOB_ID],
        f"{_SLURM_JOB_ID} (environment)",
        "SLURM's integer job id",
    )
    port = str(job % 2**12 + (65535 - 2**12 + 1))
  return _check_address(
      f"{host}:{port}",
      f"{ENV_COORDINATOR_PORT} " f"(environment) with {_SLURM_NODELIST}",
  )


def _from_slurm(environ, init_timeout_s, heartbeat_timeout_s):
  """The spec of a SLURM job step's task, or None outside one.

  Only srun sets all five variables JAX's detection reads. A batch script
  itself (sbatch, before srun) or salloc sets SLURM_JOB_ID alone: one
  process, unless it says it runs several tasks.
  """
  present = [v for v in _SLURM_VARIABLES if environ.get(v, "").strip()]
  if _SLURM_JOB_ID not in present:
    return None
  count_src = f"{_SLURM_NTASKS} (environment)"
  if len(present) < len(_SLURM_VARIABLES):
    raw_count = environ.get(_SLURM_NTASKS, "").strip()
    if not raw_count or _as_int(raw_count, count_src, "an integer >= 1") <= 1:
      return None  # One task, no step: a single process.
    missing = [v for v in _SLURM_VARIABLES if v not in present]
    raise ValueError(
        f"{', '.join(missing)} must be set in a SLURM job of "
        f"{_SLURM_NTASKS}={raw_count} tasks: start each task with srun (the "
        "README's sbatch example), or give --coordinator_address, "
        "--num_processes and --process_id."
    )
  count = _as_int(environ[_SLURM_NTASKS], count_src, "an integer >= 1")
  if count < 1:
    raise ValueError(f"{count_src} must be an integer >= 1; got {count}.")
  index_src = f"{_SLURM_PROCID} (environment)"
  index = _as_int(
      environ[_SLURM_PROCID], index_src, f"an integer in [0, {count})"
  )
  if not 0 <= index < count:
    raise ValueError(
        f"{index_src} must be in [0, {count}) for {_SLURM_NTASKS}={count}; "
        f"got {index}."
    )
  local_src = f"{_SLURM_LOCALID} (environment)"
  if _as_int(environ[_SLURM_LOCALID], local_src, "an integer >= 0") < 0:
    raise ValueError(
        f"{local_src} must be an integer >= 0; got {environ[_SLURM_LOCALID]}."
    )
  address = slurm_coordinator_address(environ)
  if count == 1:
    return None
  return ProcessSpec(
      coordinator_address=address,
      num_processes=count,
      process_id=index,
      init_timeout_s=int(init_timeout_s),
      heartbeat_timeout_s=int(heartbeat_timeout_s),
      cluster="slurm",
  )


def spec_from_flags() -> ProcessSpec | None:
  """resolve() with this module's flags (which must have been parsed)."""
  return resolve(
      _COORDINATOR_ADDRESS.value,
      _NUM_PROCESSES.value,
      _PROCESS_ID.value,
      init_timeout_s=_INIT_TIMEOUT.value,
      heartbeat_timeout_s=_HEARTBEAT_TIMEOUT.value,
  )


def _coordinator_accepts_connections(address: str) -> bool:
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
      return True
  except OSError:
    return False


def _address_source(spec: ProcessSpec) -> str:
  """Where the coordinator address came from, for error lines."""
  if spec.cluster:
    return f"{spec.cluster} job step, coordinator {spec.coordinator_address}"
  return f"--coordinator_address={spec.coordinator_address}"


def _join_failure(spec: ProcessSpec) -> str:
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


def _exit_unless_joined(spec: ProcessSpec, joined: threading.Event) -> None:
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


_joined: ProcessSpec | None = None


def initialize(spec: ProcessSpec | None) -> None:
  """Joins the run; a no-op for None (a single process).

  Must run before anything that initialises JAX's backend (jax.devices(),
  any computation). Selects gloo for CPU collectives across processes (the
  option only concerns the CPU client), then blocks until all
  spec.num_processes processes have joined.

  Args:
    spec: from resolve() or spec_from_flags().

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
