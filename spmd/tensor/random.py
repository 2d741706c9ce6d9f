"""Random numbers for DTensors that equal a single device's, shard by shard.

Every rank keeps its own generator, seeded alike (the seed of mesh coordinate 0, shared on first
use) and advanced alike, because every random op draws the *global* tensor and keeps its own
piece. So a sharded ``rand`` holds exactly the numbers one device would draw after
``torch.manual_seed`` with the same seed, and replicas agree. The cost is one global-sized draw
per rank: CPU generators cannot skip ahead to a shard's offset.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from spmd.tensor.device_mesh import DeviceMesh
from spmd.tensor.placement import Partial, Placement, Replicate
from spmd.tensor.spec import DTensorSpec, TensorMeta, contiguous_strides

__all__ = ["manual_seed", "rank_generator", "draw_global", "local_piece_of"]

_lock = threading.Lock()


@dataclass
class _RankRNG:
    seed: int
    generator: torch.Generator


_generators: dict[tuple[Any, int], _RankRNG] = {}


def _rank_key(mesh: DeviceMesh) -> tuple[Any, int]:
    # One generator per rank of a world: threads of one threaded world must not share state.
    return (id(mesh._world), mesh.get_rank())


def _coordinate_zero_seed(mesh: DeviceMesh, seed: int) -> int:
    """The seed held at mesh coordinate 0, passed along each mesh dim in turn."""
    for d in range(mesh.ndim):
        seed = int(mesh.get_communicator(d).all_gather_object(seed)[0])
    return seed


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed the DTensor generator of every rank of ``device_mesh`` (call it on every rank)."""
    seed = _coordinate_zero_seed(device_mesh, int(seed))
    with _lock:
        _generators[_rank_key(device_mesh)] = _RankRNG(seed, torch.Generator().manual_seed(seed))


def rank_generator(mesh: DeviceMesh) -> torch.Generator:
    """This rank's DTensor generator; first use takes ``torch.initial_seed()`` of coordinate 0."""
    entry = _generators.get(_rank_key(mesh))
    if entry is None:
        manual_seed(torch.initial_seed(), mesh)
        entry = _generators[_rank_key(mesh)]
    return entry.generator


def draw_global(mesh: DeviceMesh, shape: tuple[int, ...], dtype: torch.dtype, fill: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The global tensor a single device would draw: ``torch.empty(shape).<fill>_(*args)``."""
    full = torch.empty(shape, dtype=dtype)
    getattr(full, fill)(*args, generator=rank_generator(mesh), **kwargs)
    return full.to(mesh.device_type) if mesh.device_type != "cpu" else full


def local_piece_of(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's piece of a global tensor every rank holds (no communication)."""
    from spmd.tensor.redistribute import redistribute_local

    meta = TensorMeta(tuple(full.shape), contiguous_strides(full.shape), full.dtype)
    replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta)
    return redistribute_local(full, replicated, placements)


def fresh_value_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A newly drawn value is whole: shards stay shards, partials become replicas."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
