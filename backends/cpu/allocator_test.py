"""allocator: with the thresholds kept, a freed large buffer's pages serve
the next one of its size (no page faults); with glibc's defaults each one
is faulted in afresh. Each case runs in a process of its own: the setting
is process-wide and cannot be undone."""

import os
import subprocess
import sys

from unittest import mock

from absl.testing import absltest

from backends.cpu import allocator

# Allocates, writes and frees a 64 MiB buffer five times; prints the minor
# page faults of the last four and what keep_freed_memory returned.
_PROGRAM = """
import ctypes, resource
from backends.cpu import allocator
kept = allocator.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 64 << 20
faults = []
for _ in range(5):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  p = libc.malloc(size)
  ctypes.memset(p, 1, size)
  libc.free(p)
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept)
print(sum(faults[1:]) // 4)
"""


def _python(program, choice=None):
  """stdout of `program` in a fresh Python with the repository importable,
  glibc's malloc variables unset and DROPLESS_CPU_ALLOCATOR=`choice`."""
  env = dict(os.environ)
  env.pop(allocator.ENV, None)
  for name in (
      "MALLOC_ARENA_MAX",
      "MALLOC_MMAP_THRESHOLD_",
      "MALLOC_TRIM_THRESHOLD_",
      "LD_PRELOAD",
  ):
    env.pop(name, None)
  if choice is not None:
    env[allocator.ENV] = choice
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(
      filter(None, (root, env.get("PYTHONPATH")))
  )
  done = subprocess.run(
      [sys.executable, "-c", program],
      env=env,
      capture_output=True,
      text=True,
      check=False,
  )
  if done.returncode:
    raise AssertionError(done.stderr)
  return done.stdout


def _run(choice=None):
  """(what keep_freed_memory returned, faults per buffer after the first)."""
  kept, faults = _python(_PROGRAM, choice).split("\n")[:2]
  return kept, int(faults)


class KeepFreedMemoryTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if not hasattr(__import__("ctypes").CDLL(None), "gnu_get_libc_version"):
      self.skipTest("the thresholds are glibc's; this C library is not glibc")

  def test_a_freed_buffer_serves_the_next_without_faults(self):
    kept, faults = _run()
    self.assertEqual(kept, "kept")
    # 64 MiB is 16,384 pages of 4 KiB (32 of 2 MiB): none is faulted in
    # again once the first buffer's pages stay with the process.
    self.assertLess(faults, 8)

  def test_glibcs_defaults_fault_every_buffer_in(self):
    # The control: the same program where the setting is refused.
    kept, faults = _run("system")
    self.assertStartsWith(kept, "system: ")
    self.assertGreaterEqual(faults, 32)

  def test_state_says_what_was_done_without_doing_it(self):
    program = (
        "from backends.cpu import allocator; print(allocator.state()); "
        "allocator.keep_freed_memory(); print(allocator.state())"
    )
    before, after = _python(program).splitlines()
    self.assertStartsWith(before, "not asked")
    self.assertEqual(after, "kept")

  def test_an_unknown_choice_names_the_variable(self):
    env = {allocator.ENV: "tcmalloc"}
    with mock.patch.dict(os.environ, env):
      with self.assertRaisesRegex(
          ValueError, r"DROPLESS_CPU_ALLOCATOR must be one of .*'tcmalloc'"
      ):
        allocator.choice()


if __name__ == "__main__":
  absltest.main()
