"""The list of conformance suites, and concrete test classes per backend."""

from __future__ import annotations

from conformance import ep_suite
from conformance import grouped_gemm_suite
from conformance import layer_suite
from conformance import routing_suite
from conformance import stages_suite
from conformance import validation_suite

# Every suite a backend must pass. Adding one is one line here; a suite that
# needs a special environment (8 simulated devices, several processes) lives
# in its own file and Bazel target instead.
SUITES = [
    grouped_gemm_suite.GroupedGemmSuite,
    stages_suite.StagesSuite,
    layer_suite.LayerSuite,
    routing_suite.RoutingSuite,
    validation_suite.ValidationSuite,
]

# Suites that need 8 devices (--xla_force_host_platform_device_count=8 on
# CPU, set before jax is imported): each backend's `<name>_ep` Bazel target.
EP_SUITES = [
    ep_suite.ExpertParallelSuite,
]


def _camel(name: str) -> str:
  return "".join(
      part[:1].upper() + part[1:] for part in name.replace("-", "_").split("_")
  )


def make_test_classes(
    backend: str,
    options: dict | None = None,
    tolerance_overrides: dict | None = None,
    *,
    suites=None,
    name_suffix: str = "",
) -> dict[str, type]:
  """One concrete TestCase class per suite, for `backend`.

  Building a class imports nothing of the backend: a backend whose module or
  hardware is missing yields classes whose tests skip, with the reason.

  Args:
    backend: a registered backend name.
    options: keyword arguments for moe_core.get_backend (BACKEND_OPTIONS).
    tolerance_overrides: the backend's TOLERANCE_OVERRIDES (see
      `tolerances.lookup`).
    suites: the suite classes; `SUITES` by default.
    name_suffix: appended to each class name, to tell apart several
      configurations of one backend in one module.

  Returns:
    {class name: class}, e.g. {"XlaGroupedGemmTest": ...}.
  """
  classes = {}
  for suite_cls in SUITES if suites is None else suites:
    stem = suite_cls.__name__.removesuffix("Suite")
    name = f"{_camel(backend)}{stem}Test{name_suffix}"
    classes[name] = type(
        name,
        (suite_cls,),
        {
            "BACKEND": backend,
            "BACKEND_OPTIONS": dict(options or {}),
            "TOLERANCE_OVERRIDES": dict(tolerance_overrides or {}),
            "__module__": suite_cls.__module__,
            "__qualname__": name,
        },
    )
  return classes
