"""The compiled side of training: optimiser, loss, jitted train/eval steps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moe_core import flax as moe_flax
from train.parallel import mesh as mesh_lib
from train.run.inputs import run_config
from train.run.step import microbatch


def make_optimizer(run: run_config.RunConfig) -> optax.GradientTransformation:
  """AdamW, linear warmup then cosine decay to 10%, global-norm clipping.

  Weight decay skips vectors (norm scales); matrices and embeddings decay.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=run.learning_rate,
      warmup_steps=run.warmup_steps,
      decay_steps=max(run.steps, run.warmup_steps + 1),
      end_value=0.1 * run.learning_rate,
  )
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  adamw = optax.adamw(
      schedule,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=run.weight_decay,
      mask=decay_mask,
  )
  if run.opt_state_dtype != "float32":
    adamw = stored_as(adamw, jnp.dtype(run.opt_state_dtype))
  return optax.chain(optax.clip_by_global_norm(run.grad_clip), adamw)


def stored_as(
    inner: optax.GradientTransformation, dtype
) -> optax.GradientTransformation:
  """`inner` with its floating state stored in `dtype`, updated in float32.

  Each update reads the stored state as float32, runs `inner` and rounds
  the new state to `dtype`: the moments of AdamW in bfloat16 take half the
  memory (DeepSeek-V3's recipe), the arithmetic stays float32.
  """

  def cast(tree, to):
    return jax.tree.map(
        lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        tree,
    )

  def init(params):
    return cast(inner.init(params), dtype)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, cast(state, jnp.float32), params)
    return updates, cast(state, dtype)

  return optax.GradientTransformation(init, update)


def _global_norm(tree) -> jax.Array:
  # optax >= 0.2.5 has optax.tree.norm and deprecates optax.global_norm.
  tree_lib = getattr(optax, "tree", None)
  if tree_lib is not None and hasattr(tree_lib, "norm"):
    return tree_lib.norm(tree)
  return optax.global_norm(tree)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-byte loss in nats: logits [B, T, V] f32, targets [B, T]."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)
  return -jnp.mean(picked)


def _finite_flags(tree) -> list[jax.Array]:
  """One bool scalar per floating leaf of `tree`: all its values finite."""
  return [
      jnp.all(jnp.isfinite(x))
      for x in jax.tree.leaves(tree)
      if jnp.issubdtype(x.dtype, jnp.inexact)
  ]


def floating_leaf_paths(tree) -> list[str]:
  """The tree paths of `tree`'s floating leaves, in `_finite_flags` order."""
  return [
      jax.tree_util.keystr(path)
      for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
      if jnp.issubdtype(x.dtype, jnp.inexact)
  ]


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """XLA's memory figures for one compiled step, in bytes per device.

  From `Compiled.memory_analysis()`: what XLA assigns when it compiles the
  step, hence what the run allocates for it (the state's buffers are the
  arguments and outputs).
  """

  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int

  @property
  def total(self) -> int:
    """Peak bytes the step holds: inputs, outputs (less those that reuse
    an input's buffer), temporaries and generated code."""
    return (
        self.arguments
        + self.outputs
        - self.aliased
        + self.temporaries
        + self.code
    )


class Program:
  """The jitted train and eval steps of one model/optimiser configuration.

  Cached per configuration and mesh (`program`), so Trainers of equal runs
  (a run and its resumption, tests) share compiled code.

  The training state is a dict pytree {"params", "opt_state", "bias"}:
  `train_step(state, batch [B, T+1])` returns (new state, device metrics),
  `eval_step(params, bias, batch)` the mean next-byte loss.

  The train step donates its state argument: the new state takes the old
  one's buffers, so the device holds one state, not two. A step whose loss
  or gradients are not finite returns its input state unchanged (the
  "finite" metric is then False), so nothing of a diverging step is kept.
  An update that overflows from finite gradients (a learning rate near
  float32's range) is kept, and "finite" says so.

  `placement`, for a mesh, is a `train.parallel.sharding.Placement`: the
  steps keep the state where it says, take batches split as it says, and return
  replicated metrics.

  `finite_flags(state)` returns one bool per floating leaf of the state
  (see `floating_leaf_paths`): whether all its values are finite.
  """

  def __init__(self, run: run_config.RunConfig, graphdef, placement=None):
    self.run = run
    self.graphdef = graphdef
    self.placement = placement
    self.optimizer = make_optimizer(run)
    self._memory = {}  # train_step_memory's, per argument signature.
    finite_fn = lambda state: jnp.stack(_finite_flags(state))
    self.train_step = self._train_jit = jax.jit(
        self.step_fn, **self.train_jit_kwargs()
    )
    if placement is None:
      self.eval_step = jax.jit(self._eval_fn)
      self.finite_flags = jax.jit(finite_fn)
      return
    # On a mesh, the state keeps its sharding from step to step, batches
    # arrive split over the data-parallel axes, and the metrics come back
    # replicated, so every process can read them.
    state = placement.state
    self.eval_step = jax.jit(
        self._eval_fn,
        in_shardings=(state["params"], state["bias"], placement.batch),
        out_shardings=placement.replicated,
    )
    self.finite_flags = jax.jit(
        finite_fn, in_shardings=(state,), out_shardings=placement.replicated
    )

  def train_jit_kwargs(self) -> dict:
    """`jax.jit`'s arguments for `step_fn`: shardings (on a mesh), and
    the donated state."""
    kwargs = {"donate_argnums": (0,)}
    if self.placement is not None:
      state = self.placement.state
      kwargs["in_shardings"] = (state, self.placement.batch)
      kwargs["out_shardings"] = (state, self.placement.replicated)
    return kwargs

  def train_step_memory(self, state, batch) -> StepMemory | None:
    """XLA's memory figures for `train_step(state, batch)`.

    `state` and `batch` may be arrays or jax.ShapeDtypeStructs (with the
    shardings the run gives them): nothing is allocated. Compiling here
    costs nothing extra where the run then calls the step with arrays like
    these: jit and this ahead-of-time compile share their cache. The
    figures are kept per shapes and shardings.

    Returns:
      The figures, or None where the backend gives none.
    """
    signature = jax.tree.map(
        lambda x: (x.shape, x.dtype, getattr(x, "sharding", None)),
        (state, batch),
    )
    key = str(signature)
    if key not in self._memory:
      self._memory[key] = self._compile_memory(state, batch)
    return self._memory[key]

  def _compile_memory(self, state, batch) -> StepMemory | None:
    # The jitted step itself: a caller (a test) may wrap `train_step`.
    compiled = self._train_jit.lower(state, batch).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
      return None
    return StepMemory(
        arguments=int(analysis.argument_size_in_bytes),
        outputs=int(analysis.output_size_in_bytes),
        aliased=int(analysis.alias_size_in_bytes),
        temporaries=int(analysis.temp_size_in_bytes),
        code=int(analysis.generated_code_size_in_bytes),
    )

  def _forward(self, params, bias, batch):
    model = nnx.merge(self.graphdef, params, bias)
    logits, stats = model(batch[:, :-1])
    ce = cross_entropy(logits, batch[:, 1:])
    return ce, stats

  def _loss(self, params, bias, batch):
    ce, stats = self._forward(params, bias, batch)
    run = self.run
    if stats is not None:
      lb = jnp.mean(stats["load_balancing_loss"])
      z = jnp.mean(stats["router_z_loss"])
    else:
      lb = z = jnp.zeros((), jnp.float32)
    total = ce + run.aux_loss_weight * lb + run.z_loss_weight * z
    return total, (ce, lb, z, stats)

  def step_fn(self, state, batch):
    """One optimiser step: (state, batch [B, T+1]) -> (state, metrics).

    Pure (not jitted): `train_step` is its jit, with `train_jit_kwargs`.
    """
    placement = self.placement
    (total, (ce, lb, z, stats)), grads = microbatch.value_and_grad(
        self._loss,
        state["params"],
        state["bias"],
        batch=batch,
        microbatches=self.run.microbatches,
        mesh=None if placement is None else placement.mesh,
        axes=mesh_lib.BATCH_AXES,
    )
    grad_norm = _global_norm(grads)
    updates, opt_state = self.optimizer.update(
        grads, state["opt_state"], state["params"]
    )
    params = optax.apply_updates(state["params"], updates)
    model = nnx.merge(self.graphdef, params, state["bias"])
    if stats is not None:
      model.update_correction_biases(
          stats["tokens_per_expert"], self.run.bias_update_rate
      )
    _, params, bias = nnx.split(model, nnx.Param, moe_flax.CorrectionBias)
    new_state = {"params": params, "opt_state": opt_state, "bias": bias}
    # Known before the update is written: the old state's buffers (donated)
    # can take the new values in place, or keep the old ones.
    ok = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    new_state = jax.tree.map(
        lambda new, old: jnp.where(ok, new, old), new_state, state
    )
    # The finite check below reads the new state as written: without the
    # barrier XLA fuses the whole optimizer update into the check's
    # reductions and computes it a second time (10.7 ms of a 176 ms step
    # of tpu_v5e_dsv3 on a v5e, against about 2 ms to read the parameters).
    new_state = jax.lax.optimization_barrier(new_state)

    def stacked(name, empty_shape):
      if stats is None:
        return jnp.zeros(empty_shape, jnp.int32)
      return stats[name]

    metrics = {
        "loss": ce,
        "total_loss": total,
        "load_balancing_loss": lb,
        "router_z_loss": z,
        "grad_norm": grad_norm,
        "tokens_per_expert": stacked("tokens_per_expert", (0, 1)),
        "dropped": stacked("dropped_tokens", (0,)),
        # Assignments from NaN/Inf routing scores (docs/api.md, "Guarantees").
        "invalid": stacked("invalid_assignments", (0,)),
        # Whether the step's state is all finite: a finite loss can come
        # with an update that overflows (a huge learning rate), and the
        # trainer must not keep, let alone save, such a state. Only the
        # parameters and biases can overflow from finite gradients: AdamW
        # sees them clipped to a global norm of grad_clip (positive,
        # finite), so its moments stay finite. Checking the moments too
        # read 3 GB a step on tpu_v5e_dsv3 (16 ms of a 218 ms step on a
        # v5e).
        "finite": ok
        & jnp.all(
            jnp.stack(_finite_flags((new_state["params"], new_state["bias"])))
        ),
    }
    return new_state, metrics

  def _eval_fn(self, params, bias, batch):
    return self._forward(params, bias, batch)[0]


_PROGRAMS: dict[tuple, Program] = {}


def program(run: run_config.RunConfig, graphdef, placement=None) -> Program:
  """The (cached) Program of `run`'s model, optimiser and mesh settings.

  Cached per `run_config.compile_key` and mesh: the same run over other
  devices (another topology's) is another program.
  """
  run = run_config.compile_key(run)
  key = (run, None if placement is None else placement.mesh)
  if key not in _PROGRAMS:
    _PROGRAMS[key] = Program(run, graphdef, placement)
  return _PROGRAMS[key]
