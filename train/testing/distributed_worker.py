r"""One process of a small multi-process run, for distributed_test.py.

Started N times by tools/launch_local.py (which sets
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID), each
process joins through train.parallel.distributed, builds a 1-D mesh "x"
over every process's CPU devices and runs, under jit and shard_map, a psum
and an all_gather of per-device values that depend only on the global device
position (device d holds the row [d, d**2], float32), then prints one
"RESULT {...}" line that the test checks against the formula;
--die_process=I makes process I exit abruptly (DIED_EXIT_CODE) right after
joining. Usage:
    python tools/launch_local.py --num_processes=2 -- \
        python train/testing/distributed_worker.py --local_devices=2
"""

from __future__ import annotations

import json
import os
import sys

from absl import app
from absl import flags

# Run as a script (python train/testing/distributed_worker.py): the
# workspace root, one level up, must be importable for `train`.
# The workspace root: this file is train/<package>/<name>.py.
_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

# pylint: disable=g-import-not-at-top
from train import platforms  # noqa: E402
from train.parallel import distributed  # noqa: E402

# pylint: enable=g-import-not-at-top

# The exit code of the process --die_process names, right after joining, so
# that the others meet a dead peer in the collective.
DIED_EXIT_CODE = 17

_LOCAL_DEVICES = flags.DEFINE_integer(
    "local_devices", 2, "Simulated CPU devices in this process.", lower_bound=1
)
_DIE_PROCESS = flags.DEFINE_integer(
    "die_process", -1, "The process that exits abruptly right after joining."
)


def device_rows(num_devices: int):
  """[num_devices, 2] float32: row d is [d, d**2], device d's input."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  d = np.arange(num_devices, dtype=np.float32)
  return np.stack([d, d * d], axis=1)


def _collectives(num_devices):
  """(psum [2], every device's all_gather [num_devices, num_devices, 2]).

  Both are read on this process: the psum is replicated; the gathers are
  fetched from all processes (process_allgather), one per device.
  """
  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  # pylint: enable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  rows = device_rows(num_devices)
  x = jax.make_array_from_callback(
      rows.shape, NamedSharding(mesh, P("x")), lambda index: rows[index]
  )

  def per_device(block):  # block: [1, 2], this device's row.
    total = jax.lax.psum(block[0], "x")
    # Every device's own copy of the gather: [1, num_devices, 2].
    gathered = jax.lax.all_gather(block[0], "x")[None]
    return total, gathered

  step = jax.jit(
      jax.shard_map(
          per_device, mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"))
      )
  )
  total, gathered = step(x)
  # The psum is replicated: this process's first shard holds all of it.
  return (
      np.asarray(total.addressable_data(0)),
      np.asarray(multihost_utils.process_allgather(gathered, tiled=True)),
  )


def main(argv):
  del argv
  distributed.join_on_cpu_devices(_LOCAL_DEVICES.value)
  import jax  # pylint: disable=g-import-not-at-top

  print(
      f"joined: process {jax.process_index()} of {jax.process_count()}, "
      f"{jax.device_count()} devices ({jax.local_device_count()} local)",
      flush=True,
  )
  if jax.process_index() == _DIE_PROCESS.value:
    print("exiting abruptly, as asked", flush=True)
    os._exit(DIED_EXIT_CODE)  # pylint: disable=protected-access
  total, gathered = _collectives(jax.device_count())
  result = {
      "process": jax.process_index(),
      "num_processes": jax.process_count(),
      "num_devices": jax.device_count(),
      "main": distributed.is_main_process(),
      "psum": total.tolist(),
      "all_gather": gathered.tolist(),
  }
  # One line the test checks against the formula:
  #   RESULT {"process": i, "num_processes": N, "num_devices": D,
  #           "main": bool, "psum": [...], "all_gather": [[...], ...]}
  print("RESULT " + json.dumps(result), flush=True)
  distributed.shutdown()


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
