"""bench/gpu_check on the CPU: its --dry_run, --lower_only, and its tables.

The GPU session runs gpu_check once, so this is its rehearsal: one dry run
(kernels interpreted, tiny shapes) of a few programs and a variant that
cannot be built, which must be recorded while the rest still compiles,
passes the conformance tests it is given and is timed; the JSON is checked.
Then what needs no compile: the program table follows the registry, the
GPU-only conformance cases cover the tiles the timing runs, the ratios and
goals, and the carried jax-triton wheel.

The triton variants' dry run (TritonDryRunTest) interprets their kernels in
Triton's interpreter, which needs torch: the leg that has it runs that class
alone (//bench/on_device:gpu_check_triton_test);
//bench/on_device:gpu_check_test runs the rest.
"""

import contextlib
import glob
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from unittest import mock
import zipfile

from absl.testing import absltest
import jax
import jax.numpy as jnp

import moe_core
from backends.mosaic_gpu import tiling as mosaic_tiling
from backends.pallas import tiling
from backends.triton import configs as triton_configs
from bench.harness import json_report
from bench.harness import timing
from bench.on_device import gpu_check
from bench.on_device import gpu_conformance
from bench.on_device import gpu_timing
from bench.workloads import programs
from conformance import cases
from moe_core import registry


def _has_plugin() -> bool:
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
  except ModuleNotFoundError:  # No jax_plugins package at all.
    return False


_HAS_PLUGIN = _has_plugin()
# The triton variants, each with its kernels interpreted: the default
# (forward and backward), the unfused activation and the fused routing
# weights, and a grouped GEMM with its dense baseline.
_TRITON_PROGRAMS = (
    "mixtral_8x7b/triton/fwd_bwd",
    "mixtral_8x7b/triton_unfused_act/fwd",
    "mixtral_8x7b/triton_fused_routing/fwd",
    "deepseek_v3_gemm/triton/fwd",
)
# A variant that cannot be built (tiles must be powers of two): its
# programs must fail, recorded, while the others run.
_BROKEN = programs.Variant(
    "pallas_broken", "pallas", (("tiles", {"bm": 7}),), kinds=("gemm",)
)


def _dry_run(test, program_list: str, conformance_variants: str):
  """(exit code, the JSON report) of `gpu_check --dry_run` over
  `program_list` (comma-separated), one compile worker and one conformance
  test of `conformance_variants`, into a temporary folder."""
  out_dir = tempfile.mkdtemp()
  test.addCleanup(shutil.rmtree, out_dir, ignore_errors=True)
  code = gpu_check.main(
      [
          "--dry_run",
          f"--out_dir={out_dir}",
          f"--programs={program_list}",
          "--compile_workers=1",
          f"--conformance_variants={conformance_variants}",
          "--conformance_filter=test_forward_matches_numpy_and_reference"
          "_bf16_full",
      ]
  )
  (path,) = glob.glob(os.path.join(out_dir, "gpu_dryrun_*.json"))
  with open(path) as fh:
    return code, json.load(fh)


class DryRunTest(absltest.TestCase):

  def test_dry_run_records_everything_and_a_failure(self):
    if not _HAS_PLUGIN:
      self.skipTest("the deviceless compile needs jax's CUDA plugin")
    with mock.patch.object(
        programs, "OPTION_VARIANTS", programs.OPTION_VARIANTS + (_BROKEN,)
    ):
      code, report = _dry_run(
          self,
          "mixtral_8x7b/xla/fwd_bwd,deepseek_v3_gemm/pallas/fwd,"
          "deepseek_v3_gemm/pallas_broken/fwd",
          conformance_variants="xla",
      )
    self.assertEqual(code, 1)
    self.assertEqual(report["jax"], jax.__version__)
    self.assertEqual(report["target"], "h200")
    compiled = {e["program"]: e for e in report["compile"]}
    self.assertLen(compiled, 3)
    for name in ("mixtral_8x7b/xla/fwd_bwd", "deepseek_v3_gemm/pallas/fwd"):
      entry = compiled[name]
      self.assertGreater(entry["device"]["peak_bytes"], 0, name)
      self.assertEqual(entry["deviceless"]["status"], "ok", name)
      self.assertEqual(entry["deviceless"]["target"], "h200", name)
      self.assertGreater(entry["peak_ratio"], 0, name)
    # The Pallas Triton kernel in the deviceless compile, for the H200.
    gemm = compiled["deepseek_v3_gemm/pallas/fwd"]["deviceless"]
    self.assertIn(programs.TRITON_CALL, gemm["custom_calls"])
    broken = compiled["deepseek_v3_gemm/pallas_broken/fwd"]
    self.assertIn("power of two", broken["device"]["error"])
    # Unknown to the deviceless child (this process patched the table).
    self.assertIn("error", broken["deviceless"])
    (conformance,) = report["conformance"]
    self.assertEqual(conformance["variant"], "xla")
    self.assertEqual(conformance["status"], "passed", conformance)
    self.assertEqual(conformance["ran"], 1)
    timed = {r["program"]: r for r in report["timing"]}
    self.assertEqual(
        sorted(timed),
        [
            "deepseek_v3_gemm/dense/fwd",
            "deepseek_v3_gemm/pallas/fwd",
            "mixtral_8x7b/xla/fwd_bwd",
        ],
    )
    for row in timed.values():
      self.assertGreater(row["seconds"], 0, row)
      self.assertTrue(row["finite"], row)
    self.assertGreater(
        timed["deepseek_v3_gemm/pallas/fwd"]["fwd_time_over_dense"], 0
    )
    self.assertEqual(
        [f.split(":")[0] for f in report["failures"]],
        [
            "compile here deepseek_v3_gemm/pallas_broken/fwd",
            "compile deviceless deepseek_v3_gemm/pallas_broken/fwd",
        ],
    )

  def test_lower_exports_every_layer_program_with_its_kernels(self):
    """DeepSeek-V3's layer on every variant, at its full D and F: the other
    models' layers are the same programs at other sizes."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      code = gpu_check.main(["--lower_only", "--programs=deepseek_v3/*/*"])
    log = out.getvalue()
    self.assertEqual(code, 0, log)
    lowered = re.search(
        r"lowered (\d+) of (\d+) one-GPU programs for CUDA, plus (\d+) "
        r"named exceptions",
        log,
    )
    table = programs.select("deepseek_v3/*/*")
    self.assertIsNotNone(lowered, log)
    ok, tried, skipped = (int(n) for n in lowered.groups())
    self.assertEqual((ok, tried + skipped), (tried, len(table)), log)
    # mosaic_gpu's forward is Mosaic GPU; its backward's dW Pallas Triton.
    self.assertRegex(
        log,
        r"ok   deepseek_v3/mosaic_gpu/fwd_bwd: __gpu\$xla.gpu.triton, "
        r"mosaic_gpu_v2\n",
    )
    self.assertRegex(log, r"ok   deepseek_v3/xla/fwd: no custom calls\n")


class TritonDryRunTest(absltest.TestCase):

  def test_dry_run_interprets_the_triton_variants(self):
    triton = {v.name: v for v in programs.variants()}["triton"]
    ok, why = triton.build(interpret=True).availability()
    if not ok:
      self.skipTest(why)
    code, report = _dry_run(
        self, ",".join(_TRITON_PROGRAMS), conformance_variants="triton"
    )
    self.assertEqual((code, report["failures"]), (0, []))
    selected = programs.select(",".join(_TRITON_PROGRAMS))
    self.assertCountEqual(report["programs"], _TRITON_PROGRAMS)
    self.assertLen(report["compile"], len(selected))
    for program, entry in zip(selected, report["compile"]):
      name = program.name
      self.assertEqual(entry["program"], name)
      self.assertGreater(entry["device"]["peak_bytes"], 0, name)
      # Deviceless, through jax-triton where it is installed; else the
      # named exception, with its reason.
      deviceless = entry["deviceless"]
      reason = programs.exception("h200", program)
      if reason is None:
        self.assertEqual(deviceless["status"], "ok", name)
        self.assertIn(
            programs.JAX_TRITON_CALL, str(deviceless["custom_calls"]), name
        )
      else:
        self.assertEqual(
            (deviceless["status"], deviceless["reason"]),
            ("exception", reason),
            name,
        )
    (conformance,) = report["conformance"]
    self.assertEqual(
        (conformance["variant"], conformance["status"], conformance["ran"]),
        ("triton", "passed", 1),
        conformance,
    )
    timed = {r["program"]: r for r in report["timing"]}
    self.assertEqual(
        sorted(timed),
        sorted(_TRITON_PROGRAMS + ("deepseek_v3_gemm/dense/fwd",)),
    )
    for row in timed.values():
      self.assertGreater(row["seconds"], 0, row)
      self.assertTrue(row["finite"], row)
    self.assertIn(
        "triton fwd time / dense: >= 0.6x dense cuBLAS",
        [g["goal"] for g in report["goals"]],
    )


class TableTest(absltest.TestCase):

  def test_a_registered_backend_gets_programs_with_no_bench_edit(self):
    class NewBackend(moe_core.Backend):
      name = "new_gpu_backend"

      def _grouped_gemm(self, gemm):
        raise NotImplementedError

    self.enter_context(mock.patch.dict(registry._REGISTRY))
    self.enter_context(
        mock.patch.dict(
            registry.AUTO_ORDER,
            {"gpu": ("new_gpu_backend",) + registry.AUTO_ORDER["gpu"]},
        )
    )
    moe_core.register_backend("new_gpu_backend", NewBackend)
    names = {p.name for p in programs.programs()}
    for workload in programs.WORKLOADS:
      if not workload.variants:
        for mode in programs.MODES:
          self.assertIn(f"{workload.name}/new_gpu_backend/{mode}", names)

  def test_every_gpu_backend_and_option_has_programs(self):
    table = programs.programs()
    variants = {p.variant.name for p in table}
    self.assertContainsSubset(
        {"pallas", "mosaic_gpu", "triton", "te", "xla", "pallas_fp8_block"},
        variants,
    )
    self.assertContainsSubset(
        {v.name for v in programs.OPTION_VARIANTS}, variants
    )
    self.assertNotIn("reference", {p.variant.backend for p in table})
    self.assertContainsSubset(programs.gpu_backends(), programs.KERNELS)
    # te is excepted (not on the legs), and triton where jax-triton is
    # missing (the oldest leg).
    excepted = {"te"}
    if importlib.util.find_spec("jax_triton") is None:
      excepted.add("triton")
    for program in table:
      reason = programs.exception("h100", program)
      self.assertEqual(
          reason is None,
          program.variant.backend not in excepted,
          program.name,
      )

  def test_fused_activation_variants(self):
    """Which programs fuse the activation: the *_fused_act ones and every
    triton one but triton_unfused_act (as when triton fused by default),
    whatever the backends' own default (off)."""
    kernel_backends = ("pallas", "mosaic_gpu", "triton")
    fused = {
        v.name
        for v in programs.variants()
        if v.backend in kernel_backends and v.build().fuse_activation
    }
    triton = {v.name for v in programs.variants() if v.backend == "triton"}
    self.assertEqual(
        fused,
        {"pallas_fused_act", "mosaic_gpu_fused_act"}
        | (triton - {"triton_unfused_act"}),
    )
    for name in kernel_backends:
      self.assertFalse(
          moe_core.get_backend(name).fuse_activation, f"{name}'s default"
      )

  def test_gpu_cases_cover_the_timed_tiles(self):
    """Each forward tile a timed program picks on a GPU is some GPU-only
    conformance case's: pallas', mosaic_gpu's and triton's, plain (GEMM
    cases) and with two operands (the gate/up pass, the layer case)."""

    def pallas(m, c, n, e, operands=1):
      return tiling.heuristic(
          "fwd",
          m,
          c,
          n,
          e,
          jnp.bfloat16,
          interpret=False,
          num_operands=operands,
      )

    def mosaic(m, c, n, e, operands=1):
      del c, n  # Its table goes by rows per group.
      return mosaic_tiling.choose(
          mosaic_tiling.TileConfig(),
          "fwd",
          m,
          e,
          jnp.bfloat16,
          num_rhs=operands,
          num_accs=operands,
          num_outputs=operands,
      )

    def triton(m, c, n, e, operands=1):
      # Two operands: its fused gate/up kernel ("gated"), sm_90's table.
      kind = "gated" if operands == 2 else "fwd"
      return triton_configs.choose(None, "sm90", kind, m, c, n, e, jnp.bfloat16)

    for choose in (pallas, mosaic, triton):
      checked = {
          choose(c.m, c.k, c.n, c.num_groups) for c in cases.GPU_GEMM_CASES
      }
      for layer in cases.GPU_LAYER_CASES:
        cfg = layer.cfg
        m = layer.num_tokens * cfg.top_k
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size
        checked |= {choose(m, d, f, e, 2), choose(m, f, d, e)}
      for w in programs.WORKLOADS:
        s = w.full
        if w.kind == "gemm":
          e = 256
          wanted = {choose(s.tokens, s.hidden, s.ffn, e)}
        elif w.kind == "layer":
          cfg = w.config("full")
          m, e = s.tokens * cfg.top_k, cfg.num_experts
          wanted = {
              choose(m, s.hidden, s.ffn, e, 2),
              choose(m, s.ffn, s.hidden, e),
          }
        else:
          continue
        self.assertContainsSubset(
            wanted, checked, f"{choose.__name__} {w.name}"
        )

  def test_ratios_and_goals_read_the_rows(self):
    rows = [
        {"workload": "small_k", "variant": v, "mode": "fwd", "seconds": s}
        for v, s in (("pallas", 2.0), ("mosaic_gpu", 1.0), ("dense", 1.0))
    ] + [{"workload": "small_k", "variant": "xla", "mode": "fwd", "error": "x"}]
    timing.add_ratios(rows, gpu_timing.BASELINES)
    self.assertEqual(rows[1]["fwd_time_over_pallas"], 0.5)
    self.assertEqual(rows[1]["fwd_time_over_dense"], 1.0)
    self.assertIsNone(rows[1]["fwd_time_over_xla"])
    (goal,) = timing.goals(rows, gpu_timing.GOALS, "NVIDIA H200")
    self.assertEqual((goal["value"], goal["met"]), (0.5, True))


def _fake_wheel(directory, body):
  """A pure-Python wheel of "jax_triton" 9.9.9 whose __init__ is `body`."""
  path = os.path.join(directory, "jax_triton-9.9.9-py3-none-any.whl")
  with zipfile.ZipFile(path, "w") as wheel:
    wheel.writestr("jax_triton/__init__.py", body)
    wheel.writestr(
        "jax_triton-9.9.9.dist-info/METADATA",
        "Metadata-Version: 2.1\nName: jax-triton\nVersion: 9.9.9\n",
    )
  return path


class ReportTest(absltest.TestCase):

  def test_versions_are_recorded(self):
    versions = json_report.versions()
    self.assertEqual(versions["python"], platform.python_version())
    self.assertEqual(versions["jax"], jax.__version__)
    self.assertContainsSubset({"triton", "jax_triton_from"}, versions)

  def test_conformance_summaries_are_parsed(self):
    self.assertEqual(
        gpu_conformance.parse_summary(
            "...\nRan 445 tests in 81.250s\n\nOK (skipped=12)\n"
        ),
        {"ran": 445, "failures": 0, "errors": 0, "skipped": 12},
    )
    self.assertIsNone(gpu_conformance.parse_summary("Segfault")["ran"])
    skipped = gpu_conformance.run_suites(
        [programs.Variant("te", "te")], 10, available=lambda v: (False, "no TE")
    )
    self.assertEqual(
        skipped, [{"variant": "te", "status": "skipped", "reason": "no TE"}]
    )

  def _hide_installed_jax_triton(self):
    """`import jax_triton` fails, as on the GPU machine, until cleanup."""
    self.enter_context(mock.patch.object(sys, "path", list(sys.path)))
    self.enter_context(mock.patch.dict(sys.modules))
    for name in [n for n in sys.modules if n.split(".")[0] == "jax_triton"]:
      del sys.modules[name]
    sys.modules["jax_triton"] = None

  def test_carried_wheel_is_imported_from_its_zip(self):
    self._hide_installed_jax_triton()
    wheels = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, wheels, ignore_errors=True)
    wheel = _fake_wheel(wheels, "__version__ = '9.9.9'\n")
    where = json_report.provide_jax_triton(wheels)
    self.assertTrue(where.startswith(f"carried: {wheel} (installed: "), where)
    self.assertEqual(sys.modules["jax_triton"].__version__, "9.9.9")
    self.assertEqual(json_report.versions()["jax_triton"], "9.9.9")

  def test_a_carried_wheel_that_fails_leaves_sys_path_as_it_was(self):
    self._hide_installed_jax_triton()
    before = list(sys.path)
    wheels = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, wheels, ignore_errors=True)
    _fake_wheel(wheels, "raise ImportError('needs the CUDA plugin')\n")
    where = json_report.provide_jax_triton(wheels)
    self.assertIn("ImportError: needs the CUDA plugin", where)
    self.assertEqual(sys.path, before)
    self.assertNotIn("jax_triton", sys.modules)


if __name__ == "__main__":
  absltest.main()
