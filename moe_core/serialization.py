"""Registers moe_core's pytrees with jax.export's serialisation.

A program that returns an `MoEAux` (every `moe_layer`) or a `Dispatched`
exports as any other, but `Exported.serialize()` must also write the tree
structure of its outputs, and refuses node types it does not know. The
registered dataclasses have no static fields, so their auxiliary data is
empty.
"""

from __future__ import annotations

from jax import export

from moe_core import permute
from moe_core import routing


def _register(nodetype, name: str) -> None:
  export.register_pytree_node_serialization(
      nodetype,
      serialized_name=f"dropless.{name}",
      # register_dataclass nodes with data fields only: the auxiliary data
      # is the empty tuple of their (absent) static fields.
      serialize_auxdata=lambda aux: b"",
      deserialize_auxdata=lambda data: (),
  )


_register(routing.MoEAux, "MoEAux")
_register(permute.Dispatched, "Dispatched")
