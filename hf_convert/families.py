"""Every transformers 5.24.0 family with a sparse MoE block, as data.

One `Family` row per `model_type` whose `modeling_<type>.py` holds a routed
block (a router plus routed experts), in `model_type` order. Read from the
modeling files; the converter (`convert.py`), the parity test
(`hf_families_parity_test.py`) and docs/hf_families.md all read this table.
`lacks` names the switches of issue 33 that today's `MoEConfig` does not
have; a family whose `lacks` is empty is converted exactly (some only for
part of their config space: the converter refuses the rest with the switch
it needs). The rows live by router kind (`families_deepseek.py`,
`families_softmax.py`, `families_sigmoid.py`); the refused ones are here.
`family_row.py` defines the row and its notation.
"""

from __future__ import annotations

from hf_convert import families_deepseek
from hf_convert import families_sigmoid
from hf_convert import families_softmax
from hf_convert import family_row

# The row and the switch names `lacks` spells, defined in family_row.py and
# read from here.
Family = family_row.Family
INPUT_SIDE_WEIGHTS = family_row.INPUT_SIDE_WEIGHTS
SWIGLU_CLAMP = family_row.SWIGLU_CLAMP
GPT_OSS_GLU = family_row.GPT_OSS_GLU
SOFTCAP_SWIGLU = family_row.SOFTCAP_SWIGLU
NON_GATED_FFN = family_row.NON_GATED_FFN
EXPERT_BIASES = family_row.EXPERT_BIASES
ROUTER_BIAS = family_row.ROUTER_BIAS
SCORE_SQRTSOFTPLUS = family_row.SCORE_SQRTSOFTPLUS
SPARSEMIXER = family_row.SPARSEMIXER
LOGIT_BIAS_BEFORE_SIGMOID = family_row.LOGIT_BIAS_BEFORE_SIGMOID
LOGIT_SOFTCAP = family_row.LOGIT_SOFTCAP
ROUTER_INPUT_NORM = family_row.ROUTER_INPUT_NORM
ZERO_EXPERTS = family_row.ZERO_EXPERTS
HASH_ROUTING = family_row.HASH_ROUTING
LATENT_PROJECTIONS = family_row.LATENT_PROJECTIONS
PRODUCT_KEYS = family_row.PRODUCT_KEYS
ROUTER_MLP_STATE = family_row.ROUTER_MLP_STATE
ZERO_FILLED_GROUPS = family_row.ZERO_FILLED_GROUPS
TOKEN_TYPE_EXPERTS = family_row.TOKEN_TYPE_EXPERTS
CAPACITY_POLICY = family_row.CAPACITY_POLICY
CLAMP_AFTER_ACTIVATION = family_row.CLAMP_AFTER_ACTIVATION

# The families that need a switch dropless lacks.
_REFUSED = (
    Family(
        "ernie4_5_vl_moe",
        "Ernie4_5_VLMoeMoeBlock",
        "Ernie4_5_VLMoeTextConfig",
        "as ernie4_5_moe, one text and one vision expert set",
        family_row.FUSED,
        "shared_experts, ungated",
        (TOKEN_TYPE_EXPERTS,),
    ),
    Family(
        "nllb_moe",
        "NllbMoeSparseMLP",
        "NllbMoeConfig",
        "top-2 with capacity and second-expert policy",
        "non-gated ReLU with biases",
        "-",
        (CAPACITY_POLICY,),
    ),
    Family(
        "switch_transformers",
        "SwitchTransformersSparseMLP",
        "SwitchTransformersConfig",
        "softmax -> top-1 with expert capacity",
        "non-gated ReLU (wi, wo)",
        "-",
        (CAPACITY_POLICY,),
    ),
    Family(
        "zaya",
        "ZayaSparseMoeBlock",
        "ZayaConfig",
        "MLP router with state across layers, skip expert, balancing biases",
        family_row.FUSED,
        "-",
        (ROUTER_MLP_STATE,),
    ),
    Family(
        "doge",
        "DogeCDMoE",
        "DogeConfig",
        "product keys: two top-k over sqrt(E) keys each",
        "embedding experts (one up and one down vector each)",
        "dense SwiGLU beside them",
        (PRODUCT_KEYS,),
    ),
)

FAMILIES: tuple[Family, ...] = tuple(
    sorted(
        families_deepseek.ROWS
        + families_softmax.ROWS
        + families_sigmoid.ROWS
        + _REFUSED,
        key=lambda family: family.model_type,
    )
)

BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
SUPPORTED = tuple(f.model_type for f in FAMILIES if f.supported)
UNSUPPORTED = tuple(f.model_type for f in FAMILIES if not f.supported)
