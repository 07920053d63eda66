"""`RunConfig`: everything a training run depends on (flags map onto it)."""

from __future__ import annotations

import dataclasses
import json
import math

from moe_core import precision as moe_precision
from train.presets import catalog
from train.presets import rows
from train.models import model_config


def _host_only(default):
  """A field the compiled train and eval steps do not depend on."""
  return dataclasses.field(default=default, metadata={"host_only": True})


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything a training run depends on (flags map onto these fields).

  Fields made with `_host_only` change what the host does around the
  steps (data order, output, intervals), not the compiled program: runs
  that differ only in them share compiled code (`compile_key`).
  """

  model: model_config.ModelConfig
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
  seed: int = _host_only(0)
  backend: str = "auto"
  remat: str = "none"
  compute_dtype: str = "bfloat16"
  # The device mesh, as --mesh spells it ("data=2,expert=4"). Not in the
  # fingerprint: a checkpoint restores onto any mesh.
  mesh: str = "data=1"
  # The layers run under a scan (one compiled layer per stack, compile time
  # independent of depth) or unrolled (one copy per layer, the reference).
  # The parameter layout differs: stacked [layers, ...] or one per layer.
  scan_layers: bool = True
  # Gradient accumulation: each step's batch is split into this many equal
  # microbatches, run one after the other (a scan), their gradients summed.
  microbatches: int = 1
  # Each device's tokens of an MoE layer are exchanged in this many chunks
  # (`moe_core.parallel.EPOptions.num_chunks`): the drop-free receive
  # buffer, sized for the worst case (every peer's tokens to one device),
  # shrinks by this factor. The math is the same: not in the fingerprint.
  ep_chunks: int = 1
  # The dtype AdamW's moments are stored in ("float32" or "bfloat16", as
  # DeepSeek-V3 trained): updated in float32 either way.
  opt_state_dtype: str = "float32"
  data: str | None = _host_only(None)
  output_dir: str = _host_only("/tmp/dropless_train")
  eval_every: int = _host_only(50)
  eval_batches: int = _host_only(8)
  checkpoint_every: int = _host_only(100)
  keep_checkpoints: int = _host_only(2)
  log_every: int = _host_only(25)
  resume: bool = _host_only(False)
  progress: bool = _host_only(True)
  plot: bool = _host_only(True)
  # Where a jax.profiler trace of steps PROFILE_STEPS goes ("" for none).
  profile_dir: str = _host_only("")

  def __post_init__(self):
    # The flags are checked as they are parsed (train/main.py); this catches
    # a RunConfig built in code. Host-only fields may be None in a
    # `compile_key`.
    for name, minimum, kind in _NUMBER_FIELDS:
      value = getattr(self, name)
      if value is None and name in _HOST_ONLY:
        continue
      _check_number(name, value, minimum, kind)
    if self.opt_state_dtype not in OPT_STATE_DTYPES:
      raise ValueError(
          f"opt_state_dtype must be one of {OPT_STATE_DTYPES}, got "
          f"{self.opt_state_dtype!r}."
      )
    if self.batch_size % self.microbatches:
      raise ValueError(
          f"--microbatches={self.microbatches} must divide --batch_size="
          f"{self.batch_size} (each step's batch splits into equal "
          "microbatches)."
      )

  @property
  def precision(self) -> str:
    """The routed experts' GEMM recipe ("unquantized" for an all-dense
    model)."""
    if self.model.moe is None:
      return moe_precision.UNQUANTIZED
    return self.model.moe.precision

  def fingerprint(
      self, corpus_name: str, data_sha256: str | None = None
  ) -> dict:
    """What a checkpoint must share with the run that resumes it.

    Args:
      corpus_name: the text's name (`data.Corpus.name`: the --data path).
      data_sha256: the text's digest (`data.Corpus.sha256`), so that the
        same path with other contents is told apart; None leaves it out
        (checkpoints saved before it was recorded lack it).
    """
    fingerprint = {
        "model": json.loads(
            json.dumps(dataclasses.asdict(self.model), default=str)
        ),
        "batch_size": self.batch_size,
        "seq_len": self.seq_len,
        "seed": self.seed,
        "data": corpus_name,
        "compute_dtype": self.compute_dtype,
    }
    if self.scan_layers:
      # Stacked parameters: a checkpoint of the unrolled layout (saved
      # before the scan, which records no such key) does not restore.
      fingerprint["scan_layers"] = True
    if data_sha256 is not None:
      fingerprint["data_sha256"] = data_sha256
    if self.opt_state_dtype != "float32":
      # The checkpoint's moments are of this dtype.
      fingerprint["opt_state_dtype"] = self.opt_state_dtype
    return fingerprint


# What --opt_state_dtype takes, and the bytes of a moment in each.
MOMENT_BYTES = {"float32": 4, "bfloat16": 2}
OPT_STATE_DTYPES = tuple(MOMENT_BYTES)

# (field, minimum, kind): kind "int" (>= minimum), "float" (finite and
# >= minimum) or "positive" (finite and > minimum).
_NUMBER_FIELDS = (
    ("steps", 1, "int"),
    ("batch_size", 1, "int"),
    ("microbatches", 1, "int"),
    ("ep_chunks", 1, "int"),
    ("seq_len", 1, "int"),
    ("learning_rate", 0, "positive"),
    ("warmup_steps", 0, "int"),
    ("weight_decay", 0, "float"),
    ("grad_clip", 0, "positive"),
    ("bias_update_rate", 0, "float"),
    ("aux_loss_weight", 0, "float"),
    ("z_loss_weight", 0, "float"),
    ("seed", 0, "int"),
    ("eval_every", 1, "int"),
    ("eval_batches", 1, "int"),
    ("checkpoint_every", 0, "int"),
    ("keep_checkpoints", 0, "int"),
    ("log_every", 1, "int"),
)
_HOST_ONLY = frozenset(
    f.name for f in dataclasses.fields(RunConfig) if f.metadata.get("host_only")
)


def _check_number(name: str, value, minimum: float, kind: str) -> None:
  is_int = isinstance(value, int) and not isinstance(value, bool)
  if kind == "int":
    if not is_int or value < minimum:
      raise ValueError(
          f"RunConfig.{name} must be an int >= {minimum}, got {value!r}."
      )
    return
  finite = (is_int or isinstance(value, float)) and math.isfinite(value)
  relation = ">" if kind == "positive" else ">="
  if not finite or value < minimum or (kind == "positive" and value == minimum):
    raise ValueError(
        f"RunConfig.{name} must be a finite number {relation} {minimum}, got "
        f"{value!r}."
    )


def compile_key(run: RunConfig) -> RunConfig:
  """`run` with its host-only fields cleared: equal keys, equal programs."""
  host_only = [
      f.name for f in dataclasses.fields(run) if f.metadata.get("host_only")
  ]
  return dataclasses.replace(run, **dict.fromkeys(host_only))


def with_precision(
    model: model_config.ModelConfig, precision: str
) -> model_config.ModelConfig:
  """`model` with its routed experts' GEMMs in recipe `precision`.

  Args:
    model: the model; its MoE blocks share one `moe_core.MoEConfig`.
    precision: one of `moe_core.precision.RECIPES`, or a deprecated alias
      of one ("bf16": "unquantized", with a DeprecationWarning). An
      all-dense model (`model.moe` None) takes only "unquantized": it has no
      expert GEMMs.

  Returns:
    `model` with `moe.precision` set (`model` itself when dense).

  Raises:
    ValueError: `precision` is not a recipe, or not "unquantized" for a
      dense model.
  """
  if not isinstance(precision, str):
    raise ValueError(
        f"precision must be one of {moe_precision.RECIPES}, got "
        f"{precision!r}."
    )
  precision = moe_precision.check_recipe(precision, stacklevel=2)
  if model.moe is None:
    if precision != moe_precision.UNQUANTIZED:
      raise ValueError(
          f"precision quantises the routed experts' GEMMs, so the dense "
          f"model {model.name!r} (moe=None) needs "
          f"{moe_precision.UNQUANTIZED!r}, got {precision!r}."
      )
    return model
  return model.replace(moe=model.moe.replace(precision=precision))


def with_depth(
    model: model_config.ModelConfig, num_layers: int
) -> model_config.ModelConfig:
  """`model` with `num_layers` blocks, its width and first dense layers kept.

  Raises:
    ValueError: `num_layers` is not an int >= 1, or leaves no room for the
      model's first dense layers plus one MoE layer (a MoE model).
  """
  if isinstance(num_layers, bool) or not isinstance(num_layers, int):
    raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}.")
  least = model.first_dense_layers + (1 if model.moe is not None else 0)
  if num_layers < max(1, least):
    raise ValueError(
        f"num_layers must be >= {max(1, least)} for {model.name!r} (its "
        f"{model.first_dense_layers} first dense layers"
        + (" and one MoE layer" if model.moe is not None else "")
        + f"), got {num_layers}."
    )
  return model.replace(num_layers=num_layers)


def run_config_from_preset(name: str, **overrides) -> RunConfig:
  """A RunConfig from preset `name`; `overrides` set (non-None) fields.

  `precision` (a recipe of `moe_core.precision.RECIPES`) is an override too:
  it sets the preset model's `moe.precision` (see `with_precision`). So is
  `num_layers`: the preset model at that depth, full width (its first dense
  layers kept), e.g. to compile a reduced-depth DeepSeek-V3 on its real mesh.
  """
  preset = catalog.get_preset(name)
  fields = dataclasses.asdict(preset.train)
  fields["model"] = preset_model(
      preset,
      overrides.pop("precision", None),
      overrides.pop("num_layers", None),
  )
  fields.update({k: v for k, v in overrides.items() if v is not None})
  return RunConfig(**fields)


def preset_model(
    preset: rows.Preset,
    precision: str | None = None,
    num_layers: int | None = None,
) -> model_config.ModelConfig:
  """`preset`'s model as a run builds it: at `precision` (`with_precision`)
  and `num_layers` deep (`with_depth`), each where not None."""
  model = preset.model
  if precision is not None:
    model = with_precision(model, precision)
  if num_layers is not None:
    model = with_depth(model, num_layers)
  return model
