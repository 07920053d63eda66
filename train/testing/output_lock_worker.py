r"""One process of a 2-process run that takes --output_dir, for
output_lock_test.py.

Each process joins through train.parallel.distributed (one CPU device
each), builds a Trainer of small_runs.SMALL_DSV3 on the mesh data=2 and calls
prepare_output_dir, as `train.main` does; then process 1 tries to take the
directory's lock itself while process 0 holds it, and every process prints
one line, RESULT {"process": i, "holds_lock": bool, "refused": "<message>"
| null}. A run whose prepare_output_dir is refused prints `REFUSED
<message>` instead and exits with REFUSED_EXIT_CODE, on every process.
Usage:
    python tools/launch_local.py --num_processes=2 -- \
        python train/testing/output_lock_worker.py --output_dir=DIR
"""

from __future__ import annotations

import json
import os
import sys

from absl import app
from absl import flags

# Run as a script: the workspace root, one level up, must be importable.
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

REFUSED_EXIT_CODE = 3

_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "The run's directory.")


def main(argv):
  del argv
  distributed.join_on_cpu_devices(1)
  # pylint: disable=g-import-not-at-top
  import jax
  from train.checkpoints import output_lock
  from train.run.training import trainer
  from train.testing import small_runs

  # pylint: enable=g-import-not-at-top

  run = small_runs.small_run(_OUTPUT_DIR.value, mesh="data=2")
  tr = trainer.Trainer(run, small_runs.corpus(), out=None)
  try:
    tr.prepare_output_dir()
  except output_lock.OutputDirBusyError as e:
    print(f"REFUSED {e}", flush=True)
    sys.exit(REFUSED_EXIT_CODE)
  distributed.barrier("output_dir_worker_prepared")
  refused = None
  if jax.process_index() == 1:
    try:
      output_lock.OutputDirLock(_OUTPUT_DIR.value).acquire().release()
    except output_lock.OutputDirBusyError as e:
      refused = str(e)
  distributed.barrier("output_dir_worker_tried")
  result = {
      "process": jax.process_index(),
      "holds_lock": tr._output_lock is not None,  # pylint: disable=protected-access
      "refused": refused,
  }
  # `refused` is process 1's own attempt's error (None elsewhere).
  print("RESULT " + json.dumps(result), flush=True)
  tr.close()
  distributed.shutdown()


if __name__ == "__main__":
  platforms.set_default_platforms()
  flags.mark_flag_as_required("output_dir")
  app.run(main)
