"""MoE layer benchmark: each backend against the dense FFN of the same FLOPs.

Times the whole MoE layer (route, dispatch, grouped GEMMs, SwiGLU,
combine), forward and forward+backward, against a dense SwiGLU FFN of the
same useful expert FLOPs on the same tokens, as ratios over it and over
the xla backend measured in the same run; writes
bench/results/layer_<platform>_<date>.json (docs/benchmarks.md,
"bench/micro/layer_bench.py"). Usage:
    python -m bench.micro.layer_bench [--quick] [--backends cpu,xla]
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from backends.cpu import allocator
import moe_core
from bench.harness import json_report
from bench.harness import text_table
from bench.harness import timing
from train import platforms

_QUICK = flags.DEFINE_bool("quick", False, "One repeat: proves it runs.")
_TOKENS = flags.DEFINE_integer("tokens", 2048, "T: tokens per call.")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "D: the model width.")
_ACTIVE_FFN = flags.DEFINE_integer(
    "active_ffn",
    2048,
    "K*F: the routed width per token, and the dense FFN's width.",
)
_CONFIGS = flags.DEFINE_list(
    "configs", ["8x2", "64x8"], "ExK: experts and top-k per layer."
)
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "Activation/weight dtype."
)
_BACKENDS = flags.DEFINE_list("backends", ["cpu", "xla"], "Backends to time.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed calls per measurement.")
_OUT_DIR = flags.DEFINE_string(
    "out_dir",
    os.path.join(os.path.dirname(__file__), "..", "results"),
    "Where the JSON goes.",
)


def dense_ffn(params, x):
  """The SwiGLU FFN silu(x Wg) * (x Wu) Wd of width K*F: [T, D] -> [T, D]."""
  gate = jnp.dot(x, params["w_gate"], preferred_element_type=jnp.float32)
  up = jnp.dot(x, params["w_up"], preferred_element_type=jnp.float32)
  h = (jax.nn.silu(gate) * up).astype(x.dtype)
  return jnp.dot(h, params["w_down"], preferred_element_type=jnp.float32)


def _programs(fn):
  """{phase: jitted f(params, x)}; fwd_bwd returns the loss and gradients."""

  def loss(params, x):
    return jnp.mean(fn(params, x).astype(jnp.float32) ** 2)

  return {
      "fwd": jax.jit(fn),
      "fwd_bwd": jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
  }


def _times(methods, x, repeats):
  """{name: {"fwd_s", "fwd_bwd_s"}} for methods {name: (fn, params)}.

  The calls are interleaved, every repeat timing each method's phase once
  in turn, so a shared machine's changing load lands on all of them alike.
  """
  calls = {}
  for name, (fn, params) in methods.items():
    programs = _programs(fn)
    for phase in timing.PHASES:
      calls[name, phase] = programs[phase], params
  for fn, params in calls.values():  # Compile and warm up.
    jax.block_until_ready(fn(params, x))
  seconds = {key: [] for key in calls}
  for _ in range(repeats):
    for key, (fn, params) in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(params, x))
      seconds[key].append(time.perf_counter() - start)
  return {
      name: {
          f"{p}_s": statistics.median(seconds[name, p]) for p in timing.PHASES
      }
      for name in methods
  }


def _run(names, repeats, dtype):
  t, d, width = _TOKENS.value, _HIDDEN.value, _ACTIVE_FFN.value
  k_x, k_p, k_d = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k_x, (t, d), dtype)
  kg, ku, kd = jax.random.split(k_d, 3)
  dense_params = {
      "w_gate": (jax.random.normal(kg, (d, width)) / d**0.5).astype(dtype),
      "w_up": (jax.random.normal(ku, (d, width)) / d**0.5).astype(dtype),
      "w_down": (jax.random.normal(kd, (width, d)) / width**0.5).astype(dtype),
  }
  results = []
  for spec in _CONFIGS.value:
    experts, top_k = (int(v) for v in spec.split("x"))
    cfg = moe_core.MoEConfig(
        num_experts=experts,
        top_k=top_k,
        hidden_size=d,
        expert_ffn_size=width // top_k,
    )
    params = moe_core.init_params(k_p, cfg, dtype=dtype)
    methods = {"dense_ffn": (dense_ffn, dense_params)}
    for name in names:
      layer = lambda p, x, name=name: moe_core.moe_layer(
          p, x, cfg, backend=name
      )[0]
      methods[name] = (layer, params)
    timings = _times(methods, x, repeats)
    for name, times in timings.items():
      row = {
          "experts": experts,
          "top_k": top_k,
          "expert_ffn": cfg.expert_ffn_size,
          "method": name,
          **{f"{p}_ms": 1e3 * times[f"{p}_s"] for p in timing.PHASES},
      }
      for base in ("dense_ffn", "xla"):
        if base in timings:
          row.update(
              {
                  timing.ratio_key(p, base): timing.time_over(
                      times[f"{p}_s"], timings[base][f"{p}_s"]
                  )
                  for p in timing.PHASES
              }
          )
      results.append(row)
  return results


_COLUMNS = (
    text_table.Column("E", 3, "d"),
    text_table.Column("K", 2, "d"),
    text_table.Column("method", 10, align="<"),
    text_table.Column("fwd ms", 8, ".2f"),
    text_table.Column("time/dense", 10, ".2f"),
    text_table.Column("fwd+bwd ms", 10, ".2f"),
    text_table.Column("time/dense", 10, ".2f"),
)


def main(argv):
  del argv
  repeats = 1 if _QUICK.value else _REPEATS.value
  dtype = jnp.dtype(_DTYPE.value)
  names = []
  for name in _BACKENDS.value:
    ok, why = moe_core.registry.availability(name)
    if ok:
      names.append(name)
    else:
      print(f"skipping {name}: {why}")
  print(
      f"jax {jax.__version__} on {jax.default_backend()}; T={_TOKENS.value} "
      f"D={_HIDDEN.value} K*F={_ACTIVE_FFN.value} dtype={dtype.name} "
      f"repeats={repeats}; {moe_core.get_backend('auto')!r} is auto"
  )
  results = _run(names, repeats, dtype)
  text_table.print_table(
      _COLUMNS,
      results,
      lambda r: [
          r["experts"],
          r["top_k"],
          r["method"],
          r["fwd_ms"],
          r[timing.ratio_key("fwd", "dense_ffn")],
          r["fwd_bwd_ms"],
          r[timing.ratio_key("fwd_bwd", "dense_ffn")],
      ],
      "'time/dense': the layer's time / the dense SwiGLU FFN of width K*F "
      "in this run (< 1 is faster).",
  )
  json_report.save_run(
      _OUT_DIR.value,
      "layer",
      {
          "auto": repr(moe_core.get_backend("auto")),
          "quick": _QUICK.value,
          "repeats": repeats,
          "shape": {
              "tokens": _TOKENS.value,
              "hidden": _HIDDEN.value,
              "active_ffn": _ACTIVE_FFN.value,
          },
          "dtype": dtype.name,
          # backends/cpu/allocator.py: glibc's, or freed memory kept.
          "cpu_allocator": allocator.state(),
          "results": results,
      },
      device=False,
  )


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
