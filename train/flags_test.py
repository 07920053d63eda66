"""The training program checks every flag as absl parses it.

A bad value must stop `train.main` with one line per flag that names the
flag, what it needs and what it got, before anything compiles. Most cases
run in this process: flagsaver runs absl's validators exactly as
command-line parsing does. Four subprocesses check that the program really
stops at parse time (bench/micro/compare_backends_test.py checks the
benchmark's flags).
"""

import dataclasses
import io
import os
import subprocess
import sys
from unittest import mock

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized

from moe_core import precision as moe_precision
from moe_core import registry
from train import main
from train import presets
from train import train_flags
from train.run.inputs import run_config
from train.run.reporting import report
from train.run.reporting import step_log
from train.testing import small_runs

FLAGS = flags.FLAGS
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (flag, command-line value) pairs that must be refused.
_BAD = (
    ("steps", "0"),
    ("steps", "-3"),
    ("batch_size", "0"),
    ("microbatches", "0"),
    ("microbatches", "-2"),
    ("ep_chunks", "0"),
    ("num_layers", "0"),
    ("seq_len", "0"),
    ("seq_len", "-1"),
    ("warmup_steps", "-1"),
    ("seed", "-1"),
    ("seed", str(2**63)),  # Past what jax.random.key takes.
    ("eval_every", "0"),
    ("eval_batches", "0"),
    ("checkpoint_every", "-1"),
    ("keep_checkpoints", "-1"),
    ("log_every", "0"),
    ("learning_rate", "0"),
    ("learning_rate", "-1e-3"),
    ("learning_rate", "nan"),
    ("learning_rate", "inf"),
    ("weight_decay", "-0.1"),
    ("weight_decay", "nan"),
    ("grad_clip", "0"),
    ("grad_clip", "inf"),
    ("bias_update_rate", "-1e-3"),
    ("bias_update_rate", "-inf"),
    ("aux_loss_weight", "-1"),
    ("aux_loss_weight", "nan"),
    ("z_loss_weight", "-1"),
    ("z_loss_weight", "inf"),
    ("mesh", "data=2,data=4"),
    ("mesh", "data=2,expert=2,data=1"),
    ("mesh", "pipeline=2"),
    ("mesh", "data"),
    ("mesh", "data=0"),
    ("mesh", "expert=-2"),
    ("mesh", "data=two"),
    ("data", "/nonexistent/corpus.txt"),
)

# (flag, command-line value) pairs at or near the edge that must be taken.
_GOOD = (
    ("steps", "1"),
    ("batch_size", "1"),
    ("microbatches", "1"),
    ("ep_chunks", "16"),
    ("num_layers", "4"),
    ("seq_len", "1"),  # One input byte and its next-byte target.
    ("warmup_steps", "0"),
    ("seed", "0"),
    ("seed", str(2**63 - 1)),
    ("eval_every", "1"),
    ("eval_batches", "1"),
    ("checkpoint_every", "0"),  # Only at the end.
    ("keep_checkpoints", "0"),  # Keep all.
    ("log_every", "1"),
    ("learning_rate", "1e-6"),
    ("weight_decay", "0"),
    ("grad_clip", "0.5"),
    ("bias_update_rate", "0"),
    ("aux_loss_weight", "0"),
    ("z_loss_weight", "0"),
    ("mesh", "data=2,expert=4"),
    ("mesh", " fsdp = 2 , tensor=2 "),
    ("mesh", "data=1"),
)


def setUpModule():
  if not FLAGS.is_parsed():
    FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


def _own_message(error: Exception) -> str:
  """The validator's line, without absl's "flag --name=value: " prefix."""
  text = str(error)
  return text[text.index(": --") + 2 :]


def _refusal(test: absltest.TestCase, **values) -> str:
  """The one line refusing the flag `values` (flagsaver runs the validators
  as parsing does), without absl's prefix."""
  with test.assertRaises(flags.IllegalFlagValueError) as raised:
    with flagsaver.flagsaver(**values):
      pass
  test.assertNotIn("\n", str(raised.exception))
  return _own_message(raised.exception)


def _main_number_flags() -> list[str]:
  """The names of train.main's int and float flags (train_flags')."""
  names = [
      f.name
      for f in FLAGS.get_flags_for_module(train_flags)
      if f.flag_type() in ("int", "float")
  ]
  assert names, "train_flags defines no number flag"
  return names


class NumberAndMeshFlagTest(parameterized.TestCase):

  @parameterized.parameters(*_BAD)
  def test_refused_with_one_line_naming_flag_and_value(self, name, text):
    with self.assertRaises(flags.IllegalFlagValueError) as raised:
      with flagsaver.as_parsed(**{name: text}):
        pass
    self.assertNotIn("\n", str(raised.exception))
    own = _own_message(raised.exception)
    self.assertTrue(own.startswith(f"--{name}"), own)
    given = FLAGS[name].parser.parse(text)
    self.assertIn(text if name == "mesh" else repr(given), own)

  @parameterized.parameters(*_GOOD)
  def test_accepted(self, name, text):
    with flagsaver.as_parsed(**{name: text}):
      self.assertEqual(FLAGS[name].value, FLAGS[name].parser.parse(text))

  def test_every_number_flag_has_a_refused_value(self):
    self.assertContainsSubset(_main_number_flags(), {n for n, _ in _BAD})

  def test_unset_means_the_preset_default(self):
    unset = [n for n in _main_number_flags() if FLAGS[n].default is None]
    self.assertContainsSubset(["steps", "learning_rate"], unset)
    for name in unset:
      with flagsaver.flagsaver(**{name: None}):
        self.assertIsNone(FLAGS[name].value)

  def test_none_refused_where_the_default_is_a_number(self):
    with self.assertRaisesRegex(flags.IllegalFlagValueError, "--eval_every"):
      with flagsaver.flagsaver(eval_every=None):
        pass

  def test_bool_is_not_a_count(self):
    with self.assertRaisesRegex(flags.IllegalFlagValueError, "--steps"):
      with flagsaver.flagsaver(steps=True):
        pass

  def test_every_default_passes(self):
    # The default --output_dir, under /tmp, may be unwritable in a sandbox.
    out_dir = small_runs.temp_dir(self)
    with flagsaver.flagsaver():
      FLAGS.unparse_flags()
      FLAGS(["prog", f"--output_dir={out_dir}"])  # Runs every validator.
      self.assertIsNone(FLAGS.steps)

  def test_each_bad_flag_gets_its_own_line(self):
    with self.assertRaises(flags.IllegalFlagValueError) as raised:
      with flagsaver.flagsaver():
        FLAGS(
            [
                "prog",
                "--steps=0",
                "--learning_rate=nan",
                f"--output_dir={small_runs.temp_dir(self)}",
            ]
        )
    lines = str(raised.exception).splitlines()
    self.assertLen(lines, 2)
    self.assertIn("--steps", lines[0])
    self.assertIn("--learning_rate", lines[1])


class RunConfigFlagsTest(absltest.TestCase):
  """The flags set every RunConfig field, under its own name where they can."""

  def test_every_field_has_its_flag(self):
    for name in train_flags.SAME_NAME:
      self.assertIn(name, FLAGS, f"RunConfig.{name} has no --{name}")

  def test_flag_defaults_are_the_run_config_defaults(self):
    # A flag that defaults to None takes the preset's value; any other
    # default must be RunConfig's, or a run from code and one from the
    # command line would differ.
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(run_config.RunConfig)
        if f.default is not dataclasses.MISSING
    }
    checked = 0
    for name in train_flags.SAME_NAME + ("mesh",):
      flag_default = FLAGS[name].default
      if flag_default is None or name not in defaults:
        continue
      self.assertEqual(flag_default, defaults[name], f"--{name}")
      checked += 1
    self.assertGreater(checked, 10)
    self.assertEqual(FLAGS["moe_backend"].default, defaults["backend"])

  def test_each_flag_reaches_its_field(self):
    values = dict(
        steps=3,
        batch_size=16,
        seq_len=48,
        learning_rate=1e-4,
        warmup_steps=7,
        weight_decay=0.05,
        grad_clip=0.5,
        bias_update_rate=2e-3,
        aux_loss_weight=1e-3,
        z_loss_weight=1e-4,
        seed=11,
        remat="full",
        compute_dtype="float32",
        scan_layers=False,
        microbatches=2,
        ep_chunks=2,
        opt_state_dtype="bfloat16",
        output_dir="/tmp/dropless_flags_test",
        eval_every=9,
        eval_batches=3,
        checkpoint_every=5,
        keep_checkpoints=4,
        log_every=6,
        resume=True,
        progress=False,
        plot=False,
        moe_backend="reference",
        mesh="data=2,expert=4",
    )
    with flagsaver.flagsaver(**values):
      run = train_flags.run_config_from_flags()
    values["backend"] = values.pop("moe_backend")
    for name, value in values.items():
      self.assertEqual(getattr(run, name), value, name)


class MeshFitsModelTest(parameterized.TestCase):
  """The expert axis must divide the experts of --model."""

  @parameterized.parameters(
      ("expert=3", "tiny_dsv3"),  # 16 experts.
      ("data=2,expert=32", "tiny_dsv3"),
      ("expert=16", "tiny_mixtral"),  # 8 experts.
      ("fsdp=4,expert=96", "deepseek_v3"),  # 256 experts.
  )
  def test_refused(self, mesh, model):
    with self.assertRaises(flags.IllegalFlagValueError) as raised:
      with flagsaver.as_parsed(mesh=mesh, model=model):
        pass
    own = _own_message(raised.exception)
    self.assertTrue(own.startswith("--mesh"), own)
    expert = mesh.split("expert=")[1]
    self.assertIn(f"expert={expert}", own)
    self.assertIn(f"--model={model}", own)

  @parameterized.parameters(
      ("expert=16", "tiny_dsv3"),
      ("data=2,expert=8", "tiny_mixtral"),
      ("fsdp=4,expert=64", "deepseek_v3"),
      ("tensor=3", "tiny_mixtral"),  # Only the expert axis must divide.
  )
  def test_accepted(self, mesh, model):
    with flagsaver.as_parsed(mesh=mesh, model=model):
      self.assertEqual(FLAGS.mesh, mesh)

  def test_checked_against_the_model_set_with_it(self):
    # tiny_qwen3 has 32 experts; the default preset has 16. Flags set
    # together are checked together, whatever their order (a batch of 32
    # splits over the 32 devices).
    with flagsaver.flagsaver(
        mesh="expert=32", model="tiny_qwen3", batch_size=32
    ):
      self.assertEqual(FLAGS.model, "tiny_qwen3")
    with self.assertRaises(flags.IllegalFlagValueError):
      with flagsaver.flagsaver(mesh="expert=32"):
        pass


class PathFlagTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = small_runs.temp_dir(self)
    self.file = os.path.join(self.dir, "a_file")
    with open(self.file, "w") as f:
      f.write("text")

  def test_output_dir_that_is_a_file_is_refused(self):
    own = _refusal(self, output_dir=self.file)
    self.assertTrue(own.startswith("--output_dir"), own)
    self.assertIn(repr(self.file), own)
    self.assertIn("not a directory", own)

  def test_output_dir_under_a_file_is_refused(self):
    path = os.path.join(self.file, "run", "out")
    own = _refusal(self, output_dir=path)
    self.assertTrue(own.startswith("--output_dir"), own)
    self.assertIn(repr(path), own)
    self.assertIn(repr(self.file), own)  # The part that is in the way.
    self.assertIn("not a directory", own)

  def test_output_dir_in_a_read_only_directory_is_refused(self):
    if os.geteuid() == 0:
      self.skipTest("root writes to read-only directories")
    locked = os.path.join(self.dir, "locked")
    os.mkdir(locked, 0o500)
    self.addCleanup(os.chmod, locked, 0o700)
    own = _refusal(self, output_dir=os.path.join(locked, "out"))
    self.assertIn(repr(locked), own)

  def test_empty_output_dir_is_refused(self):
    self.assertTrue(_refusal(self, output_dir="").startswith("--output_dir"))

  def test_output_dir_existing_or_creatable_is_taken_and_not_made(self):
    new = os.path.join(self.dir, "run", "out")
    for path in (self.dir, new):
      with flagsaver.flagsaver(output_dir=path):
        self.assertEqual(FLAGS.output_dir, path)
    self.assertFalse(os.path.exists(os.path.join(self.dir, "run")))

  def test_dry_run_json_that_is_a_directory_is_refused(self):
    target = dict(dry_run=True, target="v5e", topology="1x1")
    own = _refusal(self, dry_run_json=self.dir, **target)
    self.assertTrue(own.startswith("--dry_run_json"), own)
    self.assertIn(repr(self.dir), own)
    # The default, in --output_dir, likewise.
    os.mkdir(os.path.join(self.dir, "dry_run_v5e_1x1.json"))
    own = _refusal(self, output_dir=self.dir, **target)
    self.assertTrue(own.startswith("--output_dir"), own)
    self.assertIn("dry_run_v5e_1x1.json", own)
    path = os.path.join(self.dir, "new", "v5e.json")
    with flagsaver.flagsaver(dry_run_json=path, **target):
      self.assertEqual(FLAGS.dry_run_json, path)

  def test_dry_run_json_without_a_target_is_refused(self):
    own = _refusal(self, dry_run=True, dry_run_json="/tmp/figures.json")
    self.assertTrue(own.startswith("--dry_run_json"), own)
    self.assertIn("--target", own)

  def test_output_paths_of_the_wrong_kind_are_refused(self):
    """What a run writes in --output_dir: checked before it trains, not
    at its last save."""
    for name, directory in (
        ("checkpoints", False),
        ("metrics.jsonl", True),
        ("summary.json", True),
        ("training.png", True),
    ):
      with self.subTest(name=name):
        out = os.path.join(self.dir, name.replace(".", "_"))
        os.mkdir(out)
        if directory:
          os.mkdir(os.path.join(out, name))
        else:
          with open(os.path.join(out, name), "w") as f:
            f.write("in the way")
        own = _refusal(self, output_dir=out)
        self.assertTrue(own.startswith("--output_dir"), own)
        self.assertIn(repr(os.path.join(out, name)), own)
        if name == "training.png":  # Written only with --plot.
          with flagsaver.flagsaver(output_dir=out, plot=False):
            self.assertEqual(FLAGS.output_dir, out)
        with flagsaver.flagsaver(output_dir=out, dry_run=True):
          self.assertEqual(FLAGS.output_dir, out)  # A dry run writes none.

  def test_data_must_be_a_file(self):
    own = _refusal(self, data=self.dir)
    self.assertTrue(own.startswith("--data"), own)
    self.assertIn(repr(self.dir), own)
    with flagsaver.flagsaver(data=self.file):
      self.assertEqual(FLAGS.data, self.file)


class SettingsTogetherTest(parameterized.TestCase):
  """Flags that are each valid but not together: refused as parsed, one
  line naming the flag, what it takes and what it got, before anything
  compiles (each once ended in a traceback, or HLO, after compiling)."""

  def _refusal_of(self, flag: str, **values) -> str:
    own = _refusal(self, **values)
    self.assertTrue(own.startswith(f"--{flag}"), own)
    return own

  def test_num_layers_below_the_dense_layers(self):
    own = self._refusal_of(
        "num_layers", model="deepseek_v3", num_layers=2, dry_run=True
    )
    self.assertRegex(own, r"num_layers must be >= 4 .*got 2.*deepseek_v3")

  def test_microbatches_that_do_not_divide_the_batch(self):
    own = self._refusal_of(
        "microbatches", batch_size=3, microbatches=2, dry_run=True
    )
    self.assertIn("--batch_size=3", own)

  def test_ep_chunks_that_do_not_divide_a_devices_tokens(self):
    # tiny_dsv3: 16 sequences of 128 tokens, 8 per device of expert=2.
    own = self._refusal_of("ep_chunks", mesh="expert=2", ep_chunks=3)
    self.assertIn("1024 tokens", own)
    self.assertIn("got 3", own)
    with flagsaver.flagsaver(mesh="expert=2", ep_chunks=4):
      self.assertEqual(FLAGS.ep_chunks, 4)

  def test_a_recipe_the_backend_does_not_multiply(self):
    own = self._refusal_of(
        "precision", precision="fp8_block", moe_backend="mosaic_tpu"
    )
    self.assertIn("['unquantized']", own)
    self.assertIn("--moe_backend=mosaic_tpu", own)
    self.assertIn("'fp8_block'", own)

  def test_a_compute_dtype_the_backend_does_not_run(self):
    own = self._refusal_of(
        "compute_dtype", compute_dtype="float32", moe_backend="mosaic_gpu"
    )
    self.assertIn("bfloat16", own)
    self.assertIn("'float32'", own)

  @parameterized.parameters(
      ("cpu", "v5e", "1x1"),
      ("pallas", "v5e", "1x1"),
      ("mosaic_tpu", "h100", "1x1x1"),
  )
  def test_a_backend_that_does_not_compile_for_the_target(
      self, backend, target, topology
  ):
    own = self._refusal_of(
        "moe_backend",
        moe_backend=backend,
        target=target,
        topology=topology,
        dry_run=True,
    )
    self.assertIn(f"--moe_backend={backend}", own)
    self.assertIn(f"--target={target}", own)
    self.assertIn("auto", own)

  def test_a_backend_whose_package_is_absent(self):
    """A backend module that needs a package (triton's jax-triton) raises
    ImportError as it is imported: named at parsing, with its words."""
    self.enter_context(mock.patch.dict(registry._REGISTRY))
    registry.register_backend("needs_a_package", "no_such_package.mod:B")
    for target in ({}, dict(target="h100", topology="1x1x1", dry_run=True)):
      own = self._refusal_of(
          "moe_backend", moe_backend="needs_a_package", **target
      )
      self.assertIn("--moe_backend=needs_a_package cannot run here", own)
      self.assertIn("no_such_package", own)

  def test_a_dense_model_takes_any_backend(self):
    dense = _dense_default_preset()
    with mock.patch.dict(presets.PRESETS, {presets.DEFAULT_PRESET: dense}):
      with flagsaver.as_parsed(
          moe_backend="mosaic_tpu", compute_dtype="float32"
      ):
        self.assertEqual(FLAGS.moe_backend, "mosaic_tpu")


def _dense_default_preset() -> presets.Preset:
  """The default preset with every MoE block made a dense MLP."""
  preset = presets.get_preset(presets.DEFAULT_PRESET)
  dense = preset.model.replace(moe=None, first_dense_layers=0)
  return dataclasses.replace(preset, model=dense)


class PrecisionFlagTest(parameterized.TestCase):
  """--precision sets the recipe of the routed experts' GEMMs."""

  def test_unknown_recipe_refused_naming_flag_choices_and_value(self):
    with self.assertRaises(flags.IllegalFlagValueError) as raised:
      with flagsaver.as_parsed(precision="fp9"):
        pass
    text = str(raised.exception)
    self.assertNotIn("\n", text)
    self.assertIn("--precision=fp9", text)
    for recipe in moe_precision.RECIPES:
      self.assertIn(recipe, text)
    self.assertIn("unquantized", text)
    self.assertNotIn("bf16", text)  # The deprecated alias is not offered.

  @parameterized.parameters(*moe_precision.RECIPES)
  def test_recipe_reaches_the_run_config_model(self, recipe):
    with flagsaver.as_parsed(precision=recipe):
      run = train_flags.run_config_from_flags()
    self.assertEqual(run.model.moe.precision, recipe)
    self.assertEqual(run.precision, recipe)
    # Nothing else of the preset's model changes.
    preset = presets.get_preset(presets.DEFAULT_PRESET)
    self.assertEqual(
        run.model.replace(moe=run.model.moe.replace(precision="unquantized")),
        preset.model,
    )

  def test_num_layers_sets_the_depth_and_keeps_the_width(self):
    with flagsaver.as_parsed(model="deepseek_v3", num_layers="5"):
      run = train_flags.run_config_from_flags()
    preset = presets.get_preset("deepseek_v3").model
    self.assertEqual(run.model.num_layers, 5)
    self.assertEqual(run.model.replace(num_layers=preset.num_layers), preset)
    self.assertEqual(run.model.num_moe_layers, 2)  # 3 dense + 2 MoE.

  def test_num_layers_below_the_dense_layers_is_refused(self):
    model = presets.get_preset("deepseek_v3").model
    with self.assertRaisesRegex(
        ValueError, r"^num_layers must be >= 4 for 'deepseek_v3'.*got 3\.$"
    ):
      run_config.with_depth(model, 3)

  def test_default_is_the_unquantized_model(self):
    with flagsaver.flagsaver():
      run = train_flags.run_config_from_flags()
    self.assertEqual(FLAGS.precision, "unquantized")
    self.assertEqual(
        run.model, presets.get_preset(presets.DEFAULT_PRESET).model
    )

  def test_recipe_is_part_of_the_compiled_program_and_checkpoint(self):
    runs = {
        recipe: run_config.run_config_from_preset(
            presets.DEFAULT_PRESET, precision=recipe
        )
        for recipe in ("unquantized", "mxfp8")
    }
    self.assertNotEqual(
        run_config.compile_key(runs["unquantized"]),
        run_config.compile_key(runs["mxfp8"]),
    )
    self.assertNotEqual(
        runs["unquantized"].fingerprint("corpus"),
        runs["mxfp8"].fingerprint("corpus"),
    )

  def test_quantised_recipe_with_a_dense_model_is_refused(self):
    dense = _dense_default_preset()
    with mock.patch.dict(presets.PRESETS, {presets.DEFAULT_PRESET: dense}):
      with self.assertRaises(flags.IllegalFlagValueError) as raised:
        with flagsaver.as_parsed(precision="nvfp4"):
          pass
      # Nothing to quantise.
      with flagsaver.as_parsed(precision="unquantized"):
        self.assertEqual(
            train_flags.run_config_from_flags().precision, "unquantized"
        )
    self.assertNotIn("\n", str(raised.exception))
    own = _own_message(raised.exception)
    self.assertTrue(own.startswith("--precision"), own)
    self.assertIn(f"--model={presets.DEFAULT_PRESET}", own)
    self.assertIn("unquantized", own)  # What a dense model takes.
    self.assertIn("'nvfp4'", own)

  def test_run_config_in_code_refuses_a_recipe_for_a_dense_model(self):
    dense = _dense_default_preset().model
    with self.assertRaisesRegex(
        ValueError, "needs 'unquantized', got 'fp8_block'"
    ):
      run_config.with_precision(dense, "fp8_block")
    with self.assertRaisesRegex(
        ValueError, r"precision must be one of \('unquantized', "
    ):
      run_config.with_precision(dense, "int8")
    self.assertIs(run_config.with_precision(dense, "unquantized"), dense)

  def test_flag_takes_the_deprecated_bf16_as_unquantized(self):
    # Logged as well as warned: a command line would not show the warning.
    with (
        self.assertLogs(level="WARNING") as logs,
        self.assertWarnsRegex(
            DeprecationWarning, "'bf16' is deprecated: use 'unquantized'"
        ),
    ):
      with flagsaver.as_parsed(precision="bf16"):
        self.assertEqual(FLAGS.precision, "unquantized")
        run = train_flags.run_config_from_flags()
    self.assertTrue(
        any("--precision 'bf16' is deprecated" in m for m in logs.output),
        logs.output,
    )
    self.assertEqual(run.precision, "unquantized")
    self.assertEqual(
        run.model, presets.get_preset(presets.DEFAULT_PRESET).model
    )

  def test_run_config_takes_the_deprecated_bf16_as_unquantized(self):
    with self.assertWarnsRegex(DeprecationWarning, "use 'unquantized'"):
      run = run_config.run_config_from_preset(
          presets.DEFAULT_PRESET, precision="bf16"
      )
    self.assertEqual(run.precision, "unquantized")
    self.assertEqual(
        run, run_config.run_config_from_preset(presets.DEFAULT_PRESET)
    )
    dense = _dense_default_preset().model
    with self.assertWarnsRegex(DeprecationWarning, "use 'unquantized'"):
      self.assertIs(run_config.with_precision(dense, "bf16"), dense)

  def test_every_recipe_is_described(self):
    self.assertCountEqual(train_flags.PRECISION_RECIPES, moe_precision.RECIPES)
    for recipe in moe_precision.RECIPES:
      self.assertIn(f"{recipe}:", FLAGS["precision"].help)

  def test_dry_run_shows_the_recipe(self):
    with flagsaver.flagsaver(precision="fp8_block", dry_run=True):
      # The recipe's line only: compiling the step is faults_test's.
      text = main.dry_run(io.StringIO(), compile_step=False)
    self.assertIn("--precision=fp8_block", text)
    self.assertIn(train_flags.PRECISION_RECIPES["fp8_block"], text)

  def test_summary_records_the_recipe(self):
    run = small_runs.small_run(small_runs.temp_dir(self))
    run = dataclasses.replace(
        run, model=run_config.with_precision(run.model, "mxfp8")
    )
    summary = report.run_summary(
        run,
        small_runs.corpus(),
        step_log.new_history(),
        steps=0,
        backend="xla",
        wall_seconds=0.0,
        checkpoint_path=None,
        interrupted=None,
    )
    self.assertEqual(summary["precision"], "mxfp8")


def _run_module(module: str, *args: str) -> subprocess.CompletedProcess:
  """`python -m module args` on the CPU, logging every JAX compilation."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1")
  env["PYTHONPATH"] = os.pathsep.join(
      filter(None, [_ROOT, env.get("PYTHONPATH")])
  )
  return subprocess.run(
      [sys.executable, "-m", module, *args],
      cwd=_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,  # Only against a hang: a refusal takes seconds.
      check=False,
  )


class StopsBeforeCompilingTest(absltest.TestCase):
  """The programs end at flag parsing: status 1, nothing run or compiled."""

  def _assert_stopped_at_parsing(self, proc, *flag_and_values):
    self.assertEqual(proc.returncode, 1, proc.stderr[-3000:])
    self.assertEqual(proc.stdout, "")  # No data, model or dry-run lines.
    # JAX_LOG_COMPILES logs each jit it traces or compiles.
    self.assertNotIn("Compiling", proc.stderr)
    self.assertNotIn("Finished tracing", proc.stderr)
    lines = proc.stderr.splitlines()
    for flag, given in flag_and_values:
      self.assertTrue(
          any(flag in line and given in line for line in lines),
          f"no line names {flag} and {given}:\n{proc.stderr[-3000:]}",
      )

  def test_train_main_zero_steps(self):
    proc = _run_module(
        "train.main", "--steps=0", f"--output_dir={small_runs.temp_dir(self)}"
    )
    self._assert_stopped_at_parsing(proc, ("--steps", "got 0"))

  def test_train_main_dry_run_expert_axis_that_does_not_divide(self):
    proc = _run_module(
        "train.main", "--dry_run", "--model=tiny_dsv3", "--mesh=expert=3"
    )
    self._assert_stopped_at_parsing(proc, ("--mesh", "expert=3"))

  def test_train_main_unknown_precision(self):
    proc = _run_module(
        "train.main",
        "--precision=fp6",
        f"--output_dir={small_runs.temp_dir(self)}",
    )
    self._assert_stopped_at_parsing(proc, ("--precision", "fp6"))

  def test_train_main_output_dir_whose_checkpoints_is_a_file(self):
    """The run trained, then lost its work at its last save."""
    out = small_runs.temp_dir(self)
    with open(os.path.join(out, "checkpoints"), "w") as f:
      f.write("in the way")
    proc = _run_module("train.main", f"--output_dir={out}")
    self._assert_stopped_at_parsing(proc, ("--output_dir", "checkpoints"))


if __name__ == "__main__":
  absltest.main()
