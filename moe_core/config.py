"""MoEConfig: the static description of one Mixture-of-Experts block."""

from __future__ import annotations

import dataclasses
import math

from moe_core import config_checks
from moe_core import precision as precision_lib

# Re-exported: the public names of this module before its checks moved.
SCORE_FUNCS = config_checks.SCORE_FUNCS
GROUP_SCORES = config_checks.GROUP_SCORES
CORRECTION_BIAS_ON = config_checks.CORRECTION_BIAS_ON
ZERO_EXPERT_OUTPUTS = config_checks.ZERO_EXPERT_OUTPUTS
SHARED_COMBINES = config_checks.SHARED_COMBINES
ACTIVATIONS = config_checks.ACTIVATIONS
FLOAT32_MAX = config_checks.FLOAT32_MAX
FLOAT32_TINY = config_checks.FLOAT32_TINY
FLOAT32_FIELDS = config_checks.FLOAT32_FIELDS


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Every knob of a routed-expert block, validated on construction.

  The routing fields express the routers of Mixtral, Qwen2-MoE, Qwen3-MoE,
  OLMoE, DeepSeek-V2 and DeepSeek-V3 exactly (the table in docs/api.md,
  "Every real router"; checked by `hf_convert/hf_parity_test.py`).

  Attributes:
    num_experts: E, routed experts.
    top_k: K, experts chosen per token.
    hidden_size: D, model width.
    expert_ffn_size: F, hidden width of one routed expert.
    score_func: how logits become scores, a key of
      `moe_core.score_functions.SCORE_FUNCTIONS`: "softmax" over all E
      logits, "sigmoid" or "sqrtsoftplus" (sqrt(softplus(l)), DeepSeek-V4)
      per expert, or "sparsemixer" (Phi-MoE's inference-time router: top-k
      of the logits, each weighed by a softmax over the experts within
      `sparsemixer_epsilon` of it; docs/api.md, "Score functions").
    norm_topk_prob: renormalise the K chosen weights to sum to 1.
    norm_epsilon: added to that denominator (DeepSeek-V3 uses 1e-20).
    norm_topk_p: the norm that normalisation divides by: the K chosen
      weights w become w / (sum_j w_j^p)^(1/p), p a finite float > 0; 1.0
      (the default) is the sum. p != 1 (DBRX's moe_normalize_expert_weights)
      needs norm_topk_prob=True and norm_epsilon=0.
    routed_scaling_factor: multiplies the routed weights after the optional
      normalisation; never the shared expert.
    correction_bias: DeepSeek-V3's aux-loss-free bias [E], added to the scores
      for choosing experts only; combine weights use the unbiased scores.
    n_group: experts split into this many contiguous groups (1 = no groups).
    topk_group: only experts of the `topk_group` best groups may be chosen.
    group_score: a group's score: "max" of its (biased) scores (DeepSeek-V2)
      or "sum_top2", the sum of its two best (DeepSeek-V3).
    sparsemixer_epsilon: score_func="sparsemixer"'s jitter threshold
      (Phi-MoE's router_jitter_noise): a finite float >= 0.
    router_bias: a learned bias [E] (param "router_bias") added to the
      router logits before anything else sees them (GPT-OSS).
    router_logit_softcap: c > 0 soft-caps the logits (after the router
      bias) to c * tanh(logits / c) (Laguna); 0 (the default) is no cap.
    correction_bias_on: where the correction bias steers the choice:
      "scores", added to the scores (DeepSeek-V3), or "logits", added to
      the logits before the score function (Kolibri); either way for the
      choice only.
    router_input_norm: RMS-normalise the router's input with its own
      learned scale [D] (param "router_norm_scale"), distinct from the
      experts' input (Gemma 4): x / sqrt(mean(x^2) + input_norm_epsilon)
      * router_norm_scale.
    expert_input_norm: RMS-normalise the experts' input (routed and
      shared) with its own learned scale [D] (param "expert_norm_scale"),
      while the router sees x itself (or its own norm): Gemma 4's
      pre_feedforward_layernorm_2, so that x is the block's un-normed
      input.
    input_norm_epsilon: the epsilon of both input norms, a finite
      float > 0.
    router_input_scale: a fixed number multiplying the router's input
      (after the norm, if any; Gemma 4: hidden_size ** -0.5).
    num_zero_experts: Z extra experts the router may choose that run no
      FFN (LongCat-Flash, Zaya): the router and its [E] params are
      [E + Z] wide, and ids E..E+Z-1 are these. Dropless and ungrouped only.
    zero_expert_output: what a zero expert returns: "identity", the
      experts' input scaled by its combine weight (LongCat-Flash), or
      "zero", nothing (Zaya's skip expert).
    num_always_on_experts: S >= 0, S < top_k: the last S of the
      num_experts FFN experts are chosen by every token, in the last S of
      its top_k slots; the router picks the other top_k - S among the first
      num_experts - S, and weighs all top_k alike (normalised together with
      norm_topk_prob): shared experts weighted by the router (Inkling's).
      Takes no groups, zero experts, hash routing or sparsemixer.
    hash_vocab_size: V > 0 routes by token id (DeepSeek-V4's hash
      layers): the experts of a token are row token_id of a fixed int32
      table [V, K] (param "hash_table", not learned), and `moe_layer` then
      needs `token_ids`; the weights are the chosen experts' scores,
      normalised and scaled as the config says. 0 (the default): the
      router chooses. Takes no correction bias, groups or sparsemixer.
    expert_output_scale: a learned scale [E] (param
      "expert_output_scale") multiplying each chosen expert's combine
      weight, after normalisation and routed_scaling_factor (Gemma 4).
    output_bias: a learned bias [D] (param "output_bias", starts at 0)
      added to the block's output, after the combine and the shared expert
      (JetMoE).
    output_norm: an RMS norm of the block's output, after the shared
      expert and output_bias: y / sqrt(mean(y^2) + output_norm_epsilon) *
      output_norm_scale, a learned scale [D] (param "output_norm_scale",
      starts at 1) (A.X-K1's post_mlp_layernorm).
    output_norm_epsilon: that norm's epsilon, > 0.
    expert_latent_size: L > 0 runs the routed experts at width L
      (Nemotron-H's moe_latent_size, Muse Spark's moe_hidden_size): the
      experts' input is projected down, x @ latent_in [D, L] (param
      "latent_in"), before the dispatch, so that the dispatch moves [L]
      rows; the experts' weights are [E, L, F] and [E, F, L]; the combined
      output (zero experts' included) is projected back, @ latent_out
      [L, D] (param "latent_out"), before the shared expert, which stays
      at width D and sees the un-projected input. 0 (the default): none.
    latent_norm: RMS-normalise the projected rows with a learned scale [L]
      (param "latent_norm_scale", starts at 1) before the dispatch (Muse
      Spark's pre_expert_norm); needs expert_latent_size > 0.
    latent_norm_epsilon: that norm's epsilon, a finite float > 0.
    post_expert_norm: each routed expert's output row y (width W, the
      experts' width: L or D) becomes z / sqrt(mean(z^2) + eps), z = y *
      post_expert_norm_scale, a learned scale [W] (param
      "post_expert_norm_scale", starts at 1) applied before the norm and
      none after; then the routing weight (Muse Spark's post_expert_norm).
      The norm would undo a weight on the input: it takes no
      routing_weights_on_input.
    post_expert_norm_epsilon: that norm's epsilon, a finite float > 0.
    latent_bias: the latent projections have biases, latent_in_bias [L]
      and latent_out_bias [D] (params, start at 0), added in float32 to
      their products (Nemotron-H's mlp_bias); needs expert_latent_size > 0.
    shared_ffn_size: Fs, hidden width of the always-on shared expert
      (0 = none).
    shared_expert_gate: scale the shared expert's output per token by
      sigmoid(x @ shared_gate) (Qwen2-MoE).
    shared_expert_bias: the shared expert's linears have biases,
      shared_b_gate and shared_b_up [Fs] (no shared_b_gate when not gated)
      and shared_b_down [D] (params, start at 0), added in float32 to the
      products, before the activation and its clamp (DeepSeek-V4's and
      Nemotron-H's mlp_bias); needs shared_ffn_size > 0.
    shared_combine: how the shared expert joins the routed output: "sum"
      (routed + shared) or "mean" ((routed + shared) / 2, Cohere 2 MoE's
      default "average"); "mean" needs shared_ffn_size > 0.
    activation: the expert FFN's activation, a name of the registry
      `moe_core.activations`: gated "silu" (SwiGLU), "gelu" (GeGLU, exact
      erf), "gelu_tanh", "gpt_oss_glu" (GPT-OSS: (u + 1) g sigmoid(alpha g))
      and "softcapped_silu" (Inkling 2); non-gated "relu" and "relu2"
      (squared ReLU), whose experts (and shared expert) have no w_gate.
    routing_weights_on_input: scale each token copy by its routing weight
      before its expert (Llama 4: FFN(w x)), and sum the outputs unweighted,
      instead of w * FFN(x).
    swiglu_limit: None, or L > 0: a gated activation first clamps gate to
      (-inf, L] and up to [-L, L] (GLM-5-Next, DeepSeek-V4, GPT-OSS); in the
      routed and (unless shared_swiglu_clamp=False) the shared experts.
    shared_swiglu_clamp: whether swiglu_limit clamps the shared expert too
      (True, the default); False clamps the routed experts only (HY-V4).
      False needs swiglu_limit set and a shared expert.
    swiglu_alpha: the sigmoid's scale of "gpt_oss_glu" (GPT-OSS: 1.702);
      None for every other activation.
    gate_softcap, up_softcap: c > 0, the soft caps c * tanh(z / c) of
      "softcapped_silu"'s gate and up factors; None for every other
      activation.
    expert_bias: the routed experts' linears have biases, b_gate and b_up
      [E, F] (no b_gate when not gated) and b_down [E, D], added in float32
      to the products, before the activation and before the routing weight.
    capacity_factor: None means dropless. A number gives each expert
      ceil(capacity_factor * T * K / E) slots; assignments beyond them are
      dropped (top-1 choices first, then by token order) and counted.
    precision: the routed experts' GEMM recipe (`moe_core.precision`):
      "unquantized" (no quantisation: the GEMMs run in the activation dtype),
      "fp8_tensor", "fp8_block", "mxfp8" or "nvfp4". Forward GEMMs quantise
      both operands; gradients are straight-through, computed in the
      activation dtype. Routing stays float32 and the shared expert in the
      activation dtype whatever the recipe. The deprecated alias "bf16" is
      accepted with a DeprecationWarning and stored as "unquantized".
  """

  num_experts: int
  top_k: int
  hidden_size: int
  expert_ffn_size: int
  score_func: str = "softmax"
  norm_topk_prob: bool = False
  norm_epsilon: float = 0.0
  norm_topk_p: float = 1.0
  routed_scaling_factor: float = 1.0
  correction_bias: bool = False
  n_group: int = 1
  topk_group: int = 1
  group_score: str = "max"
  sparsemixer_epsilon: float = 0.01
  router_bias: bool = False
  router_logit_softcap: float = 0.0
  correction_bias_on: str = "scores"
  router_input_norm: bool = False
  expert_input_norm: bool = False
  input_norm_epsilon: float = 1e-6
  router_input_scale: float = 1.0
  expert_output_scale: bool = False
  hash_vocab_size: int = 0
  num_always_on_experts: int = 0
  num_zero_experts: int = 0
  zero_expert_output: str = "identity"
  output_bias: bool = False
  output_norm: bool = False
  output_norm_epsilon: float = 1e-6
  expert_latent_size: int = 0
  latent_norm: bool = False
  latent_norm_epsilon: float = 1e-6
  post_expert_norm: bool = False
  post_expert_norm_epsilon: float = 1e-6
  latent_bias: bool = False
  shared_ffn_size: int = 0
  shared_expert_gate: bool = False
  shared_expert_bias: bool = False
  shared_combine: str = "sum"
  activation: str = "silu"
  routing_weights_on_input: bool = False
  swiglu_limit: float | None = None
  shared_swiglu_clamp: bool = True
  swiglu_alpha: float | None = None
  gate_softcap: float | None = None
  up_softcap: float | None = None
  expert_bias: bool = False
  capacity_factor: float | None = None
  precision: str = precision_lib.UNQUANTIZED

  def __post_init__(self):
    config_checks.check_sizes_and_activation(self)
    # Frozen: the canonical name replaces a deprecated alias in place, so
    # that no code past the config sees the alias. Stack level 3: the
    # caller of the generated __init__, which calls this.
    object.__setattr__(
        self,
        "precision",
        precision_lib.check_recipe(self.precision, stacklevel=3),
    )
    config_checks.check_groups_and_switches(self)

  @property
  def dropless(self) -> bool:
    return self.capacity_factor is None

  @property
  def expert_width(self) -> int:
    """The width the routed experts work at: expert_latent_size L when
    set, else hidden_size D. Their rows, w_up [E, W, F], w_down [E, F, W]
    and b_down [E, W] have it."""
    return self.expert_latent_size or self.hidden_size

  @property
  def num_router_experts(self) -> int:
    """The router's width: E routed experts plus the Z zero experts."""
    return self.num_experts + self.num_zero_experts

  @property
  def masks_copies(self) -> bool:
    """Whether some token copies skip the expert FFN (`MoEAux.kept`
    False): dropped by capacity, or sent to a zero expert."""
    return self.capacity_factor is not None or self.num_zero_experts > 0

  @property
  def experts_per_group(self) -> int:
    return self.num_experts // self.n_group

  def expert_capacity(self, num_tokens: int) -> int | None:
    """Slots per expert for `num_tokens` tokens, or None when dropless."""
    if self.capacity_factor is None:
      return None
    copies = num_tokens * self.top_k
    # No expert can take more than every copy: a larger factor (up to
    # float's largest) gives the same slots, not an int32 overflow.
    share = min(self.capacity_factor * copies / self.num_experts, copies)
    return max(1, math.ceil(share))

  def replace(self, **changes) -> MoEConfig:
    return dataclasses.replace(self, **changes)
