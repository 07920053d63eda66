"""Inputs of the conformance suite, built from fixed numpy seeds.

Over 400 lines because it is data: the named GEMM and layer cases every
suite shares.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

import moe_core

# --- Grouped GEMM -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmCase:
  """rows [m, C] x weights [E, C, n] ([E, n, C] if transposed) -> [m, n].

  C, the contracted width, is the field `k`; E is len(group_sizes); rows at
  or past sum(group_sizes) are padding.
  """

  name: str
  m: int
  k: int
  n: int
  group_sizes: tuple[int, ...]
  dtype: str = "float32"
  transpose_rhs: bool = False
  out_dtype: str | None = None
  seed: int = 0

  @property
  def num_groups(self) -> int:
    return len(self.group_sizes)

  @property
  def used_rows(self) -> int:
    return sum(self.group_sizes)

  @property
  def result_dtype(self) -> str:
    return self.out_dtype or self.dtype

  def __post_init__(self):
    if self.used_rows > self.m:
      raise ValueError(
          f"case {self.name}: sum(group_sizes)={self.used_rows}"
          f" > m={self.m}."
      )


GEMM_CASES = (
    # sum(group_sizes) == M, with an empty group in the middle.
    GemmCase("f32_full", 64, 32, 48, (10, 0, 23, 31)),
    GemmCase("bf16_full", 64, 32, 48, (10, 0, 23, 31), dtype="bfloat16"),
    # sum(group_sizes) < M: the last rows are padding.
    GemmCase(
        "bf16_padded", 64, 32, 48, (5, 17, 0, 20), dtype="bfloat16", seed=1
    ),
    GemmCase(
        "f32_transposed", 40, 24, 40, (7, 13, 0, 20), transpose_rhs=True, seed=2
    ),
    GemmCase(
        "bf16_transposed_padded",
        40,
        24,
        40,
        (7, 13, 0, 9),
        dtype="bfloat16",
        transpose_rhs=True,
        seed=3,
    ),
    GemmCase("one_row", 1, 16, 24, (0, 1, 0), seed=4),
    # C (the field k) and N not multiples of any tile; odd M.
    GemmCase("odd_37_k48_n80", 37, 48, 80, (3, 0, 34), seed=5),
    # M just past a 128-row tile, groups straddling it.
    GemmCase("rows_129", 129, 16, 24, (64, 1, 0, 60), seed=6),
    GemmCase("one_group", 20, 16, 24, (17,), seed=7),
    GemmCase("large_group", 300, 16, 16, (0, 290, 3), seed=8),
    GemmCase("all_groups_empty", 24, 16, 24, (0, 0, 0), seed=9),
    GemmCase(
        "bf16_rows_f32_out",
        48,
        32,
        40,
        (20, 0, 28),
        dtype="bfloat16",
        out_dtype="float32",
        seed=10,
    ),
    # Balanced routing with M >= ~64 E: the xla backend's batched bulk
    # (backends/xla/layout.py: bulk_rows(512, 4) = 152 rows per group, and
    # `balanced` holds), which the small cases above never reach.
    GemmCase("balanced_512", 512, 16, 24, (128, 128, 128, 128), seed=11),
    # The bulk again, with group 0 overflowing it by 8 rows into the tile
    # loop, and 16 padding rows (padding 120 <= M/4, overflow 8 <= M/10).
    GemmCase(
        "balanced_512_overflow_padded",
        512,
        16,
        24,
        (160, 96, 120, 120),
        transpose_rhs=True,
        seed=12,
    ),
)
# Shapes only a GPU runs (interpreted on a CPU they would take minutes): the
# kernel tiles bench/gpu_check times at the models' sizes, which the cases
# above are too small to pick. 288 rows a group and N = 2048 pick pallas'
# large tiles (Mixtral's); 16 rows a group its small ones (DeepSeek-V3's 256
# experts); 1109 rows and N = 512 its middle ones (Qwen3-30B-A3B's gate/up)
# and triton's many-rows tiles. bench/gpu_check_test checks that they cover
# what is timed.
GPU_GEMM_CASES = (
    GemmCase(
        "gpu_bf16_large_tiles",
        1152,
        128,
        2048,
        (300, 0, 517, 211),
        dtype="bfloat16",
        seed=13,
    ),
    GemmCase(
        "gpu_bf16_32_small_groups",
        512,
        256,
        384,
        tuple(range(31)) + (0,),
        dtype="bfloat16",
        seed=14,
    ),
    GemmCase(
        "gpu_bf16_many_rows",
        3328,
        128,
        512,
        (1400, 0, 1800),
        dtype="bfloat16",
        seed=15,
    ),
)


def _on_gpu() -> bool:
  """Whether JAX will run on an NVIDIA GPU here, decided without starting
  JAX (tests set its platforms and device counts after importing this)."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  usable = not platforms or "cuda" in platforms or "gpu" in platforms
  return usable and os.path.exists("/dev/nvidiactl")


ON_GPU = _on_gpu()
if ON_GPU:
  GEMM_CASES += GPU_GEMM_CASES
GEMM_BY_NAME = {c.name: c for c in GEMM_CASES}

# Gradients are checked on a subset to keep compile time down.
GEMM_GRAD_CASES = tuple(
    GEMM_BY_NAME[n]
    for n in (
        "f32_full",
        "bf16_full",
        "bf16_padded",
        "bf16_transposed_padded",
        "f32_transposed",
        "odd_37_k48_n80",
        "rows_129",
        "all_groups_empty",
        "balanced_512",
        "balanced_512_overflow_padded",
    )
) + (GPU_GEMM_CASES if ON_GPU else ())
# Cases with padding rows (sum(group_sizes) < M), which hold NaN.
GEMM_PADDED_CASES = tuple(c for c in GEMM_CASES if c.used_rows < c.m)


# numpy's generators rather than jax.random: every case holds the same numbers
# on every jax version and platform.
def _normal(rng, shape, scale=1.0):
  return (scale * rng.standard_normal(shape)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def gemm_inputs(case: GemmCase):
  """(rows, weights, group_sizes, cotangent) as jax arrays.

  Rows past sum(group_sizes) hold NaN ("poisoned padding"): a correct
  grouped GEMM reads them as zeros, so no NaN reaches its output or its
  gradients. The cotangent is finite everywhere.
  """
  rng = np.random.default_rng(1000 + case.seed)
  rows = _normal(rng, (case.m, case.k))
  rows[case.used_rows :] = np.nan
  w_shape = (
      (case.num_groups, case.n, case.k)
      if case.transpose_rhs
      else (case.num_groups, case.k, case.n)
  )
  weights = _normal(rng, w_shape, case.k**-0.5)
  cotangent = _normal(rng, (case.m, case.n))
  dtype = jnp.dtype(case.dtype)
  return (
      jnp.asarray(rows, dtype),
      jnp.asarray(weights, dtype),
      jnp.asarray(case.group_sizes, jnp.int32),
      jnp.asarray(cotangent, jnp.dtype(case.result_dtype)),
  )


# --- The MoE layer ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerCase:
  """One `moe_layer` call: x [*batch_shape, D] of `dtype` through `cfg`.

  Attributes:
    grads: also differentiate (x and every parameter) in this case.
    jit: run the backend under jax.jit (False: op by op).
    hot_expert: make every token's best score this expert's (a huge router
      weight on a feature that is positive for every token).
    cold_experts: make these experts every token's worst (none is chosen
      when top_k leaves enough others).
  """

  name: str
  cfg: moe_core.MoEConfig
  batch_shape: tuple[int, ...]
  dtype: str = "float32"
  grads: bool = False
  jit: bool = True
  hot_expert: int | None = None
  cold_experts: tuple[int, ...] = ()
  seed: int = 0

  @property
  def num_tokens(self) -> int:
    return math.prod(self.batch_shape)


def layer_config(**changes) -> moe_core.MoEConfig:
  """The suite's small layer (8 experts, top 2, D 32, F 48) with `changes`."""
  base = dict(num_experts=8, top_k=2, hidden_size=32, expert_ffn_size=48)
  base.update(changes)
  return moe_core.MoEConfig(**base)


_cfg = layer_config  # Short, for the tables below.


_SHARED_GATED_CFG = _cfg(shared_ffn_size=24, shared_expert_gate=True)
# Two cases each: D and F that are not multiples of 32 (over 4 experts), and
# narrow ones.
_D48_F80 = _cfg(hidden_size=48, expert_ffn_size=80, num_experts=4)
_D16_F24 = dict(hidden_size=16, expert_ffn_size=24)
_BF16 = "bfloat16"

# The sigmoid router of DeepSeek-V3 and the models after it, without its
# groups: a correction bias steers the choice, the K weights renormalised
# (epsilon 0), for a MoEConfig.
SIGMOID_BIAS_NORM_ROUTER = dict(
    score_func="sigmoid", correction_bias=True, norm_topk_prob=True
)
# DeepSeek-V3's router settings (of 4 groups, not its 8), for a MoEConfig.
DEEPSEEK_V3_ROUTER = dict(
    n_group=4,
    topk_group=2,
    group_score="sum_top2",
    norm_epsilon=1e-20,
    routed_scaling_factor=2.5,
    **SIGMOID_BIAS_NORM_ROUTER,
)
# Groups scored by their best expert, for a MoEConfig of 16 experts.
GROUPS_MAX_ROUTER = dict(n_group=4, topk_group=2, group_score="max")

# Shapes that break kernels: odd and tiny T, T past a tile, empty and
# overfull experts, E = 1, K = E, many experts for few tokens, D and F that
# are not multiples of 128.
LAYER_CASES = (
    LayerCase("base_f32", _SHARED_GATED_CFG, (16,), grads=True),
    LayerCase("base_bf16", _SHARED_GATED_CFG, (16,), _BF16, grads=True, seed=1),
    LayerCase("one_token", _cfg(), (1,), grads=True, seed=2),
    LayerCase("odd_37_tokens_d48_f80", _D48_F80, (37,), grads=True, seed=3),
    LayerCase("tokens_129", _cfg(**_D16_F24), (129,), grads=True, seed=4),
    LayerCase("batch_2x5", _cfg(), (2, 5), seed=5),
    LayerCase(
        "experts_without_tokens",
        _cfg(),
        (16,),
        grads=True,
        cold_experts=(1, 4, 6),
        seed=6,
    ),
    LayerCase(
        "one_expert_takes_all",
        _cfg(top_k=1),
        (16,),
        grads=True,
        hot_expert=3,
        seed=7,
    ),
    LayerCase(
        "single_expert", _cfg(num_experts=1, top_k=1), (12,), grads=True, seed=8
    ),
    LayerCase(
        "top_k_equals_experts",
        _cfg(num_experts=4, top_k=4),
        (10,),
        grads=True,
        seed=9,
    ),
    # The reference runs every expert on every token: jit of 256 experts
    # takes ~15 s to compile on 2 cores, op by op ~3 s. Forward only: the
    # reference's gradients take ~50 s here, jitted or not, in every
    # backend's run (the xla backend's take 4-10 s); the 256 experts' many
    # empty groups get gradients in GEMM_CASES' empty groups and in
    # experts_without_tokens.
    LayerCase(
        "experts_256_tokens_12",
        _cfg(num_experts=256, top_k=8, **_D16_F24),
        (12,),
        jit=False,
        seed=10,
    ),
    LayerCase("d48_f80_bf16", _D48_F80, (24,), _BF16, grads=True, seed=11),
)


# Every routing option of the config, each in at least one case: softmax /
# sigmoid scores; norm_topk_prob off, on with epsilon 0 and 1e-20; a nonzero
# correction bias with softmax and with sigmoid; groups scored by "max" and
# "sum_top2"; routed_scaling_factor != 1; shared expert gated and ungated;
# activations silu (the LAYER_CASES), gelu and gelu_tanh; the score
# functions sqrtsoftplus and sparsemixer; a router bias, a logit soft-cap,
# a correction bias on the logits, router and expert input norms with
# per-expert output scales; zero experts returning x or nothing.
_ROUTING_CONFIGS = {
    "softmax_norm_eps0_scaled": _cfg(
        norm_topk_prob=True, routed_scaling_factor=2.5
    ),
    "softmax_bias_norm_eps1e-20": _cfg(
        correction_bias=True, norm_topk_prob=True, norm_epsilon=1e-20
    ),
    "sigmoid": _cfg(score_func="sigmoid"),
    "sigmoid_bias_norm_eps0": _cfg(**SIGMOID_BIAS_NORM_ROUTER),
    "groups_max": _cfg(num_experts=16, top_k=3, **GROUPS_MAX_ROUTER),
    "groups_sum_top2_sigmoid_bias_scaled": _cfg(
        num_experts=16, top_k=3, **DEEPSEEK_V3_ROUTER
    ),
    "shared_gated_gelu": _SHARED_GATED_CFG.replace(activation="gelu"),
    "shared_ungated_gelu_tanh": _cfg(
        activation="gelu_tanh", shared_ffn_size=24
    ),
    # DeepSeek-V4's router: sqrt(softplus) scores, a correction bias.
    "sqrtsoftplus_bias_norm_eps1e-20_scaled": _cfg(
        score_func="sqrtsoftplus",
        correction_bias=True,
        norm_topk_prob=True,
        norm_epsilon=1e-20,
        routed_scaling_factor=1.5,
    ),
    # Phi-MoE's; a threshold wide enough that a step's softmax spans some
    # experts but not all (Phi's own 0.01 mostly leaves one).
    "sparsemixer_eps0.3": _cfg(
        score_func="sparsemixer", sparsemixer_epsilon=0.3
    ),
    # GPT-OSS's router: a learned bias on the logits, a softmax over the K.
    "router_bias_softmax_norm": _cfg(router_bias=True, norm_topk_prob=True),
    # Laguna's: soft-capped logits (cap 1 bends N(0, 1) logits), sigmoid.
    "sigmoid_softcap1_bias_norm": _cfg(
        router_logit_softcap=1.0, **SIGMOID_BIAS_NORM_ROUTER
    ),
    # Kolibri's: the correction bias on the logits, before the sigmoid.
    "sigmoid_bias_on_logits_norm": _cfg(
        correction_bias_on="logits", **SIGMOID_BIAS_NORM_ROUTER
    ),
    # Gemma 4's: the router's own input norm and scale, the experts' own
    # input norm, per-expert output scales.
    "gemma4_input_norms_expert_scale": _cfg(
        norm_topk_prob=True,
        router_input_norm=True,
        router_input_scale=32**-0.5,
        expert_input_norm=True,
        expert_output_scale=True,
    ),
    # LongCat-Flash's: identity experts besides the 8 FFN experts, chosen
    # through the correction bias, the routing weights scaled.
    "zero_experts_identity_bias_scaled": _cfg(
        top_k=3,
        num_zero_experts=4,
        correction_bias=True,
        routed_scaling_factor=2.0,
    ),
    # Zaya's skip expert: chosen, it adds nothing.
    "zero_expert_skip_sigmoid_norm": _cfg(
        score_func="sigmoid",
        norm_topk_prob=True,
        num_zero_experts=1,
        zero_expert_output="zero",
    ),
    # Inkling's: 2 always-on experts weighed with the 2 chosen (by score +
    # bias), sigmoid weights normalised over all 4.
    "always_on_sigmoid_bias_norm": _cfg(
        top_k=4, num_always_on_experts=2, **SIGMOID_BIAS_NORM_ROUTER
    ),
    # DBRX's with p = 2: the K softmax weights over their 2-norm.
    "softmax_p2_norm": _cfg(top_k=3, norm_topk_prob=True, norm_topk_p=2.0),
}
# The variants that change nothing but what moe_core.routing computes (the
# score function, its normalisation, bias, soft-cap, groups): a backend that
# routes through moe_core.routing gets from them only another set of expert
# ids and weights, which the other variants and LAYER_CASES already give its
# dispatch, kernels and combine. They run on the oracle's suite (against
# numpy, every one) and on a backend that routes by itself (`Backend._route`
# overridden); `BackendTestCase.skip_if_shared_router_variant` skips them on
# the rest. Kept everywhere: DeepSeek-V3's groups (16 experts, top 3),
# shared experts, other activations, expert input norms and output scales,
# zero and always-on experts: each reaches the backend's own stages.
ROUTER_ONLY_VARIANTS = frozenset(
    {
        "softmax_norm_eps0_scaled",
        "softmax_bias_norm_eps1e-20",
        "sigmoid",
        "sigmoid_bias_norm_eps0",
        "groups_max",
        "sqrtsoftplus_bias_norm_eps1e-20_scaled",
        "sparsemixer_eps0.3",
        "router_bias_softmax_norm",
        "sigmoid_softcap1_bias_norm",
        "sigmoid_bias_on_logits_norm",
        "softmax_p2_norm",
    }
)
assert ROUTER_ONLY_VARIANTS <= set(_ROUTING_CONFIGS), "a name in no config"
# 16 tokens through each, differentiated too. Seeds 20, 21, ... in order (a
# new variant goes last, so that the others keep their inputs).
ROUTING_VARIANTS = tuple(
    LayerCase(name, cfg, (16,), grads=True, seed=seed)
    for seed, (name, cfg) in enumerate(_ROUTING_CONFIGS.items(), start=20)
)

# The expert-FFN switches (`MoEConfig` activation and its options,
# expert_bias, routing_weights_on_input), each in one case: the clamp is
# small enough to bite on N(0, 1) products; the biases are drawn like the
# weights (nonzero). 16 tokens each, differentiated. Seeds 50, 51, ... in
# order (a new variant goes last).
_FFN_CONFIGS = {
    "ffn_swiglu_limit_shared": _cfg(swiglu_limit=0.5, shared_ffn_size=24),
    "ffn_gpt_oss_glu_bias": _cfg(
        activation="gpt_oss_glu",
        swiglu_alpha=1.702,
        swiglu_limit=0.8,
        expert_bias=True,
    ),
    "ffn_softcapped_silu": _cfg(
        activation="softcapped_silu", gate_softcap=0.7, up_softcap=0.9
    ),
    "ffn_relu2_shared": _cfg(activation="relu2", shared_ffn_size=24),
    "ffn_relu_bias_bf16": _cfg(activation="relu", expert_bias=True),
    # Llama 4's router: one expert, its sigmoid weight on the input.
    "ffn_weights_on_input": _cfg(
        top_k=1, score_func="sigmoid", routing_weights_on_input=True
    ),
    # JetMoE's: a learned bias [D] after the combine.
    "ffn_output_bias": _cfg(output_bias=True),
    # A.X-K1's: an RMS norm of the output, the shared expert's included.
    "ffn_output_norm_shared": _cfg(
        output_norm=True, output_norm_epsilon=1e-5, shared_ffn_size=24
    ),
    # Cohere 2 MoE's default: routed and shared outputs averaged.
    "ffn_shared_mean": _cfg(shared_ffn_size=24, shared_combine="mean"),
    # HY-V4's: the routed experts clamped, the shared one not.
    "ffn_swiglu_limit_routed_only": _cfg(
        swiglu_limit=0.5, shared_ffn_size=24, shared_swiglu_clamp=False
    ),
    # Nemotron-H's: non-gated experts at a latent width, with a shared
    # expert at the model's width beside them.
    "ffn_latent_relu2_shared": _cfg(
        activation="relu2",
        expert_latent_size=16,
        score_func="sigmoid",
        norm_topk_prob=True,
        shared_ffn_size=24,
    ),
    # Muse Spark's: the latent rows RMS-normed, and each expert's output
    # scaled and normed before its weight.
    "ffn_latent_norms_sigmoid": _cfg(
        expert_latent_size=16,
        latent_norm=True,
        latent_norm_epsilon=1e-5,
        post_expert_norm=True,
        post_expert_norm_epsilon=1e-5,
        **SIGMOID_BIAS_NORM_ROUTER,
    ),
    # The norm of each expert's output without a latent width, in bfloat16.
    "ffn_post_expert_norm_bf16": _cfg(post_expert_norm=True),
    # Nemotron-H's mlp_bias: biased latent projections and shared expert.
    "ffn_latent_shared_biases": _cfg(
        activation="relu2",
        expert_latent_size=16,
        latent_bias=True,
        shared_ffn_size=24,
        shared_expert_bias=True,
    ),
    # DeepSeek-V4's mlp_bias: a biased, clamped, gated shared expert.
    "ffn_shared_bias_clamped": _cfg(
        swiglu_limit=0.5, shared_ffn_size=24, shared_expert_bias=True
    ),
}
FFN_VARIANTS = tuple(
    LayerCase(
        name,
        cfg,
        (16,),
        _BF16 if name.endswith("_bf16") else "float32",
        grads=True,
        seed=seed,
    )
    for seed, (name, cfg) in enumerate(_FFN_CONFIGS.items(), start=50)
)

# DeepSeek-V4's hash layers: experts from a table of 50 token ids.
HASH_ROUTING_CASE = LayerCase(
    "hash_sqrtsoftplus_norm_scaled",
    _cfg(
        hash_vocab_size=50,
        score_func="sqrtsoftplus",
        norm_topk_prob=True,
        norm_epsilon=1e-20,
        routed_scaling_factor=1.5,
    ),
    (16,),
    grads=True,
    seed=45,
)


def hash_token_ids(case: LayerCase) -> jax.Array:
  """[T] int32 token ids in [0, V) for a hash-routing case."""
  rng = np.random.default_rng(3000 + case.seed)
  ids = rng.integers(0, case.cfg.hash_vocab_size, case.num_tokens)
  return jnp.asarray(ids, jnp.int32)


# capacity = ceil(capacity_factor * T * K / E) = 4 and 2 slots per expert.
CAPACITY_CASES = (
    LayerCase("capacity_1.0", _cfg(capacity_factor=1.0), (16,), seed=40),
    LayerCase(
        "capacity_0.5_sigmoid",
        _cfg(capacity_factor=0.5, score_func="sigmoid", norm_topk_prob=True),
        (16,),
        seed=41,
    ),
)

# Only where a GPU is (see GPU_GEMM_CASES): bf16 tokens of width 128 through
# a wide expert FFN, differentiated. (name, seed, T, E, K, F):
_GPU_FFNS = (
    # 1152 rows over 4 experts, F = 2048, so the fused gate/up kernel runs
    # pallas' large tiles fitted to two accumulators, as Mixtral's timed
    # layer does.
    ("gpu_wide_ffn_bf16", 12, 576, 4, 2, 2048),
    # 1024 rows an expert: triton's fused gate/up takes the 8-warp tiles of
    # its many-rows table row, as Mixtral's timed layer does.
    ("gpu_many_rows_ffn_bf16", 13, 2048, 2, 1, 1024),
)
GPU_LAYER_CASES = tuple(
    LayerCase(
        name,
        _cfg(num_experts=e, top_k=k, hidden_size=128, expert_ffn_size=f),
        (t,),
        _BF16,
        grads=True,
        seed=seed,
    )
    for name, seed, t, e, k, f in _GPU_FFNS
)
if ON_GPU:
  LAYER_CASES += GPU_LAYER_CASES
LAYER_BY_NAME = {c.name: c for c in LAYER_CASES}
LAYER_GRAD_CASES = tuple(
    c for c in LAYER_CASES + ROUTING_VARIANTS + FFN_VARIANTS if c.grads
)


def named(cases) -> list[tuple]:
  """(name, case) pairs for parameterized.named_parameters."""
  return [(c.name, c) for c in cases]


@functools.lru_cache(maxsize=None)
def layer_inputs(case: LayerCase):
  """(params, x, cotangent): params and x of the case's dtype, the
  cotangent for y in float32, all jax arrays.

  Matrices have std 1/sqrt(fan_in), so router logits are about N(0, 1); the
  correction bias (when enabled) is nonzero, on the scale of the spread of
  the scores, so that it changes which experts are chosen.
  """
  cfg = case.cfg
  rng = np.random.default_rng(2000 + case.seed)
  x = _normal(rng, case.batch_shape + (cfg.hidden_size,))
  params = {}
  for name, shape in moe_core.param_shapes(cfg).items():
    if name == "correction_bias":
      # Against logits (spread about 1) a larger bias than against scores.
      on_logits = cfg.correction_bias_on == "logits"
      params[name] = _normal(rng, shape, 1.0 if on_logits else 0.1)
    elif name == "hash_table":  # K distinct experts per token id.
      params[name] = np.argsort(rng.random((shape[0], cfg.num_router_experts)))
      params[name] = params[name][:, : shape[1]].astype(np.int32)
    elif name in (
        "router_bias",
        "output_bias",
        "latent_in_bias",
        "latent_out_bias",
        "shared_b_gate",
        "shared_b_up",
        "shared_b_down",
    ):
      params[name] = _normal(rng, shape)
    elif name in (
        "router_norm_scale",
        "expert_norm_scale",
        "output_norm_scale",
        "latent_norm_scale",
        "post_expert_norm_scale",
    ):
      params[name] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    elif name == "expert_output_scale":
      params[name] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    else:
      params[name] = _normal(rng, shape, shape[-2] ** -0.5)
  if case.hot_expert is not None or case.cold_experts:
    # Feature 0 is >= 1 for every token, so router row 0 decides.
    x[..., 0] = 1.0 + np.abs(x[..., 0])
    if case.hot_expert is not None:
      params["router"][0, case.hot_expert] = 40.0
    for e in case.cold_experts:
      params["router"][0, e] = -40.0
  cotangent = _normal(rng, x.shape)
  dtype = jnp.dtype(case.dtype)
  params = {
      n: jnp.asarray(v, _PARAM_DTYPES.get(n, dtype)) for n, v in params.items()
  }
  return params, jnp.asarray(x, dtype), jnp.asarray(cotangent)


# The params that keep their dtype whatever the case's: routing state.
_PARAM_DTYPES = {"correction_bias": jnp.float32, "hash_table": jnp.int32}


# --- Single stages -----------------------------------------------------------

# Dispatch / combine: E = 6, K = 3, T = 13; with capacity_factor 0.5 each
# expert keeps ceil(0.5 * 13 * 3 / 6) = 4 copies and some are dropped.
PERMUTE_CFG = _cfg(num_experts=6, top_k=3, hidden_size=16, expert_ffn_size=16)
PERMUTE_CAPACITY_CFG = PERMUTE_CFG.replace(capacity_factor=0.5)
PERMUTE_TOKENS = 13


@functools.lru_cache(maxsize=None)
def permute_inputs(cfg: moe_core.MoEConfig):
  """(x [T, D], router [D, E], expert_out [T*K, D], weights [T, K],
  cotangent [T, D]), float32 jax arrays for the dispatch/combine stage."""
  rng = np.random.default_rng(3000)
  t, d, e, k = PERMUTE_TOKENS, cfg.hidden_size, cfg.num_experts, cfg.top_k
  arrays = (
      _normal(rng, (t, d)),
      _normal(rng, (d, e), d**-0.5),
      _normal(rng, (t * k, d)),
      rng.uniform(0.1, 1.0, (t, k)),
      _normal(rng, (t, d)),
  )
  return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


# Expert FFN on an already dispatched buffer: groups (5, 0, 9, 7) of 29 rows,
# so rows 21..28 are padding (and expert 1 is empty).
FFN_CFG = _cfg(num_experts=4, top_k=2, hidden_size=32, expert_ffn_size=48)
FFN_GROUP_SIZES = (5, 0, 9, 7)
FFN_ROWS = 29


# The stage again with a clamped, biased GLU and a biased non-gated FFN:
# the biases must leave the padding rows exactly zero.
FFN_STAGE_CFGS = {
    "": FFN_CFG,
    "_gpt_oss_glu_bias": FFN_CFG.replace(
        activation="gpt_oss_glu",
        swiglu_alpha=1.702,
        swiglu_limit=0.8,
        expert_bias=True,
    ),
    "_relu2_bias": FFN_CFG.replace(activation="relu2", expert_bias=True),
}


@functools.lru_cache(maxsize=None)
def ffn_inputs(dtype: str, cfg: moe_core.MoEConfig = FFN_CFG):
  """(rows [29, D], group_sizes [4], params, cotangent [29, D]) as jax
  arrays; the padding rows hold NaN. params: the expert weights (and
  biases) of `cfg`, one of FFN_STAGE_CFGS."""
  rng = np.random.default_rng(3001)
  rows = _normal(rng, (FFN_ROWS, cfg.hidden_size))
  rows[sum(FFN_GROUP_SIZES) :] = np.nan
  params = {
      n: jnp.asarray(_normal(rng, s, s[-2] ** -0.5), dtype)
      for n, s in moe_core.param_shapes(cfg).items()
      if n.startswith(("w_", "b_"))
  }
  cotangent = _normal(rng, (FFN_ROWS, cfg.hidden_size))
  return (
      jnp.asarray(rows, dtype),
      jnp.asarray(FFN_GROUP_SIZES, jnp.int32),
      params,
      jnp.asarray(cotangent, dtype),
  )
