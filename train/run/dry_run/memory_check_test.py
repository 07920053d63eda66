"""A run whose compiled step does not fit a device is refused before it
allocates anything; the limit is the device's, or the host's RAM on a CPU."""

import io
import os
import re
from unittest import mock

import jax
from absl import app
from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

from train import main
from train.run.dry_run import memory_check
from train.run.step import steps
from train.run.training import trainer
from train.testing import small_runs


def setUpModule():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


_GIB = 2**30
_MEMORY = steps.StepMemory(
    arguments=3 * _GIB,
    outputs=3 * _GIB,
    aliased=3 * _GIB,
    temporaries=2 * _GIB,
    code=0,
)


class CheckTest(absltest.TestCase):

  def test_a_step_that_fits_says_so(self):
    line = memory_check.check(
        small_runs.small_run("/unused"), _MEMORY, (8 * _GIB, "a test's limit")
    )
    self.assertEqual(
        line,
        "memory: the step needs 5 GiB per device of 8 GiB (a test's limit)",
    )

  def test_a_step_that_does_not_fit_is_refused_in_one_line(self):
    run = small_runs.small_run("/unused", microbatches=2)
    with self.assertRaises(memory_check.StepDoesNotFitError) as raised:
      memory_check.check(run, _MEMORY, (5 * _GIB - 1, "a test's limit"))
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    self.assertStartsWith(
        message,
        f"--model={run.model.name} does not fit: its compiled train step "
        "needs 5 GiB per device (XLA memory_analysis: arguments 3 GiB, "
        "temporaries 2 GiB; the analytic estimate is ",
    )
    self.assertIn("more than the 5 GiB (a test's limit) a device has", message)
    for flag in (
        "--batch_size (now 4)",
        "--microbatches (now 2)",
        "--seq_len (now 32)",
        "--remat=full (now none)",
        "--mesh (now data=1)",
    ):
      self.assertIn(flag, message)

  def test_no_figures_no_check(self):
    line = memory_check.check(small_runs.small_run("/unused"), None, (1, "x"))
    self.assertIn("not checked", line)

  def test_a_cpu_shares_the_hosts_ram_among_its_devices(self):
    limit, source = memory_check.device_limit(jax.local_devices()[0])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    self.assertEqual(limit, ram // jax.local_device_count())
    self.assertIn(f"/ {jax.local_device_count()} local cpu device(s)", source)

  def test_an_accelerator_reports_its_allocators_limit(self):
    device = mock.Mock(device_kind="NVIDIA H100 80GB HBM3")
    device.memory_stats.return_value = {"bytes_limit": 79 * _GIB}
    self.assertEqual(
        memory_check.device_limit(device),
        (79 * _GIB, "the NVIDIA H100 80GB HBM3's limit"),
    )


class TrainerTest(absltest.TestCase):

  def test_refused_before_the_state_exists(self):
    run = small_runs.small_run(small_runs.temp_dir(self))
    before = len(jax.live_arrays())
    with mock.patch.object(
        memory_check, "device_limit", return_value=(1024, "a test's limit")
    ):
      with self.assertRaisesRegex(
          memory_check.StepDoesNotFitError,
          r"more than the 1 KiB \(a test's limit\) a device has",
      ):
        trainer.Trainer(run, small_runs.corpus(), out=None)
    self.assertEqual(len(jax.live_arrays()), before)


class FullSizePresetTest(absltest.TestCase):

  # The 2e9-parameter cap is gone: a full-size preset is compiled and
  # refused by the memory it needs (46.7B parameters and their AdamW
  # moments, float32, on this host's CPU devices).
  def test_mixtral_is_refused_by_its_compiled_memory(self):
    with flagsaver.flagsaver(
        model="mixtral_8x7b",
        batch_size=8,
        seq_len=64,
        steps=1,
        output_dir=small_runs.temp_dir(self),
    ):
      with self.assertRaisesRegex(
          app.UsageError,
          r"^--model=mixtral_8x7b does not fit: its compiled train step "
          r"needs ([\d.]+) ([GT])iB per device",
      ) as raised:
        main.train(io.StringIO())
    figure = re.search(r"needs ([\d.]+) ([GT])iB", str(raised.exception))
    need = float(figure[1]) * {"G": 2**30, "T": 2**40}[figure[2]]
    # At least the float32 parameters and their two AdamW moments.
    self.assertGreater(need, 46e9 * 12)


if __name__ == "__main__":
  absltest.main()
