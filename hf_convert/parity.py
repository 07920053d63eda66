"""Builds each family's transformers block and compares it with moe_layer.

Shared by `hf_convert/hf_families_parity_test.py` and `report.py`. Needs
torch and transformers (the py311-jax0.10 leg); `IMPORT_ERROR` says why not
elsewhere. Blocks are built directly from their classes with a small config
(D=32, F=48, E=16, K=4, 4 groups of which 2 are kept, scaling 2.5 where the
family scales) and seeded random weights, in float32 and eval mode. Gemma 4's
MoE half lives in its decoder layer: `_GemmaMoE` assembles its router,
experts and expert input norm under the layer's names. DeepSeek-V4's hash
layer also gets random token ids, passed to both sides.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import inspect
import os
import re

import jax.numpy as jnp
import numpy as np

import hf_convert
from hf_convert import convert
from hf_convert import families
import moe_core

try:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  IMPORT_ERROR = None
except ImportError as e:  # The tests skip with this reason.
  torch = transformers = None
  IMPORT_ERROR = e

SKIP_REASON = (
    "needs torch and transformers, which only the py311-jax0.10 leg "
    f"installs (tools/test.sh --leg=py311-jax0.10): {IMPORT_ERROR}"
)

# Output error bound, relative to the largest |output| of the HF block.
TOLERANCE = 1e-5

D, F, E, K = 32, 48, 16, 4
_SHARED_F = 40
# The experts' latent width, for the families that project to one.
_LATENT = 24

# The small sizes, each under every name the families' configs give it;
# set on a family's config when its default config has the attribute.
_SMALL = {
    name: value
    for value, names in (
        (D, "hidden_size"),
        (F, "intermediate_size moe_intermediate_size expert_ffn_hidden_size"),
        (E, "num_experts num_local_experts n_routed_experts moe_num_experts"),
        (K, "num_experts_per_tok moe_topk moe_k top_k_experts"),
        (1, "n_shared_experts num_shared_experts moe_num_shared_experts"),
        (
            _SHARED_F,
            "shared_expert_intermediate_size shared_experts_intermediate_size "
            "shared_intermediate_size share_expert_dim",
        ),
        (4, "n_group"),
        (2, "topk_group"),
        (
            2.5,
            "routed_scaling_factor route_scale router_scaling_factor "
            "moe_routed_scaling_factor",
        ),
        (4, "num_attention_heads num_key_value_heads"),
        (8, "head_dim"),
        ("silu", "hidden_act"),
    )
    for name in names.split()
}


def dbrx_ffn_config(**settings) -> dict:
  """DBRX's `ffn_config` (where its expert settings live) at the small
  sizes, plus `settings`."""
  return dict(ffn_hidden_size=F, moe_num_experts=E, moe_top_k=K, **settings)


# Per family, on top of _SMALL (settings the converter supports).
_OVERRIDES = {
    "deepseek_v2": dict(topk_method="group_limited_greedy"),
    "deepseek_ocr2": dict(topk_method="group_limited_greedy"),
    "unlimited_ocr": dict(topk_method="group_limited_greedy"),
    "dbrx": dict(
        d_model=D,
        ffn_config=dbrx_ffn_config(moe_normalize_expert_weights=1.0),
    ),
    "lfm2_moe": dict(use_expert_bias=True),
    # Fewer zero experts than routed ones, so that both kinds are chosen.
    "longcat_flash": dict(zero_expert_num=8),
    "gpt_oss": dict(swiglu_limit=1.0),
    "openai_privacy_filter": dict(swiglu_limit=1.0),
    # A jitter threshold wide enough that the masked softmaxes weigh
    # several experts.
    "phimoe": dict(router_jitter_noise=0.3),
    # Two layers, a hash one first (the block is built as layer 0).
    "deepseek_v4": dict(
        vocab_size=64,
        num_hidden_layers=2,
        mlp_layer_types=["hash_moe", "moe"],
        swiglu_limit=1.0,
    ),
    "axk2": dict(n_group=None, topk_group=None),
    "step3p7": dict(swiglu_limits=None, swiglu_limits_shared=None),
    # Clamps and soft caps tight enough to bite on products of std ~1.
    "glm5_next": dict(swiglu_limit=1.0),
    "hy_v4": dict(swiglu_limit=1.0),
    "hy_v4_vl": dict(swiglu_limit=1.0),
    "minimax_m3_vl": dict(swiglu_limit=1.0),
    "inkling2": dict(mlp_gate_softcap=1.0, mlp_up_softcap=2.0),
    # Two router-weighted shared experts.
    "inkling": dict(n_shared_experts=2),
    "inkling2_loop": dict(mlp_gate_softcap=1.0, mlp_up_softcap=2.0),
    "nemotron_h": dict(moe_shared_expert_intermediate_size=_SHARED_F),
    # A latent width below D (its default is 4096).
    "muse_spark": dict(moe_hidden_size=_LATENT),
    # The Mamba layers' own check; the MoE block never reads these.
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8),
    # Settings the small config needs to build at all.
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[F, F]),
    "zaya": dict(num_experts_per_tok=1),
}

# Families whose shared expert sits in the decoder layer: its class, built
# beside the block and added to the block's output (as the layer does).
_LAYER_SHARED_MLP = {
    "granitemoeshared": "GraniteMoeSharedMLP",
    "granitemoehybrid": "GraniteMoeHybridMLP",
    "granitemoe_swa": "GraniteMoeSWAMLP",
}

# Names of a choice bias [E] (a buffer or a frozen parameter).
_BIAS_NAMES = ("e_score_correction_bias", "expert_bias")

# Multiplicative scales (Gemma 4's router and expert norms): 1 + noise.
_SCALE_NAMES = ("scale", "per_expert_scale", "global_scale")

# Gemma 4's MoE half lives in its decoder layer: the router, the experts and
# the experts' own input norm, built from their classes (`_GemmaMoE`).
_GEMMA_PARTS = {
    "gemma4": ("Gemma4TextRouter", "Gemma4TextExperts", "Gemma4RMSNorm"),
    "diffusion_gemma": (
        "DiffusionGemmaTextRouter",
        "DiffusionGemmaTextExperts",
        "DiffusionGemmaRMSNorm",
    ),
}


def modeling_module(model_type: str):
  return importlib.import_module(
      f"transformers.models.{model_type}.modeling_{model_type}"
  )


def configuration_module(model_type: str):
  return importlib.import_module(
      f"transformers.models.{model_type}.configuration_{model_type}"
  )


def transformers_moe_families() -> list[str]:
  """model_types whose modeling file defines routed experts.

  A family counts when its modeling file defines a class named `*Experts`
  (the routed expert bank of every 5.x MoE) or, for Doge's product-key
  experts, `*CDMoE`.
  """
  root = os.path.dirname(transformers.models.__file__)
  found = []
  for path in glob.glob(os.path.join(root, "*", "modeling_*.py")):
    with open(path, encoding="utf-8") as f:
      source = f.read()
    if re.search(r"^class \w*(Experts|CDMoE)\(", source, re.M):
      found.append(os.path.basename(os.path.dirname(path)))
  return sorted(set(found))


def _config_class(model_type: str):
  family = families.BY_MODEL_TYPE[model_type]
  return getattr(configuration_module(model_type), family.config)


def _has(config, name: str) -> bool:
  # Some 5.x configs raise their own error (not AttributeError) for
  # per-layer attributes read globally: those are left at their defaults.
  try:
    getattr(config, name)
  except Exception:  # pylint: disable=broad-except
    return False
  return hasattr(config, name)


def hf_config(model_type: str, **overrides):
  """The family's config class with the small sizes it has attributes for."""
  cls = _config_class(model_type)
  default = cls()
  fields = {k: v for k, v in _SMALL.items() if _has(default, k)}
  fields.update(_OVERRIDES.get(model_type, {}))
  fields.update(overrides)
  return cls(**fields)


def _init_(module, gen, router_keys):
  """Seeded weights: router std 0.3, others 1/sqrt(fan_in), biases U[0, .5).

  The router's spread (logits of std ~1.7) keeps the choice clear of ties;
  biases in [0, 0.5) move choices without making biased scores negative.
  """
  with torch.no_grad():
    for name, p in module.named_parameters():
      if not p.numel():  # A width-0 shared expert (HY-V4 without one).
        continue
      if name.split(".")[-1] in _SCALE_NAMES or "layernorm" in name:
        p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=gen))
      elif name.split(".")[-1] in _BIAS_NAMES:
        p.copy_(torch.rand(p.shape, generator=gen) * 0.5)
      elif name in router_keys:
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
      else:
        p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    for name, b in module.named_buffers():
      if name.split(".")[-1] in _BIAS_NAMES:
        b.copy_(torch.rand(b.shape, generator=gen) * 0.5)
      elif name.split(".")[-1] == "tid2eid":
        # DeepSeek-V4's hash table: K distinct experts per token id.
        b.copy_(
            torch.stack(
                [
                    torch.randperm(_num_experts(module), generator=gen)[
                        : b.shape[1]
                    ]
                    for _ in range(b.shape[0])
                ]
            )
        )


def _num_experts(module) -> int:
  for sub in module.modules():
    if hasattr(sub, "num_experts") and isinstance(sub.num_experts, int):
      return sub.num_experts
  raise ValueError(f"{type(module).__name__} names no num_experts.")


class _GemmaMoE(torch.nn.Module if torch is not None else object):
  """Gemma 4's decoder-layer MoE half, with the layer's own names.

  forward(residual) -> the experts' output before post_feedforward_layernorm_2,
  as Gemma4TextDecoderLayer computes it: the router sees the residual, the
  experts its pre_feedforward_layernorm_2.
  """

  def __init__(self, model_type, cfg):
    super().__init__()
    router, experts, norm = (
        getattr(modeling_module(model_type), n)
        for n in _GEMMA_PARTS[model_type]
    )
    self.router = router(cfg)
    self.experts = experts(cfg)
    self.pre_feedforward_layernorm_2 = norm(
        cfg.hidden_size, eps=cfg.rms_norm_eps
    )

  def forward(self, hidden_states):
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    _, weights, index = self.router(flat)
    out = self.experts(self.pre_feedforward_layernorm_2(flat), index, weights)
    return out.reshape(hidden_states.shape)


def build_block(model_type: str, seed: int = 0, **overrides):
  """(hf_config, block, shared_mlp or None), float32, eval, seeded."""
  family = families.BY_MODEL_TYPE[model_type]
  modeling = modeling_module(model_type)
  cfg = hf_config(model_type, **overrides)
  if model_type in _GEMMA_PARTS:
    block = _GemmaMoE(model_type, cfg)
  else:
    block_cls = getattr(modeling, family.block)
    params = inspect.signature(block_cls.__init__).parameters
    if "layer_idx" in params:  # Blocks whose settings may vary by layer.
      block = block_cls(cfg, layer_idx=0)
    else:
      block = block_cls(cfg)
  block = block.float().eval()
  gen = torch.Generator().manual_seed(seed)
  _init_(block, gen, set(convert.ROUTER_KEYS) & set(block.state_dict()))
  shared = None
  # Granite's decoder layer has no shared MLP when its width is 0.
  if model_type in _LAYER_SHARED_MLP and cfg.shared_intermediate_size:
    shared = getattr(modeling, _LAYER_SHARED_MLP[model_type])(cfg)
    shared = shared.float().eval()
    _init_(shared, gen, set())
  return cfg, block, shared


def tokens(seed: int = 1, shape=(2, 16, D)) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_hf(block, shared, x: np.ndarray, token_ids=None):
  """(output [..., D], chosen ids [T, K] or None) of the transformers block.

  The ids are read where the block hands them to its experts: every 5.x
  expert bank is called as `experts(hidden, top_k_index, top_k_weights)`,
  except Llama 4's, which takes the weighted copies of every token: its ids
  are the K experts whose router score (0 outside the choice) is not 0;
  and JetMoE's, whose router hands back its copies sorted by expert.
  """
  captured = []
  scores = []
  experts = getattr(block, "experts", None)
  handles = []
  if isinstance(experts, torch.nn.Module):
    handles.append(
        experts.register_forward_pre_hook(
            lambda module, args: captured.append(args)
        )
    )
  router = getattr(block, "router", None)
  sorted_routing = []
  if type(router).__name__ == "JetMoeTopKGating":
    handles.append(
        router.register_forward_hook(
            lambda module, args, out: sorted_routing.append((module.top_k, out))
        )
    )
  if isinstance(router, torch.nn.Module) and hasattr(block, "top_k"):
    handles.append(
        router.register_forward_hook(
            lambda module, args, out: scores.append(out[0])
        )
    )
  try:
    with torch.no_grad():
      xt = torch.from_numpy(x)
      if token_ids is None:
        y = block(xt)
      else:  # DeepSeek-V4's hash layers read the token ids.
        y = block(xt, torch.from_numpy(token_ids).long())
      if isinstance(y, tuple):
        y = y[0]
      if shared is not None:
        y = y + shared(xt)
  finally:
    for handle in handles:
      handle.remove()
  ids = None
  if sorted_routing:
    ids = _jetmoe_ids(*sorted_routing[0])
  elif captured and len(captured[0]) > 1:
    index = captured[0][1]
    if isinstance(index, torch.Tensor) and not index.is_floating_point():
      ids = index.reshape(-1, index.shape[-1]).numpy()
  elif scores and scores[0].ndim == 2:
    chosen = scores[0].numpy() != 0
    if (chosen.sum(-1) == block.top_k).all():
      ids = np.argsort(~chosen, axis=-1, kind="stable")[:, : block.top_k]
  return y.reshape(x.shape).numpy(), ids


def _jetmoe_ids(top_k: int, routing) -> np.ndarray:
  """[T, K] ids from JetMoE's router output: its copies sorted by expert
  (index_sorted_experts, the flat [T*K] index of each sorted copy) and the
  copies per expert (expert_size)."""
  order, _, _, expert_size, _ = routing
  num_copies = order.numel()
  expert_of_sorted = np.repeat(np.arange(len(expert_size)), expert_size)
  flat = np.empty(num_copies, np.int64)
  flat[order.numpy()] = expert_of_sorted
  return flat.reshape(-1, top_k)


@dataclasses.dataclass
class Result:
  model_type: str
  errors: dict  # backend -> max |y - y_hf|
  scale: float  # max |y_hf|
  ids: np.ndarray  # [T, K] dropless' choice
  ids_hf: np.ndarray | None  # [T, K] the HF router's, when it returns ids


def compare(
    model_type: str, backends=("reference", "xla"), seed: int = 0, **overrides
) -> Result:
  """Runs the family's block and moe_layer on `backends` on the same tokens."""
  hf_cfg, block, shared = build_block(model_type, seed, **overrides)
  x = tokens()
  # The block is layer 0 (for the families whose settings vary by layer).
  cfg = hf_convert.moe_config_from_hf(hf_cfg, layer_idx=0)
  token_ids = None
  extra = {}
  if cfg.hash_vocab_size:
    token_ids = np.random.default_rng(2).integers(
        0, cfg.hash_vocab_size, x.shape[:-1]
    )
    extra = dict(token_ids=jnp.asarray(token_ids, jnp.int32))
  y_hf, ids_hf = run_hf(block, shared, x, token_ids)
  s = cfg.num_always_on_experts
  if ids_hf is not None and s:
    # Inkling hands its experts the K routed ids; every token also runs
    # the S shared ones, dropless' experts E - S .. E - 1.
    always_on = np.arange(cfg.num_experts - s, cfg.num_experts)
    ids_hf = np.concatenate(
        [ids_hf, np.broadcast_to(always_on, (ids_hf.shape[0], s))], axis=-1
    )
  state = dict(block.state_dict())
  if shared is not None:
    state.update({f"shared_mlp.{k}": v for k, v in shared.state_dict().items()})
  # Both: the family read from the config must be the one named.
  params = hf_convert.params_from_hf(
      state, cfg, model_type=model_type, hf_config=hf_cfg
  )
  errors = {}
  ids = None
  for backend in backends:
    y, aux = moe_core.moe_layer(
        params, jnp.asarray(x), cfg, backend=backend, **extra
    )
    errors[backend] = float(np.abs(np.asarray(y) - y_hf).max())
    ids = np.asarray(aux.expert_ids)
  return Result(model_type, errors, float(np.abs(y_hf).max()), ids, ids_hf)
