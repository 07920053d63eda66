"""tokamax_compare's reading of tokamax's table and its tiles,
trace_summary's grouping of a profile, and the commit tpu_check records: on
small hand-made inputs, no chip and no tokamax needed."""

import ast
import glob
import json
import os
import subprocess
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp

from bench.harness import timing
from bench.harness import trace_summary
from bench.micro import tokamax_compare
from bench.on_device import tpu_check


def _key(lhs, rhs, dims, group_dims, sizes, residuals=False, dtype="bf16"):
  return json.dumps(
      {
          "lhs": f"{dtype}[{','.join(map(str, lhs))}]",
          "rhs": f"{dtype}[{','.join(map(str, rhs))}]",
          "group_sizes": sizes,
          "ragged_dot_dimension_numbers": {
              "dot_dimension_numbers": [dims, [[], []]],
              "lhs_ragged_dimensions": [0],
              "rhs_group_dimensions": group_dims,
          },
          "return_residuals": residuals,
          "activation": None,
      }
  )


def _timed(ms, **config):
  return {json.dumps(config): {"evaluation_times_ms": ms}}


class TokamaxTableTest(absltest.TestCase):

  def test_passes_configs_and_left_out_entries(self):
    sizes = [384, 0, 128, 0]
    table = {
        _key((512, 256), (4, 256, 384), [[1], [1]], [0], sizes): {
            **_timed([2.0, 1.0, 3.0], tile_m=128, tile_k=256, tile_n=128),
            **_timed([4.0, 5.0, 6.0], tile_m=256, tile_k=256, tile_n=128),
        },
        _key((512, 384), (4, 256, 384), [[1], [2]], [0], sizes): {},
        _key((512, 256), (512, 384), [[0], [0]], [], sizes, True): _timed(
            [1.0], tile_m=128, tile_k=128, tile_n=384
        ),
        _key(
            (512, 256), (4, 256, 384), [[1], [1]], [0], sizes, False, "f32"
        ): {},
    }
    entries, left_out = tokamax_compare.parse_table(table)
    self.assertEqual([e.pass_ for e in entries], ["fwd", "dlhs", "drhs"])
    fwd, dlhs, drhs = entries
    # The faster of two stored configs, its median time.
    self.assertEqual(fwd.config["tile_m"], 128)
    self.assertEqual(fwd.stored_ms, 2.0)
    self.assertIsNone(dlhs.config)
    self.assertTrue(drhs.name.endswith("+res"))
    self.assertEqual(fwd.flops, 2 * 512 * 256 * 384)
    self.assertEqual(dlhs.flops, 2 * 512 * 256 * 384)
    self.assertEqual(drhs.flops, 2 * 512 * 256 * 384)
    self.assertLen(left_out, 1)
    self.assertIn("f32", left_out[0])

  def test_tokamax_tiles_become_ours_fitted_to_the_call(self):
    sizes = (384, 0, 128, 0)
    entry = tokamax_compare.Entry(
        "fwd x",
        "fwd",
        (512, 256),
        (4, 256, 384),
        sizes,
        {"tile_m": 100, "tile_k": 4096, "tile_n": 128},
        1.0,
    )
    found = dict(tokamax_compare.raw_candidates(entry, "v5e"))
    # tile_m rounded up to 128; a tile_k past K is the whole K (None).
    self.assertEqual(found["tokamax"].bm, 128)
    self.assertIsNone(found["tokamax"].bk)
    self.assertEqual(found["tokamax"].bn, 128)
    labels = [
        label for label, _ in tokamax_compare.raw_candidates(entry, "v5e")
    ]
    self.assertEqual(labels[0], "table")
    self.assertEqual(len(labels), len(set(map(str, found.values()))))
    # The table's row with finer rows keeps its columns and K.
    table = found["table"]
    finer = found["rows256x128"]
    self.assertEqual((finer.bm, finer.chunk), (256, 128))
    self.assertEqual((finer.bk, finer.bn), (table.bk, table.bn))


class TraceSummaryTest(absltest.TestCase):

  def test_leaf_ops_per_step_by_kind_and_line(self):
    meta = lambda ph_name, pid, tid, name: {
        "ph": "M",
        "name": ph_name,
        "pid": pid,
        "tid": tid,
        "args": {"name": name},
    }
    op = lambda name, dur, source: {
        "ph": "X",
        "pid": 3,
        "tid": 3,
        "name": name,
        "dur": dur,
        "args": {"source": source},
    }
    events = [
        meta("process_name", 3, 0, "/device:TPU:0"),
        meta("process_name", 7, 0, "/host:CPU"),
        meta("thread_name", 3, 1, "Steps"),
        meta("thread_name", 3, 3, "XLA Ops"),
        {"ph": "X", "pid": 3, "tid": 1, "name": "0", "dur": 5000},
        {"ph": "X", "pid": 3, "tid": 1, "name": "1", "dur": 6000},
        op("while.3", 9000, "a.py:1"),  # Holds the others: not counted.
        op("gather_fusion.1", 3000, "/r/a.py:2"),
        op("gather_fusion.22", 1000, "/r/a.py:2"),
        op("dropless_tpu_gmm.4", 6000, "/r/b.py:9"),
        {"ph": "X", "pid": 7, "tid": 3, "name": "host", "dur": 99000},
    ]
    s = trace_summary.summarise(events, steps=2, repo="/r")
    self.assertEqual(s["device"], "/device:TPU:0")
    self.assertEqual(s["step_ms"], [5.0, 6.0])
    self.assertAlmostEqual(s["device_ms_per_step"], 5.0)
    top, second = s["groups"]
    self.assertEqual(
        (top["kind"], top["source"]), ("dropless_tpu_gmm", "b.py:9")
    )
    self.assertAlmostEqual(top["ms_per_step"], 3.0)
    self.assertEqual(
        (second["kind"], second["calls_per_step"]), ("gather_fusion", 1.0)
    )
    self.assertAlmostEqual(second["share"], 0.4)


class TimeOneTest(absltest.TestCase):

  def test_a_non_finite_output_is_an_error_of_its_row(self):
    x = jnp.ones((64, 128), jnp.bfloat16)
    finite = timing.time_one({}, jax.jit(lambda a: a * 2), (x,), 2, 1)
    self.assertTrue(finite["finite"])
    self.assertNotIn("error", finite)
    for bad in (jnp.nan, jnp.inf):
      poisoned = jax.jit(lambda a, v=bad: a.at[63, 127].set(v))
      row = timing.time_one({}, poisoned, (x,), 2, 1)
      self.assertFalse(row["finite"])
      self.assertEqual(row["error"], "non-finite output")


class CommitTest(absltest.TestCase):

  def test_no_commit_from_a_repository_around_the_tree(self):
    with tempfile.TemporaryDirectory() as repo:
      git = lambda *a: subprocess.run(
          ["git", "-C", repo, *a], check=True, capture_output=True
      )
      git("init", "-q")
      git(
          "-c",
          "user.name=t",
          "-c",
          "user.email=t@t",
          "commit",
          "-q",
          "--allow-empty",
          "-m",
          "x",
      )
      head = git("rev-parse", "HEAD").stdout.decode().strip()
      tree = os.path.join(repo, "copied_tree")
      os.mkdir(tree)
      env = {k: v for k, v in os.environ.items() if k != "DROPLESS_COMMIT"}
      with mock.patch.dict(os.environ, env, clear=True):
        with mock.patch.object(tpu_check, "_REPO", repo):
          self.assertEqual(tpu_check._git_commit(), head)
        with mock.patch.object(tpu_check, "_REPO", tree):
          self.assertIsNone(tpu_check._git_commit())
      with mock.patch.dict(os.environ, {"DROPLESS_COMMIT": "abc"}):
        with mock.patch.object(tpu_check, "_REPO", tree):
          self.assertEqual(tpu_check._git_commit(), "abc")


class ProgramsTest(absltest.TestCase):

  def test_every_program_sets_the_default_platforms(self):
    # Importing bench sets nothing (`train.platforms`): each program (a
    # module with a __main__ block, tests aside) calls
    # set_default_platforms at module level or in that block, before JAX
    # starts its backends.
    here = os.path.dirname(os.path.abspath(__file__))
    programs = []
    for path in sorted(glob.glob(os.path.join(here, "..", "*", "*.py"))):
      if path.endswith("_test.py"):
        continue
      with open(path) as f:
        tree = ast.parse(f.read())
      top = [
          n
          for n in tree.body
          if not isinstance(n, (ast.FunctionDef, ast.ClassDef))
      ]
      if not any(_is_main_block(n) for n in top):
        continue
      programs.append(os.path.basename(path))
      calls = {
          node.func.attr
          for stmt in top
          for node in ast.walk(stmt)
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
      }
      self.assertIn("set_default_platforms", calls, path)
    self.assertIn("tpu_check.py", programs)


def _is_main_block(node) -> bool:
  return (
      isinstance(node, ast.If)
      and isinstance(node.test, ast.Compare)
      and isinstance(node.test.left, ast.Name)
      and node.test.left.id == "__name__"
  )


if __name__ == "__main__":
  absltest.main()
