"""Runs one MoE layer forward and backward on every available backend.

Prints, per backend, the forward and forward+backward time (median of
`--repeats` jitted calls, and the fwd+bwd time over the reference
backend's measured in the same run: below 1 is faster), and the largest
error of the output and of every gradient against the reference, relative
to the reference's largest magnitude. Usage:
    python -m bench.micro.demo [--tokens 1024] [--dtype bfloat16] [--repeats 5]
"""

from __future__ import annotations


from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import moe_core
from bench.harness import timing
from train import platforms
from train import presets

_TOKENS = flags.DEFINE_integer("tokens", 1024, "Tokens per call (T).")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "Activation and weight dtype."
)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per measurement.")
_BACKENDS = flags.DEFINE_list(
    "backends", [], "Backends to run (default: every available one)."
)

# A small DeepSeek-V3-style block: sigmoid scores, the aux-loss-free
# correction bias, group-limited top-k, routed scaling, one shared expert.
DEMO_CONFIG = presets.deepseek_v3_moe(
    256, num_experts=16, top_k=4, expert_ffn_size=384, n_group=4, topk_group=2
)


def _relative_error(got, want):
  got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
  scale = jnp.maximum(jnp.abs(want).max(), 1e-30)
  return float(jnp.abs(got - want).max() / scale)


def _measure(backend, params, x, cfg, repeats):
  def loss(p, x):
    y, aux = moe_core.moe_layer(p, x, cfg, backend=backend)
    return jnp.mean(y.astype(jnp.float32) ** 2) + 1e-2 * (
        aux.load_balancing_loss
    )

  forward = jax.jit(
      lambda p, x: moe_core.moe_layer(p, x, cfg, backend=backend)[0]
  )
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  return {
      "forward_s": timing.median_seconds(forward, (params, x), repeats),
      "train_s": timing.median_seconds(grad, (params, x), repeats),
      "y": forward(params, x),
      "grads": grad(params, x),
  }


def main(argv):
  del argv
  cfg = DEMO_CONFIG
  dtype = jnp.dtype(_DTYPE.value)
  k_params, k_bias, k_x = jax.random.split(jax.random.key(0), 3)
  params = moe_core.init_params(k_params, cfg, dtype=dtype)
  params["correction_bias"] = 0.05 * jax.random.normal(
      k_bias, (cfg.num_experts,)
  )
  x = jax.random.normal(k_x, (_TOKENS.value, cfg.hidden_size), dtype)

  names = _BACKENDS.value or moe_core.available_backends()
  if "reference" not in names:
    names = ["reference"] + names
  print(
      f"jax {jax.__version__} on {jax.default_backend()} "
      f"({jax.devices()[0].device_kind}); T={_TOKENS.value} "
      f"D={cfg.hidden_size} F={cfg.expert_ffn_size} E={cfg.num_experts} "
      f"K={cfg.top_k} dtype={dtype.name}"
  )
  for name in moe_core.registered_backends():
    ok, why = moe_core.registry.availability(name)
    if not ok:
      print(f"  {name}: skipped, {why}")

  results = {
      name: _measure(name, params, x, cfg, _REPEATS.value) for name in names
  }
  ref = results["reference"]
  header = (
      f"{'backend':<10} {'fwd ms':>8} {'fwd+bwd ms':>11} "
      f"{'time/ref':>8} {'y err':>9} {'worst grad err':>15}"
  )
  print(header)
  print("-" * len(header))
  for name, r in results.items():
    grad_errors = jax.tree.map(_relative_error, r["grads"], ref["grads"])
    worst = max(jax.tree.leaves(grad_errors))
    print(
        f"{name:<10} {1e3 * r['forward_s']:8.2f} {1e3 * r['train_s']:11.2f} "
        f"{timing.time_over(r['train_s'], ref['train_s']):8.2f} "
        f"{_relative_error(r['y'], ref['y']):9.2e} {worst:15.2e}"
    )
  print(
      "errors are max |backend - reference| / max |reference|; "
      "'time/ref' is fwd+bwd time / the reference's fwd+bwd time (< 1 is "
      "faster)."
  )


if __name__ == "__main__":
  platforms.set_default_platforms()
  app.run(main)
