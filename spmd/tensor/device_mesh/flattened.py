"""The dims each rank has flattened on each root mesh (``DeviceMesh._flatten``), per world.

world -> (rank, root's MeshKey, root's ordinal) -> {name: (layout, names of the dims flattened)}. As
torch's, flattened names belong to one root mesh: two init_device_mesh calls over the same ranks
flatten apart. A root is named by its value and by how many roots its rank had made before it, not by
the object, because equal meshes are interchangeable (a decision cached by one rank thread may hand
another rank a spec holding the first rank's mesh object), and every rank makes its meshes in the same
order; by rank, because rank threads reach their own ``_flatten`` calls at different times.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from spmd.comm import World
from spmd.tensor.device_mesh.layout import DimLayout

__all__ = ["Flattened", "MeshKey", "flattened_dims", "next_root_ordinal"]

MeshKey = tuple[Any, ...]
"""A mesh's value without its world: (device type, shape, ranks, dim names)."""
Flattened = dict[str, tuple[DimLayout, tuple[str, ...]]]
"""name -> (layout, names of the dims flattened)."""

_FLATTENED: weakref.WeakKeyDictionary[World, dict[tuple[int, MeshKey, int], Flattened]] = weakref.WeakKeyDictionary()
_ROOTS_MADE: weakref.WeakKeyDictionary[World, dict[int, int]] = weakref.WeakKeyDictionary()
"""world -> rank -> how many root meshes that rank has made (names the next root's ordinal)."""
_LOCK = threading.Lock()


def next_root_ordinal(world: World) -> int:
    """The ordinal of the root mesh the calling rank is making: how many it made before."""
    rank = world.current_rank()
    with _LOCK:
        made = _ROOTS_MADE.setdefault(world, {})
        ordinal = made[rank] = made.get(rank, -1) + 1
    return ordinal


def flattened_dims(world: World, root: MeshKey, ordinal: int, *, create: bool = False) -> Flattened:
    """The dims the calling rank has flattened on the root mesh ``root`` (its ``ordinal``-th); without
    ``create``, an empty dict outside the registry when it has flattened none."""
    key = (world.current_rank(), root, ordinal)
    per_world = _FLATTENED.get(world)
    if per_world is None:
        if not create:
            return {}
        with _LOCK:
            per_world = _FLATTENED.setdefault(world, {})
    registry = per_world.get(key)
    if registry is None:
        if not create:
            return {}
        registry = per_world.setdefault(key, {})
    return registry
