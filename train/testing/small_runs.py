"""Small runs shared by the train/ tests: models, presets and run configs
that compile fast on a CPU, the corpus, temporary directories, fits."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from train import presets
from train.models import model_config
from train.run.inputs import data as data_lib
from train.run.inputs import run_config

# The test models' sizes: byte tokens, width 32, 2 heads of 16.
_SMALL_DIMS = dict(vocab_size=256, hidden_size=32, num_heads=2, head_dim=16)

# A DeepSeek-V3-shaped model small enough to compile in seconds: a dense
# first layer, then an MoE layer with a shared expert, sigmoid routing, a
# correction bias, group-limited top-k and routed scaling.
SMALL_DSV3 = model_config.ModelConfig(
    name="test_dsv3",
    **_SMALL_DIMS,
    num_layers=2,
    num_kv_heads=2,
    first_dense_layers=1,
    dense_ffn_size=64,
    moe=presets.deepseek_v3_moe(
        32, num_experts=8, top_k=2, expert_ffn_size=32, n_group=4, topk_group=2
    ),
)

# DeepSeek-V4's decoder, small (issue 33): one layer of each attention kind
# (sliding, compressed-sparse, heavily-compressed), the first two routed by
# hash, windows short enough for a 24-token sequence.
_TINY_V4 = presets.get_preset("tiny_deepseek_v4").model
SMALL_DEEPSEEK_V4 = _TINY_V4.replace(
    name="test_deepseek_v4",
    **_SMALL_DIMS,
    num_layers=3,
    q_lora_rank=16,
    moe=presets.deepseek_v4_moe(
        32,
        num_experts=8,
        top_k=2,
        expert_ffn_size=16,
        routed_scaling_factor=1.5,
    ),
    deepseek_v4=_TINY_V4.deepseek_v4.replace(
        layer_types=("sliding", "csa", "hca"),
        rope_head_dim=8,
        o_lora_rank=8,
        sliding_window=6,
        hca_rate=8,
        # Enough indexer heads that ReLU rarely zeroes an entry's every
        # head: ties at the k-th score would make the choice arbitrary.
        index_n_heads=8,
        index_head_dim=8,
        index_topk=2,
    ),
)

# SMALL_DSV3 as a preset with small_run's hyper-parameters: tests of
# train.main put it in place of the default preset (mock.patch.dict on
# presets.PRESETS), so that the program trains a model that compiles fast.
SMALL_PRESET = presets.Preset(
    model=SMALL_DSV3,
    # 8 steps of 4 x 32 tokens, the rest at TrainDefaults' defaults.
    train=presets.TrainDefaults(
        steps=8, batch_size=4, seq_len=32, warmup_steps=2
    ),
    description="small_runs.SMALL_DSV3",
)

_CORPUS = None


# transformers' DeepseekV4Config names for our DeepSeek-V4 layer types.
DEEPSEEK_V4_HF_LAYER_TYPES = {
    "sliding": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}


def deepseek_v4_hf_fields(cfg: model_config.ModelConfig) -> dict:
  """A DeepSeek-V4 `ModelConfig` as transformers' DeepseekV4Config fields
  (keyword arguments; no transformers import here), for the tests that
  build transformers' model from our config."""
  s = cfg.deepseek_v4
  return dict(
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.hidden_size,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads,
      num_key_value_heads=1,
      head_dim=cfg.head_dim,
      qk_rope_head_dim=s.rope_head_dim,
      q_lora_rank=cfg.q_lora_rank,
      o_groups=s.o_groups,
      o_lora_rank=s.o_lora_rank,
      n_routed_experts=cfg.moe.num_experts,
      n_shared_experts=1,
      num_experts_per_tok=cfg.moe.top_k,
      moe_intermediate_size=cfg.moe.expert_ffn_size,
      num_hash_layers=s.num_hash_layers,
      index_n_heads=s.index_n_heads,
      index_head_dim=s.index_head_dim,
      index_topk=s.index_topk,
      hc_mult=s.hc_mult,
      hc_sinkhorn_iters=s.hc_sinkhorn_iters,
      sliding_window=s.sliding_window,
      compress_rates={
          "compressed_sparse_attention": s.csa_rate,
          "heavily_compressed_attention": s.hca_rate,
      },
      layer_types=[DEEPSEEK_V4_HF_LAYER_TYPES[t] for t in s.layer_types],
      rms_norm_eps=cfg.norm_eps,
  )


def corpus() -> data_lib.Corpus:
  """The embedded corpus, loaded once per process."""
  global _CORPUS
  if _CORPUS is None:
    _CORPUS = data_lib.load()
  return _CORPUS


def small_run(output_dir: str, **overrides) -> run_config.RunConfig:
  """A fast RunConfig on SMALL_DSV3 with SMALL_PRESET's hyper-parameters;
  `overrides` replace any field."""
  run = run_config.RunConfig(
      model=SMALL_DSV3,
      **dataclasses.asdict(SMALL_PRESET.train),
      seed=0,
      backend="xla",
      output_dir=output_dir,
      eval_every=1000,
      eval_batches=2,
      checkpoint_every=0,
      log_every=1000,
      progress=False,
      plot=False,
  )
  return dataclasses.replace(run, **overrides)


def corpus_unigram_cross_entropy() -> float:
  """Held-out loss of the train split's byte frequencies (nats/byte)."""
  c = corpus()
  return data_lib.unigram_cross_entropy(c.train, c.held_out)


def temp_dir(test_case) -> str:
  """A fresh directory removed after `test_case`.

  Unlike absltest's create_tempdir, it works without parsed absl flags
  (under pytest as well as under bazel test).
  """
  handle = tempfile.TemporaryDirectory(prefix="dropless_train_test_")
  test_case.addCleanup(handle.cleanup)
  return handle.name


class TempDirs:
  """Fresh directories under one temporary root, for a whole test class."""

  def __init__(self):
    self._root = tempfile.TemporaryDirectory(prefix="dropless_train_test_")
    self._count = 0

  def new(self) -> str:
    self._count += 1
    path = os.path.join(self._root.name, f"run_{self._count}")
    os.makedirs(path)
    return path

  def cleanup(self) -> None:
    self._root.cleanup()


def step_losses(run: run_config.RunConfig, steps: int | None = None):
  """The losses of `steps` (default `run.steps`) training steps of `run` on
  the embedded corpus, as floats; no output directory is written.

  As `fit`, imports the trainer when called: its callers depend on
  //train/run/training:trainer.
  """
  from train.run.training import trainer  # pylint: disable=g-import-not-at-top

  tr = trainer.Trainer(run, corpus(), out=None)
  return [
      float(tr.train_step(tr.sampler.next())["loss"])
      for _ in range(run.steps if steps is None else steps)
  ]


def fit(run: run_config.RunConfig, interrupt_after: int | None = None):
  """Trains `run` in this process; returns (Trainer, summary).

  The trainer comes back closed (its output directory given back, so the
  caller may resume it); its state, history and program are still there.

  With `interrupt_after=n`, a Ctrl-C lands inside step n + 1, after its
  batch was drawn (the trainer then checkpoints step n and stops).
  """
  # Imported here so that the config helpers above need no trainer; the
  # callers of fit depend on //train/run/training:trainer.
  from train.run.training import trainer  # pylint: disable=g-import-not-at-top

  tr = trainer.Trainer(run, corpus(), out=None)
  tr.prepare_output_dir()
  if interrupt_after is not None:
    real_step, done = tr.train_step, []

    def interrupted_step(batch):
      if len(done) == interrupt_after:
        raise KeyboardInterrupt
      done.append(None)
      return real_step(batch)

    tr.train_step = interrupted_step
  summary = tr.fit()
  tr.close()  # Gives back the output directory: the caller may resume it.
  return tr, summary
