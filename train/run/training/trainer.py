"""The trainer: a Trainer builds the model and trains it.

Around the compiled steps (`steps.py`) it draws batches, evaluates,
checkpoints and resumes (`resume.py`); its loop (`loop.py`, `fit`) logs
each step and stops cleanly after the step in flight on a signal. A
Trainer owns its --output_dir from `prepare_output_dir` (or `fit`) to
`close` (process 0 holds the directory's lock), and the faults a run can
meet (`training_faults.py`: a non-finite loss or state, the device's
memory, a checkpoint that cannot be written) end it with one line each
(docs/training.md, "The training program's faults"). Its public methods
(steps, evaluation, checkpoints, the output directory, the loop) are the
program's and tests' API.
"""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from train.checkpoints import checkpoint
from train.checkpoints import checkpoint_dirs
from train.checkpoints import output_dir
from train.checkpoints import output_lock
from train.parallel import distributed
from train.parallel import mesh as mesh_lib
from train.presets import sizing
from train.run.dry_run import memory_check
from train.run.inputs import data as data_lib
from train.run.inputs import run_config
from train.run.reporting import mfu
from train.run.reporting import step_log
from train.run.step import state as state_lib
from train.run.step import step_builder
from train.run.step import steps
from train.run.training import loop
from train.run.training import resume
from train.run.training import stop_signals
from train.run.training import training_faults

# Their old home: the run config and the compiled steps used to live here.
RunConfig = run_config.RunConfig
run_config_from_preset = run_config.run_config_from_preset
make_optimizer = steps.make_optimizer
cross_entropy = steps.cross_entropy


class Trainer(loop.TrainingLoop):
  """Builds the model and optimiser for `run` and trains it.

  State is a dict pytree {"params", "opt_state", "bias"}: float32 master
  weights (`nnx.Param`), the optax state, and the MoE correction biases
  (`moe_flax.CorrectionBias`, float32, updated by the aux-loss-free rule and
  never by the optimiser).

  The faults a run can meet raise one exception each, whose message is the
  one line `train.main` prints (no traceback):
  `training_faults.NonFiniteError` for a non-finite loss or state (nothing
  of that step kept or saved), `training_faults.OutOfMemoryError` for the
  device's memory (naming the estimate and the flags that lower it),
  `checkpoint_failures.CheckpointSaveError` for a checkpoint that cannot be
  written (at the step it failed).
  """

  def __init__(
      self,
      run: RunConfig,
      corpus: data_lib.Corpus | None = None,
      out=sys.stdout,
  ):
    self.run = run
    self.out = out
    self.corpus = corpus or data_lib.load(run.data)
    if run.model.vocab_size < data_lib.VOCAB_SIZE:
      raise ValueError(
          f"byte tokens need vocab_size >= 256, got " f"{run.model.vocab_size}."
      )
    self.sizes = mesh_lib.parse(run.mesh)
    self.mesh = mesh_lib.build(self.sizes)
    self.is_main = distributed.is_main_process()
    # The step and the state's shapes and shardings, built abstractly: the
    # state is computed (`state`) or restored only once the step is known
    # to fit.
    self.built = step_builder.build(run, self.mesh)
    self.placement = self.built.spec.placement
    self.program = self.built.program
    self._state = None
    self.step = 0
    self.sampler = data_lib.BatchSampler(
        self.corpus.train, run.batch_size, run.seq_len, run.seed
    )
    self.eval_set = data_lib.eval_batches(
        self.corpus.held_out, run.batch_size, run.seq_len, run.eval_batches
    )
    if self.mesh is not None:
      # A short last batch must still split over the data-parallel devices.
      shards = mesh_lib.batch_shards(self.sizes)
      self.eval_set = [b[: len(b) - len(b) % shards] for b in self.eval_set]
      self.eval_set = [b for b in self.eval_set if len(b)]
    self.history = step_log.new_history()
    # MFU's terms: the model's training FLOPs per token and the devices'
    # peak (None on a CPU or an unknown accelerator: no MFU is logged).
    self.device_kind = jax.devices()[0].device_kind
    self.peak = mfu.peak_of(self.device_kind)
    self.flops_per_token = sizing.flops_per_token(run.model, run.seq_len)[
        "train"
    ]
    self._checkpointer = None
    self.backend_name = self._resolve_backend()
    self._signals = stop_signals.StopSignals()
    # The output directory: taken by prepare_output_dir or fit, given back
    # by close. Only process 0 holds the lock.
    self._output_lock: output_lock.OutputDirLock | None = None
    self._owns_output_dir = False
    # XLA's memory figures of the train step; a step that does not fit the
    # devices is refused here, before anything is allocated.
    self.memory: steps.StepMemory | None = self._compile_and_check()

  @property
  def state(self):
    """The training state; computed on first use, sharded as it lives.

    A run that resumes restores it instead (`restore_checkpoint`), so the
    state is never held twice.
    """
    if self._state is None:
      self._state = state_lib.initialise(self.run, self.built.spec)
    return self._state

  @state.setter
  def state(self, value) -> None:
    self._state = value

  def _abstract_arguments(self):
    """(state, batch) as the step receives them, abstract. Without a mesh
    they carry no sharding, as the run's arrays (uncommitted): compiling
    for them fills the cache the run's first step reads."""
    return self.built.state, self.built.batch

  def _compile_and_check(self) -> steps.StepMemory | None:
    """Compiles the train step and refuses it if it does not fit.

    Raises:
      memory_check.StepDoesNotFitError: XLA's figure exceeds a device's
        memory (`memory_check`).
      training_faults.OutOfMemoryError: the compile itself ran out of
        device memory.
    """
    try:
      memory = self.program.train_step_memory(*self._abstract_arguments())
    except RuntimeError as e:
      if not training_faults.is_out_of_memory(e):
        raise
      raise training_faults.out_of_memory_error(
          self.run, e, when="compiling the train step"
      ) from e
    memory_check.check(self.run, memory)
    return memory

  # --- Host side -------------------------------------------------------------

  def _resolve_backend(self) -> str:
    if self.run.model.moe is None:
      return "none (dense model)"
    name = self.run.backend
    if name == "auto":
      chosen = moe_core.get_backend("auto").name
      # Why "auto" ran past a backend that runs here (the cpu backend where
      # its kernels lose to xla's): a newcomer's first question.
      passed = []
      for candidate in moe_core.auto_order():
        if candidate == chosen:
          break
        if moe_core.registry.availability(candidate)[0]:
          passed.append(moe_core.registry.auto_choice(candidate)[1])
      return f"auto -> {chosen}" + "".join(f" ({why})" for why in passed)
    ok, why = moe_core.get_backend(name).availability()
    if not ok:
      raise ValueError(
          f"--moe_backend={name} is not available here: {why} "
          f"Available: {moe_core.available_backends()}."
      )
    return name

  def _put_batch(self, batch) -> jax.Array:
    """A host batch [B, T+1] (the same on every process) on the devices."""
    if isinstance(batch, jax.Array):
      return batch
    if self.placement is None:
      return jnp.asarray(batch)
    return self.placement.put_batch(batch)

  def _next_batch(self) -> jax.Array:
    """The sampler's next batch; each process reads only its own rows."""
    if self.placement is None:
      return jnp.asarray(self.sampler.next())
    return self.placement.read_batch(self.sampler)

  def train_step(self, batch) -> dict:
    """One optimiser step on `batch` [B, T+1]; returns host metrics.

    The step counter moves only once the step's metrics are on the host,
    and only if its loss and its updated state are finite. The step
    donates the state: from its dispatch on, the trainer holds the state
    it returns, which is the state before it when its loss or gradients
    were not finite (see `steps.Program`).

    Raises:
      training_faults.NonFiniteError: the loss, or a value of the updated
        state, is NaN or Inf; one line naming the step. The step counter
        stays, and so does the state unless finite gradients overflowed it
        (a learning rate near float32's range).
      training_faults.StepInterrupted: a KeyboardInterrupt landed while the
        step ran; the step was finished and committed first (the state it
        consumed is gone).
    """
    state, metrics = self.program.train_step(self.state, self._put_batch(batch))
    self.state = state
    try:
      metrics = jax.device_get(metrics)
    except KeyboardInterrupt as interrupt:
      metrics = jax.device_get(metrics)  # The step is under way: finish it.
      self._commit(metrics)
      raise training_faults.StepInterrupted(metrics) from interrupt
    self._commit(metrics)
    return metrics

  def _commit(self, metrics: dict) -> None:
    """Counts the step whose host `metrics` these are, if finite."""
    loss = float(metrics["loss"])
    if not math.isfinite(loss) or not bool(metrics.get("finite", True)):
      raise training_faults.NonFiniteError(
          training_faults.non_finite_message(
              self.run, self.step + 1, loss, self._newest_checkpoint()
          )
      )
    self.step += 1

  def _newest_checkpoint(self) -> str | None:
    ours = [
        p
        for _, p in checkpoint_dirs.list_checkpoints(self.checkpoint_dir)
        if checkpoint_dirs.is_ours(p)
    ]
    return ours[-1] if ours else None

  def non_finite_leaves(self, state=None) -> list[str]:
    """Tree paths of the leaves of `state` (default: the run's) that hold a
    NaN or Inf."""
    state = self.state if state is None else state
    flags = np.asarray(jax.device_get(self.program.finite_flags(state)))
    paths = steps.floating_leaf_paths(state)
    return [p for p, ok in zip(paths, flags) if not ok]

  def step_memory(self) -> steps.StepMemory | None:
    """XLA's memory figures of this run's train step, per device.

    Compiles the step for the run's state and batches, abstractly: the
    compile the first step does (they share jit's cache).
    """
    return self.program.train_step_memory(*self._abstract_arguments())

  def evaluate(self) -> float:
    """Mean held-out next-byte loss (nats) over the fixed eval batches."""
    losses = [
        float(
            self.program.eval_step(
                self.state["params"], self.state["bias"], self._put_batch(b)
            )
        )
        for b in self.eval_set
    ]
    weights = [len(b) for b in self.eval_set]
    return float(np.average(losses, weights=weights))

  # --- Checkpoints -----------------------------------------------------------

  @property
  def checkpoint_dir(self) -> str:
    return os.path.join(self.run.output_dir, "checkpoints")

  @property
  def fingerprint(self) -> dict:
    """What a checkpoint of this run records, and a resume must match."""
    return self.run.fingerprint(self.corpus.name, self.corpus.sha256)

  @property
  def checkpointer(self) -> checkpoint.Checkpointer:
    """The run's (async, Orbax) checkpointer, made on first use."""
    if self._checkpointer is None:
      self._checkpointer = checkpoint.Checkpointer(
          self.checkpoint_dir,
          fingerprint=self.fingerprint,
          keep=self.run.keep_checkpoints,
      )
    return self._checkpointer

  def save_checkpoint(self) -> str:
    """Starts saving the state (every process its own shards); see wait.

    Raises:
      training_faults.NonFiniteError: the state holds a NaN or Inf (nothing
        is written).
      checkpoint_failures.CheckpointSaveError: the checkpoint cannot be written.
    """
    bad = self.non_finite_leaves()
    if bad:
      raise training_faults.NonFiniteError(
          f"step {self.step}: not saving a checkpoint of a state with NaN or "
          f"Inf values ({len(bad)} leaves, first {bad[0]})."
      )
    return self.checkpointer.save(
        self.step,
        self.state,
        extra={
            "data": self.sampler.state(),
            "history": self.history,
            "settings": resume.soft_settings(self.run),
        },
    )

  def restore_checkpoint(self, path: str) -> None:
    """Loads checkpoint `path` onto this run's devices and mesh.

    The checkpoint may come from another mesh or process count: each leaf
    is read into this run's sharding of it.
    """
    fingerprint = resume.resume_fingerprint(
        path, self.fingerprint, self.corpus, self.run, self._print
    )
    state, meta = resume.restore(
        self.checkpointer,
        path,
        self.built.state,
        fingerprint=fingerprint,
        non_finite_leaves=self.non_finite_leaves,
    )
    extra = meta["extra"]
    self.state, self.step = state, meta["step"]
    self.sampler.restore(extra["data"])
    self.history = extra.get("history", self.history)
    resume.note_changed_settings(
        self.run, extra.get("settings", {}), self._print
    )

  # --- The output directory --------------------------------------------------

  def _take_output_dir(self) -> None:
    """Process 0 takes --output_dir's lock; every process learns if it did.

    Raises:
      output_lock.OutputDirBusyError: another run holds it (process 0's
        message names the holder); on the other processes, one line
        saying that process 0 could not take it.
    """
    if self._owns_output_dir:
      return
    lock = output_dir.take(self.run.output_dir, self.is_main)
    self._output_lock, self._owns_output_dir = lock, True
    if lock is not None and lock.note:
      self._print(lock.note)

  def _release_output_dir(self) -> None:
    if self._output_lock is not None:
      self._output_lock.release()
    self._output_lock, self._owns_output_dir = None, False

  def prepare_output_dir(self) -> None:
    """Takes --output_dir, then resumes from the newest checkpoint, or clears
    this program's old ones when fresh.

    First deletes what killed saves left behind (process 0), saying so. A
    fresh run deletes only the `step_*` checkpoints this program wrote
    (`checkpoint_dirs.is_ours`); it refuses to start beside `step_*`
    directories of any other origin, whose names its saves could meet.

    Raises:
      output_lock.OutputDirBusyError: another run holds --output_dir.
      checkpoint_meta.CheckpointError: nothing or nothing usable to resume, or
        foreign `step_*` directories in the way of a fresh run. The
        directory is given back before it is raised.
    """
    self._take_output_dir()
    try:
      self._prepare_checkpoints()
    except BaseException:
      self._release_output_dir()
      raise

  def _prepare_checkpoints(self) -> None:
    newest = output_dir.prepare_checkpoints(
        self.checkpoint_dir,
        resume=self.run.resume,
        is_main=self.is_main,
        say=self._print,
    )
    if newest is not None:
      self.restore_checkpoint(newest)
      self._print(f"resumed from {newest} at step {self.step}")
    else:
      # A fresh run computes its initial state now: a failure to place it
      # on the devices is met before the first step.
      _ = self.state

  # --- Output ---------------------------------------------------------------

  def _print(self, text: str) -> None:
    if self.out is not None:
      print(text, file=self.out, flush=True)

  def close(self) -> None:
    """Finishes any checkpoint still being written, then gives back
    --output_dir (call before exiting)."""
    try:
      if self._checkpointer is not None:
        self._checkpointer.close()
        self._checkpointer = None
    finally:
      self._release_output_dir()
