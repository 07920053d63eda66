"""A checkpoint written before train/ became packages still resumes.

testdata/tiny_dsv3_meta_d0eb1e8.json is the meta.json of a `tiny_dsv3`
checkpoint that commit d0eb1e8 (the flat train/ folder) wrote after 2 steps
(`python -m train.main --steps=2 --batch_size=2 --seq_len=16
--eval_every=2 --eval_batches=1 --plot=false --progress=false`, default
data), with each leaf's checksum left out (they are the arrays', which are
not kept here). A restore checks a checkpoint's meta.json against the run
before it reads an array: the fingerprint (the model config, batch, seed,
data), and the state's tree paths, shapes and dtypes, under which Orbax
stored the arrays. Today's tree must pass both checks for the run of the
same flags, so the move of the model's modules (families' blocks, the
DeepSeek-V4 hyper-head) changed no tree path and the presets' tables no
config field. (By hand, on 2026-12-06: that checkpoint itself, resumed by
`python -m train.main --resume` with the same flags and --steps=4 on this
tree, went on from step 2 to step 4.)
"""

from __future__ import annotations

import json
import os

from absl.testing import absltest
import jax

from train.checkpoints import checkpoint_dirs
from train.checkpoints import checkpoint_meta
from train.run.inputs import run_config
from train.run.step import step_builder

_GOLDEN = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "testdata",
    "tiny_dsv3_meta_d0eb1e8.json",
)


def _golden_meta() -> dict:
  with open(_GOLDEN) as f:
    return json.load(f)


class LayoutCompatTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.meta = _golden_meta()
    # The flags the checkpoint was written with (see the module docstring).
    cls.run_config = run_config.run_config_from_preset(
        "tiny_dsv3", steps=2, batch_size=2, seq_len=16, eval_batches=1
    )

  def test_it_is_this_programs_checkpoint(self):
    self.assertEqual(
        self.meta[checkpoint_dirs.WRITER_KEY], checkpoint_dirs.WRITER
    )
    self.assertEqual(
        self.meta["format_version"], checkpoint_meta.FORMAT_VERSION
    )

  def test_fingerprint_matches_the_same_flags(self):
    saved = self.meta["fingerprint"]
    # The text's identity is the data's, not the code's: taken as saved.
    fingerprint = self.run_config.fingerprint(
        saved["data"], saved.get("data_sha256")
    )
    checkpoint_meta.check_fingerprint(_GOLDEN, self.meta, fingerprint)

  def test_state_has_the_saved_tree_paths_shapes_and_dtypes(self):
    state = step_builder.build(self.run_config, None).state
    with_path, _ = jax.tree_util.tree_flatten_with_path(state)
    paths = [jax.tree_util.keystr(p) for p, _ in with_path]
    leaves = [leaf for _, leaf in with_path]
    checkpoint_meta.check_layout(_GOLDEN, self.meta, paths, leaves)
    # The model's classes moved modules; the tree paths name attributes.
    self.assertIn("['params']['embed'].value", paths)


if __name__ == "__main__":
  absltest.main()
