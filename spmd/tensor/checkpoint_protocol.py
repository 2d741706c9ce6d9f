"""torch.distributed.checkpoint's planner protocol for DTensor: which rank writes which chunk.

DCP asks each state_dict value three questions through dunder methods (DTensor forwards them here):

- ``__create_write_items__(fqn, obj)`` on save: the chunks this rank writes. A rank writes its
  shard only if it sits at coordinate 0 of every mesh dim that does not shard the tensor, so each
  block of the global tensor is written exactly once whatever the placements (DCP's global plan
  check refuses overlapping chunks). Empty shards of uneven splits are not written.
- ``__create_chunk_list__()`` on load: the block this rank needs, on every rank, replicas included;
  DCP's resharding turns it into reads of whichever saved chunks overlap it.
- ``__get_tensor_shard__(index)`` on both: this rank's local tensor for the chunk at
  ``index.offset`` (DCP narrows it and reads from it, or copies into it in place).

Chunks are blocks in global coordinates, so a checkpoint saved with one mesh and placements loads
into any other. ``Partial`` values are refused on both sides: a rank's partial value is not a block
of the tensor. ``spmd.checkpoint.save`` reduces them first (``redistribute`` to ``Replicate`` on
the partial mesh dims); to load into a Partial layout, load a Replicate one and redistribute.

DCP is imported inside the functions: only DCP calls them, and ``import spmd.tensor`` must stay
free of ``torch.distributed.checkpoint`` (which imports ``torch.distributed.tensor``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from spmd.tensor.placement import Partial, Replicate, Shard
from spmd.tensor.spec import local_shape_and_offset

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

    from spmd.tensor.dtensor import DTensor

__all__ = ["PartialPlacementError", "create_write_items", "create_chunk_list", "get_tensor_shard", "owned_chunk"]


class PartialPlacementError(RuntimeError):
    """A Partial DTensor was given to DCP: its local values are addends, not blocks of the tensor."""


def _refuse_partial(fqn: str, dtensor: DTensor, action: str) -> None:
    spec = dtensor._spec
    for mesh_dim, p in enumerate(spec.placements):
        if isinstance(p, Partial):
            reduced = "[" + ", ".join(repr(Replicate() if isinstance(q, Partial) else q) for q in spec.placements) + "]"
            fix = (
                f"use spmd.checkpoint.save, which reduces it, or redistribute it to {reduced} first"
                if action == "save"
                else f"load into a DTensor laid out as {reduced}, then redistribute it"
            )
            # Not a ValueError: DCP's load planner replaces those with a message about metadata.
            raise PartialPlacementError(
                f"cannot {action} {fqn or 'a DTensor'} ({spec}): it is {p} on mesh dim {mesh_dim}, and a "
                f"rank's partial value is not a block of the tensor; {fix}"
            )


def _local_chunk(dtensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(sizes, offsets) of the caller's shard, or None when the caller is not in the mesh."""
    spec = dtensor._spec
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return None
    return local_shape_and_offset(spec.shape, spec.mesh, spec.placements, coordinate)


def owned_chunk(dtensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(sizes, offsets) of the caller's block if the caller is the rank that saves it, else None.

    The owner is the rank at coordinate 0 of every mesh dim that does not shard the tensor (the
    others hold copies of its block), if its block is not empty; for a tensor with no elements at
    all, the rank at the mesh origin (so that the checkpoint still records the tensor's shape).
    """
    spec = dtensor._spec
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return None
    if any(c != 0 for c, p in zip(coordinate, spec.placements) if not isinstance(p, Shard)):
        return None
    sizes, offsets = local_shape_and_offset(spec.shape, spec.mesh, spec.placements, coordinate)
    if math.prod(sizes) > 0 or (math.prod(spec.shape) == 0 and not any(coordinate)):
        return sizes, offsets
    return None


def create_write_items(fqn: str, dtensor: DTensor) -> list[WriteItem]:
    """The write item of this rank's block, if this rank owns it (see ``owned_chunk``)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    _refuse_partial(fqn, dtensor, "save")
    chunk = owned_chunk(dtensor)
    if chunk is None:
        return []
    sizes, offsets = torch.Size(chunk[0]), torch.Size(chunk[1])
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties.create_from_tensor(dtensor._local_tensor),
                size=torch.Size(dtensor._spec.shape),
            ),
        )
    ]


def create_chunk_list(dtensor: DTensor) -> list[ChunkStorageMetadata]:
    """The block this rank holds, which a load must fill (replicas read it too)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _refuse_partial("", dtensor, "load into")
    chunk = _local_chunk(dtensor)
    if chunk is None:
        return []
    return [ChunkStorageMetadata(offsets=torch.Size(chunk[1]), sizes=torch.Size(chunk[0]))]


def get_tensor_shard(dtensor: DTensor, index: MetadataIndex) -> torch.Tensor:
    """This rank's local tensor, which holds the chunk at ``index.offset`` (DCP reads or fills it)."""
    chunk = _local_chunk(dtensor)
    if chunk is None:
        raise ValueError(
            f"{index.fqn}: rank {dtensor._spec.mesh.get_rank()} is not in {dtensor._spec.mesh!r} and holds "
            "no chunk of it; save and load DTensors only on the ranks of their mesh"
        )
    offsets = torch.Size(chunk[1])
    if index.offset is not None and torch.Size(index.offset) != offsets:
        raise ValueError(
            f"{index.fqn}: DCP asked for the chunk at offset {list(index.offset)} but this rank holds the one at "
            f"{list(offsets)} ({dtensor._spec}); the state_dict changed between planning and I/O"
        )
    return dtensor._local_tensor
