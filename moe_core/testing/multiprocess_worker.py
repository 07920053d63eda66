"""One process of a multi-process expert-parallel run on CPU (gloo, 127.0.0.1).

Run by `moe_core/multiprocess_test.py`, N copies at once (`_parse` shows
the command line): each process joins `jax.distributed` over 127.0.0.1 with
gloo collectives, builds the same inputs from fixed seeds, runs `moe_layer`
with a mesh over every process's devices, and process 0 writes y, the aux
statistics and the gradients (gathered from all processes) to `--out`,
which the test compares with one process's single-device result; its
failure modes (`--die_process`, a process started without its peers, the
exit codes) let the tests check that a broken run ends with a clear error
and not a hang.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

# Exit codes: 0 success, 3 could not join (a process started without its
# peers times out in `jax.distributed.initialize`), 4 the run failed after
# joining.
EXIT_JOIN_FAILED = 3
EXIT_RUN_FAILED = 4
NUM_TOKENS = 32  # x is [8, 4, D]: 4 tokens per device on 8 devices.


def config():
  """The block every process runs (and the test's single-device oracle)."""
  import moe_core  # pylint: disable=g-import-not-at-top

  return moe_core.MoEConfig(
      num_experts=8,
      top_k=2,
      hidden_size=16,
      expert_ffn_size=24,
      score_func="sigmoid",
      norm_topk_prob=True,
      correction_bias=True,
      shared_ffn_size=8,
      shared_expert_gate=True,
  )


def inputs(cfg):
  """(params, x [8, 4, D], cotangent) as float32 numpy, from fixed seeds."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import moe_core  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(4242)
  params = {}
  for name, shape in moe_core.param_shapes(cfg).items():
    scale = 0.1 if name == "correction_bias" else shape[-2] ** -0.5
    params[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
  x = rng.standard_normal((8, NUM_TOKENS // 8, cfg.hidden_size))
  cotangent = rng.standard_normal(x.shape)
  return params, x.astype(np.float32), cotangent.astype(np.float32)


def make_step(cfg, backend, **layer_kwargs):
  """f(params, x, cotangent) -> (y, aux statistics, grads of params and x).

  The loss is sum(y * cotangent) + the two auxiliary losses, so the
  gradients cover the expert path, the router and the shared expert.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import moe_core  # pylint: disable=g-import-not-at-top

  def loss(params, x, cotangent):
    y, aux = moe_core.moe_layer(params, x, cfg, backend=backend, **layer_kwargs)
    value = (
        jnp.sum(y * cotangent)
        + 0.1 * aux.load_balancing_loss
        + 0.01 * aux.router_z_loss
    )
    stats = {
        "tokens_per_expert": aux.tokens_per_expert,
        "load_balancing_loss": aux.load_balancing_loss,
        "router_z_loss": aux.router_z_loss,
        "dropped_tokens": aux.dropped_tokens,
        "expert_ids": aux.expert_ids,
    }
    return value, (y, stats)

  def step(params, x, cotangent):
    (_, (y, stats)), (d_params, d_x) = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True
    )(params, x, cotangent)
    return y, stats, dict(d_params, x=d_x)

  return step


def _parse():
  """The flags, as in (one command line)

  python multiprocess_worker.py --port=P --num_processes=N --process_id=I
      --local_devices=2 --mesh=2x4 --out=/tmp/result.npz
  """
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--local_devices", type=int, default=2)
  parser.add_argument(
      "--mesh",
      default="1x4",
      help="data x expert sizes, e.g. 2x4; their product is "
      "num_processes * local_devices.",
  )
  parser.add_argument("--exchange", default="padded")
  parser.add_argument("--backend", default="xla")
  parser.add_argument("--out", default="")
  parser.add_argument("--init_timeout", type=int, default=60)
  parser.add_argument("--heartbeat_timeout", type=int, default=10)
  # Process I exits abruptly after joining, for the failure tests.
  parser.add_argument("--die_process", type=int, default=-1)
  return parser.parse_args()


def _log(args, message):
  print(
      f"[worker {args.process_id}/{args.num_processes}] {message}", flush=True
  )


def main():
  args = _parse()
  # Must precede the first import of jax.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={args.local_devices}"
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  start = time.monotonic()
  try:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.init_timeout,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
        cluster_detection_method="deactivate",
    )
  except Exception as e:  # pylint: disable=broad-except
    print(
        f"DISTRIBUTED_INIT_FAILED after {time.monotonic() - start:.1f}s: "
        f"{type(e).__name__}: {e}",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(EXIT_JOIN_FAILED)
  _log(
      args,
      f"joined: {jax.process_count()} processes, "
      f"{jax.device_count()} devices ({jax.local_device_count()} local)",
  )
  if args.process_id == args.die_process:
    _log(args, "exiting abruptly, as asked")
    os._exit(17)  # pylint: disable=protected-access
  try:
    _run(args, jax)
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    print(
        f"EP_RUN_FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True
    )
    os._exit(EXIT_RUN_FAILED)  # pylint: disable=protected-access
  _log(args, "done")
  jax.distributed.shutdown()


def _run(args, jax):
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from jax.experimental import multihost_utils
  from moe_core import parallel
  # pylint: enable=g-import-not-at-top

  data, expert = (int(n) for n in args.mesh.split("x"))
  if data * expert != jax.device_count():
    raise ValueError(
        f"--mesh={args.mesh} must cover the " f"{jax.device_count()} devices."
    )
  devices = np.array(jax.devices()).reshape(data, expert)
  mesh = jax.sharding.Mesh(devices, ("data", "expert"))
  cfg = config()
  params_np, x_np, cotangent_np = inputs(cfg)

  def global_array(value, spec):
    return jax.make_array_from_callback(
        value.shape,
        jax.sharding.NamedSharding(mesh, spec),
        lambda index: value[index],
    )

  specs = parallel.param_specs(cfg, "expert")
  params = {k: global_array(v, specs[k]) for k, v in params_np.items()}
  x = global_array(x_np, jax.sharding.PartitionSpec(("data", "expert")))
  cotangent = global_array(
      cotangent_np, jax.sharding.PartitionSpec(("data", "expert"))
  )
  options = parallel.EPOptions(exchange=args.exchange)
  step = jax.jit(make_step(cfg, args.backend, mesh=mesh, ep_options=options))
  y, stats, grads = step(params, x, cotangent)
  gathered = multihost_utils.process_allgather(
      {
          "y": y,
          **{f"aux_{k}": v for k, v in stats.items()},
          **{f"grad_{k}": v for k, v in grads.items()},
      },
      tiled=True,
  )
  _log(args, f"ran the layer on mesh {dict(mesh.shape)}")
  if args.process_id == 0 and args.out:
    np.savez(args.out, **{k: np.asarray(v) for k, v in gathered.items()})


if __name__ == "__main__":
  main()
