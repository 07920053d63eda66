"""`--dry_run --target --topology`: the real step compiled for chips not here.

One compile where the leg has libtpu: tiny_dsv3 on 4 v5e chips with
expert parallelism (about 30 s). Three where it has jax's CUDA plugin:
tiny_dsv3 on one H100
with a batch of a million tokens (does not fit; about 1 min on 2 busy
cores); DeepSeek-V3 at 4 layers, full width, on 1,024 H100s with the
committed layout, expert parallelism and Mosaic GPU kernels, and Mixtral
8x7B at 2 layers on 8 H100s with bfloat16 moments (both fit). The
flag checks, the one-line refusal and the per-step collective count need no
compile.
"""

import contextlib
import io
import json
import os

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
import jax
import numpy as np

from moe_core import aot
from train import main
from train import train_flags
from train.parallel import mesh as mesh_lib
from train.run.dry_run import dry_run_target
from train.run.inputs import run_config
from train.run.step import step_builder
from train.testing import small_runs

FLAGS = flags.FLAGS
MESH = "data=2,expert=4"


def setUpModule():
  if not FLAGS.is_parsed():
    FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


def _run_main(**flag_values) -> tuple[int, str, str]:
  """(exit status, stdout, stderr) of train.main with these flags."""
  out, err = io.StringIO(), io.StringIO()
  status = 0
  with flagsaver.flagsaver(**flag_values):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        main.main(["train.main"])
      except SystemExit as e:
        status = e.code
  return status, out.getvalue(), err.getvalue()


class UsageTest(absltest.TestCase):
  """Bad combinations are one line naming the flag, at parse time."""

  def _refused(self, flag: str, **values) -> str:
    with self.assertRaises(flags.IllegalFlagValueError) as raised:
      with flagsaver.as_parsed(**values):
        pass
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    self.assertIn(f"--{flag}", message)
    return message

  def test_unknown_target(self):
    message = self._refused(
        "target", target="h800", topology="1x1x8", dry_run="true"
    )
    self.assertIn("h800", message)

  def test_target_without_topology(self):
    message = self._refused("topology", target="h100", dry_run="true")
    self.assertIn("--target=h100 needs --topology=SxHxG", message)

  def test_topology_without_target(self):
    message = self._refused("target", topology="1x1x8", dry_run="true")
    self.assertIn("--topology=1x1x8 needs --target", message)

  def test_target_without_dry_run(self):
    message = self._refused(
        "dry_run", target="h100", topology="1x1x8", mesh=MESH
    )
    self.assertIn("it needs --dry_run", message)

  def test_topology_that_is_not_sxhxg(self):
    message = self._refused(
        "topology", target="h100", topology="8", dry_run="true"
    )
    self.assertIn("--topology must be 'SxHxG'", message)

  def test_topology_whose_gpus_are_not_the_mesh(self):
    message = self._refused(
        "topology",
        target="h100",
        topology="1x1x4",
        dry_run="true",
        mesh=MESH,
    )
    self.assertIn("--topology=1x1x4 has 4 h100 devices, but --mesh=", message)
    self.assertIn("multiplies to 8", message)

  def test_consistent_flags_accepted(self):
    with flagsaver.as_parsed(
        target="b200", topology="1x2x4", dry_run="true", mesh=MESH
    ):
      pass

  def test_tpu_topology_is_a_chip_grid(self):
    message = self._refused(
        "topology", target="v5p", topology="2x2x1", dry_run="true", mesh=MESH
    )
    self.assertIn("--topology=2x2x1 has 4 v5p devices", message)
    self.assertNotIn(
        "SxHxG", self._refused("topology", target="v5e", dry_run="true")
    )
    message = self._refused(
        "topology", target="v5e", topology="2x2x2", dry_run="true"
    )
    self.assertIn(
        "--topology for v5e must be a chip grid of 2 dimensions", message
    )

  def test_tpu_flags_accepted(self):
    # tpu7x: two devices a chip; "/2": two slices.
    with flagsaver.as_parsed(
        target="tpu7x", topology="2x1x1/2", dry_run="true", mesh=MESH
    ):
      pass


class WordsTest(absltest.TestCase):
  """The refusal and the per-step count, on records and text made here."""

  def test_does_not_fit_is_one_line_naming_figures_and_flags(self):
    gib = 2**30
    run = run_config.run_config_from_preset("tiny_dsv3", mesh=MESH)
    record = {
        "fits": False,
        "target": "h100",
        "topology": "1x1x8",
        "usable_bytes": int(76 * gib),
        "figures": {"peak": {"compiled": int(90.5 * gib)}},
    }
    with self.assertRaises(dry_run_target.TargetDoesNotFitError) as raised:
      dry_run_target.check_fits(record, run)
    message = str(raised.exception)
    self.assertNotIn("\n", message)
    self.assertTrue(
        message.startswith(
            "peak 90.5 GiB per device > 76.0 GiB usable on h100 by 14.5 GiB:"
        ),
        message,
    )
    for flag in ("--batch_size", "--microbatches", "--remat", "--topology"):
      self.assertIn(flag, message)
    record["fits"] = True
    dry_run_target.check_fits(record, run)  # No error.

  def test_tpu_compilers_refusal_is_the_same_line(self):
    """XLA's TPU compiler refuses a step over HBM; its figures, one line."""
    run = run_config.run_config_from_preset("tiny_dsv3", mesh=MESH)
    gib = 2**30
    message = dry_run_target._does_not_fit(  # pylint: disable=protected-access
        run, "v5e", "2x4", int(20 * gib), int(15.75 * gib)
    )
    self.assertTrue(
        message.startswith(
            "peak 20.0 GiB per device > 15.8 GiB usable on v5e by 4.2 GiB: "
            "--model=tiny_dsv3 does not fit on --topology=2x4"
        ),
        message,
    )

  def test_per_step_counts_loops_and_the_exact_ragged_buffer(self):
    hlo = "\n".join(
        [
            "%body (p: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {",
            "  %p = (s32[], bf16[8,4]) parameter(0)",
            "  %x = bf16[8,4]{1,0} get-tuple-element(%p), index=1",
            "  %out = bf16[32,4]{1,0} broadcast(%x)",
            "  %o = s64[4]{0} constant({0,0,0,0})",
            "  %r = bf16[32,4]{1,0} ragged-all-to-all(%x, %out, %o, %o, %o,"
            " %o)",
            "  %a = bf16[8,4]{1,0} all-to-all(%x), dimensions={0}",
            "}",
            "ENTRY %main (q: bf16[8,4]) -> bf16[8,4] {",
            "  %q = bf16[8,4]{1,0} parameter(0)",
            "  %w = (s32[], bf16[8,4]) while(%t), condition=%c, body=%body,"
            ' backend_config={"known_trip_count":{"n":"5"}}',
            "  %b = bf16[8,4]{1,0} all-to-all(%q), dimensions={0}",
            "}",
        ]
    )
    counted = aot.per_step_collective_bytes(hlo)
    row_bytes = 8 * 4 * 2  # bf16[8,4]
    # The ragged one sends its 8 rows (not the 32-row worst case), 5 times.
    self.assertEqual(counted.bytes["ragged-all-to-all"], 5 * row_bytes)
    self.assertEqual(counted.bytes["all-to-all"], 5 * row_bytes + row_bytes)
    self.assertEqual(counted.unknown_loops, 0)


def _shard_bytes(leaf) -> int:
  """Bytes device 0 holds of `leaf`, from the sharding's index map."""
  index = leaf.sharding.devices_indices_map(leaf.shape)[
      leaf.sharding.mesh.devices.flat[0]
  ]
  shape = [
      len(range(*s.indices(n))) if isinstance(s, slice) else 1
      for s, n in zip(index, leaf.shape)
  ]
  return int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize


class CompiledTest(absltest.TestCase):
  """tiny_dsv3 compiled for one H100 through train.main."""

  def setUp(self):
    super().setUp()
    if not aot.cuda_plugin_installed():
      self.skipTest(
          "compiling for GPUs needs jax's CUDA plugin (jax-cuda13-plugin), "
          "which this leg does not install"
      )
    self.out_dir = small_runs.temp_dir(self)

  def test_step_that_does_not_fit_one_h100_exits_with_one_line(self):
    status, out, err = _run_main(
        model="tiny_dsv3",
        dry_run=True,
        target="h100",
        topology="1x1x1",
        mesh="data=1",
        batch_size=256,
        seq_len=4096,  # A million tokens on one GPU.
        moe_backend="xla",
        output_dir=self.out_dir,
    )
    self.assertEqual(status, 1)
    # One line says why (JAX may log warnings around it).
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    self.assertLen(lines, 1, err)
    self.assertRegex(
        lines[0],
        r"^error: peak [\d.]+ GiB per device > 76\.0 GiB usable on h100 by "
        r"[\d.]+ GiB: --model=tiny_dsv3 ",
    )
    self.assertIn("DOES NOT FIT", out)
    # The figures are written all the same, at the default path.
    with open(
        dry_run_target.default_json_path(self.out_dir, "h100", "1x1x1")
    ) as f:
      self.assertFalse(json.load(f)["fits"])


class TpuCompiledTest(absltest.TestCase):
  """tiny_dsv3 compiled for 4 v5e chips through train.main."""

  def setUp(self):
    super().setUp()
    if not aot.libtpu_installed():
      self.skipTest(
          "compiling for TPUs needs libtpu (jax's `tpu` extra), which this "
          "leg does not install"
      )
    self.out_dir = small_runs.temp_dir(self)

  def test_tiny_dsv3_on_four_v5e_chips(self):
    path = os.path.join(self.out_dir, "v5e.json")
    status, out, err = _run_main(
        model="tiny_dsv3",
        dry_run=True,
        target="v5e",
        topology="2x2",
        mesh="data=2,expert=2",
        dry_run_json=path,
        output_dir=self.out_dir,
    )
    self.assertEqual(status, 0, err[-3000:])
    self.assertIn("peak vs usable HBM", out)
    with open(path) as f:
      record = json.load(f)
    self.assertTrue(record["fits"])
    self.assertEqual(record["usable_bytes"], aot.target("v5e").usable_bytes)
    figures = record["figures"]
    self.assertAlmostEqual(figures["params"]["ratio"], 1.0, delta=1e-3)
    # XLA:TPU's dots are convolutions, and its loops carry no trip count:
    # both are counted (the routed experts' ragged dots are Mosaic calls).
    self.assertGreater(figures["flops"]["compiled"], 0)
    self.assertEqual(record["matmuls_in_unknown_loops"], 0)
    self.assertGreater(record["kernel_launches_per_step"]["tpu_custom_call"], 0)
    self.assertGreater(
        record["collective_bytes_per_step"]["ragged-all-to-all"], 0
    )


# The committed DeepSeek-V3 layout for 1,024 H100s (docs/scaling.md), here
# at 4 layers (3 dense + 1 MoE) and the first microbatch's batch: full
# width, the real mesh, the real exchange and kernels.
SEED_FLAGS = dict(
    model="deepseek_v3",
    num_layers=4,
    target="h100",
    topology="1x128x8",
    mesh="fsdp=16,expert=64",
    batch_size=1024,
    seq_len=4096,
    remat="full",
    moe_backend="mosaic_gpu",
    ep_chunks=16,
)


class SeedScaleTest(absltest.TestCase):
  """DeepSeek-V3 at reduced depth compiled for 1,024 H100s (about 1.5 min),
  where the leg has jax's CUDA plugin."""

  def setUp(self):
    super().setUp()
    if not aot.cuda_plugin_installed():
      self.skipTest(
          "compiling for GPUs needs jax's CUDA plugin (jax-cuda13-plugin), "
          "which this leg does not install"
      )
    self.out_dir = small_runs.temp_dir(self)

  def test_deepseek_v3_layers_on_1024_h100s(self):
    path = os.path.join(self.out_dir, "figures.json")
    status, out, err = _run_main(dry_run=True, dry_run_json=path, **SEED_FLAGS)
    self.assertEqual(status, 0, err[-3000:])
    with open(path) as f:
      record = json.load(f)
    print(f"deepseek_v3 (4 layers) for 1,024 H100s: {out.splitlines()[-12:]}")
    self.assertTrue(record["fits"])
    self.assertEqual(record["num_layers"], 4)
    figures = record["figures"]
    # The exchange moves what the analytic model says: every token's top-k
    # rows, 6 times a layer (forward, backward, recompute), no more.
    self.assertAlmostEqual(figures["all_to_all"]["ratio"], 1.0, delta=1e-3)
    self.assertGreater(
        record["collective_bytes_per_step"]["ragged-all-to-all"], 0
    )
    # The routed experts run in Mosaic GPU kernels (opaque to the FLOP
    # count), the rest in counted GEMMs.
    self.assertGreater(record["kernel_launches_per_step"]["mosaic_gpu_v2"], 0)
    self.assertGreater(figures["flops"]["compiled"], 0)
    for key in ("params", "optimizer", "temporaries", "peak", "flops"):
      self.assertGreater(figures[key]["analytic"], 0, key)
      self.assertAlmostEqual(
          figures[key]["ratio"],
          figures[key]["compiled"] / figures[key]["analytic"],
      )
    self.assertEqual(record["usable_bytes"], aot.target("h100").usable_bytes)
    # Parameters per device: the abstract params' shards, summed.
    flag_values = {
        k: v for k, v in SEED_FLAGS.items() if k not in ("target", "topology")
    }
    with flagsaver.flagsaver(**flag_values):
      run = train_flags.run_config_from_flags()
    topology = aot.gpu_topology("h100", SEED_FLAGS["topology"])
    mesh = mesh_lib.build(mesh_lib.parse(run.mesh), devices=topology.devices)
    params = step_builder.build(run, mesh).state["params"]
    self.assertEqual(
        figures["params"]["compiled"],
        sum(_shard_bytes(x) for x in jax.tree.leaves(params)),
    )
    self.assertEqual(
        figures["params"]["compiled"], figures["gradients"]["compiled"]
    )

  def test_mixtral_layers_on_one_host_of_8_h100s(self):
    # The committed one-host Mixtral plan (docs/scaling.md) at 2 layers.
    path = os.path.join(self.out_dir, "mixtral.json")
    status, _, err = _run_main(
        model="mixtral_8x7b",
        num_layers=2,
        dry_run=True,
        target="h100",
        topology="1x1x8",
        mesh="expert=8",
        batch_size=8,
        seq_len=4096,
        remat="full",
        moe_backend="mosaic_gpu",
        opt_state_dtype="bfloat16",
        dry_run_json=path,
    )
    self.assertEqual(status, 0, err[-3000:])
    with open(path) as f:
      record = json.load(f)
    self.assertTrue(record["fits"])
    figures = record["figures"]
    # Two bfloat16 moments: the parameters' float32 bytes (and AdamW's
    # step counts).
    self.assertAlmostEqual(
        figures["optimizer"]["compiled"],
        figures["params"]["compiled"],
        delta=1024,
    )
    self.assertAlmostEqual(figures["optimizer"]["ratio"], 1.0, delta=1e-3)
    self.assertAlmostEqual(figures["all_to_all"]["ratio"], 1.0, delta=1e-3)


if __name__ == "__main__":
  absltest.main()
