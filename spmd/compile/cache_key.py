"""The key torch.compile's caches (AOTAutograd's and inductor's, kept on disk) file a DTensor input under.

A graph traced over DTensors depends on more than the local shard's shape: the spec decides which
local ops and collectives are traced, the caller's mesh coordinate decides its shard's offsets,
and every collective names its group by an int handle that is only meaningful in this process
(spmd/comm/library_ops.py). A cached graph can be picked up by a later process, so the key
holds all of these: a hit means the same layout, the same coordinate, and handles that name groups
of the same ranks in the same kind of world.
"""

from __future__ import annotations

import hashlib

import torch

from spmd.tensor.spec import DTensorSpec

__all__ = ["stable_cache_key"]


def stable_cache_key(spec: DTensorSpec, local: torch.Tensor, requires_grad: bool) -> str:
    """A hex digest of everything a graph traced for this DTensor input depends on."""
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    groups: list[tuple[int, tuple[int, ...]]] = []
    if coordinate is not None:
        for dim in range(mesh.ndim):
            comm = mesh.get_communicator(dim)
            groups.append((comm.group_handle(), tuple(comm.ranks)))
    meta = spec.tensor_meta
    payload = (
        "DTensor",
        tuple(str(p) for p in spec.placements),
        (tuple(meta.shape), tuple(meta.stride), str(meta.dtype)),
        (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, type(mesh._world).__name__),
        coordinate,
        tuple(groups),
        (tuple(local.shape), tuple(local.stride()), str(local.dtype), str(local.device)),
        requires_grad,
    )
    return hashlib.blake2b(repr(payload).encode(), digest_size=16).hexdigest()
