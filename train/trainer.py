"""The training loop: a Trainer builds the model and trains it.

Around the compiled steps (`train/steps.py`) it draws batches, evaluates,
checkpoints, resumes, and logs each step (`train/step_log.py`); signals
stop it cleanly after the step in flight.

A Trainer owns its --output_dir from `prepare_output_dir` (or `fit`) to
`close`: process 0 holds the directory's lock (`train/output_lock.py`), and
a second run on the same directory is refused. The faults a run can meet
end it with one line each (the exception's message, no traceback in
`train.main`): a non-finite loss or state (`NonFiniteError`, nothing of it
kept or saved), the device's memory (`OutOfMemoryError`, naming the
estimate and the flags that lower it), a checkpoint that cannot be written
(`checkpoint_failures.CheckpointSaveError`, at the step it failed).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from train import checkpoint
from train import checkpoint_dirs
from train import checkpoint_meta
from train import cost_report
from train import data as data_lib
from train import distributed
from train import memory_check
from train import mesh as mesh_lib
from train import output_lock
from train import report
from train import run_config
from train import state as state_lib
from train import step_builder
from train import step_log
from train import steps

# Their old home: the run config and the compiled steps used to live here.
RunConfig = run_config.RunConfig
run_config_from_preset = run_config.run_config_from_preset
make_optimizer = steps.make_optimizer
cross_entropy = steps.cross_entropy


class TrainingFault(RuntimeError):
  """A fault that ends a run; its message is the one line to show."""


class NonFiniteError(TrainingFault):
  """The loss or the updated state is not finite (NaN or Inf)."""


class OutOfMemoryError(TrainingFault):
  """The device ran out of memory (XLA's RESOURCE_EXHAUSTED)."""


class StepInterrupted(KeyboardInterrupt):
  """A KeyboardInterrupt during a train step, raised once the step that
  was under way is committed; `metrics` are its host metrics."""

  def __init__(self, metrics: dict):
    super().__init__()
    self.metrics = metrics


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA running out of device memory.

  XLA raises `jax.errors.JaxRuntimeError` (a RuntimeError) whose message
  starts with its status, RESOURCE_EXHAUSTED; tensorstore's disk-full
  errors use that status too, but as ValueErrors.
  """
  return isinstance(error, RuntimeError) and (
      "RESOURCE_EXHAUSTED" in str(error)
  )


def out_of_memory_error(
    run: RunConfig,
    error: BaseException,
    *,
    when: str,
    memory: steps.StepMemory | None = None,
) -> OutOfMemoryError:
  """The one-line OutOfMemoryError for `error`, met `when`.

  It names XLA's complaint, the estimate for the run's flags (XLA's figure
  for the compiled step where known, and the analytic one) and the flags
  that lower it.
  """
  said = (str(error).strip().splitlines() or [""])[0][:200]
  analytic = cost_report.analytic_bytes_per_device(run)
  if memory is not None:
    estimate = (
        f"the compiled train step needs {cost_report.human_bytes(memory.total)}"
        f" per device (XLA; the analytic estimate is "
        f"{cost_report.human_bytes(analytic)})"
    )
  else:
    estimate = (
        f"the analytic estimate is {cost_report.human_bytes(analytic)} per "
        "device (--dry_run also prints XLA's figure for the compiled step)"
    )
  remat = "" if run.remat == "full" else f", --remat=full (now {run.remat})"
  return OutOfMemoryError(
      f"out of device memory {when} ({said}); {estimate}. Lower it with "
      f"--batch_size (now {run.batch_size}), --microbatches (now "
      f"{run.microbatches}), --seq_len (now {run.seq_len})"
      f"{remat}, or more devices on --mesh (now {run.mesh}; fsdp, expert "
      "and tensor split the weights, data, fsdp and expert the batch)."
  )


def compiled_step_memory(run: RunConfig) -> steps.StepMemory | None:
  """XLA's memory figures for `run`'s train step, compiled for its mesh.

  Builds the step abstractly (nothing allocated) and compiles the very
  step a Trainer of `run` compiles: the figures are those of the run.
  Needs the mesh's devices (simulated CPU devices will do).

  Raises:
    ValueError: the mesh does not fit the devices, or the run the mesh.
  """
  sizes = mesh_lib.parse(run.mesh)
  step = step_builder.build(run, mesh_lib.build(sizes))
  return step.program.train_step_memory(step.state, step.batch)


def _on_default_device(tree):
  """Abstract leaves without a sharding, placed on the default device (a
  restore target: each leaf says where it goes)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(
      lambda x: x
      if x.sharding is not None
      else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      tree,
  )


def _optimizer_step_counts(opt_state) -> dict[str, int]:
  """{tree path: value} of the optax state's step counters ("count")."""
  counts = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if getattr(path[-1], "name", None) == "count":
      # Replicated: every process holds the whole scalar.
      local = leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf
      counts[jax.tree_util.keystr(path)] = int(np.asarray(local))
  return counts


class Trainer:
  """Builds the model and optimiser for `run` and trains it.

  State is a dict pytree {"params", "opt_state", "bias"}: float32 master
  weights (`nnx.Param`), the optax state, and the MoE correction biases
  (`moe_flax.CorrectionBias`, float32, updated by the aux-loss-free rule and
  never by the optimiser).
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
    self._checkpointer = None
    self.backend_name = self._resolve_backend()
    self._stop_signal = None
    self._deferring_signals = False
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
      OutOfMemoryError: the compile itself ran out of device memory.
    """
    try:
      memory = self.program.train_step_memory(*self._abstract_arguments())
    except RuntimeError as e:
      if not is_out_of_memory(e):
        raise
      raise out_of_memory_error(
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
      return f"auto -> {moe_core.get_backend('auto').name}"
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
      NonFiniteError: the loss, or a value of the updated state, is NaN or
        Inf; one line naming the step. The step counter stays, and so does
        the state unless finite gradients overflowed it (a learning rate
        near float32's range).
      StepInterrupted: a KeyboardInterrupt landed while the step ran; the
        step was finished and committed first (the state it consumed is
        gone).
    """
    state, metrics = self.program.train_step(self.state, self._put_batch(batch))
    self.state = state
    try:
      metrics = jax.device_get(metrics)
    except KeyboardInterrupt as interrupt:
      metrics = jax.device_get(metrics)  # The step is under way: finish it.
      self._commit(metrics)
      raise StepInterrupted(metrics) from interrupt
    self._commit(metrics)
    return metrics

  def _commit(self, metrics: dict) -> None:
    """Counts the step whose host `metrics` these are, if finite."""
    loss = float(metrics["loss"])
    if not math.isfinite(loss) or not bool(metrics.get("finite", True)):
      raise NonFiniteError(self._non_finite_message(self.step + 1, loss))
    self.step += 1

  def _non_finite_message(self, step: int, loss: float) -> str:
    if math.isfinite(loss):
      what = (
          f"the update made the parameters or optimiser state non-finite "
          f"(the loss, {loss:.4g}, was finite)"
      )
    else:
      what = f"the loss is {loss}"
    newest = self._newest_checkpoint()
    resume = (
        f"--resume continues from {os.path.basename(newest)}"
        if newest
        else "no checkpoint was saved yet"
    )
    return (
        f"step {step}: {what}; the run stopped, keeping and saving nothing "
        f"of this step. Lower --learning_rate (now {self.run.learning_rate:g})"
        f" or raise --warmup_steps (now {self.run.warmup_steps}); {resume}."
    )

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

  # Settings a run may be resumed with changed (with a note): they change
  # the trajectory but not the shapes of the state.
  _SOFT_SETTINGS = (
      "steps",
      "learning_rate",
      "warmup_steps",
      "weight_decay",
      "grad_clip",
      "bias_update_rate",
      "aux_loss_weight",
      "z_loss_weight",
      "backend",
      "remat",
  )

  def _soft_settings(self) -> dict:
    return {k: getattr(self.run, k) for k in self._SOFT_SETTINGS}

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
      NonFiniteError: the state holds a NaN or Inf (nothing is written).
      checkpoint_failures.CheckpointSaveError: the checkpoint cannot be written.
    """
    bad = self.non_finite_leaves()
    if bad:
      raise NonFiniteError(
          f"step {self.step}: not saving a checkpoint of a state with NaN or "
          f"Inf values ({len(bad)} leaves, first {bad[0]})."
      )
    return self.checkpointer.save(
        self.step,
        self.state,
        extra={
            "data": self.sampler.state(),
            "history": self.history,
            "settings": self._soft_settings(),
        },
    )

  def restore_checkpoint(self, path: str) -> None:
    """Loads checkpoint `path` onto this run's devices and mesh.

    The checkpoint may come from another mesh or process count: each leaf
    is read into this run's sharding of it.
    """
    fingerprint = self._resume_fingerprint(path)
    # The abstract state is the template: each leaf's sharding says where
    # its shards go, and each process reads just its devices' shards. No
    # initial state is computed to be overwritten.
    template = _on_default_device(self.built.state)
    state, meta = self.checkpointer.restore(
        path, template, fingerprint=fingerprint
    )
    bad = self.non_finite_leaves(state)
    if bad:
      raise checkpoint_meta.CheckpointError(
          f"checkpoint {path!r} holds NaN or Inf values ({len(bad)} leaves, "
          f"first {bad[0]}): it was saved after the run diverged. Move it "
          "out of the checkpoint directory to resume from the one before, "
          "or start afresh."
      )
    extra = meta.get("extra", {})
    if "data" not in extra:
      raise checkpoint_meta.CheckpointError(
          f"checkpoint {path!r} lacks the data position; cannot resume "
          "exactly."
      )
    counts = _optimizer_step_counts(state["opt_state"])
    if any(count != meta["step"] for count in counts.values()):
      raise checkpoint_meta.CheckpointError(
          f"checkpoint {path!r}: {checkpoint_dirs.META} records step "
          f"{meta['step']}, but the step counters of the optimiser state in "
          f"{checkpoint_dirs.ARRAYS}/ say {counts}."
      )
    self.state, self.step = state, meta["step"]
    self.sampler.restore(extra["data"])
    self.history = extra.get("history", self.history)
    settings = extra.get("settings", {})
    changed = {
        k: (settings[k], v)
        for k, v in self._soft_settings().items()
        if k in settings and settings[k] != v
    }
    if changed:
      self._print(
          f"note: resuming with changed settings {changed} "
          "(checkpoint value, now); the run will not match an "
          "uninterrupted one."
      )

  def _resume_fingerprint(self, path: str) -> dict:
    """The fingerprint checkpoint `path` must match, after checking that
    the text has the contents it was trained on.

    Raises:
      checkpoint_meta.CheckpointError: the same --data path (or the embedded
        corpus) with other contents than when `path` was saved.
    """
    saved = checkpoint_meta.read_meta(path)["fingerprint"]
    fingerprint = self.fingerprint
    if "data_sha256" not in saved:
      # Saved before the digest was recorded: only the name can be checked.
      del fingerprint["data_sha256"]
      self._print(
          f"note: {os.path.basename(path)} records no digest of its text; "
          "whether the contents of --data changed since cannot be checked."
      )
    elif (
        saved.get("data") == self.corpus.name
        and saved["data_sha256"] != self.corpus.sha256
    ):
      what = (
          f"--data={self.corpus.name!r}"
          if self.run.data
          else f"the embedded corpus {self.corpus.name!r} (another Python "
          "version ships other text)"
      )
      raise checkpoint_meta.CheckpointError(
          f"{what} changed since checkpoint {path!r} was saved: its SHA-256 "
          f"was {saved['data_sha256'][:16]}..., now "
          f"{self.corpus.sha256[:16]}...; --resume needs the text the run "
          "trained on: put it back, or start a new run (without --resume, or "
          "in another --output_dir)."
      )
    return fingerprint

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
    lock, error = None, None
    if self.is_main:
      try:
        lock = output_lock.OutputDirLock(self.run.output_dir).acquire()
      except (output_lock.OutputDirBusyError, OSError) as e:
        error = e
    # All processes stop together, or none does.
    if not distributed.all_true(error is None):
      if error is not None:
        raise error
      raise output_lock.OutputDirBusyError(
          f"--output_dir={self.run.output_dir!r}: process 0 of this run "
          "could not take the directory's lock; its output says why."
      )
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
    if self.is_main:
      for line in checkpoint_dirs.remove_leftovers(self.checkpoint_dir):
        self._print(f"{self.checkpoint_dir}: {line}")
    # No process may list the checkpoints before the leftovers are gone.
    distributed.barrier("dropless_checkpoint_leftovers")
    found = checkpoint_dirs.list_checkpoints(self.checkpoint_dir)
    if self.run.resume:
      if not found:
        raise checkpoint_meta.CheckpointError(
            f"--resume: no checkpoint in {self.checkpoint_dir!r}; run without "
            "--resume to start a new run."
        )
      self.restore_checkpoint(found[-1][1])
      self._print(f"resumed from {found[-1][1]} at step {self.step}")
    elif found:
      foreign = checkpoint_dirs.foreign_step_dirs(self.checkpoint_dir)
      if foreign:
        raise checkpoint_meta.CheckpointError(
            f"{self.checkpoint_dir!r} holds {foreign[:5]} (showing up to 5), "
            "which this program did not write (no meta.json of its own); a "
            "fresh run deletes only its own checkpoints, and its saves could "
            "meet these names: move them out, or pass another --output_dir."
        )
      self._print(
          f"starting fresh: removing {len(found)} checkpoint(s) of a "
          f"previous run in {self.checkpoint_dir} (pass --resume to "
          "continue it instead)"
      )
      if self.is_main:
        checkpoint_dirs.remove_checkpoints(self.checkpoint_dir)
      # No process may look for checkpoints until they are gone.
      distributed.barrier("dropless_fresh_output_dir")
    if not self.run.resume:
      # A fresh run computes its initial state now: a failure to place it
      # on the devices is met before the first step.
      _ = self.state

  # --- The loop --------------------------------------------------------------

  def _print(self, text: str) -> None:
    if self.out is not None:
      print(text, file=self.out, flush=True)

  def _on_signal(self, signum, frame):
    """Asks the loop to stop after the current step (then it checkpoints).

    A second Ctrl-C is not deferred: it raises KeyboardInterrupt at once.
    """
    del frame
    self._stop_signal = signum
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)

  @contextlib.contextmanager
  def deferring_signals(self):
    """Inside, SIGINT and SIGTERM ask the run to stop after the step in flight.

    Before the last step that is an interruption (checkpointed, resumable);
    after it, the run finishes as usual: the final evaluation, save and
    report still happen, and nothing counts as interrupted. The previous
    handlers come back on exit. Nested uses are one. Main thread only.
    """
    if self._deferring_signals:
      yield
      return
    previous = {
        sig: signal.signal(sig, self._on_signal)
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    self._deferring_signals = True
    try:
      yield
    finally:
      self._deferring_signals = False
      for sig, handler in previous.items():
        signal.signal(sig, handler)

  def fit(self, *, handle_signals: bool = False) -> dict:
    """Trains to `run.steps`, evaluating and checkpointing on the way.

    Takes --output_dir first, if `prepare_output_dir` did not. With
    `handle_signals`, Ctrl-C and SIGTERM are deferred as
    `deferring_signals` says, up to the end of the final save.

    Returns:
      A summary dict (also written as summary.json by `train.main`).

    Raises:
      NonFiniteError: a step's loss or state is not finite (not kept).
      OutOfMemoryError: the devices ran out of memory.
      checkpoint_failures.CheckpointSaveError: a checkpoint could not be
        written; raised after the step that started it.
    """
    self._take_output_dir()
    signals = (
        self.deferring_signals() if handle_signals else contextlib.nullcontext()
    )
    with signals:
      return self._fit()

  def _fit(self) -> dict:
    run = self.run
    os.makedirs(run.output_dir, exist_ok=True)
    metrics_path = os.path.join(run.output_dir, "metrics.jsonl")
    self._first_step = self.step
    interrupted = None
    start = time.perf_counter()
    if self.step < run.steps:
      self._show_memory()
    try:
      # Only the holder of --output_dir's lock (process 0) writes the
      # metrics; the others compute the same ones. A resumed run keeps the
      # records up to the step it resumed from.
      with step_log.MetricsLog(
          metrics_path if self._output_lock is not None else None,
          resume_step=self.step if run.resume else None,
      ) as log:
        while self.step < run.steps:
          self._one_step(log, start)
          if self._stop_signal is not None and self.step < run.steps:
            interrupted = signal.Signals(self._stop_signal).name
            break
    except KeyboardInterrupt:
      interrupted = "KeyboardInterrupt"
    except RuntimeError as e:
      if not is_out_of_memory(e):
        raise
      raise out_of_memory_error(
          run, e, when=f"at step {self.step + 1}", memory=self.memory
      ) from e
    path = self.save_checkpoint()  # At the end, and on an interrupt.
    self.checkpointer.wait()
    if interrupted:
      self._print(
          f"\ninterrupted ({interrupted}) at step {self.step}; saved "
          f"{path}; continue with --resume"
      )
    elif self._stop_signal is not None:
      self._print(
          f"note: {signal.Signals(self._stop_signal).name} arrived after "
          "the last step; the run finished as usual"
      )
    return self.summary(
        wall_seconds=time.perf_counter() - start,
        checkpoint_path=path,
        interrupted=interrupted,
    )

  def _show_memory(self) -> None:
    """Prints the compiled train step's memory beside the estimate."""
    if self.memory is not None:
      analytic = cost_report.analytic_bytes_per_device(self.run)
      self._print(
          "memory: " + cost_report.compiled_memory_line(self.memory, analytic)
      )

  def _one_step(self, log: step_log.MetricsLog, start: float) -> None:
    """Trains, logs, evaluates and checkpoints one step, as due."""
    run = self.run
    position = self.sampler.state()
    batch = self._next_batch()
    t0 = time.perf_counter()
    interrupted = None
    try:
      metrics = self.train_step(batch)
    except StepInterrupted as e:
      metrics, interrupted = e.metrics, e  # Taken: logged, then raised.
    except KeyboardInterrupt:
      # The step did not happen: its batch must be drawn again.
      self.sampler.restore(position)
      raise
    record = step_log.log_step(
        self.history, run, self.step, metrics, time.perf_counter() - t0
    )
    log.append(record)
    if interrupted is not None:
      raise interrupted
    step_log.show_progress(
        run,
        self.step,
        record["loss"],
        record["tokens_per_s"],
        start=start,
        first_step=self._first_step,
    )
    if self.step % run.log_every == 0 or self.step == 1:
      self._print(step_log.format_record(run, record))
    if self.step % run.eval_every == 0 or self.step == run.steps:
      eval_loss = self.evaluate()
      self.history["eval_step"].append(self.step)
      self.history["eval_loss"].append(eval_loss)
      self._print(f"step {self.step:5d} held-out loss {eval_loss:.4f}")
    if self._checkpointer is not None:
      # A save started at an earlier step that has failed since stops the
      # run now, not at the next save.
      self._checkpointer.poll()
    if (
        run.checkpoint_every
        and self.step % run.checkpoint_every == 0
        and self.step < run.steps
    ):
      self.save_checkpoint()
      log.sync()  # The log on disk reaches at least the checkpoint.

  def close(self) -> None:
    """Finishes any checkpoint still being written, then gives back
    --output_dir (call before exiting)."""
    try:
      if self._checkpointer is not None:
        self._checkpointer.close()
        self._checkpointer = None
    finally:
      self._release_output_dir()

  def summary(
      self,
      *,
      wall_seconds: float,
      checkpoint_path: str | None,
      interrupted: str | None,
  ) -> dict:
    """The run's summary so far (see `report.run_summary`)."""
    return report.run_summary(
        self.run,
        self.corpus,
        self.history,
        steps=self.step,
        backend=self.backend_name,
        wall_seconds=wall_seconds,
        checkpoint_path=checkpoint_path,
        interrupted=interrupted,
        num_processes=jax.process_count(),
    )
