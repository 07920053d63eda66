"""moe_core.aot: targets as data, topologies, and compiles read back.

Compiles for GPUs and TPUs that are not here, through XLA's GPU compiler
(the CUDA plugin of the installed jax) and its TPU compiler (libtpu); on a
leg without one the compiling tests skip with that reason.
"""

from __future__ import annotations

import base64
import re
import shutil
import tempfile
import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from moe_core import aot
from moe_core.aot import results_cache
from moe_core import precision
from moe_core import registry

_HAS_PLUGIN = aot.cuda_plugin_installed()
_HAS_LIBTPU = aot.libtpu_installed()


def _field(text: str, name: str) -> str:
  match = re.search(rf"\b{name}:\s*([^\s}}]+)", text)
  assert match, name
  return match.group(1)


class TargetsTest(parameterized.TestCase):

  @parameterized.parameters(*aot.GPU_TARGETS)
  def test_config_agrees_with_the_target(self, name):
    t = aot.target(name)
    text = t.config_text()
    self.assertEqual(int(_field(text, "core_count")), t.num_cores)
    self.assertEqual(int(_field(text, "device_memory_size")), t.hbm_bytes)
    major = int(_field(text, "major"))
    self.assertEqual({9: "sm90", 10: "sm100"}[major], t.generation)
    self.assertIn(f'device_description_str: "{t.device_kind}"', text)
    self.assertLess(t.usable_bytes, t.hbm_bytes)

  def test_unknown_target_names_the_known_ones(self):
    with self.assertRaisesRegex(ValueError, r"one of \['b200', 'h100'"):
      aot.target("a100")

  @parameterized.parameters("1x2", "0x1x8", "1x128x8x1", "eight", 8)
  def test_bad_topology_spec_is_refused(self, spec):
    with self.assertRaisesRegex(ValueError, "topology must be 'SxHxG'"):
      aot.parse_topology(spec)

  def test_topology_spec(self):
    self.assertEqual(aot.parse_topology("1x128x8"), (1, 128, 8))

  def test_tpu_targets_beside_the_gpu_targets(self):
    self.assertEqual(set(aot.TPU_TARGETS), {"v5e", "v6e", "v5p", "tpu7x"})
    self.assertEqual(
        set(aot.TARGETS), set(aot.GPU_TARGETS) | set(aot.TPU_TARGETS)
    )
    for name, t in aot.TPU_TARGETS.items():
      self.assertTrue(aot.is_tpu(name))
      self.assertLess(t.usable_bytes, t.hbm_bytes, name)
      self.assertIn(t.vmem_bytes, (64 * 2**20, 128 * 2**20), name)
      self.assertLess(t.scoped_vmem_bytes, t.vmem_bytes, name)
      for example in t.topologies:
        target, _, spec = example.partition(":")
        self.assertEqual(target, name)
        aot.parse_tpu_topology(name, spec)
    self.assertFalse(aot.is_tpu("h100"))

  @parameterized.parameters(
      ("v5e", "2x2", 4),
      ("v5e", "2x4/2", 16),
      ("v5p", "4x4x4", 64),
      ("tpu7x", "2x2x1", 8),  # Two devices a chip.
      ("h100", "1x8x8", 64),
  )
  def test_device_counts(self, target, spec, count):
    self.assertEqual(aot.num_devices(target, spec), count)

  @parameterized.parameters(
      ("v5e", "2x2x1"), ("v5p", "2x2"), ("v6e", "2x2/0"), ("v5e", "two")
  )
  def test_bad_tpu_topology_is_refused(self, target, spec):
    with self.assertRaisesRegex(ValueError, f"topology for {target} must be"):
      aot.parse_tpu_topology(target, spec)

  def test_compile_refuses_arguments_of_the_wrong_kind(self):
    """Before any compile (no libtpu or CUDA plugin needed): each named,
    with what it takes and what it got (an AttributeError, or a dict's
    ValueError, before)."""
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    double = lambda a: a * 2
    for kwargs, pattern in (
        (dict(topology=123), r"^topology must be a Topology .*got 123\.$"),
        (
            dict(topology="v5e:1x1", xla_options="quick"),
            r"^xla_options must be None or a dict .*got 'quick'\.$",
        ),
        (
            dict(topology="v5e:1x1", mesh="data"),
            r"^mesh must be None or a jax.sharding.Mesh .*got 'data'\.$",
        ),
    ):
      with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
        with self.assertRaisesRegex(TypeError, pattern):
          aot.compile(double, x, **kwargs)

  def test_device_count_of_an_unknown_target_names_the_targets(self):
    with self.assertRaisesRegex(ValueError, r"^target must be one of .*'zz'"):
      aot.num_devices("zz", "1x1x1")

  def test_topology_names_need_a_target(self):
    with self.assertRaisesRegex(ValueError, "'<target>:<shape>'"):
      aot.named_topology("2x2")
    with self.assertRaisesRegex(ValueError, "GPU target must be one of"):
      aot.gpu_topology("v5e", "1x1x1")
    with self.assertRaisesRegex(ValueError, "TPU target must be one of"):
      aot.tpu_topology("h100", "2x2")

  def test_tpu_kernel_names_from_the_module_or_the_instruction(self):
    # The base64 bytecode's string table holds the kernel's symbol after
    # the func's attribute names; XLA's own kernels carry text modules.
    body = base64.b64encode(
        b"MLiR\x00sym_name\x00function_type\x00value\x00"
        b"dropless_tpu_gmm\x00tpu.dimension_semantics"
    ).decode()
    hlo = "\n".join(
        [
            "  %fusion.7 = bf16[8,128]{1,0} custom-call(%a), custom_call_target"
            '="tpu_custom_call", backend_config={"custom_call_config":{"body":'
            f'"{body}"}},"used_scoped_memory_configs":[{{"memory_space":"1",'
            '"offset":"0","size":"4096"}]}',
            "  ROOT %ragged-dot-none.3 = bf16[8,128]{1,0} custom-call(%b),"
            ' custom_call_target="tpu_custom_call", backend_config={"custom_'
            'call_config":{"body":"bW9kdWxlIHsK"}}',
            '  %c = f32[] custom-call(), custom_call_target="Sharding"',
        ]
    )
    self.assertEqual(
        aot.tpu_kernels(hlo), {"dropless_tpu_gmm": 1, "ragged-dot-none": 1}
    )


def _requires_plugin(test):
  if not _HAS_PLUGIN:
    test.skipTest(
        "compiling for GPUs needs jax's CUDA plugin (jax-cuda13-plugin, "
        "jax-cuda13-pjrt), which this leg does not install"
    )


class CompileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    _requires_plugin(self)

  def test_topology_models_hosts_and_meshes(self):
    topo = aot.gpu_topology("h100", "1x2x4")
    self.assertEqual(topo.num_devices, 8)
    self.assertEqual(
        [d.process_index for d in topo.devices], [0, 0, 0, 0, 1, 1, 1, 1]
    )
    self.assertEqual(topo.devices[0].device_kind, "NVIDIA H100 80GB HBM3")
    mesh = topo.mesh({"data": -1, "expert": 4})
    self.assertEqual(dict(mesh.shape), {"data": 2, "expert": 4})
    with self.assertRaisesRegex(ValueError, "multiply to 6, but the topo"):
      topo.mesh({"data": 2, "expert": 3})

  @parameterized.parameters("h100", "b200")
  def test_compile_reports_memory_flops_and_fit(self, target):
    topo = aot.gpu_topology(target, "1x1x1")
    n = 2048
    device = jax.sharding.SingleDeviceSharding(topo.devices[0])
    x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=device)
    # The sort: a B200 target's CUB rewrite fails without a GPU unless
    # compile turns it off (DEVICELESS_OPTIONS).
    program = aot.compile(
        lambda a: jnp.sort(a @ a, axis=-1), x, topology=topo, name="mm"
    )
    self.assertEqual(program.argument_bytes, n * n * 2)
    self.assertEqual(program.output_bytes, n * n * 2)
    self.assertGreaterEqual(program.peak_bytes, 2 * n * n * 2)
    self.assertTrue(program.fits)
    self.assertGreaterEqual(program.flops, 2 * n**3)
    record = program.to_json()
    self.assertEqual(record["target"], target)
    self.assertEqual(record["peak_bytes"], program.peak_bytes)

  def test_over_budget_program_does_not_fit(self):
    topo = aot.gpu_topology("h100", "1x1x1")
    device = jax.sharding.SingleDeviceSharding(topo.devices[0])
    # 96 GiB of float32 arguments on an 80 GB part.
    x = jax.ShapeDtypeStruct((6, 2**32), jnp.float32, sharding=device)
    program = aot.compile(lambda a: a * 2, x, topology=topo)
    self.assertFalse(program.fits)

  def test_collective_bytes_of_an_all_to_all(self):
    topo = aot.gpu_topology("h100", "1x1x8")
    mesh = topo.mesh({"x": 8})
    spec = jax.sharding.PartitionSpec
    sharding = jax.sharding.NamedSharding(mesh, spec("x"))

    def exchange(a):
      return jax.shard_map(
          lambda b: jax.lax.all_to_all(b, "x", 0, 0, tiled=True),
          mesh=mesh,
          in_specs=spec("x"),
          out_specs=spec("x"),
      )(a)

    x = jax.ShapeDtypeStruct((8 * 64, 256), jnp.float32, sharding=sharding)
    program = aot.compile(exchange, x, topology=topo, mesh=mesh)
    # Each device sends its [64, 256] float32 block once.
    self.assertEqual(program.collective_bytes.get("all-to-all"), 64 * 256 * 4)

  def test_quick_options_reach_the_compiler(self):
    """Under QUICK_OPTIONS XLA's own GEMM is a cuBLAS call, not a Triton
    GEMM fusion, and the memory figures are still read."""
    topo = aot.gpu_topology("h100", "1x1x1")
    device = jax.sharding.SingleDeviceSharding(topo.devices[0])
    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=device)
    default = aot.compile(lambda a: a @ a, x, topology=topo)
    quick = aot.compile(
        lambda a: a @ a, x, topology=topo, xla_options=aot.QUICK_OPTIONS
    )
    text = quick.hlo_text
    triton_gemm = '"kind":"__triton'  # __triton_gemm, __triton_nested_gemm...
    self.assertIn(triton_gemm, default.hlo_text)
    self.assertNotIn(triton_gemm, text)
    self.assertTrue(any("cublas" in c for c in quick.custom_calls), text)
    self.assertEqual(quick.output_bytes, default.output_bytes)
    self.assertGreaterEqual(quick.peak_bytes, 2 * 512 * 512 * 2)


def _requires_libtpu(test):
  if not _HAS_LIBTPU:
    test.skipTest(
        "compiling for TPUs needs libtpu (jax's `tpu` extra), which this "
        "leg does not install"
    )


def _doubling_kernel(block_rows: int, name: str = "dropless_tpu_probe"):
  """x -> 2x by a Pallas TPU kernel over [block_rows, 128] blocks."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  def fn(x):
    block = pl.BlockSpec((block_rows, 128), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // block_rows,),
        in_specs=[block],
        out_specs=block,
        name=name,
    )(x)

  return fn


class TpuCompileTest(parameterized.TestCase):
  """Compiles for TPUs through libtpu, without a TPU."""

  def setUp(self):
    super().setUp()
    _requires_libtpu(self)

  def test_topology_of_chips_hosts_and_slices(self):
    topo = aot.tpu_topology("v5e", "2x4/2")
    self.assertEqual(topo.num_devices, 16)
    self.assertEqual((topo.slices, topo.name), (2, "v5e:2x4/2"))
    self.assertEqual(topo.devices[0].device_kind, "TPU v5 lite")
    self.assertEqual(len({d.process_index for d in topo.devices}), 4)
    self.assertEqual(aot.named_topology("tpu7x:2x2x1").num_devices, 8)
    self.assertEqual(
        dict(topo.mesh({"data": 2, "expert": -1}).shape),
        {"data": 2, "expert": 8},
    )

  @parameterized.parameters(*aot.TPU_TARGETS)
  def test_compile_names_our_kernel_and_reads_memory(self, target):
    x = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    topology = aot.TPU_TARGETS[target].topologies[0]
    program = aot.compile(
        _doubling_kernel(256), x, topology=topology, name="probe"
    )
    self.assertEqual(program.tpu_kernels, {"dropless_tpu_probe": 1})
    self.assertEqual(program.custom_calls.get("tpu_custom_call"), 1)
    self.assertEqual(program.argument_bytes, 1024 * 128 * 4)
    self.assertEqual(program.output_bytes, 1024 * 128 * 4)
    self.assertTrue(program.fits)
    # In and out blocks, double-buffered (tpu7x: single): 4 x [256, 128]
    # float32.
    self.assertIn(program.kernel_vmem_bytes, (2 * 2**17, 4 * 2**17))
    self.assertEqual(program.target, target)

  def test_xla_ragged_dot_is_a_mosaic_call_too(self):
    """The call target alone would count XLA's kernels as ours."""
    topo = aot.named_topology("v5e:1x1")
    device = jax.sharding.SingleDeviceSharding(topo.devices[0])
    rows = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=device)
    weights = jax.ShapeDtypeStruct((4, 256, 128), jnp.bfloat16, sharding=device)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=device)
    program = aot.compile(
        jax.lax.ragged_dot, rows, weights, sizes, topology=topo
    )
    self.assertIn("tpu_custom_call", program.custom_calls)
    self.assertFalse(
        [k for k in program.tpu_kernels if k.startswith("dropless_tpu_")]
    )

  def test_auto_backend_compiles_for_a_tpu_from_a_cpu_host(self):
    """A layer with backend="auto" (the default) compiles for a TPU: auto
    orders by the platform lowered for, so where the native cpu backend is
    available on this host (auto's choice here), its CPU-only custom calls
    stay out of the TPU program (XLA's TPU compiler refused them: "Custom
    emitter for dropless_cpu_gmm_v1 not found")."""
    cpu_ok, why = registry.availability("cpu")
    if not cpu_ok:
      print(
          "the native cpu backend is unavailable here, so auto never chose it "
          f"on this host ({why}); this compile then passed before too"
      )
    cfg = moe_core.MoEConfig(
        num_experts=4, top_k=2, hidden_size=128, expert_ffn_size=128
    )
    params = jax.eval_shape(
        lambda: moe_core.init_params(jax.random.key(0), cfg, jnp.bfloat16)
    )
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    program = aot.compile(
        lambda p, x: moe_core.moe_layer(p, x, cfg)[0],
        params,
        x,
        topology="v5e:1x1",
    )
    self.assertFalse(
        [c for c in program.custom_calls if c.startswith("dropless_cpu")]
    )
    self.assertIn("tpu_custom_call", program.custom_calls)

  def test_a_kernel_over_scoped_vmem_fails_to_compile(self):
    """[16384, 128] float32 blocks, in and out, double-buffered: 32 MiB of
    VMEM, within v6e's default scoped limit and over v5p's."""
    x = jax.ShapeDtypeStruct((65536, 128), jnp.float32)
    fits = aot.compile(_doubling_kernel(16384), x, topology="v6e:1x1")
    self.assertEqual(fits.kernel_vmem_bytes, 32 * 2**20)
    self.assertLessEqual(
        fits.kernel_vmem_bytes, aot.TPU_TARGETS["v6e"].scoped_vmem_bytes
    )
    with self.assertRaisesRegex(Exception, "CompileTimeScopedVmemOom"):
      aot.compile(_doubling_kernel(16384), x, topology="v5p:1x1x1")

  def test_a_program_over_hbm_fails_with_its_figures(self):
    x = jax.ShapeDtypeStruct((6, 2**30), jnp.float32)  # 24 GiB, 48 with 2x.
    with self.assertRaises(aot.HbmOomError) as caught:
      aot.compile(lambda a: a * 2, x, topology="v5e:1x1")
    self.assertEqual(
        caught.exception.available_bytes,
        aot.TPU_TARGETS["v5e"].usable_bytes,
    )
    self.assertGreater(caught.exception.required_bytes, 24 * 2**30)

  def test_collective_bytes_of_an_all_to_all_over_chips(self):
    topo = aot.tpu_topology("v5e", "2x4")
    mesh = topo.mesh({"x": 8})
    spec = jax.sharding.PartitionSpec
    sharding = jax.sharding.NamedSharding(mesh, spec("x"))

    def exchange(a):
      return jax.shard_map(
          lambda b: jax.lax.all_to_all(b, "x", 0, 0, tiled=True),
          mesh=mesh,
          in_specs=spec("x"),
          out_specs=spec("x"),
      )(a)

    x = jax.ShapeDtypeStruct((8 * 64, 256), jnp.float32, sharding=sharding)
    program = aot.compile(exchange, x, topology=topo, mesh=mesh)
    self.assertEqual(program.collective_bytes.get("all-to-all"), 64 * 256 * 4)

  @parameterized.parameters(
      ("fp8_tensor", "f8e4m3fn"), ("mxfp8", "f8e4m3fn"), ("nvfp4", "f4e2m1fn")
  )
  def test_quantized_elements_are_read_back_rounded(self, recipe, narrow):
    """TPU's compiler drops f32 -> narrow -> f32 round trips inside one
    program (XLA's excess precision): measured on the v5e, the quantised
    GEMM then multiplied unrounded values. `precision` holds the narrow
    array behind a barrier, so the dequantising computation must take it
    as an input of that narrow type."""
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)

    def round_trip(x):
      return precision.dequantize(precision.quantize(x, recipe, axis=-1))

    text = aot.compile(round_trip, x, topology="v5e:1x1").hlo_text
    reads = [
        line
        for line in text.splitlines()
        if re.search(rf"= {narrow}\[[0-9,]*\]\S* parameter\(", line)
    ]
    self.assertNotEmpty(reads, f"no {narrow} input read back in:\n{text}")


def _scanned_matmuls(layers: int, m: int, k: int):
  """(loss, args): `layers` [m,k]x[k,k] matmuls under a scan."""

  def loss(x, ws):
    def layer(h, w):
      return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, x, ws)[0].sum()

  return loss, (jnp.zeros((m, k)), jnp.zeros((layers, k, k)))


class MatmulFlopsTest(absltest.TestCase):
  """`per_step_matmul_flops` against the arithmetic of known programs."""

  def test_every_iteration_of_a_scanned_gradient_counts(self):
    layers, m, k = 7, 64, 128
    loss, args = _scanned_matmuls(layers, m, k)
    grad = jax.grad(loss, argnums=(0, 1))
    text = jax.jit(grad).lower(*args).compile().as_text()
    counted = aot.per_step_matmul_flops(text)
    # Per layer: the forward product, and dX and dW in the backward.
    self.assertEqual(counted.flops, 3 * layers * 2 * m * k * k)
    self.assertEqual(counted.unknown_loops, 0)

  def test_gemm_calls_fusions_ragged_dots_and_kernels(self):
    hlo = "\n".join(
        [
            "%fused (a: bf16[16,8], b: bf16[8,32]) -> bf16[16,32] {",
            "  %a = bf16[16,8]{1,0} parameter(0)",
            "  %b = bf16[8,32]{1,0} parameter(1)",
            "  ROOT %d = bf16[16,32]{1,0} dot(bf16[16,8]{1,0} %a,"
            " bf16[8,32]{1,0} %b), lhs_contracting_dims={1},"
            " rhs_contracting_dims={0}",
            "}",
            "%body (p: (s32[], bf16[16,8])) -> (s32[], bf16[16,8]) {",
            "  %p = (s32[], bf16[16,8]) parameter(0)",
            "  %x = bf16[16,8]{1,0} get-tuple-element(%p), index=1",
            "  %w = bf16[8,32]{1,0} constant({...})",
            "  %f = bf16[16,32]{1,0} fusion(%x, %w), kind=kCustom,"
            " calls=%fused",
            "  %g = (bf16[16,32]{1,0}, s8[64]{0}) custom-call(%x, %w),"
            ' custom_call_target="__cublas$gemm", backend_config={'
            '"gemm_backend_config":{"dot_dimension_numbers":{'
            '"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":'
            '["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}',
            "  %k = bf16[16,32]{1,0} custom-call(%x, %w),"
            ' custom_call_target="mosaic_gpu_v2"',
            "}",
            "ENTRY %main (q: bf16[16,8], e: bf16[4,8,32], s: s32[4])"
            " -> f32[] {",
            "  %q = bf16[16,8]{1,0} parameter(0)",
            "  %e = bf16[4,8,32]{2,1,0} parameter(1)",
            "  %s = s32[4]{0} parameter(2)",
            "  %loop = (s32[], bf16[16,8]) while(%t), condition=%c, body=%body,"
            ' backend_config={"known_trip_count":{"n":"3"}}',
            "  %r = bf16[16,32]{1,0} ragged-dot(%q, %e, %s),"
            " lhs_contracting_dims={1}, rhs_contracting_dims={1},"
            " lhs_ragged_dims={0}, rhs_group_dims={0}",
            "}",
        ]
    )
    counted = aot.per_step_matmul_flops(hlo)
    product = 2 * 16 * 32 * 8
    # The fused dot and the cuBLAS call, 3 times; the ragged dot (each row
    # meets one group) once.
    self.assertEqual(counted.flops, 3 * 2 * product + product)
    self.assertEqual(counted.kernel_launches, {"mosaic_gpu_v2": 3})

  def test_tpu_dots_are_convolutions(self):
    hlo = "\n".join(
        [
            "ENTRY %main (a: bf16[4,64,128], b: bf16[4,128,256]) -> f32[] {",
            "  %a = bf16[4,64,128]{2,1,0} parameter(0)",
            "  %b = bf16[4,128,256]{2,1,0} parameter(1)",
            "  %c = bf16[4,64,256]{2,1,0} convolution(%a, %b),"
            " window={size=4 stride=3 lhs_dilate=4}, dim_labels=0bf_0io->0bf",
            "}",
        ]
    )
    counted = aot.per_step_matmul_flops(hlo)
    self.assertEqual(counted.flops, 2 * 4 * 64 * 256 * 128)

  @absltest.skipUnless(_HAS_LIBTPU, "no libtpu on this leg")
  def test_a_tpu_compile_counts_its_dots_per_iteration(self):
    layers, m, k = 5, 256, 512
    loss, args = _scanned_matmuls(layers, m, k)
    abstract = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in args]
    program = aot.compile(
        jax.grad(loss, argnums=(0, 1)), *abstract, topology="v6e:1x1"
    )
    counted = aot.per_step_matmul_flops(program.hlo_text)
    self.assertEqual(counted.flops, 3 * layers * 2 * m * k * k)

  @absltest.skipUnless(_HAS_PLUGIN, "no CUDA plugin on this leg")
  def test_a_gpu_compile_counts_its_gemm_calls_per_iteration(self):
    topo = aot.gpu_topology("h100", "1x1x1")
    layers, m, k = 5, 256, 512
    loss, args = _scanned_matmuls(layers, m, k)
    device = jax.sharding.SingleDeviceSharding(topo.devices[0])
    abstract = [
        jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=device)
        for a in args
    ]
    program = aot.compile(
        jax.grad(loss, argnums=(0, 1)), *abstract, topology=topo
    )
    counted = aot.per_step_matmul_flops(program.hlo_text)
    self.assertEqual(counted.flops, 3 * layers * 2 * m * k * k)
    # XLA's own analysis sees one loop body.
    self.assertLess(program.flops, counted.flops / 2)


@absltest.skipUnless(_HAS_LIBTPU, "no libtpu on this leg")
class ResultsCacheTest(absltest.TestCase):
  """Where JAX's compilation cache is on, a compile's figures and text are
  kept and read back for the same program, target and options only."""

  def setUp(self):
    super().setUp()
    previous = jax.config.jax_compilation_cache_dir
    folder = tempfile.mkdtemp(prefix="aot_results_cache_test_")
    self.addCleanup(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    self.addCleanup(jax.config.update, "jax_compilation_cache_dir", previous)
    self.x = jax.ShapeDtypeStruct((256, 512), jnp.float32)

  def _compile(self, fn, topology="v5e:1x1", **kwargs):
    return aot.compile(fn, self.x, topology=topology, **kwargs)

  def test_the_same_compile_is_read_back(self):
    square = lambda a: a @ a.T
    first = self._compile(square)
    again = self._compile(square, name="again")
    self.assertFalse(first.cached)
    self.assertTrue(again.cached)
    self.assertIsNone(again.compiled)
    self.assertEqual(again.hlo_text, first.compiled.as_text())
    want = first.to_json() | {"name": "again", "cached": True}
    self.assertEqual(again.to_json(), want)

  def test_another_program_chip_or_option_compiles(self):
    self._compile(lambda a: a @ a.T)
    for other in (
        self._compile(lambda a: a @ a.T + 1),
        self._compile(lambda a: a @ a.T, topology="v6e:1x1"),
        self._compile(
            lambda a: a @ a.T,
            xla_options={"xla_tpu_enable_latency_hiding_scheduler": False},
        ),
    ):
      self.assertFalse(other.cached, other.to_json())
      self.assertIsNotNone(other.compiled)

  def test_off_without_a_compilation_cache(self):
    jax.config.update("jax_compilation_cache_dir", None)
    square = lambda a: a @ a.T
    self.assertFalse(self._compile(square).cached)
    self.assertFalse(self._compile(square).cached)


class ResultsCacheKeyTest(absltest.TestCase):
  """The key leaves out where the source tree is (kernels record their
  files' paths) and nothing else."""

  def _key(self, tree, source, kernel_hash="h1"):
    body = base64.b64encode(f"ML\xefR kernel at {tree}/{source}:7".encode())
    text = (
        f'custom_call @tpu_custom_call() {{backend_config = "{{\\22body\\22:'
        f' \\22{body.decode()}\\22}}"}} custom_call @mosaic_gpu_v2() '
        f'{{kernel_hash = "{kernel_hash}", module = "ML\\EFR {tree}/{source}"}}'
    )
    # Stand-ins with what the key reads: no TPU compiler needed.
    topology = types.SimpleNamespace(
        target=types.SimpleNamespace(name="v5e"), spec="1x1"
    )
    mesh = types.SimpleNamespace(
        devices=np.array([types.SimpleNamespace(id=0)]), axis_names=("x",)
    )
    with mock.patch.object(results_cache, "_TREE", tree):
      return results_cache.key(text, {}, topology, mesh)

  def test_the_same_program_from_another_checkout(self):
    here = self._key("/a/checkout", "backends/k.py")
    self.assertEqual(here, self._key("/sandbox/7/runfiles/x", "backends/k.py"))
    # The Mosaic GPU kernel's hash of its module (paths and all) is left out.
    self.assertEqual(here, self._key("/a/checkout", "backends/k.py", "h2"))
    self.assertNotEqual(here, self._key("/a/checkout", "backends/other.py"))


if __name__ == "__main__":
  absltest.main()
