"""Works out which process of a training run this one is, before JAX starts.

A run of N processes (one per host, or N on one machine through
tools/launch_local.py) names a coordinator, process 0's HOST:PORT, and gives
every process its id. The flags below win; else the standard environment
variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID are
read; with none of them set, a SLURM job step (srun) is detected the way
jax.distributed.initialize() detects it (SLURM_JOB_ID, SLURM_STEP_NODELIST,
SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID: one process per task, the first
node of the step is the coordinator, the port derives from the job id unless
JAX_COORDINATOR_PORT is set); else the run is a single process,
spec_from_flags() returns None and nothing is joined. Reading them touches
no JAX, so it can run before the backend starts; distributed.py joins
the run that the resulting ProcessSpec describes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from absl import flags

# Defaults for a real cluster, JAX's own: hosts may start minutes apart.
DEFAULT_INIT_TIMEOUT_S = 300
DEFAULT_HEARTBEAT_TIMEOUT_S = 100

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

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
