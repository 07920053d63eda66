"""--mesh: parsing, the device count, the model's split, parameter placement."""

import io

import jax
import numpy as np
from absl import app
from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized

from train import main
from train.parallel import mesh as mesh_lib
from train.parallel import sharding
from train.run.inputs import data as data_lib
from train.run.training import trainer
from train.testing import small_runs

P = jax.sharding.PartitionSpec


def setUpModule():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


class MeshFlagTest(absltest.TestCase):

  def test_sizes_that_do_not_cover_the_devices_are_refused(self):
    with self.assertRaisesRegex(
        ValueError,
        r"--mesh=data=2,expert=2 multiplies to 4 devices, but there are 8 "
        r"\(1 process\(es\) x 8 cpu devices\); give axis sizes whose "
        r"product is 8",
    ):
      mesh_lib.build(mesh_lib.parse("data=2,expert=2"))

  def test_one_device_mesh_runs_on_the_default_device(self):
    self.assertIsNone(mesh_lib.build(mesh_lib.parse("data=1")))

  def test_mesh_axes_in_order(self):
    mesh = mesh_lib.build(mesh_lib.parse("expert=4,data=2"))
    self.assertEqual(
        dict(mesh.shape), {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    )
    self.assertEqual(list(mesh.devices.flat), jax.devices())

  def test_unknown_axis_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"AXIS=SIZE with AXIS in"):
      mesh_lib.parse("pipeline=2")

  def test_expert_axis_must_divide_the_experts(self):
    with self.assertRaisesRegex(
        ValueError,
        r"--mesh expert=16 must divide the number of experts, 8, of model "
        r"test_dsv3",
    ):
      mesh_lib.check_run(
          mesh_lib.parse("expert=16"), small_runs.SMALL_DSV3, batch_size=16
      )

  def test_microbatches_must_divide_over_the_data_parallel_devices(self):
    with self.assertRaisesRegex(
        ValueError,
        r"^--microbatches must be >= 1 and split --batch_size=16 into "
        r"microbatches that divide over data x fsdp x expert = 8 devices of "
        r"--mesh=data=2,expert=4, got --microbatches=4\.$",
    ):
      mesh_lib.check_run(
          mesh_lib.parse("data=2,expert=4"),
          small_runs.SMALL_DSV3,
          batch_size=16,
          microbatches=4,
      )
    mesh_lib.check_run(  # 2 microbatches of 8 rows: one per device.
        mesh_lib.parse("data=2,expert=4"),
        small_runs.SMALL_DSV3,
        batch_size=16,
        microbatches=2,
    )

  def test_a_mesh_over_given_devices(self):
    devices = jax.devices()[::-1]
    mesh = mesh_lib.build(mesh_lib.parse("expert=8"), devices=devices)
    self.assertEqual(list(mesh.devices.flat), devices)
    one = mesh_lib.build(mesh_lib.parse("data=1"), devices=devices[:1])
    self.assertEqual(dict(one.shape), dict.fromkeys(mesh_lib.AXES, 1))

  def test_batch_must_divide_over_the_data_parallel_devices(self):
    with self.assertRaisesRegex(
        ValueError,
        r"--batch_size=6 must be divisible by the data-parallel size data x "
        r"fsdp x expert = 8 of --mesh=data=2,expert=4",
    ):
      mesh_lib.check_run(
          mesh_lib.parse("data=2,expert=4"), small_runs.SMALL_DSV3, batch_size=6
      )

  def test_canonical_spelling(self):
    self.assertEqual(
        mesh_lib.canonical(mesh_lib.parse("expert=4, data=2,tensor=1")),
        "data=2,expert=4",
    )
    self.assertEqual(mesh_lib.canonical(mesh_lib.parse("data=1")), "data=1")


class PlacementTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    run = small_runs.small_run("/unused", mesh="fsdp=2,expert=4", batch_size=8)
    cls.trainer = trainer.Trainer(run, small_runs.corpus(), out=None)

  def _specs(self):
    return {
        jax.tree_util.keystr(path): leaf.sharding.spec
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            self.trainer.state
        )[0]
    }

  def test_experts_split_over_expert_and_moments_follow_params(self):
    specs = self._specs()
    for name in ("w_gate", "w_up", "w_down"):
      # Stacked [layers, E, D, F]: the layer axis stays whole.
      key = f"['params']['moe_layers']['mlp']['{name}'].value"
      self.assertEqual(specs[key], P(None, "expert", "fsdp", None))
    params = [k for k in specs if k.startswith("['params']")]
    self.assertNotEmpty(params)
    for key in params:
      path = key[len("['params']") :]
      for moment in ("mu", "nu"):
        self.assertEqual(
            specs[f"['opt_state'][1][0].{moment}{path}"], specs[key]
        )

  def test_other_matrices_split_over_fsdp_and_expert_vectors_replicated(
      self,
  ):
    specs = self._specs()
    shards = ("fsdp", "expert")
    self.assertEqual(specs["['params']['embed'].value"], P(shards, None))
    self.assertEqual(
        specs["['params']['dense_layers']['attn']['wo'].value"],
        P(None, None, shards),
    )
    self.assertEqual(
        specs["['params']['dense_layers']['attn_norm']['scale'].value"],
        P(None),
    )
    self.assertEqual(
        specs["['bias']['moe_layers']['mlp']['correction_bias'].value"],
        P(None),
    )

  def test_each_device_holds_its_share_of_the_state(self):
    # 8 experts over expert=4: two experts' weights per device, halved
    # again over fsdp=2, for the one MoE layer.
    w = self.trainer.state["params"]["moe_layers"]["mlp"]["w_gate"][...]
    self.assertEqual(w.shape, (1, 8, 32, 32))
    for shard in w.addressable_shards:
      self.assertEqual(shard.data.shape, (1, 2, 16, 32))

  def test_a_dimension_the_axis_does_not_divide_stays_whole(self):
    spec = sharding.spec_for(
        (jax.tree_util.DictKey("wq"),), (30, 64), mesh_lib.parse("fsdp=4")
    )
    self.assertEqual(spec, P(None, None))

  def test_fsdp_alone_where_fsdp_times_expert_does_not_divide(self):
    sizes = mesh_lib.parse("fsdp=2,expert=4")
    key = (jax.tree_util.DictKey("wq"),)
    self.assertEqual(
        sharding.spec_for(key, (8, 6), sizes), P(("fsdp", "expert"), None)
    )
    self.assertEqual(sharding.spec_for(key, (6, 6), sizes), P("fsdp", None))
    self.assertEqual(
        sharding.spec_for(key, (8, 6), mesh_lib.parse("expert=4")),
        P("expert", None),
    )

  def test_batches_are_split_over_the_data_parallel_devices(self):
    tr = self.trainer
    position = tr.sampler.state()
    batch = tr._next_batch()
    tr.sampler.restore(position)
    expected = tr.sampler.next()
    np.testing.assert_array_equal(np.asarray(batch), expected)
    rows = {shard.data.shape[0] for shard in batch.addressable_shards}
    self.assertEqual(rows, {len(expected) // 8})


class SamplerReadTest(absltest.TestCase):

  def test_next_is_read_of_next_starts(self):
    tokens = np.arange(1000, dtype=np.uint8)
    a = data_lib.BatchSampler(tokens, 4, 7, seed=3)
    b = data_lib.BatchSampler(tokens, 4, 7, seed=3)
    for _ in range(40):  # Several epochs.
      starts = b.next_starts()
      np.testing.assert_array_equal(a.next(), b.read(starts))
      np.testing.assert_array_equal(b.read(starts[1:3]), b.read(starts)[1:3])


class MainFlagErrorsTest(parameterized.TestCase):
  """Bad --mesh input ends train.main with one line naming the flag.

  (An expert axis that does not divide the experts: MeshFlagTest; no
  8-device mesh fails to divide a preset's experts.)
  """

  @parameterized.parameters(
      ("data=2,expert=4", 12, r"--batch_size=12 must be divisible by .* 8"),
      ("data=2,expert=4", 8, r"--microbatches must be >= 1 and split", 2),
  )
  def test_batch_that_does_not_split_is_refused_as_parsed(
      self, mesh, batch_size, message, microbatches=1
  ):
    with self.assertRaisesRegex(flags.IllegalFlagValueError, message) as e:
      with flagsaver.flagsaver(
          mesh=mesh,
          batch_size=batch_size,
          microbatches=microbatches,
          model="tiny_dsv3",
      ):
        pass
    self.assertNotIn("\n", str(e.exception))

  @parameterized.parameters(
      ("data=2,expert=2", 16, r"--mesh=data=2,expert=2 multiplies to 4"),
  )
  def test_one_line_error(self, mesh, batch_size, message, microbatches=1):
    with flagsaver.flagsaver(
        mesh=mesh,
        batch_size=batch_size,
        microbatches=microbatches,
        model="tiny_dsv3",
        steps=1,
    ):
      with self.assertRaisesRegex(app.UsageError, message) as raised:
        main.train(io.StringIO())
    self.assertNotIn("\n", str(raised.exception))


if __name__ == "__main__":
  absltest.main()
