"""compare_backends' flags: a bad value is refused as the flags are parsed,
before a model is built or compiled, in one line naming the flag and the
value (the training program's own flags: train/flags_test.py)."""

import re

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

# Importing it defines the flags under test.
from bench.micro import compare_backends  # noqa: F401


class FlagsTest(absltest.TestCase):

  def test_each_bad_value_is_refused_naming_its_flag(self):
    for arg, says in (
        ("--steps=2", "--steps must be an int >= 3, got 2"),
        ("--batch_size=0", "--batch_size must be an int >= 1, got 0"),
        ("--seq_len=0", "--seq_len must be an int >= 1, got 0"),
        ("--backends=reference,nope", "got ['reference', 'nope']"),
        ("--backends=xla,xla", "distinct names"),
    ):
      with self.subTest(arg=arg), flagsaver.flagsaver():
        with self.assertRaisesRegex(
            flags.IllegalFlagValueError, re.escape(says)
        ):
          flags.FLAGS(["compare_backends", arg])

  def test_the_defaults_pass(self):
    with flagsaver.flagsaver():
      flags.FLAGS(["compare_backends"])
      self.assertEqual(flags.FLAGS.backends, ["reference", "xla"])


if __name__ == "__main__":
  absltest.main()
