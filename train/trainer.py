"""The training loop: state, jitted steps, evaluation, checkpoints, logging."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import moe_core
from train import checkpoint
from train import data as data_lib
from train import model as model_lib
from train import nnx_moe
from train import presets


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything a training run depends on (flags map onto these fields)."""

  model: presets.ModelConfig
  steps: int
  batch_size: int
  seq_len: int
  learning_rate: float
  warmup_steps: int
  weight_decay: float
  grad_clip: float
  bias_update_rate: float
  aux_loss_weight: float
  z_loss_weight: float
  seed: int = 0
  backend: str = "auto"
  remat: str = "none"
  compute_dtype: str = "bfloat16"
  data: str | None = None
  output_dir: str = "/tmp/dropless_train"
  eval_every: int = 50
  eval_batches: int = 8
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  log_every: int = 25
  resume: bool = False
  progress: bool = True
  plot: bool = True

  def fingerprint(self, corpus_name: str) -> dict:
    """What a checkpoint must share with the run that resumes it."""
    return {
        "model": json.loads(
            json.dumps(dataclasses.asdict(self.model), default=str)
        ),
        "batch_size": self.batch_size,
        "seq_len": self.seq_len,
        "seed": self.seed,
        "data": corpus_name,
        "compute_dtype": self.compute_dtype,
    }


def run_config_from_preset(name: str, **overrides) -> RunConfig:
  """A RunConfig from preset `name`; `overrides` set (non-None) fields."""
  preset = presets.get_preset(name)
  fields = dataclasses.asdict(preset.train)
  fields["model"] = preset.model
  fields.update({k: v for k, v in overrides.items() if v is not None})
  return RunConfig(**fields)


def make_optimizer(run: RunConfig) -> optax.GradientTransformation:
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
  return optax.chain(
      optax.clip_by_global_norm(run.grad_clip),
      optax.adamw(
          schedule,
          b1=0.9,
          b2=0.95,
          eps=1e-8,
          weight_decay=run.weight_decay,
          mask=decay_mask,
      ),
  )


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


class _Program:
  """The jitted train and eval steps of one model/optimiser configuration.

  Cached per configuration (`_program`), so Trainers of equal runs (a run
  and its resumption, tests) share compiled code.
  """

  def __init__(self, run: RunConfig, graphdef):
    self.run = run
    self.graphdef = graphdef
    self.optimizer = make_optimizer(run)
    self.train_step = jax.jit(self._step_fn)
    self.eval_step = jax.jit(self._eval_fn)

  def _forward(self, params, bias, batch):
    model = nnx.merge(self.graphdef, params, bias)
    logits, stats = model(batch[:, :-1])
    ce = cross_entropy(logits, batch[:, 1:])
    return ce, stats

  def _loss(self, params, bias, batch):
    ce, stats = self._forward(params, bias, batch)
    run = self.run
    layers = sorted(stats)
    if layers:
      lb = jnp.mean(
          jnp.stack([stats[i]["load_balancing_loss"] for i in layers])
      )
      z = jnp.mean(jnp.stack([stats[i]["router_z_loss"] for i in layers]))
    else:
      lb = z = jnp.zeros((), jnp.float32)
    total = ce + run.aux_loss_weight * lb + run.z_loss_weight * z
    return total, (ce, lb, z, stats)

  def _step_fn(self, state, batch):
    grad_fn = jax.value_and_grad(self._loss, has_aux=True)
    (total, (ce, lb, z, stats)), grads = grad_fn(
        state["params"], state["bias"], batch
    )
    updates, opt_state = self.optimizer.update(
        grads, state["opt_state"], state["params"]
    )
    params = optax.apply_updates(state["params"], updates)
    model = nnx.merge(self.graphdef, params, state["bias"])
    for i, block in model.moe_blocks().items():
      block.update_correction_bias(
          stats[i]["tokens_per_expert"], self.run.bias_update_rate
      )
    _, params, bias = nnx.split(model, nnx.Param, nnx_moe.CorrectionBias)
    layers = sorted(stats)  # The MoE layers' indices.
    metrics = {
        "loss": ce,
        "total_loss": total,
        "load_balancing_loss": lb,
        "router_z_loss": z,
        "grad_norm": _global_norm(grads),
        "tokens_per_expert": (
            jnp.stack([stats[i]["tokens_per_expert"] for i in layers])
            if layers
            else jnp.zeros((0, 1), jnp.int32)
        ),
        "dropped": (
            jnp.stack([stats[i]["dropped_tokens"] for i in layers])
            if layers
            else jnp.zeros((0,), jnp.int32)
        ),
    }
    return {"params": params, "opt_state": opt_state, "bias": bias}, metrics

  def _eval_fn(self, params, bias, batch):
    return self._forward(params, bias, batch)[0]


# Fields of RunConfig that do not change the compiled program.
_HOST_ONLY_FIELDS = (
    "seed",
    "data",
    "output_dir",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "resume",
    "progress",
    "plot",
)
_PROGRAMS: dict[RunConfig, _Program] = {}


def _program(run: RunConfig, graphdef) -> _Program:
  key = dataclasses.replace(run, **{f: None for f in _HOST_ONLY_FIELDS})
  if key not in _PROGRAMS:
    _PROGRAMS[key] = _Program(key, graphdef)
  return _PROGRAMS[key]


class Trainer:
  """Builds the model and optimiser for `run` and trains it.

  State is a dict pytree {"params", "opt_state", "bias"}: float32 master
  weights (`nnx.Param`), the optax state, and the MoE correction biases
  (`nnx_moe.CorrectionBias`, float32, updated by the aux-loss-free rule and
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
    dtype = jnp.dtype(run.compute_dtype)
    model = model_lib.Transformer(
        run.model,
        backend=run.backend,
        compute_dtype=dtype,
        remat=run.remat,
        rngs=nnx.Rngs(params=run.seed),
    )
    graphdef, params, bias = nnx.split(model, nnx.Param, nnx_moe.CorrectionBias)
    self.program = _program(run, graphdef)
    self.state = {
        "params": params,
        "opt_state": self.program.optimizer.init(params),
        "bias": bias,
    }
    self.step = 0
    self.sampler = data_lib.BatchSampler(
        self.corpus.train, run.batch_size, run.seq_len, run.seed
    )
    self.eval_set = data_lib.eval_batches(
        self.corpus.held_out, run.batch_size, run.seq_len, run.eval_batches
    )
    self.history = {
        "step": [],
        "loss": [],
        "tokens_per_s": [],
        "eval_step": [],
        "eval_loss": [],
        "load": [],
        "dropped": [],
    }
    self.backend_name = self._resolve_backend()
    self._stop_signal = None

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

  def train_step(self, batch: np.ndarray) -> dict:
    """One optimiser step on `batch` [B, T+1]; returns host metrics.

    The step is committed (state and step counter) only once its metrics
    are on the host: dispatch is asynchronous, so a Ctrl-C most likely lands
    in the wait, and then neither the state nor the step may have moved.
    """
    state, metrics = self.program.train_step(self.state, jnp.asarray(batch))
    metrics = jax.device_get(metrics)
    self.state, self.step = state, self.step + 1
    return metrics

  def evaluate(self) -> float:
    """Mean held-out next-byte loss (nats) over the fixed eval batches."""
    losses = [
        float(
            self.program.eval_step(
                self.state["params"], self.state["bias"], jnp.asarray(b)
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

  def save_checkpoint(self) -> str:
    return checkpoint.save(
        self.checkpoint_dir,
        self.step,
        self.state,
        fingerprint=self.run.fingerprint(self.corpus.name),
        extra={
            "data": self.sampler.state(),
            "history": self.history,
            "settings": self._soft_settings(),
        },
        keep=self.run.keep_checkpoints,
    )

  def restore_checkpoint(self, path: str) -> None:
    state, meta = checkpoint.restore(
        path, self.state, fingerprint=self.run.fingerprint(self.corpus.name)
    )
    self.state = jax.tree.map(jnp.asarray, state)
    self.step = meta["step"]
    extra = meta.get("extra", {})
    if "data" not in extra:
      raise checkpoint.CheckpointError(
          f"checkpoint {path!r} lacks the data position; cannot resume "
          "exactly."
      )
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

  def prepare_output_dir(self) -> None:
    """Resumes from the newest checkpoint, or clears old ones when fresh."""
    found = checkpoint.list_checkpoints(self.checkpoint_dir)
    if self.run.resume:
      if not found:
        raise checkpoint.CheckpointError(
            f"--resume: no checkpoint in {self.checkpoint_dir!r}; run without "
            "--resume to start a new run."
        )
      self.restore_checkpoint(found[-1][1])
      self._print(f"resumed from {found[-1][1]} at step {self.step}")
    elif found:
      self._print(
          f"starting fresh: removing {len(found)} checkpoint(s) of a "
          f"previous run in {self.checkpoint_dir} (pass --resume to "
          "continue it instead)"
      )
      shutil.rmtree(self.checkpoint_dir)

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

  def _progress(self, step: int, loss: float, tps: float, start: float):
    if not self.run.progress or not sys.stderr.isatty():
      return
    width = 30
    done = int(width * step / self.run.steps)
    elapsed = time.perf_counter() - start
    eta = elapsed / max(step - self._first_step, 1) * (self.run.steps - step)
    sys.stderr.write(
        f"\r[{'#' * done}{'.' * (width - done)}] {step}/"
        f"{self.run.steps} loss {loss:.3f} {tps:,.0f} tok/s "
        f"eta {eta:.0f}s "
    )
    sys.stderr.flush()
    if step == self.run.steps:
      sys.stderr.write("\n")

  def _log_step(self, metrics: dict, seconds: float) -> dict:
    run = self.run
    tokens = run.batch_size * run.seq_len
    loss = float(metrics["loss"])
    if not math.isfinite(loss):
      raise FloatingPointError(f"loss is {loss} at step {self.step}.")
    tpe = np.asarray(metrics["tokens_per_expert"], np.float64)
    load = (
        tpe / tpe.mean(axis=-1, keepdims=True) if tpe.size else np.zeros((0, 0))
    )
    assignments = tokens * (run.model.moe.top_k if run.model.moe else 0)
    dropped = (
        np.asarray(metrics["dropped"], np.float64) / assignments
        if assignments
        else np.zeros(0)
    )
    record = {
        "step": self.step,
        "loss": loss,
        "total_loss": float(metrics["total_loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "load_min": load.min(axis=-1).round(3).tolist() if load.size else [],
        "load_max": load.max(axis=-1).round(3).tolist() if load.size else [],
        "dropped_fraction": dropped.tolist(),
    }
    h = self.history
    h["step"].append(self.step)
    h["loss"].append(loss)
    h["tokens_per_s"].append(record["tokens_per_s"])
    h["load"].append(load.round(4).tolist())
    h["dropped"].append(dropped.tolist())
    return record

  def _format_record(self, r: dict) -> str:
    layers = [
        i
        for i in range(self.run.model.num_layers)
        if self.run.model.is_moe_layer(i)
    ]
    load = " ".join(
        f"L{i}:{lo:.2f}/{hi:.2f}"
        for i, lo, hi in zip(layers, r["load_min"], r["load_max"])
    )
    dropped = max(r["dropped_fraction"], default=0.0)
    text = (
        f"step {r['step']:5d}/{self.run.steps} loss {r['loss']:.4f} "
        f"{r['tokens_per_s']:8,.0f} tok/s"
    )
    if layers:
      text += f" | load min/max over mean {load} | dropped {dropped:.3f}"
    return text

  def _logged_lines_up_to_step(self, path: str) -> list[str]:
    """Lines of a previous metrics.jsonl up to the resumed step.

    A run killed after its last checkpoint logged steps that the resumed run
    repeats; those lines are dropped, not duplicated.
    """
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return [
          line
          for line in f
          if line.strip() and json.loads(line)["step"] <= self.step
      ]

  def fit(self, *, handle_signals: bool = False) -> dict:
    """Trains to `run.steps`, evaluating and checkpointing on the way.

    Returns:
      A summary dict (also written as summary.json by `train.main`).
    """
    run = self.run
    os.makedirs(run.output_dir, exist_ok=True)
    metrics_path = os.path.join(run.output_dir, "metrics.jsonl")
    previous = {}
    if handle_signals:
      # Ctrl-C and SIGTERM finish the step in flight, then checkpoint: an
      # exception inside the step could leave a half-logged step behind.
      for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, self._on_signal)
    self._first_step = self.step
    interrupted = None
    start = time.perf_counter()
    kept = self._logged_lines_up_to_step(metrics_path) if run.resume else []
    try:
      with open(metrics_path, "w") as log:
        log.writelines(kept)
        while self.step < run.steps:
          position = self.sampler.state()
          batch = self.sampler.next()
          t0 = time.perf_counter()
          try:
            metrics = self.train_step(batch)
          except KeyboardInterrupt:
            # The step did not happen: its batch must be drawn again.
            self.sampler.restore(position)
            raise
          record = self._log_step(metrics, time.perf_counter() - t0)
          log.write(json.dumps(record) + "\n")
          self._progress(
              self.step, record["loss"], record["tokens_per_s"], start
          )
          if self.step % run.log_every == 0 or self.step == 1:
            self._print(self._format_record(record))
          if self.step % run.eval_every == 0 or self.step == run.steps:
            eval_loss = self.evaluate()
            self.history["eval_step"].append(self.step)
            self.history["eval_loss"].append(eval_loss)
            self._print(f"step {self.step:5d} held-out loss {eval_loss:.4f}")
          if (
              run.checkpoint_every
              and self.step % run.checkpoint_every == 0
              and self.step < run.steps
          ):
            self.save_checkpoint()
          if self._stop_signal is not None:
            interrupted = signal.Signals(self._stop_signal).name
            break
    except KeyboardInterrupt:
      interrupted = "KeyboardInterrupt"
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
    path = self.save_checkpoint()  # At the end, and on an interrupt.
    if interrupted:
      self._print(
          f"\ninterrupted ({interrupted}) at step {self.step}; saved "
          f"{path}; continue with --resume"
      )
    return self.summary(
        wall_seconds=time.perf_counter() - start,
        checkpoint_path=path,
        interrupted=interrupted,
    )

  def summary(
      self,
      *,
      wall_seconds: float,
      checkpoint_path: str | None,
      interrupted: str | None,
  ) -> dict:
    h = self.history
    counts = presets.param_counts(self.run.model)
    # Skip the first steps of a run: they include compilation.
    tps = h["tokens_per_s"][2:] or h["tokens_per_s"]
    return {
        "model": self.run.model.name,
        "backend": self.backend_name,
        "steps": self.step,
        "batch_size": self.run.batch_size,
        "seq_len": self.run.seq_len,
        "remat": self.run.remat,
        "compute_dtype": self.run.compute_dtype,
        "data": self.corpus.name,
        "train_bytes": int(len(self.corpus.train)),
        "held_out_bytes": int(len(self.corpus.held_out)),
        "params_total": counts.total,
        "params_active": counts.active,
        "final_train_loss": h["loss"][-1] if h["loss"] else None,
        "final_held_out_loss": (h["eval_loss"][-1] if h["eval_loss"] else None),
        "unigram_entropy": data_lib.unigram_entropy(
            np.concatenate([self.corpus.train, self.corpus.held_out])
        ),
        "unigram_held_out_cross_entropy": data_lib.unigram_cross_entropy(
            self.corpus.train, self.corpus.held_out
        ),
        "tokens_per_s_median": float(np.median(tps)) if tps else None,
        "max_dropped_fraction": max(
            (max(d, default=0.0) for d in h["dropped"]), default=0.0
        ),
        "wall_seconds": wall_seconds,
        "checkpoint": checkpoint_path,
        "interrupted": interrupted,
    }
