"""Expert parallelism: dropless dispatch and combine across a device mesh.

`moe_layer(..., mesh=...)` (here, or `moe_core.moe_layer` with `mesh=`) runs
one MoE block with its experts split over the expert axis of a mesh. The
package has one concern a module: `options` (EPOptions, the exchange names,
buffer sizing; pure Python), `exchange` (the `Exchange` interface: how rows
travel) with `padded` and `ragged`, its transports, `stages` (route,
dispatch, combine: call them inside `jax.shard_map`), `overflow` (bounded
buffers) and `layer` (routed_experts per device, moe_layer under shard_map,
param_specs, shard_params). Mesh and option checks live in
`moe_core.validation`, version shims in `moe_core.compat`;
docs/expert_parallel.md has the whole picture.
"""

from moe_core.parallel.exchange import Exchange
from moe_core.parallel.exchange import get_exchange
from moe_core.parallel.exchange import Layout
from moe_core.parallel.layer import moe_layer
from moe_core.parallel.layer import NamedSharding
from moe_core.parallel.layer import P
from moe_core.parallel.layer import param_specs
from moe_core.parallel.layer import routed_experts
from moe_core.parallel.layer import shard_params
from moe_core.parallel.options import buffer_sizes
from moe_core.parallel.options import EPOptions
from moe_core.parallel.options import EXCHANGE_CLASSES
from moe_core.parallel.options import EXCHANGES
from moe_core.parallel.options import exchange_names
from moe_core.parallel.options import OVERFLOW_POLICIES
from moe_core.parallel.options import RAGGED_PLATFORMS
from moe_core.parallel.options import register_exchange
from moe_core.parallel.options import resolve_exchange
from moe_core.parallel.options import safe_slots_per_peer
from moe_core.parallel.overflow import BufferOverflowError
from moe_core.parallel.ragged import emulated_ragged_all_to_all
from moe_core.parallel.stages import combine
from moe_core.parallel.stages import dispatch
from moe_core.parallel.stages import EPDispatched
from moe_core.parallel.stages import route
from moe_core.validation import check_mesh

__all__ = [
    "BufferOverflowError",
    "EPDispatched",
    "EPOptions",
    "EXCHANGES",
    "EXCHANGE_CLASSES",
    "Exchange",
    "Layout",
    "NamedSharding",
    "OVERFLOW_POLICIES",
    "P",
    "RAGGED_PLATFORMS",
    "buffer_sizes",
    "check_mesh",
    "combine",
    "dispatch",
    "emulated_ragged_all_to_all",
    "exchange_names",
    "get_exchange",
    "moe_layer",
    "param_specs",
    "register_exchange",
    "resolve_exchange",
    "route",
    "routed_experts",
    "safe_slots_per_peer",
    "shard_params",
]
