"""The triton backend's layer through XLA's GPU compiler, for H100 and B200.

`moe_core.aot.compile` compiles a `moe_layer` forward and its forward and
backward (`jax.value_and_grad`) for one GPU of each target from this host,
with jax-triton building each kernel for the target (its compute
capability, and PTX the CUDA plugin's compiler takes). For each program:
it compiles; the executable holds one jax-triton custom call per kernel the
backend launches (a silent fallback to XLA's own ops would hold none); and
its peak memory per GPU fits the target's HBM. Where the leg has no CUDA
plugin of jax, no jax-triton, or TRITON_INTERPRET is set, every test skips
with that reason.
"""

from __future__ import annotations

import math
import re
import zlib

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

import moe_core
from backends.triton import launch
from backends.triton import launch_record
from backends.triton import target as target_lib
from moe_core import aot
from moe_core.kernels import primitive

# jax-triton's custom-call targets: 0.4's FFI handler, 0.3's.
_JAX_TRITON_CALLS = ("triton_kernel_call_ffi", "triton_kernel_call")
# The config table's rows for each target.
_GENERATIONS = {"h100": "sm90", "b200": "sm100"}
_VARIANTS = {
    "plain": {"fuse_activation": False},
    "fused_activation": {"fuse_activation": True},
    "fused_routing_weights": {
        "fuse_activation": True,
        "fuse_routing_weights": True,
    },
}
# Small, so that the 12 programs compile in well under a minute on 2 cores;
# the kernels are the same code at any size (their shapes are constexprs).
_CFG = moe_core.MoEConfig(
    num_experts=8, top_k=2, hidden_size=256, expert_ffn_size=128
)
_TOKENS = 256


def _launches(fn, *args) -> int:
  """The kernels `fn` launches: one jax-triton call each (none is empty)."""
  # The kernel primitives' abstract evaluation traces their kernels once
  # (for their effects, then cached): done here, outside the recorder.
  jax.make_jaxpr(fn)(*args)
  with launch_record.recording() as calls:
    primitive.trace_kernel_calls(fn, *args)
  return sum(
      math.prod(c.grid) > 0 and any(math.prod(o.shape) > 0 for o in c.out_types)
      for c in calls
  )


def _abstract_args(topo):
  """(params, x) of the layer as ShapeDtypeStructs on topo's first GPU."""
  device = jax.sharding.SingleDeviceSharding(topo.devices[0])
  params = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
      jax.eval_shape(
          lambda: moe_core.init_params(
              jax.random.key(0), _CFG, dtype=jnp.bfloat16
          )
      ),
  )
  x = jax.ShapeDtypeStruct(
      (_TOKENS, _CFG.hidden_size), jnp.bfloat16, sharding=device
  )
  return params, x


# A jax-triton call's payload in StableHLO: 0.4's opaque, 0.3's
# backend_config; a zlib-compressed proto holding the kernel's PTX.
_PAYLOAD = re.compile(r'(?:opaque|backend_config) = "((?:[^"\\]|\\.)+)"')
# MLIR escapes a string's bytes as \XX (hex) and a backslash as \\.
_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{2}|\\)")


def _ptx_headers(stablehlo: str) -> list[tuple[str, str]]:
  """(.target, .version) of each jax-triton kernel's PTX in `stablehlo`."""
  headers = []
  for literal in _PAYLOAD.findall(stablehlo):
    raw = _ESCAPE.sub(
        lambda m: "\\" if m.group(1) == "\\" else chr(int(m.group(1), 16)),
        literal,
    ).encode("latin-1")
    ptx = zlib.decompress(raw).decode("latin-1")
    target = re.search(r"^\.target (\w+)", ptx, re.MULTILINE)
    version = re.search(r"^\.version (\d+\.\d+)", ptx, re.MULTILINE)
    headers.append((target and target.group(1), version and version.group(1)))
  return headers


class GpuCompileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if not aot.cuda_plugin_installed():
      self.skipTest(
          "compiling for GPUs needs jax's CUDA plugin (jax-cuda13-plugin, "
          "jax-cuda13-pjrt), which this leg does not install"
      )
    ok, reason = launch.compilable()
    if not ok:
      self.skipTest(reason)
    try:
      launch._jax_triton()  # pylint: disable=protected-access
    except ImportError as e:
      self.skipTest(str(e))

  @parameterized.product(target=tuple(_GENERATIONS), variant=tuple(_VARIANTS))
  def test_layer_compiles_with_the_kernels(self, target, variant):
    topo = aot.gpu_topology(target, "1x1x1")
    params, x = _abstract_args(topo)
    backend = moe_core.get_backend(
        "triton", generation=_GENERATIONS[target], **_VARIANTS[variant]
    )

    def forward(p, x):
      return moe_core.moe_layer(p, x, _CFG, backend=backend)[0]

    def loss(p, x):
      return jnp.sum(forward(p, x).astype(jnp.float32))

    programs = {
        "forward": forward,
        "forward_backward": jax.value_and_grad(loss, argnums=(0, 1)),
    }
    for name, fn in programs.items():
      with self.subTest(name):
        program = aot.compile(
            fn, params, x, topology=topo, name=f"triton_{variant}_{name}"
        )
        logging.info(
            "%s %s: %.1f s, peak %.2f MiB, %s",
            target,
            program.name,
            program.compile_seconds,
            program.peak_bytes / 2**20,
            program.custom_calls,
        )
        kernels = sum(program.custom_calls.get(c, 0) for c in _JAX_TRITON_CALLS)
        self.assertEqual(
            kernels,
            _launches(fn, params, x),
            f"jax-triton kernels in the executable: {program.custom_calls}",
        )
        self.assertGreater(kernels, 0)
        self.assertTrue(
            program.fits,
            f"{program.peak_bytes} bytes > {program.usable_bytes} usable",
        )

  @parameterized.parameters(("h100", "sm_90a"), ("b200", "sm_100a"))
  def test_kernels_are_built_for_the_target(self, target, arch):
    """Each kernel's PTX is for the target, in an ISA the plugin takes."""
    topo = aot.gpu_topology(target, "1x1x1")
    params, x = _abstract_args(topo)
    backend = moe_core.get_backend(
        "triton", generation=_GENERATIONS[target], fuse_activation=True
    )
    mesh = topo.single_device_mesh()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      self.assertEqual(target_lib.target_capability(), int(arch[3:-1]))
      text = (
          jax.jit(
              lambda p, x: moe_core.moe_layer(p, x, _CFG, backend=backend)[0]
          )
          .lower(params, x)
          .as_text()
      )
    headers = _ptx_headers(text)
    self.assertNotEmpty(headers)
    plugin = target_lib._plugin_ptx_version()  # pylint: disable=protected-access
    for got_arch, version in headers:
      self.assertEqual(got_arch, arch)
      major, minor = (int(v) for v in version.split("."))
      self.assertLessEqual(10 * major + minor, plugin)


if __name__ == "__main__":
  absltest.main()
