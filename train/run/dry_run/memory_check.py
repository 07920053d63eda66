"""Does a run's compiled train step fit its devices' memory?

Before the training program allocates anything it compiles the step for
the run's mesh (abstract arguments) and compares XLA's figure for it
(`memory_analysis()`, the `steps.StepMemory` total: arguments, outputs not
aliased to them, temporaries, code) with what a device has
(`device_limit`); a step that needs more is refused in one line that names
both figures and the flags that lower the first, so any model whose
compiled step fits trains.
"""

from __future__ import annotations

import os

import jax

from train.run.inputs import run_config
from train.run.reporting import cost_report
from train.run.step import steps


class StepDoesNotFitError(ValueError):
  """The compiled train step needs more memory than a device has."""


def host_ram_bytes() -> int:
  """The host's physical memory in bytes."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_limit(device: jax.Device | None = None) -> tuple[int, str]:
  """(bytes a device of this process may use, where that figure comes from).

  An accelerator: its allocator's limit (`Device.memory_stats()`'s
  "bytes_limit", what XLA may take of the device's memory). A CPU, which
  reports no limit: the host's physical RAM divided by this process's
  devices (simulated CPU devices share the host's RAM).

  Args:
    device: default `jax.local_devices()[0]` (the devices of a run are of
      one kind).
  """
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None  # Some platforms raise instead of returning None.
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"the {device.device_kind}'s limit"
  count = jax.local_device_count()
  ram = host_ram_bytes()
  return ram // count, (
      f"host RAM {cost_report.human_bytes(ram)} / {count} local "
      f"{device.platform} device(s)"
  )


def check(
    run: run_config.RunConfig,
    memory: steps.StepMemory | None,
    limit: tuple[int, str] | None = None,
) -> str:
  """Refuses a step that does not fit; returns a line saying that it does.

  Args:
    run: the run (its flags go into the message).
    memory: XLA's figures for its compiled step, or None where the backend
      gives none (then nothing is checked).
    limit: (bytes, source) as `device_limit` gives; default that.

  Raises:
    StepDoesNotFitError: `memory.total` exceeds the limit.
  """
  if memory is None:
    return "memory: XLA gives no figures for this backend; not checked"
  limit_bytes, source = limit or device_limit()
  need = cost_report.human_bytes(memory.total)
  have = f"{cost_report.human_bytes(limit_bytes)} ({source})"
  if memory.total <= limit_bytes:
    return f"memory: the step needs {need} per device of {have}"
  analytic = cost_report.analytic_bytes_per_device(run)
  raise StepDoesNotFitError(
      f"--model={run.model.name} does not fit: its compiled train step needs "
      f"{need} per device (XLA memory_analysis: arguments "
      f"{cost_report.human_bytes(memory.arguments)}, temporaries "
      f"{cost_report.human_bytes(memory.temporaries)}; the analytic estimate "
      f"is {cost_report.human_bytes(analytic)}), more than the {have} a "
      f"device has. {cost_report.memory_remedies(run)}"
  )
