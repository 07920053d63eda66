"""Do the quantised GEMMs round the same on the chip as on the host?

On a TPU host (set-up: ../shared/notes/tpu.md), with JAX_PLATFORMS=tpu,cpu:

  python3 -m bench.micro.quant_probe      # writes $OUT/quant_probe.json

Three readings, each printed and written:
  1. `x.astype(fmt).astype(float32)` inside one jit, chip against host, for
     E4M3, E2M1 and bfloat16 (`convert_<fmt>_mismatch`: elements that
     differ; with XLA's excess precision the chip returns x unrounded), and
     1 / x (`reciprocal_mismatch`: the chip's division is not correctly
     rounded).
  2. `ragged_dot` and `jnp.dot` of float32 at the default and "highest"
     precision against float64 numpy (relative error of the largest term).
  3. Per recipe and conformance case (`precision_suite.PRECISION_GEMM_CASES`):
     how many bits of the quantised operands differ chip against host, and
     how far apart the GEMM outputs of `xla` and `reference` are, on the
     chip and on the host ([max |a - b| / max |reference on the host|,
     values past 1e-3 of it]).

Without a TPU both "devices" are the host's CPU: every mismatch is 0.
bench/results/tpu_quantization_20261206.json has the readings before and
after `precision` held its narrow arrays behind a barrier.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from conformance import base
from conformance import cases
from conformance import precision_suite
from moe_core import precision
from train import platforms

# This program probes the device as it is imported: the platforms first.
platforms.set_default_platforms()
_ON_TPU = jax.default_backend() == "tpu"
CHIP = jax.devices()[0]
HOST = jax.devices("cpu")[0]


def _bits(x):
  x = np.asarray(x)
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _both(fn, *args):
  """fn(*args) jitted on the chip and on the host, as numpy."""
  f = jax.jit(fn)
  return tuple(
      jax.tree.map(np.asarray, f(*jax.device_put(args, d)))
      for d in (CHIP, HOST)
  )


def conversions(out):
  rng = np.random.default_rng(0)
  n = 1 << 20
  v = rng.standard_normal(n) * np.exp2(rng.integers(-12, 12, n))
  v = v.astype(np.float32)
  formats = {
      "e4m3": jnp.float8_e4m3fn,
      "e2m1": jnp.float4_e2m1fn,
      "bf16": jnp.bfloat16,
  }
  for name, dtype in formats.items():
    chip, host = _both(lambda x, t=dtype: x.astype(t).astype(jnp.float32), v)
    off = (chip != host) & np.isfinite(host)
    out[f"convert_{name}_mismatch"] = int(off.sum())
    out[f"convert_{name}_examples"] = [
        (float(v[i]), float(chip[i]), float(host[i]))
        for i in np.nonzero(off)[0][:5]
    ]
  chip, host = _both(lambda x: 1.0 / x, v)
  out["reciprocal_mismatch"] = int(np.sum(chip != host))


def products(out):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((256, 512)).astype(np.float32)
  w = rng.standard_normal((4, 512, 128)).astype(np.float32)
  sizes = np.full((4,), 64, np.int32)
  want = np.concatenate(
      [x[i * 64 : (i + 1) * 64].astype(np.float64) @ w[i] for i in range(4)]
  )
  scale = np.max(np.abs(want))
  for prec in (None, jax.lax.Precision.HIGHEST):
    ragged = jax.jit(
        lambda x, w, g, p=prec: jax.lax.ragged_dot(
            x, w, g, precision=p, preferred_element_type=jnp.float32
        )
    )(*jax.device_put((x, w, sizes), CHIP))
    dense = jax.jit(lambda x, w, p=prec: jnp.dot(x, w, precision=p))(
        *jax.device_put((x[:64], w[0]), CHIP)
    )
    out[f"ragged_dot_{prec}_relerr"] = float(
        np.max(np.abs(np.asarray(ragged) - want)) / scale
    )
    out[f"dot_{prec}_relerr"] = float(
        np.max(np.abs(np.asarray(dense) - want[:64])) / scale
    )


def quantized_gemms(out):
  backends = {
      "xla": moe_core.get_backend("xla"),
      "ref": moe_core.get_backend("reference"),
  }
  for recipe in precision_suite.RECIPES:
    for case in precision_suite.PRECISION_GEMM_CASES:
      rows, weights, sizes, _ = cases.gemm_inputs(case)
      contract = 2 if case.transpose_rhs else 1
      row = {}
      quantizers = {
          "rows": (
              lambda r, g: precision.quantize_grouped_rows(r, g, recipe),
              (rows, sizes),
          ),
          "weights": (
              lambda w: precision.quantize_grouped_weights(
                  w, recipe, contract_axis=contract
              ),
              (weights,),
          ),
      }
      for name, (fn, args) in quantizers.items():
        chip, host = _both(fn, *args)
        for field in ("data", "scales", "tensor_scale"):
          row[f"{name}_{field}_bits_differ"] = int(
              np.sum(_bits(getattr(chip, field)) != _bits(getattr(host, field)))
          )
      outs = {}
      for b, backend in backends.items():
        fn = base.gemm_function(backend, case, grads=False, precision=recipe)
        chip, host = _both(fn, rows, weights)
        outs[f"{b}_tpu"] = chip[0].astype(np.float64)
        outs[f"{b}_cpu"] = host[0].astype(np.float64)
      scale = np.max(np.abs(outs["ref_cpu"]))
      pairs = (
          ("xla_tpu", "ref_tpu"),
          ("xla_tpu", "ref_cpu"),
          ("ref_tpu", "ref_cpu"),
          ("xla_cpu", "ref_cpu"),
          ("xla_tpu", "xla_cpu"),
      )
      for a, b in pairs:
        d = np.abs(outs[a] - outs[b])
        row[f"{a}~{b}"] = [
            float(np.max(d) / scale),
            int(np.sum(d > 1e-3 * scale)),
        ]
      out[f"{recipe}_{case.name}"] = row
      print(f"{recipe}_{case.name}", json.dumps(row), flush=True)


def main():
  out = {"device": CHIP.device_kind, "on_tpu": _ON_TPU, "jax": jax.__version__}
  conversions(out)
  products(out)
  print(json.dumps(out, indent=1), flush=True)
  quantized_gemms(out)
  path = os.path.join(os.environ.get("OUT", "/tmp"), "quant_probe.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
