"""Meshes, placements and communicators as constants to torch.compile (registered at spmd.tensor import).

Dynamo meets these values as inputs or module attributes (it guards on them by ``==``, so a changed
placement recompiles) and inside the region, read off a DTensor made there (``y.placements``,
``y.device_mesh``) or built by user code (``[Shard(0)]``). Each is registered as an opaque *value*
type: Dynamo holds the real object, and for the members listed here either evaluates them on it
while tracing (``USE_REAL``: shapes, ranks, queries) or traces their body (``INLINED``: a
collective, whose body calls an ``spmd::`` op that the graph keeps). Registration imports no
``torch._dynamo``, so it is cheap enough to run for every user of spmd.
"""

from __future__ import annotations

from torch._library.opaque_object import MemberType, is_opaque_type, register_opaque_type

from spmd.tensor.comm.base import Communicator
from spmd.tensor.device_mesh import DeviceMesh
from spmd.tensor.placement import Partial, Replicate, Shard, _StridedShard

__all__ = ["register_compile_values"]

USE_REAL, INLINED = MemberType.USE_REAL, MemberType.INLINED

_PLACEMENT_QUERIES = dict.fromkeys(("is_shard", "is_replicate", "is_partial", "__eq__"), USE_REAL)

_MEMBERS: dict[type, dict[str, MemberType]] = {
    Shard: _PLACEMENT_QUERIES | {"dim": USE_REAL},
    _StridedShard: _PLACEMENT_QUERIES | {"dim": USE_REAL, "split_factor": USE_REAL},
    Replicate: _PLACEMENT_QUERIES,
    Partial: _PLACEMENT_QUERIES | {"reduce_op": USE_REAL, "is_linear": USE_REAL},
    DeviceMesh: dict.fromkeys(
        (
            "ndim",
            "shape",
            "size",
            "mesh",
            "mesh_dim_names",
            "device_type",
            "dim_index",
            "get_rank",
            "get_coordinate",
            "get_local_rank",
            "_require_coordinate",
            "get_communicator",
            "get_group",
            "__getitem__",
            "__eq__",
            "__ne__",
        ),
        USE_REAL,
    ),
    Communicator: dict.fromkeys(
        ("size", "ranks", "local_rank", "mesh_dim", "group_handle", "describe", "with_context", "__eq__"), USE_REAL
    )
    | dict.fromkeys(
        ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "scatter", "_check"), INLINED
    ),
}
"""What traced code may use of each value; anything else is a Dynamo error naming the member."""


def register_compile_values() -> None:
    """Register the value types with torch.compile (idempotent)."""
    for cls, members in _MEMBERS.items():
        if not is_opaque_type(cls):
            register_opaque_type(cls, typ="value", members=members)


register_compile_values()
