"""Old home of the remat policies and of the NNX block runner.

The policies now live in `moe_core.remat` (pure JAX), `call_block` in
`moe_core.flax`. Kept for one release so that `from train import remat`
keeps working; import those instead.
"""

from moe_core import flax as moe_flax
from moe_core import remat as moe_remat

POLICIES = moe_remat.POLICIES
MOE_NAMES = moe_remat.MOE_NAMES
check_policy_name = moe_remat.check_policy_name
policy = moe_remat.policy
call_block = moe_flax.call_block
