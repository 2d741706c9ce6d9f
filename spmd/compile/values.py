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

from spmd.comm.base import Communicator
from spmd.tensor.device_mesh.mesh import DeviceMesh
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
            "_rank_on",
            "_coordinate_of",
            "_communicator_on",
            "_group_on",
            "_group_key_on",
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
"""How Dynamo treats each value's members. Properties (``traceable_property``, see
spmd/compile/properties.py) and the members not listed are traced like plain Python. Among those
are the mesh's per-rank queries (``get_rank``, ``get_coordinate``, ``get_local_rank``,
``get_communicator``, ``get_group``): their traced body reads the rank thread's rank and passes it
to a ``USE_REAL`` member, so each rank thread of a threaded world gets a graph of its own."""


def register_compile_values() -> None:
    """Register the value types with torch.compile (idempotent)."""
    for cls, members in _MEMBERS.items():
        if not is_opaque_type(cls):
            register_opaque_type(cls, typ="value", members=members)


register_compile_values()
