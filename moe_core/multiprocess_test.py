"""Expert parallelism through JAX's real distributed runtime, on one machine.

Starts N copies of `testing/multiprocess_worker.py` joined over 127.0.0.1
with gloo collectives, each with its own 2 CPU devices, and checks that the
layer's output, aux statistics and gradients equal one process's
single-device result; and that a process that never joins, or dies, ends the
run with a clear error within a bounded time instead of a hang. Every
subprocess runs under a timeout and is killed (its process group) past it.
"""

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

import moe_core
from conformance import tolerances
from moe_core.testing import multiprocess_worker as worker

_WORKER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "testing",
    "multiprocess_worker.py",
)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 processes compile the layer and its gradients at once on 2 cores.
_RUN_TIMEOUT_S = 400
# Failures must surface within this (the runtime's timeouts are set to 5 s).
_FAILURE_TIMEOUT_S = 90


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(num_processes, *, process_ids=None, timeout_s, **flags):
  """Runs workers; returns [(returncode, output, seconds)], one per process.

  Args:
    num_processes: the size of the distributed run.
    process_ids: the ids to start (default all); the others never join.
    timeout_s: wall-clock limit for all of them; past it they are killed and
      the test fails.
    **flags: worker flags (--mesh, --out, ...).
  """
  port = _free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (_ROOT, env.get("PYTHONPATH", "")) if p
  )
  env["PYTHONUNBUFFERED"] = "1"
  env.pop("XLA_FLAGS", None)  # The worker sets its own device count.
  env["JAX_PLATFORMS"] = "cpu"
  args = [f"--{k}={v}" for k, v in flags.items()]
  procs = []
  start = time.monotonic()
  for i in range(num_processes) if process_ids is None else process_ids:
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            _WORKER,
            f"--port={port}",
            f"--num_processes={num_processes}",
            f"--process_id={i}",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        start_new_session=True,
    )
    procs.append((proc, log))
  results = []
  for proc, log in procs:
    left = max(1.0, timeout_s - (time.monotonic() - start))
    try:
      proc.wait(timeout=left)
    except subprocess.TimeoutExpired:
      for p, _ in procs:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
      for p, _ in procs:
        p.wait()
      outputs = []
      for _, lg in procs:
        lg.seek(0)
        outputs.append(lg.read()[-3000:])
      raise AssertionError(
          f"workers did not finish within {timeout_s} s; "
          "their output:\n" + "\n---\n".join(outputs)
      )
    log.seek(0)
    results.append((proc.returncode, log.read(), time.monotonic() - start))
    log.close()
  return results


@functools.cache
def _single_device_result(backend):
  cfg = worker.config()
  params, x, cotangent = worker.inputs(cfg)
  y, stats, grads = jax.jit(worker.make_step(cfg, backend))(
      params, x, cotangent
  )
  return {
      "y": np.asarray(y),
      **{f"aux_{k}": np.asarray(v) for k, v in stats.items()},
      **{f"grad_{k}": np.asarray(v) for k, v in grads.items()},
  }


class MultiProcessTest(parameterized.TestCase):

  @parameterized.parameters(
      # Every registered backend at 2 processes (padded exchange, which
      # XLA:CPU runs). 4 processes (a data axis across processes, the
      # ragged layout) on xla alone: what crosses processes is the
      # exchange, the same for every backend; each 4-process run costs
      # 11-20 s on 2 cores.
      [(b, 2, "1x4", "padded") for b in moe_core.registered_backends()]
      + [("xla", 4, "2x4", "padded"), ("xla", 4, "1x8", "ragged_emulated")]
  )
  def test_matches_one_process(self, backend, num_processes, mesh, exchange):
    ok, why = moe_core.registry.availability(backend)
    if not ok:
      self.skipTest(f"backend {backend!r} cannot run here: {why}")
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "result.npz")
      results = _launch(
          num_processes,
          timeout_s=_RUN_TIMEOUT_S,
          mesh=mesh,
          exchange=exchange,
          local_devices=2,
          out=out,
          backend=backend,
      )
      for i, (code, output, _) in enumerate(results):
        self.assertEqual(code, 0, f"process {i} failed:\n{output[-4000:]}")
        self.assertIn(
            f"joined: {num_processes} processes, "
            f"{2 * num_processes} devices (2 local)",
            output,
        )
      with np.load(out) as got:
        got = dict(got)
    one_process = _single_device_result(backend)
    self.assertEqual(sorted(got), sorted(one_process))
    forward = tolerances.TABLE["float32"]["forward"]
    gradient = tolerances.TABLE["float32"]["gradient"]
    for name, want in one_process.items():
      with self.subTest(name):
        self.assertEqual(got[name].shape, want.shape, name)
        if np.issubdtype(want.dtype, np.floating):
          tol = gradient if name.startswith("grad_") else forward
          problem = tolerances.violation(got[name], want, tol)
          self.assertIsNone(problem, f"{name}: {problem}")
        else:
          np.testing.assert_array_equal(got[name], want, name)

  def test_process_that_never_joins_fails_within_the_timeout(self):
    # Only process 0 of 2 starts: it waits for its peer, for at most
    # --init_timeout seconds.
    ((code, output, seconds),) = _launch(
        2, process_ids=[0], timeout_s=_FAILURE_TIMEOUT_S, init_timeout=5
    )
    self.assertNotEqual(code, 0, output[-3000:])
    # JAX aborts the process (SIGABRT) from C++ with this message; a Python
    # exception would be reported by the worker as DISTRIBUTED_INIT_FAILED.
    self.assertRegex(output, r"DEADLINE_EXCEEDED|DISTRIBUTED_INIT_FAILED")
    print(f"never-joined peer: exit {code} after {seconds:.1f} s")

  @parameterized.named_parameters(("worker_dies", 1), ("coordinator_dies", 0))
  def test_process_that_dies_fails_the_others_within_the_timeout(self, dying):
    results = _launch(
        2,
        timeout_s=_FAILURE_TIMEOUT_S,
        die_process=dying,
        heartbeat_timeout=5,
        mesh="1x4",
    )
    survivor = 1 - dying
    code, output, seconds = results[survivor]
    self.assertEqual(results[dying][0], 17, results[dying][1][-3000:])
    self.assertNotEqual(code, 0, output[-3000:])
    self.assertRegex(
        output,
        re.compile(
            r"stopped sending heartbeats|leader task was "
            r"preempted/died|Socket closed|EP_RUN_FAILED"
        ),
        output[-3000:],
    )
    print(
        f"peer {dying} died: process {survivor} exited {code} after "
        f"{seconds:.1f} s"
    )


if __name__ == "__main__":
  absltest.main()
