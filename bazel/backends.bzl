"""Macros for the targets every backend folder (backends/<name>/) declares.

A backend folder holds one library, the backend's module and whatever it
imports, and runs the shared conformance suite against it
(moe_conformance_test, bazel/moe.bzl). These macros declare those targets
from a few arguments (moe_backend), so that each backends/<name>/BUILD
states only what is particular to its backend: its extra dependencies, its
suite's options, and its own tests (plain moe_py_test targets).
"""

load(":moe.bzl", "moe_conformance_test", "moe_py_library")

# What every backend library imports: the `backends` package and the
# moe_core API it implements.
BACKEND_DEPS = [
    "//backends",
    "//moe_core",
]

def moe_backend(name, srcs = None, deps = [], data = [], suite = {}):
    """A backend: its library and the shared conformance suite run on it.

    Declares
      <name>                  the library: the backend's modules, importable
                              as backends.<name>; the registry
                              (moe_core/registry.py) imports it by name at
                              run time and //backends:all lists the target;
      conformance_test,       moe_conformance_test's targets (bazel/moe.bzl)
      conformance_test_ep,    on the folder's conformance_test.py, which
      conformance_test_all    depends on the library.

    Args:
      name: the backend's name, which is also its folder's.
      srcs: the library's .py files; by default every .py file of the folder
        but the tests (`*_test.py`).
      deps: libraries it imports beyond BACKEND_DEPS (another backend whose
        kernels it reuses, say). The deps are BACKEND_DEPS and these, sorted.
      data: files the library reads at run time.
      suite: moe_conformance_test's options for the suite (shard_count,
        tags, oldest_leg, oldest_leg_ep, ep, ...), e.g.
        `dict(ep = False)`, or gpu_only_suite().
    """
    if srcs == None:
        srcs = native.glob(["*.py"], exclude = ["*_test.py"])
    moe_py_library(
        name = name,
        srcs = srcs,
        deps = sorted(BACKEND_DEPS + deps),
        data = data,
    )
    moe_conformance_test(
        srcs = ["conformance_test.py"],
        deps = [":" + name],
        **suite
    )

def gpu_only_suite(tags = []):
    """moe_backend's `suite` for a backend that runs on NVIDIA GPUs only.

    Off such a GPU every test skips with the backend's reason, so the
    targets are one shard each (a shard off a GPU is only a process that
    skips: CI's time), declare the whole skip (tag `skips-without-gpu`, read
    by tools/whole_skips.py), and are left to the newest leg: the oldest
    leaves them out.

    Args:
      tags: further `skips-without-<what>` tags (what else the backend needs).
    """
    return dict(
        shard_count = 1,
        tags = ["skips-without-gpu"] + tags,
        oldest_leg = False,
        oldest_leg_ep = False,
    )
