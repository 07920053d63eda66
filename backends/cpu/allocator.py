"""Keeps freed memory in the process for the next call's buffers (glibc).

XLA:CPU takes every call's output buffers from malloc. glibc serves a
request above its mmap threshold (adaptive, at most 32 MiB) with a fresh
mapping and unmaps it on free, and trims freed memory at the top of the
heap above 128 KiB: so a buffer the size of last step's arrives as pages
the OS has never handed out, and the kernel writing it first faults in and
zero-fills each of them. The grouped GEMM's weight gradient is such a
buffer every step ([E, D, F]: 128 MiB at E=64, D=512, F=1024 in float32,
where the dense product's is 2 MiB), and on the hosts measured the page
clearing took as long as the dW kernel's arithmetic (docs/cpu.md).

`keep_freed_memory()` raises both thresholds to their maximum (2 GiB) and
keeps every thread on the main heap (one arena: glibc's other arenas grow
in 64 MiB heaps and map anything larger afresh), so that large buffers
come from the heap and freed ones stay there for the next step's buffers
of the same sizes: a training loop's resident memory then stays at its
high-water mark between steps instead of going back to the OS. It must run
before JAX starts its CPU client (the first computation): threads started
before it keep the arenas they have. The programs do it at start-up
(`train.platforms.set_default_platforms`, on the CPU); a program of your
own calls it first thing, or sets MALLOC_ARENA_MAX=1,
MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ in its environment, or
preloads tcmalloc or jemalloc. DROPLESS_CPU_ALLOCATOR=system keeps glibc's
defaults.
"""

from __future__ import annotations

import ctypes
import functools
import os

ENV = "DROPLESS_CPU_ALLOCATOR"
CHOICES = ("keep", "system")

# mallopt's parameters (glibc's malloc.h) and the largest value it takes
# (an int).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_LARGEST = 2**31 - 1


def choice() -> str:
  """$DROPLESS_CPU_ALLOCATOR: "keep" (the default) or "system"."""
  value = os.environ.get(ENV, "keep")
  if value not in CHOICES:
    raise ValueError(
        f"{ENV} must be one of {CHOICES} (unset: keep), got {value!r}."
    )
  return value


def state() -> str:
  """What `keep_freed_memory` did in this process, or that nothing asked
  (for records: a benchmark's JSON says which allocator its times had)."""
  if keep_freed_memory.cache_info().currsize:
    return keep_freed_memory()
  return "not asked: the C library's thresholds stand"


@functools.cache
def keep_freed_memory() -> str:
  """Sets glibc's mmap and trim thresholds to 2 GiB and one arena, once.

  Returns:
    What holds now: "kept", or why not ("system: ...", "not glibc: ...").

  Raises:
    ValueError: $DROPLESS_CPU_ALLOCATOR is neither "keep" nor "system".
  """
  if choice() == "system":
    return f"system: {ENV}=system keeps the C library's thresholds"
  process = ctypes.CDLL(None)
  if not hasattr(process, "gnu_get_libc_version"):
    return "not glibc: the C library's own thresholds stand"
  mallopt = process.mallopt
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  for parameter, value in (
      (_M_MMAP_THRESHOLD, _LARGEST),
      (_M_TRIM_THRESHOLD, _LARGEST),
      (_M_ARENA_MAX, 1),
  ):
    if not mallopt(parameter, value):
      return f"not kept: glibc refused mallopt({parameter}, {value})"
  return "kept"
