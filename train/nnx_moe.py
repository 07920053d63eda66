"""Old home of the Flax MoE modules: they now live in `moe_core.flax`.

Kept for one release so that `from train import nnx_moe` keeps working;
import `moe_core.flax` instead.
"""

from moe_core import flax as moe_flax

BIAS_NAME = moe_flax.BIAS_NAME
LINEN_STATE_COLLECTION = moe_flax.LINEN_STATE_COLLECTION
CorrectionBias = moe_flax.CorrectionBias
LinenMoE = moe_flax.LinenMoE
MoE = moe_flax.MoE
set_value = moe_flax.set_value
