"""moe_layer against the Hugging Face transformers MoE blocks, in float32.

Read in transformers 5.24.0 (models/<family>/modeling_<family>.py); every
point below is a place where the six families differ, and each is either
expressed by a `MoEConfig` field (set by `hf_convert/`) or listed
as a known divergence.

Router scores and selection
  * Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: softmax over all E logits (in
    float32: Mixtral calls `.float()`, the others `softmax(dtype=float)`),
    then `torch.topk` (sorted, best first).
  * DeepSeek-V2: softmax in float32. `topk_method="greedy"` (V2-Lite): plain
    top-k. `"group_limited_greedy"` (V2): a group's score is the max of its
    softmax scores, the `topk_group` best groups are kept and the rest
    `masked_fill(..., 0.0)`. Softmax scores are > 0, so 0.0 acts like -inf
    here (dropless masks with -inf). `topk(sorted=False)`: ids come in no
    particular order, so ids are compared as sets.
  * DeepSeek-V3: sigmoid scores; `e_score_correction_bias` is added for the
    choice only (groups included); a group's score is the sum of its two best
    biased scores; excluded groups are masked with -inf in 5.24 (DeepSeek's
    original Hub `modeling_deepseek.py` for V3 and older ports masked with
    0.0, which lets an excluded expert win when the biased scores of the
    chosen groups are negative: vllm-project/vllm#13474); the combine weights
    are gathered from the unbiased sigmoid scores. dropless masks with -inf,
    as DeepSeek's own inference code does.
Normalisation and scaling
  * Mixtral always renormalises the top-k weights (no flag, no epsilon).
  * Qwen2-MoE, Qwen3-MoE, OLMoE renormalise iff `norm_topk_prob` (no
    epsilon). Real checkpoints: Qwen1.5/Qwen2-MoE False, Qwen3-MoE True,
    OLMoE False.
  * DeepSeek-V3: iff `norm_topk_prob`, divide by sum + 1e-20; then always
    multiply by `routed_scaling_factor` (2.5 in V3).
  * DeepSeek-V2: transformers never normalises (it ignores `norm_topk_prob`)
    and always multiplies by `routed_scaling_factor` (16.0 in V2, 1.0 in
    V2-Lite). DeepSeek's own V2 code normalises *instead of* scaling when
    `norm_topk_prob` is set. dropless normalises iff `norm_topk_prob` and then
    always scales. All three agree on the real V2 configs (norm_topk_prob
    False); with norm_topk_prob=True they differ, see
    `test_deepseek_v2_norm_topk_prob_is_ignored_by_hf`. `hf_convert` follows
    transformers (norm_topk_prob=False for V2).
Shared expert
  * Qwen2-MoE: one shared SwiGLU of width `shared_expert_intermediate_size`,
    scaled per token by sigmoid(x @ shared_expert_gate.weight.T).
  * DeepSeek-V2/V3: `n_shared_experts * moe_intermediate_size` wide, no gate,
    added to the routed output.
  * Mixtral, Qwen3-MoE, OLMoE: none.
Dtypes (no effect in float32; in bfloat16 dropless is the more precise)
  * Qwen2-MoE, Qwen3-MoE, OLMoE cast the routing weights back to the hidden
    dtype after normalising; Mixtral and DeepSeek keep them float32.
  * Mixtral/Qwen/OLMoE compute the router logits in the hidden dtype
    (`F.linear`); DeepSeek casts x and the router to float32 (V3 also keeps
    `gate.weight` and the bias float32 when loading). dropless always routes in
    float32.
  * HF accumulates each expert's weighted output into the hidden dtype with
    `index_add_`; dropless sums the K outputs in float32.
Weight layouts
  * nn.Linear weights are [out, in]: router `gate.weight` [E, D], shared
    `*_proj.weight` [out, in], `shared_expert_gate.weight` [1, D].
  * transformers 5.x fuses experts: `experts.gate_up_proj` [E, 2F, D] (gate
    rows, then up rows; `chunk(2)`), `experts.down_proj` [E, D, F]. 4.x and
    Hub checkpoints keep per-expert `experts.{e}.{gate,up,down}_proj` (Mixtral:
    `w1` gate, `w3` up, `w2` down). dropless: router [D, E], w_gate/w_up
    [E, D, F], w_down [E, F, D], i.e. every matrix transposed.
Activation: `hidden_act` "silu" (all real checkpoints), "gelu" (erf),
"gelu_pytorch_tanh" map to dropless "silu", "gelu", "gelu_tanh".
Mixtral's `router_jitter_noise` acts only in training mode; blocks run in
eval mode here.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np

import hf_convert
import moe_core

try:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  _IMPORT_ERROR = None
except ImportError as e:  # Skipped in setUp, with this reason.
  torch = transformers = None
  _IMPORT_ERROR = e

# torch's CPU wheel exists for Python 3.11 only (on 3.12 and 3.13 the
# registry's torch is a multi-GB CUDA build), so only the py311-jax0.10 leg
# (requirements/py311-jax0.10.in) installs torch and transformers.
_SKIP_REASON = (
    f"needs torch and transformers, which only the py311-jax0.10 leg "
    f"installs (tools/test.sh --leg=py311-jax0.10): {_IMPORT_ERROR}"
)

_D = 32  # hidden_size
_F = 48  # expert ffn size
_BACKENDS = ("reference", "xla")


@dataclasses.dataclass(frozen=True)
class _Family:
  block_class: str
  config_class: str
  fields: dict


_FAMILIES = {
    "mixtral": _Family(
        "MixtralSparseMoeBlock",
        "MixtralConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=_F),
    ),
    "qwen2_moe": _Family(
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeConfig",
        dict(
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=_F,
            shared_expert_intermediate_size=64,
        ),
    ),
    "qwen3_moe": _Family(
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=_F),
    ),
    "olmoe": _Family(
        "OlmoeSparseMoeBlock",
        "OlmoeConfig",
        dict(num_experts=16, num_experts_per_tok=4, intermediate_size=_F),
    ),
    "deepseek_v2": _Family(
        "DeepseekV2Moe",
        "DeepseekV2Config",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=_F,
            n_shared_experts=2,
        ),
    ),
    "deepseek_v3": _Family(
        "DeepseekV3MoE",
        "DeepseekV3Config",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=_F,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
        ),
    ),
}


def _hf_block(family: str, seed: int = 0, bias=None, **overrides):
  """(hf_config, block) in float32 eval mode, with random weights.

  Args:
    family: a key of `_FAMILIES`.
    seed: seeds every weight.
    bias: DeepSeek-V3 correction bias [E] (numpy); default uniform [0, 0.5),
      so every biased score stays positive.
    **overrides: HF config fields.
  """
  spec = _FAMILIES[family]
  modeling = importlib.import_module(
      f"transformers.models.{family}.modeling_{family}"
  )
  configuration = importlib.import_module(
      f"transformers.models.{family}.configuration_{family}"
  )
  fields = dict(
      hidden_size=_D,
      num_attention_heads=4,
      num_key_value_heads=4,
      hidden_act="silu",
  )
  fields.update(spec.fields)
  fields.update(overrides)
  hf_cfg = getattr(configuration, spec.config_class)(**fields)
  block = getattr(modeling, spec.block_class)(hf_cfg).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in block.named_parameters():
      # Router std 0.3 spreads the logits (std ~1.7) so the choice is clear;
      # other matrices get 1/sqrt(fan_in), fan_in being the last axis.
      std = 0.3 if name == "gate.weight" else p.shape[-1] ** -0.5
      p.copy_(torch.randn(p.shape, generator=gen) * std)
    for name, b in block.named_buffers():
      if name.endswith("e_score_correction_bias"):
        if bias is None:
          b.copy_(torch.rand(b.shape, generator=gen) * 0.5)
        else:
          b.copy_(torch.as_tensor(bias, dtype=torch.float32))
  return hf_cfg, block


def _tokens(seed: int = 1, shape=(2, 16, _D)) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _run_hf(block, x: np.ndarray):
  """HF output [..., D] and its router's (logits, weights, ids), as numpy."""
  with torch.no_grad():
    xt = torch.from_numpy(x)
    y = block(xt).numpy()
    logits, weights, ids = block.gate(xt.reshape(-1, x.shape[-1]))
  return y, logits.numpy(), weights.float().numpy(), ids.numpy()


def _by_expert(ids, weights):
  """Sorts each token's choices by expert id (HF may return them unsorted)."""
  order = np.argsort(ids, axis=-1)
  return (
      np.take_along_axis(ids, order, -1),
      np.take_along_axis(weights, order, -1),
  )


def _best_groups(choice: np.ndarray, cfg: moe_core.MoEConfig) -> list[set]:
  """Per token, the experts of its `topk_group` best groups (numpy loop)."""
  per_group = cfg.experts_per_group
  out = []
  for row in choice:
    scores = []
    for g in range(cfg.n_group):
      members = sorted(row[g * per_group : (g + 1) * per_group], reverse=True)
      scores.append(
          sum(members[:2]) if cfg.group_score == "sum_top2" else members[0]
      )
    groups = sorted(range(cfg.n_group), key=lambda g: -scores[g])
    out.append(
        {
            g * per_group + i
            for g in groups[: cfg.topk_group]
            for i in range(per_group)
        }
    )
  return out


class HfParityTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if _IMPORT_ERROR is not None:
      self.skipTest(_SKIP_REASON)

  def _assert_parity(self, family, backends=_BACKENDS, **overrides):
    hf_cfg, block = _hf_block(family, **overrides)
    x = _tokens()
    y_hf, logits_hf, w_hf, ids_hf = _run_hf(block, x)
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    params = hf_convert.params_from_hf(block.state_dict(), cfg)
    scale = np.abs(y_hf).max()
    for backend in backends:
      with self.subTest(backend=backend):
        y, aux = moe_core.moe_layer(
            params, jnp.asarray(x), cfg, backend=backend
        )
        np.testing.assert_allclose(
            np.asarray(y), y_hf, rtol=1e-5, atol=1e-5 * scale
        )
    np.testing.assert_allclose(
        np.asarray(aux.router_logits), logits_hf, rtol=1e-5, atol=1e-5
    )
    ids, w = _by_expert(
        np.asarray(aux.expert_ids), np.asarray(aux.combine_weights)
    )
    want_ids, want_w = _by_expert(ids_hf, w_hf)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)

  @parameterized.named_parameters(
      ("mixtral", "mixtral", {}),
      ("qwen2_moe", "qwen2_moe", dict(norm_topk_prob=False)),
      ("qwen3_moe", "qwen3_moe", dict(norm_topk_prob=True)),
      (
          "qwen3_moe_no_norm_gelu_tanh",
          "qwen3_moe",
          dict(norm_topk_prob=False, hidden_act="gelu_pytorch_tanh"),
      ),
      ("olmoe", "olmoe", dict(norm_topk_prob=False)),
      # DeepSeek-V2-Lite: plain top-k, no scaling.
      (
          "deepseek_v2_lite",
          "deepseek_v2",
          dict(topk_method="greedy", routed_scaling_factor=1.0),
      ),
      # DeepSeek-V2: group-limited (max per group), scaled by 16.
      (
          "deepseek_v2",
          "deepseek_v2",
          dict(
              topk_method="group_limited_greedy",
              n_group=4,
              topk_group=2,
              routed_scaling_factor=16.0,
          ),
      ),
      (
          "deepseek_v3",
          "deepseek_v3",
          dict(norm_topk_prob=True, routed_scaling_factor=2.5),
      ),
      (
          "deepseek_v3_no_norm_gelu",
          "deepseek_v3",
          dict(
              norm_topk_prob=False, routed_scaling_factor=1.0, hidden_act="gelu"
          ),
      ),
  )
  def test_matches_hf_block(self, family, overrides):
    self._assert_parity(family, **overrides)

  def test_deepseek_v3_bias_changes_choice_not_weights(self):
    # Guards the DeepSeek-V3 parity cases: their bias must move choices.
    hf_cfg, block = _hf_block(
        "deepseek_v3", norm_topk_prob=False, routed_scaling_factor=1.0
    )
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    params = hf_convert.params_from_hf(block.state_dict(), cfg)
    x = _tokens().reshape(-1, _D).astype(np.float64)
    aux = moe_core.route(
        jnp.asarray(x, jnp.float32),
        params["router"],
        cfg,
        params["correction_bias"],
    )
    _, _, _, ids_hf = _run_hf(block, _tokens())
    np.testing.assert_array_equal(
        np.sort(aux.expert_ids, -1), np.sort(ids_hf, -1)
    )
    scores = 1 / (1 + np.exp(-(x @ np.asarray(params["router"]))))
    unbiased = moe_core.route(
        jnp.asarray(x, jnp.float32),
        params["router"],
        cfg.replace(correction_bias=False),
    )
    self.assertFalse(
        np.array_equal(
            np.sort(unbiased.expert_ids, -1), np.sort(aux.expert_ids, -1)
        )
    )
    np.testing.assert_allclose(
        aux.combine_weights,
        np.take_along_axis(scores, np.asarray(aux.expert_ids), -1),
        rtol=1e-5,
    )

  def test_deepseek_v3_negative_biased_scores_stay_in_chosen_groups(self):
    # bias -1 makes every biased score negative. Masking excluded groups
    # with -inf keeps the choice inside the best groups; masking with 0.0
    # (older DeepSeek-V3 ports) would pick excluded experts, whose masked 0.0
    # beats every negative eligible score.
    e = _FAMILIES["deepseek_v3"].fields["n_routed_experts"]
    hf_cfg, block = _hf_block("deepseek_v3", bias=-np.ones(e))
    x = _tokens()
    y_hf, _, w_hf, ids_hf = _run_hf(block, x)
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    params = hf_convert.params_from_hf(block.state_dict(), cfg)
    y, aux = moe_core.moe_layer(
        params, jnp.asarray(x), cfg, backend="reference"
    )
    tokens = x.reshape(-1, _D).astype(np.float64)
    choice = 1 / (1 + np.exp(-(tokens @ np.asarray(params["router"])))) - 1
    self.assertTrue((choice < 0).all())
    allowed = _best_groups(choice, cfg)
    for t, ids in enumerate(np.asarray(aux.expert_ids)):
      self.assertLessEqual(set(ids.tolist()), allowed[t], f"token {t}")
    hf_inside = all(
        set(ids.tolist()) <= allowed[t] for t, ids in enumerate(ids_hf)
    )
    if hf_inside:  # transformers 5.x masks with -inf, as dropless does.
      np.testing.assert_array_equal(
          np.sort(ids_hf, -1), np.sort(np.asarray(aux.expert_ids), -1)
      )
      np.testing.assert_allclose(
          np.asarray(y), y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max()
      )
    else:
      logging.warning(
          "transformers %s masks excluded DeepSeek-V3 groups "
          "with 0.0: it picks experts outside the chosen groups "
          "when biased scores are negative; dropless does not.",
          transformers.__version__,
      )

  def test_deepseek_v2_norm_topk_prob_is_ignored_by_hf(self):
    # transformers' V2 router neither reads norm_topk_prob nor skips the
    # scaling; a dropless config that asks for normalisation differs.
    scale = 2.0
    hf_cfg, block = _hf_block(
        "deepseek_v2",
        topk_method="greedy",
        norm_topk_prob=True,
        routed_scaling_factor=scale,
    )
    x = _tokens()
    _, logits_hf, w_hf, ids_hf = _run_hf(block, x)
    softmax = np.exp(logits_hf - logits_hf.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    np.testing.assert_allclose(
        w_hf, scale * np.take_along_axis(softmax, ids_hf, -1), rtol=1e-5
    )
    converted = hf_convert.moe_config_from_hf(hf_cfg)
    self.assertFalse(converted.norm_topk_prob)
    self._assert_parity(
        "deepseek_v2",
        backends=("reference",),
        topk_method="greedy",
        norm_topk_prob=True,
        routed_scaling_factor=scale,
    )
    params = hf_convert.params_from_hf(block.state_dict(), converted)
    normed = moe_core.route(
        jnp.asarray(x.reshape(-1, _D)),
        params["router"],
        converted.replace(norm_topk_prob=True),
    )
    np.testing.assert_allclose(
        np.asarray(normed.combine_weights).sum(-1), scale, rtol=1e-5
    )
    self.assertTrue((np.abs(w_hf.sum(-1) - scale) > 1e-3).all())


class HfConvertTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if _IMPORT_ERROR is not None:
      self.skipTest(_SKIP_REASON)

  # Expected fields written from reading each HF router, not from hf_convert.
  @parameterized.named_parameters(
      (
          "mixtral",
          "mixtral",
          {},
          dict(num_experts=8, top_k=2, expert_ffn_size=_F, norm_topk_prob=True),
      ),
      (
          "qwen2_moe",
          "qwen2_moe",
          dict(norm_topk_prob=False),
          dict(
              num_experts=16,
              top_k=4,
              expert_ffn_size=_F,
              shared_ffn_size=64,
              shared_expert_gate=True,
          ),
      ),
      (
          "qwen3_moe",
          "qwen3_moe",
          dict(norm_topk_prob=True),
          dict(
              num_experts=16, top_k=4, expert_ffn_size=_F, norm_topk_prob=True
          ),
      ),
      (
          "olmoe",
          "olmoe",
          dict(hidden_act="gelu_pytorch_tanh"),
          dict(
              num_experts=16,
              top_k=4,
              expert_ffn_size=_F,
              activation="gelu_tanh",
          ),
      ),
      (
          "deepseek_v2",
          "deepseek_v2",
          dict(
              topk_method="group_limited_greedy",
              n_group=4,
              topk_group=2,
              routed_scaling_factor=16.0,
              norm_topk_prob=True,
          ),
          dict(
              num_experts=16,
              top_k=4,
              expert_ffn_size=_F,
              routed_scaling_factor=16.0,
              n_group=4,
              topk_group=2,
              group_score="max",
              shared_ffn_size=2 * _F,
          ),
      ),
      (
          "deepseek_v3",
          "deepseek_v3",
          dict(routed_scaling_factor=2.5),
          dict(
              num_experts=16,
              top_k=4,
              expert_ffn_size=_F,
              score_func="sigmoid",
              norm_topk_prob=True,
              norm_epsilon=1e-20,
              routed_scaling_factor=2.5,
              correction_bias=True,
              n_group=4,
              topk_group=2,
              group_score="sum_top2",
              shared_ffn_size=_F,
          ),
      ),
  )
  def test_config(self, family, overrides, want):
    hf_cfg, _ = _hf_block(family, **overrides)
    self.assertEqual(
        hf_convert.moe_config_from_hf(hf_cfg),
        moe_core.MoEConfig(hidden_size=_D, **want),
    )

  def test_config_overrides(self):
    hf_cfg, _ = _hf_block("mixtral")
    cfg = hf_convert.moe_config_from_hf(hf_cfg, capacity_factor=1.25)
    self.assertEqual(cfg.capacity_factor, 1.25)

  def test_unknown_model_type(self):
    with self.assertRaisesRegex(
        ValueError, r"model_type must be one of .*'llama'"
    ):
      hf_convert.moe_config_from_hf(transformers.LlamaConfig())

  def test_unknown_deepseek_v2_topk_method(self):
    hf_cfg, _ = _hf_block("deepseek_v2")
    hf_cfg.topk_method = "noaux_tc"
    with self.assertRaisesRegex(
        NotImplementedError, r"topk_method must be .*'noaux_tc'"
    ):
      hf_convert.moe_config_from_hf(hf_cfg)

  @parameterized.named_parameters(
      ("mixtral", "mixtral", ("w1", "w3", "w2")),
      ("qwen3_moe", "qwen3_moe", ("gate_proj", "up_proj", "down_proj")),
  )
  def test_per_expert_layout_matches_fused(self, family, names):
    # Hub checkpoints and transformers 4.x store one nn.Linear per expert.
    hf_cfg, block = _hf_block(family)
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    sd = {"model.layers.0.mlp." + k: v for k, v in block.state_dict().items()}
    gate_up = sd.pop("model.layers.0.mlp.experts.gate_up_proj")
    down = sd.pop("model.layers.0.mlp.experts.down_proj")
    for e in range(cfg.num_experts):
      g, u = gate_up[e].chunk(2, dim=0)
      for name, w in zip(names, (g, u, down[e])):
        sd[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = w
    got = hf_convert.params_from_hf(sd, cfg, prefix="model.layers.0.mlp.")
    want = hf_convert.params_from_hf(block.state_dict(), cfg)
    self.assertEqual(sorted(got), sorted(want))
    for name in want:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)

  def test_params_layout(self):
    hf_cfg, block = _hf_block("qwen2_moe")
    cfg = hf_convert.moe_config_from_hf(hf_cfg)
    sd = block.state_dict()
    params = hf_convert.params_from_hf(sd, cfg, dtype=jnp.bfloat16)
    f = cfg.expert_ffn_size
    np.testing.assert_array_equal(params["router"], sd["gate.weight"].T)
    np.testing.assert_array_equal(
        params["w_up"][3],
        jnp.asarray(sd["experts.gate_up_proj"][3, f:].T.numpy(), jnp.bfloat16),
    )
    np.testing.assert_array_equal(
        params["shared_gate"],
        jnp.asarray(sd["shared_expert_gate.weight"].T.numpy(), jnp.bfloat16),
    )
    self.assertEqual(params["router"].dtype, jnp.float32)
    self.assertEqual(params["w_down"].dtype, jnp.bfloat16)

  def test_shape_mismatch_names_param(self):
    hf_cfg, block = _hf_block("olmoe")
    cfg = hf_convert.moe_config_from_hf(hf_cfg).replace(expert_ffn_size=40)
    with self.assertRaisesRegex(
        ValueError,
        r"w_gate must have shape \(16, 32, 40\) .* got " r"\(16, 32, 48\)",
    ):
      hf_convert.params_from_hf(block.state_dict(), cfg)

  def test_moe_core_and_hf_convert_never_import_torch(self):
    code = (
        "import sys, moe_core, hf_convert; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    self.assertEqual(result.returncode, 0, result.stderr)


if __name__ == "__main__":
  absltest.main()
