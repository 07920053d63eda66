"""Bazel macros for dropless: Python libraries, tests and backend conformance.

Every macro wraps a built-in Python rule of Bazel 4.2.3 (no rules_python).
Third-party packages (jax, absl, numpy, ...) are not Bazel targets: they come
from the interpreter of the registered toolchain (bazel/python_toolchain.bzl),
normally the project's .venv.
"""

# Tags that keep a target out of CPU runs (.bazelrc filters them).
_DEVICE_TAGS = {
    "cpu": [],
    "gpu": ["requires-gpu"],
    "tpu": ["requires-tpu"],
}

# The tags of a test that compares with Hugging Face transformers: it needs
# torch and transformers, which only the py311-jax0.10 leg installs (a
# `matrix` leg); elsewhere every test skips with the reason, which the
# `skips-without-*` tags declare to tools/whole_skips.py.
TRANSFORMERS_TEST_TAGS = [
    "matrix",
    "skips-without-torch",
    "skips-without-transformers",
]

def _workspace_root_import():
    """The `imports` entry that puts the workspace root on sys.path."""
    package = native.package_name()
    if not package:
        return "."
    return "/".join([".."] * len(package.split("/")))

def moe_py_library(
        name,
        srcs = None,
        deps = [],
        data = [],
        visibility = ["//visibility:public"]):
    """A py_library importable by its path from the workspace root.

    `import moe_core`, `from backends.xla import backend`,
    `from conformance import cases`, `import train...` then work from any test
    or binary that depends on the library.

    Args:
      name: target name; by convention the module or package name.
      srcs: the library's .py files; by default the one module
        `<name>.py`, so that a one-module library is `moe_py_library(name =
        "data")`.
      deps: other moe_py_library targets it imports. Third-party packages
        come from the toolchain's interpreter and are not listed.
      data: files read at run time.
      visibility: Bazel visibility; public by default.
    """
    native.py_library(
        name = name,
        srcs = [name + ".py"] if srcs == None else srcs,
        deps = deps,
        data = data,
        imports = [_workspace_root_import()],
        srcs_version = "PY3",
        visibility = visibility,
    )

# XLA flags every CPU test gets (moe_py_test's quick_cpu_compile): LLVM at
# -O0 without its expensive passes. The tests compile thousands of small
# programs and run each a few times, so compiling dominates; these make the
# xla conformance suite about a fifth faster on 2 cores (202 s against 165 s
# for the same 71 tests, 2026-12-06). The programs compute the same
# operations; vectorised reductions may round in another order, which every
# test's tolerance already allows for (the order differs between machines
# too).
QUICK_CPU_XLA_FLAGS = [
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
]

def moe_py_test(
        name,
        srcs = None,
        deps = [],
        data = [],
        size = "medium",
        shard_count = None,
        args = [],
        env = {},
        tags = [],
        devices = None,
        main = None,
        timeout = None,
        flaky = False,
        quick_cpu_compile = True):
    """A py_test that runs JAX on the CPU unless it is tagged requires-gpu.

    The environment is set by Bazel before Python starts, hence before JAX is
    imported: `JAX_PLATFORMS=cpu` (omitted for tests tagged `requires-gpu`)
    and, for `devices = N`, `XLA_FLAGS=--xla_force_host_platform_device_count=N`
    so that N CPU devices exist for sharding tests.

    Args:
      name: target name; `<name>.py` is the main file unless `main` is given.
      srcs: the test's .py files; by default the main file alone (`main`,
        or `<name>.py`), so that most tests need neither.
      deps: moe_py_library targets it imports.
      data: files read at run time.
      size: Bazel test size ("small", "medium", "large", "enormous"); it sets
        the default timeout. JAX compiles slowly on two cores: heavy tests
        should be "large" or sharded.
      shard_count: number of shards (absltest honours Bazel's sharding).
      args: command-line arguments (Bazel splits them like a Bourne shell).
      env: extra environment variables. An `XLA_FLAGS` entry is appended to
        the one `devices` sets; any other entry overrides the defaults.
      tags: Bazel tags; `requires-gpu` / `requires-tpu` keep the test out of
        CPU runs (see .bazelrc) and drop `JAX_PLATFORMS=cpu`.
      devices: number of simulated CPU devices, or None for JAX's default.
      main: the main file, if not `<name>.py`.
      timeout: Bazel timeout ("short", ..., "eternal"); None follows `size`.
      flaky: let Bazel retry a failing run up to three times.
      quick_cpu_compile: add QUICK_CPU_XLA_FLAGS to a CPU test's XLA_FLAGS.
        False for a test whose subject is what a compiler makes (the GPU and
        TPU compile checks), so that it compiles as users do.
    """
    test_env = {}
    xla_flags = []
    if "requires-gpu" not in tags:
        test_env["JAX_PLATFORMS"] = "cpu"
        if quick_cpu_compile:
            xla_flags.extend(QUICK_CPU_XLA_FLAGS)
    if devices != None:
        if type(devices) != "int" or devices < 1:
            fail("moe_py_test %r: devices must be a positive int or None, " %
                 name + "got %r." % (devices,))
        xla_flags.append("--xla_force_host_platform_device_count=%d" % devices)
    if xla_flags:
        test_env["XLA_FLAGS"] = " ".join(xla_flags)
    for key, value in env.items():
        if key == "XLA_FLAGS" and key in test_env:
            test_env[key] = test_env[key] + " " + value
        else:
            test_env[key] = value

    optional = {}
    if shard_count != None:
        optional["shard_count"] = shard_count
    if main != None:
        optional["main"] = main
    if timeout != None:
        optional["timeout"] = timeout

    if srcs == None:
        srcs = [name + ".py" if main == None else main]

    native.py_test(
        name = name,
        srcs = srcs,
        deps = deps,
        data = data,
        size = size,
        args = args,
        env = test_env,
        tags = tags,
        flaky = flaky,
        imports = [_workspace_root_import()],
        python_version = "PY3",
        srcs_version = "PY3",
        **optional
    )

def moe_conformance_test(
        name = "conformance_test",
        srcs = None,
        main = None,
        deps = [],
        data = [],
        shard_count = 4,
        size = "large",
        tags = [],
        device = "cpu",
        oldest_leg = True,
        oldest_leg_ep = True,
        ep = True,
        quick_cpu_compile = True):
    """Runs the shared conformance suite against one backend.

    One BUILD line per backend folder, e.g.

        moe_conformance_test(srcs = ["conformance_test.py"], deps = [":xla"])

    (the backends under backends/ declare it through moe_backend,
    bazel/backends.bzl, with their library).

    The file names the backend and its options in Python: it subclasses
    `suite.ConformanceTest` and `suite.ExpertParallelTest` and ends with
    `suite.main()` (see conformance/suite.py). Three targets come out:

      <name>      the single-device suites (suite.SUITES);
      <name>_ep   the expert-parallel suites (suite.EP_SUITES) on 8
                  simulated devices: the same file with CONFORMANCE_EP=1 in
                  its environment, which makes `suite.main()` run the
                  ExpertParallelTest classes;
      <name>_all  a test_suite of both (of <name> alone with ep = False).

    Args:
      name: target name.
      srcs: the test's .py files; one, its main, in the usual case.
      main: the main file, if srcs holds several.
      deps: the library that defines the backend's module (the registry
        imports it by name at run time), e.g. [":xla"]; the suite itself,
        //conformance, is added.
      data: files read at run time.
      shard_count: number of shards of each target; absltest splits the
        test methods across them.
      size: Bazel test size; "large" gives each shard 15 minutes.
      tags: extra Bazel tags. `matrix` and `conformance` are always added.
      device: "cpu", "gpu" (adds tag requires-gpu) or "tpu" (requires-tpu).
      oldest_leg: False tags <name> `not-on-oldest-leg`: the oldest JAX leg
        of .ci/run (`tools/test.sh --matrix=oldest`) leaves it to the newest
        leg. For a suite whose version-sensitive code another target already
        checks on the oldest leg (a second configuration of a backend, or
        kernels that have their own matrix tests).
      oldest_leg_ep: the same for <name>_ep.
      ep: False makes no <name>_ep: for a configuration whose EP suites
        cannot run anywhere (a target that only skips cannot fail), or
        whose EP path is another target's (a second configuration that
        changes only the GEMMs).
      quick_cpu_compile: moe_py_test's. False for a suite whose time goes
        into running an interpreter's loops rather than compiling (Mosaic
        GPU's interpreter: its suite took 385 s with the flags against 157 s
        without, in two fresh-clone runs on 2026-12-06).
    """
    if not srcs or type(srcs) != "list":
        fail("moe_conformance_test %r: srcs must list the test file, " % name +
             "e.g. [\"conformance_test.py\"], got %r." % (srcs,))
    if main == None:
        if len(srcs) != 1:
            fail("moe_conformance_test %r: name the main file of " % name +
                 "%r with main = ..." % (srcs,))
        main = srcs[0]
    if device not in _DEVICE_TAGS:
        fail("moe_conformance_test %r: device must be one of %s, got %r." %
             (name, sorted(_DEVICE_TAGS.keys()), device))

    # Every backend's suite runs on the legs that run the version matrix
    # (`tools/test.sh --matrix` selects the targets tagged `matrix`);
    # `conformance` lets a shorter leg leave the suites out.
    tags = tags + [t for t in ["matrix", "conformance"] if t not in tags]
    tags = tags + [t for t in _DEVICE_TAGS[device] if t not in tags]
    common = dict(
        srcs = srcs,
        main = main,
        deps = ["//conformance"] + deps,
        data = data,
        size = size,
        shard_count = shard_count,
        tags = tags,
        quick_cpu_compile = quick_cpu_compile,
    )

    oldest_leg_tag = ["not-on-oldest-leg"]
    moe_py_test(
        name = name,
        **dict(common, tags = tags + ([] if oldest_leg else oldest_leg_tag))
    )

    # Expert parallelism in a target of its own: the device count is fixed
    # when jax starts. The variable is conformance/suite.py's EP_ENV.
    if ep:
        moe_py_test(
            name = name + "_ep",
            devices = 8,
            env = {"CONFORMANCE_EP": "1"},
            **dict(common, tags = tags + ([] if oldest_leg_ep else oldest_leg_tag))
        )

    native.test_suite(
        name = name + "_all",
        tests = [":" + name] + ([":" + name + "_ep"] if ep else []),
        # A `manual` suite stays manual: a test_suite found by `//...`
        # would otherwise run the tests it lists, manual or not.
        tags = ["manual"] if "manual" in tags else [],
    )
