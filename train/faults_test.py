"""The training program's faults: each ends the run in one line, safely.

Faults are staged, not waited for: a diverging run by
--learning_rate=1e30. The tests drive a Trainer of testing.SMALL_DSV3.
"""

import os

from absl.testing import absltest
import jax
import jax.numpy as jnp

from train import checkpoint
from train import testing
from train import trainer

# Every run here has this many steps: runs that differ only in host-side
# settings share one compiled program.
_STEPS = 4


def _run(output_dir: str, **overrides):
  return testing.small_run(output_dir, steps=_STEPS, **overrides)


def _trainer(run, out=None) -> trainer.Trainer:
  tr = trainer.Trainer(run, testing.corpus(), out=out)
  tr.prepare_output_dir()
  return tr


class NonFiniteTest(absltest.TestCase):

  def test_diverging_run_stops_naming_the_step_and_saves_only_finite_states(
      self,
  ):
    out = testing.temp_dir(self)
    run = _run(out, learning_rate=1e30, checkpoint_every=1, keep_checkpoints=0)
    tr = _trainer(run)
    with self.assertRaises(trainer.NonFiniteError) as raised:
      tr.fit()
    tr.close()
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    # The failed step is named and not kept: the state is the step before.
    self.assertStartsWith(message, f"step {tr.step + 1}: ")
    self.assertIn("--learning_rate (now 1e+30)", message)
    self.assertGreaterEqual(tr.step, 1)
    self.assertEqual(tr.non_finite_leaves(), [])
    saved = checkpoint.list_checkpoints(tr.checkpoint_dir)
    self.assertEqual([s for s, _ in saved], list(range(1, tr.step + 1)))
    for _, path in saved:
      state, _ = checkpoint.restore(path, tr.state, fingerprint=tr.fingerprint)
      self.assertEqual(tr.non_finite_leaves(state), [], path)
    with open(os.path.join(out, "metrics.jsonl")) as f:
      self.assertLen(f.readlines(), tr.step)

  def test_non_finite_state_is_neither_saved_nor_resumed(self):
    out = testing.temp_dir(self)
    tr = _trainer(_run(out))
    tr.state = jax.tree.map(
        lambda x: x * jnp.nan if x.ndim >= 2 else x, tr.state
    )
    with self.assertRaisesRegex(
        trainer.NonFiniteError,
        r"^step 0: not saving a checkpoint of a state with NaN or Inf values",
    ):
      tr.save_checkpoint()
    tr.close()
    self.assertFalse(os.path.exists(tr.checkpoint_dir))
    # A checkpoint of such a state, as an older program could write one,
    # is refused when resumed, naming it and a leaf.
    path = checkpoint.save(
        tr.checkpoint_dir,
        0,
        tr.state,
        fingerprint=tr.fingerprint,
        extra={"data": tr.sampler.state()},
    )
    resumed = trainer.Trainer(
        _run(out, resume=True), testing.corpus(), out=None
    )
    with self.assertRaisesRegex(
        checkpoint.CheckpointError,
        rf"checkpoint {path!r} holds NaN or Inf values \(\d+ leaves, first "
        r"\['(params|opt_state)'\]",
    ):
      resumed.prepare_output_dir()


if __name__ == "__main__":
  absltest.main()
