"""Flax modules for `moe_core.moe_layer` (needs the optional flax package).

`import moe_core` never imports this package, so the library runs without
flax; import it by name when you build a Flax model: `moe_core.flax.MoE`
(flax.nnx), `moe_core.flax.LinenMoE` (flax.linen), `moe_core.flax.call_block`
(an nnx block under a remat policy). Both modules own their parameters in
the library's layout (`moe_core.param_shapes`), so a checkpoint of either is
a `moe_layer` params dict, and both return `(y, aux)` exactly as `moe_layer`
does.
"""

from moe_core.flax.linen_moe import ImmutableBiasError
from moe_core.flax.linen_moe import LINEN_STATE_COLLECTION
from moe_core.flax.linen_moe import LinenMoE
from moe_core.flax.nnx_moe import BIAS_NAME
from moe_core.flax.nnx_moe import CorrectionBias
from moe_core.flax.nnx_moe import HASH_TABLE_NAME
from moe_core.flax.nnx_moe import HashTable
from moe_core.flax.nnx_moe import MoE
from moe_core.flax.nnx_moe import set_value
from moe_core.flax.remat import call_block

__all__ = [
    "BIAS_NAME",
    "LINEN_STATE_COLLECTION",
    "CorrectionBias",
    "HASH_TABLE_NAME",
    "HashTable",
    "ImmutableBiasError",
    "LinenMoE",
    "MoE",
    "call_block",
    "set_value",
]
