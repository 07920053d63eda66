"""Hugging Face MoE blocks -> dropless: `MoEConfig` and parameters.

`moe_config_from_hf(hf_config)` and `params_from_hf(state_dict, cfg)` cover
every family of `families.FAMILIES` whose `lacks` is empty
(`SUPPORTED_MODEL_TYPES`); the others are refused with the switches they
lack. See docs/hf_families.md.
"""

from hf_convert.convert import moe_config_from_hf
from hf_convert.convert import params_from_hf
from hf_convert.convert import SUPPORTED_MODEL_TYPES
from hf_convert.families import FAMILIES

__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "moe_config_from_hf",
    "params_from_hf",
]
