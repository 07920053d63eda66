"""The te backend: Transformer Engine's router, grouped GEMMs, permutation."""

from moe_core.parallel import options as _ep_options

# Transformer Engine's NCCL-EP as an expert-parallel exchange (GPU, bf16, a
# communicator bootstrapped outside jit: `nccl_ep.bootstrap`): chosen by
# name only, never by "auto". Registered by name and module, so importing
# this package loads neither TE nor the exchange.
_ep_options.register_exchange(
    "te_nccl_ep", "backends.te.nccl_ep:NcclEpExchange"
)
