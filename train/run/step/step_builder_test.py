"""The built step is the run's step, on this host's devices or a topology's."""

import jax
import numpy as np
from absl.testing import absltest

from moe_core import aot
from train.parallel import mesh as mesh_lib
from train.run.step import state as state_lib
from train.run.step import step_builder
from train.run.training import trainer
from train.testing import small_runs

MESH = "data=2,expert=4"


class HereTest(absltest.TestCase):
  """On a (data=2, expert=4) mesh of 8 CPU devices."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.train_run = small_runs.small_run("/unused", mesh=MESH, batch_size=8)
    cls.mesh = mesh_lib.build(mesh_lib.parse(MESH))

  def test_builds_without_allocating(self):
    before = len(jax.live_arrays())
    step = step_builder.build(self.train_run, self.mesh)
    self.assertEqual(len(jax.live_arrays()), before)
    self.assertEqual(step.batch.shape, (8, 33))
    self.assertEqual(step.batch.sharding.spec, step.spec.placement.batch.spec)
    for leaf, where in zip(
        jax.tree.leaves(step.state), jax.tree.leaves(step.spec.placement.state)
    ):
      self.assertEqual(leaf.sharding, where)

  def test_its_fn_under_its_jit_kwargs_is_the_trainers_step(self):
    step = step_builder.build(self.train_run, self.mesh)
    tr = trainer.Trainer(self.train_run, small_runs.corpus(), out=None)
    batch = tr.sampler.next()
    want_state, want = tr.program.train_step(tr.state, tr._put_batch(batch))  # pylint: disable=protected-access
    # A fresh jit of the builder's pure fn, on the same initial state.
    fresh = jax.jit(step.fn, **step.jit_kwargs)
    state = state_lib.initialise(self.train_run, step.spec)
    got_state, got = fresh(state, tr._put_batch(batch))  # pylint: disable=protected-access
    tr.close()
    for key in ("loss", "grad_norm", "tokens_per_expert"):
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    for g, w in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
      np.testing.assert_array_equal(g, w)

  def test_ep_chunks_change_the_buffers_not_the_step(self):
    # --ep_chunks reaches the layer: the same step's signature, its
    # exchange split into twice the all-to-alls. That chunked layers
    # compute the same values is moe_core's parallel_test (forward and
    # gradients); lowering, not compiling, keeps this at a few seconds.
    lowered = {}
    for chunks in (1, 2):
      run = small_runs.small_run(
          "/unused", mesh=MESH, batch_size=8, ep_chunks=chunks
      )
      step = step_builder.build(run, self.mesh)
      lowered[chunks] = jax.jit(step.fn, **step.jit_kwargs).lower(
          step.state, step.batch
      )
    one, two = lowered[1], lowered[2]
    self.assertEqual(one.in_tree, two.in_tree)
    self.assertEqual(one.out_tree, two.out_tree)
    for a, b in zip(
        jax.tree.leaves(one.out_info), jax.tree.leaves(two.out_info)
    ):
      self.assertEqual((a.shape, a.dtype), (b.shape, b.dtype))
    count = {k: v.as_text().count("all_to_all") for k, v in lowered.items()}
    self.assertGreater(count[1], 0)
    self.assertEqual(count[2], 2 * count[1], count)

  def test_run_that_does_not_split_over_the_mesh_is_refused(self):
    run = small_runs.small_run(
        "/unused", mesh=MESH, batch_size=8, microbatches=4
    )
    with self.assertRaisesRegex(ValueError, r"^--microbatches must be"):
      step_builder.build(run, self.mesh)


class TopologyTest(absltest.TestCase):
  """Compiled for 8 H100s that are not here (moe_core.aot)."""

  def setUp(self):
    super().setUp()
    if not aot.cuda_plugin_installed():
      self.skipTest(
          "compiling for GPUs needs jax's CUDA plugin (jax-cuda13-plugin), "
          "which this leg does not install"
      )

  def test_compiles_for_gpus_that_are_not_here(self):
    topology = aot.gpu_topology("h100", "1x1x8")
    mesh = mesh_lib.build(mesh_lib.parse(MESH), devices=topology.devices)
    run = small_runs.small_run(
        "/unused", mesh=MESH, batch_size=16, microbatches=2
    )
    step = step_builder.build(run, mesh)
    program = aot.compile(
        step.fn,
        step.state,
        step.batch,
        topology=topology,
        mesh=mesh,
        **step.jit_kwargs,
    )
    # Each GPU holds its shard of the state: the arguments are the state's
    # shards and the batch's rows, no more.
    shards = sum(
        np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves((step.state, step.batch))
    )
    self.assertBetween(
        program.argument_bytes,
        shards,
        shards + 8 * len(jax.tree.leaves((step.state, step.batch))),
    )
    self.assertTrue(program.fits)
    # The donated state: its outputs reuse its buffers.
    self.assertGreater(program.alias_bytes, 0)
    # The experts are split over expert=4: the tokens travel.
    self.assertGreater(program.collective_bytes.get("all-to-all", 0), 0)


if __name__ == "__main__":
  absltest.main()
