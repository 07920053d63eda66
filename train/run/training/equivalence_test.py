"""Training on a mesh is training on one device, up to bf16 noise.

The `tiny_dsv3` preset (with a small batch) trains for a few steps from the
same seed (so the same initial weights) on the same batches, on one device,
on four meshes of 8 simulated devices, and as 2 processes x 4 devices
started by tools/launch_local.py; each step's loss, gradient global norm
and per-expert token counts must agree. The meshes: data x expert and
fsdp x expert train the whole run; expert=8 continues a run resumed onto it
from data x expert; data x fsdp x tensor trains with each batch in 2
microbatches (one run each: a training costs about half a minute on 2
cores). The layers run under a scan (the default); the same run with
unrolled layers, and in 2 microbatches on one device, must agree too. A run
resumed on its own mesh must equal the uninterrupted run bit for bit, and
the 2-process run's checkpoint must restore into one process on another
mesh.

The bound, and where it comes from. The meshes compute the same function;
what differs is the order of float32 sums (a psum over devices against one
device's loop) and which all-to-all slot a row travels in. A float32
reordering moves a value by about 2^-24 relative, but activations are
stored in bfloat16, so an element sitting near a rounding boundary moves by
one bfloat16 ulp, 2^-8 relative (8 significant bits), and a token whose two
best experts score within that ulp may pick the other one. So:

* loss: relative difference <= 2^-8 (one bf16 ulp of the loss). Measured
  (5 steps, the four meshes): at most 1.2e-3 relative, about 2^-10.
* gradient global norm: relative difference <= 2^-6 (a few ulps: the
  norm sums squares of bf16-derived gradients, and a flipped routing
  choice moves whole rows of two experts' gradients). Measured: at most
  2.7e-3.
* expert loads: at most 2^-5 of the (token, expert) assignments move to
  another expert (measured: at most 1.3%, a few near-ties per step). A
  dropped token, a lost all-to-all slot or experts on the wrong device
  move far more (a whole device's share: 1/8 or more).

Unrolled layers and microbatches change the same things: XLA fuses an
unrolled layer differently from the scan's body (in float32 the two give
the same logits), and microbatches add float32 partial sums in another
order; the bounds above hold for them too. The load-balancing loss, a
product of two means, is the one statistic that is not the whole batch's
under microbatches (microbatch.py); tiny_dsv3 does not train on it.

These are per-step bounds over STEPS steps; over hundreds of steps the runs
drift apart like any two bf16 runs (docs/training.md, "Same model on every
mesh", gives the held-out loss of a full run on one device and on a mesh).
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from train.checkpoints import checkpoint_dirs
from train.run.inputs import run_config
from train.run.training import trainer
from train.testing import small_runs

# The workspace root: this file is train/run/<room>/<name>.py.
_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
_LAUNCHER = os.path.join(_ROOT, "tools", "launch_local.py")

PRESET = "tiny_dsv3"
STEPS = 5
BATCH = 8  # Divides over the 8 devices of every mesh below.
SEQ = 32
# The run, as train.main's flags; the in-process runs use the same values.
FLAGS = {
    "model": PRESET,
    "steps": STEPS,
    "batch_size": BATCH,
    "seq_len": SEQ,
    "moe_backend": "xla",
    "eval_every": 1000,
    "eval_batches": 2,
    "checkpoint_every": 0,
    "progress": "false",
    "plot": "false",
}
LOSS_RTOL = 2**-8
GRAD_NORM_RTOL = 2**-6
MOVED_ASSIGNMENTS = 2**-5


# Wall-clock fields of a metrics.jsonl record: never equal across runs.
_TIMING = ("seconds", "tokens_per_s", "tokens_per_s_per_device")


def _records(output_dir: str) -> list[dict]:
  """metrics.jsonl of a run, without its timings."""
  with open(os.path.join(output_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if k not in _TIMING} for r in records]


def _fit(run, interrupt_after=None) -> trainer.Trainer:
  return small_runs.fit(run, interrupt_after)[0]


def assert_same_run(test, expected: list[dict], got: list[dict]) -> None:
  """Each step of `got` agrees with `expected` within the bf16 bounds."""
  test.assertEqual([r["step"] for r in got], [r["step"] for r in expected])
  for want, have in zip(expected, got):
    step = want["step"]
    np.testing.assert_allclose(
        have["loss"], want["loss"], rtol=LOSS_RTOL, err_msg=f"step {step}"
    )
    np.testing.assert_allclose(
        have["grad_norm"],
        want["grad_norm"],
        rtol=GRAD_NORM_RTOL,
        err_msg=f"step {step}",
    )
    counts_want = np.asarray(want["tokens_per_expert"])
    counts_have = np.asarray(have["tokens_per_expert"])
    # Every assignment is counted on both sides (nothing dropped or lost).
    np.testing.assert_array_equal(
        counts_have.sum(-1), counts_want.sum(-1), err_msg=f"step {step}"
    )
    moved = 0.5 * np.abs(counts_have - counts_want).sum(-1)
    test.assertLessEqual(
        (moved / counts_want.sum(-1)).max(),
        MOVED_ASSIGNMENTS,
        f"step {step}: {moved} of {counts_want.sum(-1)} assignments moved",
    )


class MeshEquivalenceTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._out = small_runs.TempDirs()
    cls.base_run = run_config.run_config_from_preset(
        PRESET,
        steps=STEPS,
        batch_size=BATCH,
        seq_len=SEQ,
        backend="xla",
        eval_every=1000,
        eval_batches=2,
        checkpoint_every=0,
        progress=False,
        plot=False,
        output_dir=cls._out.new(),
    )
    _fit(cls.base_run)
    cls.expected = _records(cls.base_run.output_dir)
    cls._fitted = {}

  @classmethod
  def tearDownClass(cls):
    cls._out.cleanup()
    super().tearDownClass()

  def _run(self, mesh: str, **overrides):
    overrides.setdefault("output_dir", self._out.new())
    return dataclasses.replace(self.base_run, mesh=mesh, **overrides)

  def _fit_once(self, mesh: str) -> trainer.Trainer:
    """The uninterrupted run on `mesh` (shared by the tests of the class)."""
    if mesh not in self._fitted:
      self._fitted[mesh] = _fit(self._run(mesh))
    return self._fitted[mesh]

  # expert=8 is trained by the resume test below (steps 4 and 5, split
  # E / 8 experts a device) and data x fsdp x tensor by the microbatch test.
  @parameterized.parameters("data=2,expert=4", "fsdp=2,expert=4")
  def test_mesh_trains_the_same_model(self, mesh):
    tr = self._fit_once(mesh)
    self.assertIsNotNone(tr.mesh)
    assert_same_run(self, self.expected, _records(tr.run.output_dir))

  # The reference run scans its layers (the default); unrolled, they are
  # the same model from the same initial values (scan_model_test checks
  # that in float32), and the same run within the bf16 bounds.
  def test_unrolled_layers_train_the_same_model(self):
    tr = _fit(self._run("data=1", scan_layers=False))
    self.assertNotIn("moe_layers", tr.state["params"])
    assert_same_run(self, self.expected, _records(tr.run.output_dir))

  # Each step's batch in microbatches, gradients accumulated: the same
  # run, on one device and on a mesh (BATCH / 2 rows split over data x
  # fsdp = 4 devices). tokens_per_expert adds up over the microbatches, so
  # the loads and the bias updates are the whole batch's. The mesh has no
  # expert split (every device holds all experts) and splits the attention
  # and dense-MLP matrices over tensor.
  @parameterized.parameters("data=1", "data=2,fsdp=2,tensor=2")
  def test_microbatches_train_the_same_model(self, mesh):
    tr = _fit(self._run(mesh, microbatches=2))
    assert_same_run(self, self.expected, _records(tr.run.output_dir))

  def test_resume_on_the_same_mesh_is_bit_for_bit(self):
    straight = self._fit_once("data=2,expert=4").run
    run = self._run("data=2,expert=4")
    self.assertEqual(_fit(run, interrupt_after=3).step, 3)
    resumed = _fit(dataclasses.replace(run, resume=True))
    self.assertEqual(resumed.step, STEPS)
    self.assertEqual(_records(run.output_dir), _records(straight.output_dir))

  def test_resume_onto_another_mesh_continues_the_run(self):
    run = self._run("data=2,expert=4")
    self.assertEqual(_fit(run, interrupt_after=3).step, 3)
    moved = dataclasses.replace(run, mesh="expert=8", resume=True)
    resumed = _fit(moved)
    self.assertEqual(resumed.step, STEPS)
    expert_weights = resumed.state["params"]["moe_layers"]["mlp"]["w_up"][...]
    # Restored split over expert=8: E / 8 experts per device (of every MoE
    # layer: [layers, E, D, F]).
    self.assertEqual(
        {s.data.shape[1] for s in expert_weights.addressable_shards},
        {expert_weights.shape[1] // 8},
    )
    assert_same_run(self, self.expected, _records(run.output_dir))

  def test_two_processes_train_the_same_model(self):
    out = self._out.new()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # Each process gets 4 devices from --mesh.
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [_ROOT, env.get("PYTHONPATH")])
    )
    command = [
        sys.executable,
        _LAUNCHER,
        "--num_processes=2",
        # As srun starts them: the processes join through JAX's detection
        # of SLURM's variables (the JAX_* path: distributed_test).
        "--env=slurm",
        "--timeout_s=400",
        # Generous: under `bazel test` other targets share the 2 cores.
        "--init_timeout_s=120",
        "--heartbeat_timeout_s=60",
        "--",
        sys.executable,
        "-m",
        "train.main",
        *(f"--{k}={v}" for k, v in FLAGS.items()),
        "--mesh=data=2,expert=4",
        f"--output_dir={out}",
    ]
    proc = subprocess.run(
        command,
        cwd=_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=450,
        check=False,
    )
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    with open(os.path.join(out, "summary.json")) as f:
      summary = json.load(f)
    self.assertEqual(
        (summary["mesh"], summary["num_processes"]), ("data=2,expert=4", 2)
    )
    assert_same_run(self, self.expected, _records(out))

    # Its checkpoint, written by 2 processes, restores into this one on
    # another mesh (checksums verified), and evaluates to the held-out loss
    # the 2 processes measured: only the evaluation's sums differ.
    tr = trainer.Trainer(
        self._run("expert=8", output_dir=out, resume=True),
        small_runs.corpus(),
        out=None,
    )
    tr.restore_checkpoint(checkpoint_dirs.latest(tr.checkpoint_dir))
    self.assertEqual(tr.step, STEPS)
    np.testing.assert_allclose(
        tr.evaluate(), summary["final_held_out_loss"], rtol=LOSS_RTOL
    )


if __name__ == "__main__":
  absltest.main()
