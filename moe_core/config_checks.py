"""MoEConfig's checks: the raising check of each field, run on construction.

`MoEConfig.__post_init__` runs `check_sizes_and_activation`, resolves the
precision recipe, then `check_groups_and_switches`, in that order, so that
a config with several bad fields names the same one first as before.
"""

from __future__ import annotations

import math

from moe_core import activations as activations_lib
from moe_core import score_functions

SCORE_FUNCS = tuple(score_functions.SCORE_FUNCTIONS)
GROUP_SCORES = ("max", "sum_top2")
CORRECTION_BIAS_ON = ("scores", "logits")
ZERO_EXPERT_OUTPUTS = ("identity", "zero")
SHARED_COMBINES = ("sum", "mean")
# The built-in activations; `moe_core.activations` registers more.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

# float32's largest finite number and its smallest normal one. The block
# computes these fields' values in float32, where a larger one becomes inf
# and a smaller one 0 (a subnormal is flushed to 0 on TPUs and in XLA's CPU
# code): a soft-cap of inf or 0 gives NaN logits, an epsilon of 0 divides 0
# by 0 in a norm. So each must be 0 (where 0 is valid: `True`) or of a
# magnitude in [FLOAT32_TINY, FLOAT32_MAX].
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_FIELDS = {
    "routed_scaling_factor": True,
    "norm_topk_p": False,
    "router_logit_softcap": True,
    "router_input_scale": True,
    "input_norm_epsilon": False,
    "output_norm_epsilon": False,
    "latent_norm_epsilon": False,
    "post_expert_norm_epsilon": False,
    "swiglu_limit": False,
    "swiglu_alpha": False,
    "gate_softcap": False,
    "up_softcap": False,
}


def check_sizes_and_activation(cfg) -> None:
  """The sizes, the core switches, the score function and the activation."""
  for name in (
      "num_experts",
      "top_k",
      "hidden_size",
      "expert_ffn_size",
      "n_group",
      "topk_group",
  ):
    _check_positive_int(name, getattr(cfg, name))
  _check_int(cfg, "shared_ffn_size", minimum=0)
  _check_bools(cfg, "norm_topk_prob", "correction_bias", "shared_expert_gate")
  if cfg.top_k > cfg.num_experts:
    raise ValueError(
        f"top_k must be <= num_experts, got top_k={cfg.top_k}, "
        f"num_experts={cfg.num_experts}."
    )
  _check_choice("score_func", cfg.score_func, SCORE_FUNCS)
  _check_choice("group_score", cfg.group_score, GROUP_SCORES)
  _check_activation(cfg)


def check_groups_and_switches(cfg) -> None:
  """The expert groups, the shared expert, the numbers and every switch the
  families brought (`_check_router_switches`), then the float32 range."""
  if cfg.num_experts % cfg.n_group:
    raise ValueError(
        f"n_group must divide num_experts, got n_group={cfg.n_group}, "
        f"num_experts={cfg.num_experts}."
    )
  if cfg.topk_group > cfg.n_group:
    raise ValueError(
        f"topk_group must be <= n_group, got topk_group={cfg.topk_group}, "
        f"n_group={cfg.n_group}."
    )
  if cfg.n_group > 1:
    per_group = cfg.num_experts // cfg.n_group
    if cfg.group_score == "sum_top2" and per_group < 2:
      raise ValueError(
          "group_score='sum_top2' needs at least 2 experts per group, got "
          f"num_experts={cfg.num_experts} / n_group={cfg.n_group} = "
          f"{per_group}."
      )
    if cfg.top_k > cfg.topk_group * per_group:
      raise ValueError(
          "top_k must be <= topk_group * experts per group (the experts "
          f"that may be chosen), got top_k={cfg.top_k}, topk_group="
          f"{cfg.topk_group}, experts per group={per_group}."
      )
  _check_choice("shared_combine", cfg.shared_combine, SHARED_COMBINES)
  if cfg.shared_combine != "sum" and not cfg.shared_ffn_size:
    raise ValueError(
        f"shared_combine={cfg.shared_combine!r} needs shared_ffn_size > "
        f"0, got shared_ffn_size={cfg.shared_ffn_size}."
    )
  if cfg.shared_expert_gate and not cfg.shared_ffn_size:
    raise ValueError(
        "shared_expert_gate=True needs shared_ffn_size > 0, "
        f"got shared_ffn_size={cfg.shared_ffn_size}."
    )
  if not (_is_finite_number(cfg.norm_epsilon) and cfg.norm_epsilon >= 0):
    raise ValueError(
        "norm_epsilon must be a finite float >= 0, got "
        f"{cfg.norm_epsilon!r}."
    )
  if not _is_finite_number(cfg.routed_scaling_factor):
    raise ValueError(
        "routed_scaling_factor must be a finite number, got "
        f"{cfg.routed_scaling_factor!r}."
    )
  if cfg.capacity_factor is not None and not (
      _is_finite_number(cfg.capacity_factor) and cfg.capacity_factor > 0
  ):
    raise ValueError(
        "capacity_factor must be None (dropless) or a finite number "
        f"> 0, got {cfg.capacity_factor!r}."
    )
  _check_router_switches(cfg)
  _check_float32_range(cfg)


def _check_norm_topk_p(cfg) -> None:
  """norm_topk_p: a finite p > 0, read by norm_topk_prob (no epsilon)."""
  p = cfg.norm_topk_p
  if not (_is_finite_number(p) and p > 0):
    raise ValueError(f"norm_topk_p must be a finite float > 0, got {p!r}.")
  if p != 1 and not (cfg.norm_topk_prob and cfg.norm_epsilon == 0):
    raise ValueError(
        f"norm_topk_p={p} needs norm_topk_prob=True and norm_epsilon=0 (the "
        f"p-norm has no epsilon), got norm_topk_prob={cfg.norm_topk_prob}, "
        f"norm_epsilon={cfg.norm_epsilon}."
    )


def _check_always_on_experts(cfg) -> None:
  """num_always_on_experts: below top_k, with a top-k router of its own."""
  _check_int(cfg, "num_always_on_experts", minimum=0)
  s = cfg.num_always_on_experts
  if not s:
    return
  if s >= cfg.top_k:
    raise ValueError(
        f"num_always_on_experts must be < top_k={cfg.top_k} (the router "
        f"still chooses at least one expert), got {s}."
    )
  for name, value, ok in (
      ("n_group", cfg.n_group, cfg.n_group == 1),
      ("num_zero_experts", cfg.num_zero_experts, not cfg.num_zero_experts),
      ("hash_vocab_size", cfg.hash_vocab_size, not cfg.hash_vocab_size),
      ("score_func", cfg.score_func, cfg.score_func != "sparsemixer"),
  ):
    if not ok:
      raise ValueError(
          "num_always_on_experts > 0 needs a plain top-k router, got "
          f"{name}={value!r}."
      )


def _check_expert_width_switches(cfg) -> None:
  """The latent projections, the norms around the routed experts and the
  shared expert's biases."""
  _check_int(cfg, "expert_latent_size", minimum=0)
  _check_bools(
      cfg,
      "latent_norm",
      "post_expert_norm",
      "latent_bias",
      "shared_expert_bias",
  )
  for name in ("latent_norm_epsilon", "post_expert_norm_epsilon"):
    value = getattr(cfg, name)
    if not (_is_finite_number(value) and value > 0):
      raise ValueError(f"{name} must be a finite float > 0, got {value!r}.")
  for name in ("latent_norm", "latent_bias"):
    if getattr(cfg, name) and not cfg.expert_latent_size:
      raise ValueError(
          f"{name}=True belongs to the latent projections, so it needs "
          f"expert_latent_size > 0, got expert_latent_size="
          f"{cfg.expert_latent_size}."
      )
  if cfg.shared_expert_bias and not cfg.shared_ffn_size:
    raise ValueError(
        "shared_expert_bias=True needs shared_ffn_size > 0, got "
        f"shared_ffn_size={cfg.shared_ffn_size}."
    )
  if cfg.post_expert_norm and cfg.routing_weights_on_input:
    raise ValueError(
        "post_expert_norm=True would undo a routing weight applied to the "
        "expert's input, so it needs routing_weights_on_input=False, got "
        "routing_weights_on_input=True."
    )


def _check_router_switches(cfg) -> None:
  """The routing fields that came with issue 33's families."""
  _check_bools(
      cfg,
      "router_bias",
      "router_input_norm",
      "expert_input_norm",
      "expert_output_scale",
      "output_bias",
      "output_norm",
  )
  for name, low, strict in (
      ("sparsemixer_epsilon", 0, False),
      ("router_logit_softcap", 0, False),
      ("input_norm_epsilon", 0, True),
      ("output_norm_epsilon", 0, True),
  ):
    value = getattr(cfg, name)
    if not (
        _is_finite_number(value) and (value > low if strict else value >= low)
    ):
      raise ValueError(
          f"{name} must be a finite float {'>' if strict else '>='} {low}, "
          f"got {value!r}."
      )
  if not _is_finite_number(cfg.router_input_scale):
    raise ValueError(
        "router_input_scale must be a finite number, got "
        f"{cfg.router_input_scale!r}."
    )
  _check_choice(
      "correction_bias_on", cfg.correction_bias_on, CORRECTION_BIAS_ON
  )
  _check_int(cfg, "hash_vocab_size", minimum=0)
  if cfg.hash_vocab_size:
    for name, value, ok in (
        ("correction_bias", cfg.correction_bias, not cfg.correction_bias),
        ("n_group", cfg.n_group, cfg.n_group == 1),
        ("score_func", cfg.score_func, cfg.score_func != "sparsemixer"),
    ):
      if not ok:
        raise ValueError(
            "hash_vocab_size > 0 takes its experts from a table, so it takes "
            f"no router choice settings, got {name}={value!r}."
        )
  _check_int(cfg, "num_zero_experts", minimum=0)
  _check_choice(
      "zero_expert_output", cfg.zero_expert_output, ZERO_EXPERT_OUTPUTS
  )
  if cfg.num_zero_experts:
    for name, value, ok in (
        ("capacity_factor", cfg.capacity_factor, cfg.capacity_factor is None),
        ("n_group", cfg.n_group, cfg.n_group == 1),
    ):
      if not ok:
        raise ValueError(
            "num_zero_experts > 0 needs a dropless, ungrouped router "
            f"(capacity_factor=None, n_group=1), got {name}={value!r}."
        )
  _check_always_on_experts(cfg)
  _check_norm_topk_p(cfg)
  _check_expert_width_switches(cfg)
  if cfg.correction_bias_on != "scores" and not cfg.correction_bias:
    raise ValueError(
        f"correction_bias_on={cfg.correction_bias_on!r} needs "
        "correction_bias=True, got correction_bias=False."
    )
  if cfg.score_func == "sparsemixer":
    # Sparsemixer computes its own weights from the plain logits' order.
    clashes = {
        "norm_topk_prob": cfg.norm_topk_prob,
        "correction_bias": cfg.correction_bias,
        "n_group": cfg.n_group if cfg.n_group > 1 else None,
    }
    for name, value in clashes.items():
      if value:
        raise ValueError(
            "score_func='sparsemixer' weighs its top-k of the logits itself, "
            f"so it takes no {name}, got {name}={value!r}."
        )


def _check_float32_range(cfg) -> None:
  """The `FLOAT32_FIELDS` (already finite numbers, or None) stay what they
  are in float32: 0 where valid, else of a normal float32's magnitude."""
  for name, zero_ok in FLOAT32_FIELDS.items():
    value = getattr(cfg, name)
    if value is None or (zero_ok and value == 0):
      continue
    if not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
      becomes = "inf" if abs(value) > FLOAT32_MAX else "0"
      raise ValueError(
          f"{name} must be {'0 or ' if zero_ok else ''}within float32's "
          f"range, {FLOAT32_TINY:.8g} <= |{name}| <= {FLOAT32_MAX:.8g} (the "
          f"block computes it in float32, where it would become {becomes}), "
          f"got {value!r}."
      )


def _is_finite_number(value) -> bool:
  """An int or float (not a bool) that is neither NaN nor infinite."""
  return (
      isinstance(value, (int, float))
      and not isinstance(value, bool)
      and math.isfinite(value)
  )


def _check_bools(cfg, *names) -> None:
  """TypeError for the first of the fields `names` that is not a bool."""
  for name in names:
    if not isinstance(getattr(cfg, name), bool):
      raise TypeError(f"{name} must be a bool, got {getattr(cfg, name)!r}.")


def _check_positive_int(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}.")


def _check_int(cfg, name, *, minimum):
  value = getattr(cfg, name)
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def _check_activation(cfg) -> None:
  """The activation is registered and its options are exactly the ones set."""
  _check_bools(
      cfg, "routing_weights_on_input", "expert_bias", "shared_swiglu_clamp"
  )
  if not cfg.shared_swiglu_clamp and (
      cfg.swiglu_limit is None or not cfg.shared_ffn_size
  ):
    raise ValueError(
        "shared_swiglu_clamp=False exempts the shared expert from "
        "swiglu_limit, so it needs both, got swiglu_limit="
        f"{cfg.swiglu_limit!r}, shared_ffn_size={cfg.shared_ffn_size}."
    )
  act = activations_lib.get(cfg.activation)
  for name in ("swiglu_limit",) + activations_lib.OPTIONS:
    value = getattr(cfg, name)
    if value is not None and not (_is_finite_number(value) and value > 0):
      raise ValueError(
          f"{name} must be None or a finite number > 0, got {value!r}."
      )
  if cfg.swiglu_limit is not None and not act.gated:
    raise ValueError(
        "swiglu_limit clamps the gate and up of a gated activation, got "
        f"swiglu_limit={cfg.swiglu_limit!r} with the non-gated "
        f"activation={cfg.activation!r}."
    )
  for name in activations_lib.OPTIONS:
    value = getattr(cfg, name)
    if name in act.reads and value is None:
      raise ValueError(
          f"activation={cfg.activation!r} needs {name} (a finite number "
          "> 0), got None."
      )
    if name not in act.reads and value is not None:
      raise ValueError(
          f"{name} is read only by the activations "
          f"{_readers(name)}, got {name}={value!r} with "
          f"activation={cfg.activation!r}."
      )


def _readers(option: str) -> tuple[str, ...]:
  return tuple(
      n
      for n in activations_lib.names()
      if option in activations_lib.get(n).reads
  )


def _check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
