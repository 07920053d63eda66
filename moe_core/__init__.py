"""dropless: Mixture-of-Experts layers for JAX that never drop a token."""

from moe_core.api import moe_layer
from moe_core.backend import Backend
from moe_core.backend import HOOKS_VERSION as BACKEND_HOOKS_VERSION
from moe_core.checks import checked
from moe_core.config import MoEConfig
from moe_core.permute import combine
from moe_core.permute import dispatch
from moe_core.permute import Dispatched
from moe_core.ffn import shared_expert
from moe_core.operands import FfnOperands
from moe_core.operands import GemmOperands
from moe_core.parallel import EPOptions
from moe_core.params import init_params
from moe_core.params import param_shapes
from moe_core.registry import auto_order
from moe_core.registry import available_backends
from moe_core.registry import get_backend
from moe_core.registry import register_backend
from moe_core.registry import registered_backends
from moe_core.routing import MoEAux
from moe_core.routing import route
from moe_core.routing import update_correction_bias
from moe_core import serialization as _serialization  # noqa: F401 (registers pytrees)

__all__ = [
    "BACKEND_HOOKS_VERSION",
    "Backend",
    "Dispatched",
    "EPOptions",
    "FfnOperands",
    "GemmOperands",
    "MoEAux",
    "MoEConfig",
    "auto_order",
    "available_backends",
    "checked",
    "combine",
    "dispatch",
    "get_backend",
    "init_params",
    "moe_layer",
    "param_shapes",
    "register_backend",
    "registered_backends",
    "route",
    "shared_expert",
    "update_correction_bias",
]
