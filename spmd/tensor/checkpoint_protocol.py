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

A ``_StridedShard`` piece is several blocks of the tensor (one per group of the split, per strided
dim), so such a rank writes, and asks to read, one chunk per block; ``__get_tensor_shard__``
answers with the matching view of its local tensor.

Chunks are blocks in global coordinates, so a checkpoint saved with one mesh and placements loads
into any other. ``Partial`` values are refused on both sides: a rank's partial value is not a block
of the tensor. ``spmd.checkpoint.save`` reduces them first (``redistribute`` to ``Replicate`` on
the partial mesh dims); to load into a Partial layout, load a Replicate one and redistribute.

DCP is imported inside the functions: only DCP calls them, and ``import spmd.tensor`` must stay
free of ``torch.distributed.checkpoint`` (which imports ``torch.distributed.tensor``).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Protocol

import torch

from spmd.tensor.placement import Partial, Replicate, Shard, _is_shard_like, _StridedShard, shard_offsets, shard_sizes
from spmd.tensor.spec import DTensorSpec, has_strided, local_shape_and_offset

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = [
    "PartialPlacementError",
    "create_write_items",
    "create_chunk_list",
    "get_tensor_shard",
    "owned_chunk",
    "owned_chunks",
    "local_blocks",
]


class DTensor(Protocol):
    """What the protocol reads of a DTensor (spmd/tensor/dtensor.py forwards DCP's calls here)."""

    _spec: DTensorSpec
    _local_tensor: torch.Tensor


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


Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""One block of the caller's piece: (sizes, offsets in the global tensor, offsets in the local tensor)."""


def local_blocks(spec: DTensorSpec, coordinate: tuple[int, ...] | list[int]) -> list[Block]:
    """The blocks of the global tensor that the piece at ``coordinate`` holds, in local order.

    One block for Shard/Replicate placements; with ``_StridedShard`` the piece of each strided
    dim is several runs of entries, and the blocks are every combination of one run per dim.
    """
    if not has_strided(spec.placements):
        sizes, offsets = local_shape_and_offset(spec.shape, spec.mesh, spec.placements, coordinate)
        return [(sizes, offsets, (0,) * len(sizes))]
    per_dim_runs = []
    for dim, size in enumerate(spec.shape):
        entries = list(range(size))  # the global entries of this dim the piece holds, in its order
        for mesh_dim, p in enumerate(spec.placements):
            n, i = spec.mesh.shape[mesh_dim], coordinate[mesh_dim]
            if isinstance(p, Shard) and p.dim == dim:
                start = shard_offsets(len(entries), n)[i]
                entries = entries[start : start + shard_sizes(len(entries), n)[i]]
            elif isinstance(p, _StridedShard) and p.dim == dim:
                entries = [entries[k] for k in p.local_shard_indices(len(entries), n, i)]
        per_dim_runs.append(_runs(entries) if entries else [(0, 0, 0)])
    return [
        (tuple(r[1] for r in combo), tuple(r[0] for r in combo), tuple(r[2] for r in combo))
        for combo in itertools.product(*per_dim_runs)
    ]


def _runs(entries: list[int]) -> list[tuple[int, int, int]]:
    """``entries`` as maximal runs of consecutive values: (first value, length, position in ``entries``)."""
    runs: list[tuple[int, int, int]] = []
    for k, entry in enumerate(entries):
        if runs and runs[-1][0] + runs[-1][1] == entry:
            first, length, at = runs[-1]
            runs[-1] = (first, length + 1, at)
        else:
            runs.append((entry, 1, k))
    return runs


def _local_blocks(dtensor: DTensor) -> list[Block] | None:
    """The caller's blocks, or None when the caller is not in the mesh."""
    spec = dtensor._spec
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return None
    return local_blocks(spec, coordinate)


def owned_chunks(dtensor: DTensor) -> list[Block]:
    """The caller's blocks if the caller is the rank that saves them, else none.

    The owner is the rank at coordinate 0 of every mesh dim that does not shard the tensor (the
    others hold copies of its blocks); empty blocks are left out, except that for a tensor with no
    elements at all the rank at the mesh origin writes one (so that the checkpoint still records
    the tensor's shape).
    """
    spec = dtensor._spec
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return []
    if any(c != 0 for c, p in zip(coordinate, spec.placements) if not _is_shard_like(p)):
        return []
    blocks = local_blocks(spec, coordinate)
    if math.prod(spec.shape) == 0:
        return blocks[:1] if not any(coordinate) else []
    return [block for block in blocks if math.prod(block[0]) > 0]


def owned_chunk(dtensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(sizes, offsets) of the caller's block if the caller is the rank that saves it, else None
    (Shard/Replicate placements: one block per rank; see ``owned_chunks`` for ``_StridedShard``)."""
    if has_strided(dtensor._spec.placements):
        raise ValueError(f"{dtensor._spec}: a _StridedShard piece is several blocks, not one; use owned_chunks()")
    blocks = owned_chunks(dtensor)
    return (blocks[0][0], blocks[0][1]) if blocks else None


def create_write_items(fqn: str, dtensor: DTensor) -> list[WriteItem]:
    """The write item of this rank's block, if this rank owns it (see ``owned_chunk``)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    _refuse_partial(fqn, dtensor, "save")
    properties = TensorProperties.create_from_tensor(dtensor._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=properties,
                size=torch.Size(dtensor._spec.shape),
            ),
        )
        for sizes, offsets, _ in owned_chunks(dtensor)
    ]


def create_chunk_list(dtensor: DTensor) -> list[ChunkStorageMetadata]:
    """The block this rank holds, which a load must fill (replicas read it too)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _refuse_partial("", dtensor, "load into")
    blocks = _local_blocks(dtensor)
    if blocks is None:
        return []
    return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)) for sizes, offsets, _ in blocks]


def get_tensor_shard(dtensor: DTensor, index: MetadataIndex) -> torch.Tensor:
    """This rank's local tensor, which holds the chunk at ``index.offset`` (DCP reads or fills it);
    for a ``_StridedShard`` piece, the view of it that is that chunk."""
    blocks = _local_blocks(dtensor)
    if blocks is None:
        raise ValueError(
            f"{index.fqn}: rank {dtensor._spec.mesh.get_rank()} is not in {dtensor._spec.mesh!r} and holds "
            "no chunk of it; save and load DTensors only on the ranks of their mesh"
        )
    local = dtensor._local_tensor
    if len(blocks) == 1 and index.offset is None:
        return local
    for sizes, offsets, local_offsets in blocks:
        if index.offset is None or torch.Size(index.offset) == torch.Size(offsets):
            if len(blocks) == 1:
                return local
            view = local
            for dim, (start, length) in enumerate(zip(local_offsets, sizes)):
                view = view.narrow(dim, start, length)
            return view
    held = [list(offsets) for _, offsets, _ in blocks]
    raise ValueError(
        f"{index.fqn}: DCP asked for the chunk at offset {list(index.offset or ())} but this rank holds the ones at "
        f"{held} ({dtensor._spec}); the state_dict changed between planning and I/O"
    )
