"""The executor's collectives: every collective the library issues goes through these functions.

Two groups:

- the steps of a redistribute plan on one mesh dim (``all_gather_dim``, ``reduce_scatter_dim``,
  ``all_to_all_dims``) and their local twins (``local_chunk``, ``pad_into_partial``,
  ``partition_value``), which redistribute.py runs;
- the small public set the rest of the library uses outside a plan: ``scatter_from`` and
  ``broadcast_from`` (making a DTensor from one coordinate's data), ``agree`` (small Python values
  from every rank), ``reduce_over`` (a local tensor reduced over some mesh dims).

Uneven shards travel padded to the largest piece (``pad_dim``), so every backend moves equal
blocks, the way NCCL wants them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from spmd.comm import Communicator
from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.placement import _StridedShard, pad_dim, shard_offsets, shard_sizes

__all__ = [
    "pad_dim",
    "all_gather_dim",
    "all_gather_strided",
    "reduce_scatter_dim",
    "all_to_all_dims",
    "shard_dim_alltoall",
    "local_chunk",
    "pad_into_partial",
    "reduction_identity",
    "partition_value",
    "scatter_from",
    "scatter_pieces_from",
    "broadcast_from",
    "agree",
    "reduce_over",
]


# ----- the public set ------------------------------------------------------------------------------
def scatter_from(mesh: DeviceMesh, mesh_dim: int, tensor: torch.Tensor, dim: int, *, src: int = 0) -> torch.Tensor:
    """This rank's Shard(dim) piece of ``tensor`` as held by coordinate ``src`` of ``mesh_dim``.

    Every member passes a tensor of the same shape (only ``src``'s values matter); pieces follow
    ``shard_sizes``, so uneven dims work.
    """
    sizes = shard_sizes(tensor.size(dim), mesh.size(mesh_dim))
    pieces = list(torch.split(tensor, sizes, dim=dim)) if tensor.size(dim) else [tensor] * len(sizes)
    return scatter_pieces_from(mesh, mesh_dim, pieces, dim, src=src)


def scatter_pieces_from(
    mesh: DeviceMesh, mesh_dim: int, pieces: Sequence[torch.Tensor], dim: int, *, src: int = 0
) -> torch.Tensor:
    """This rank's entry of ``pieces`` (one per member of ``mesh_dim``, lengths along ``dim`` may
    differ) as coordinate ``src`` holds them; the others pass pieces of the same shapes."""
    comm = mesh.get_communicator(mesh_dim)
    longest = max(piece.size(dim) for piece in pieces)
    block = comm.scatter(torch.stack([pad_dim(piece, dim, longest) for piece in pieces]), src)
    return block.narrow(dim, 0, pieces[comm.local_rank].size(dim)).contiguous()


def broadcast_from(mesh: DeviceMesh, mesh_dim: int, tensor: torch.Tensor, *, src: int = 0) -> torch.Tensor:
    """Coordinate ``src``'s ``tensor`` on every member of ``mesh_dim`` (a new tensor on each)."""
    return mesh.get_communicator(mesh_dim).broadcast(tensor, src)


def agree(mesh: DeviceMesh, mesh_dims: Sequence[int], value: Any) -> list[Any]:
    """Every rank's ``value`` over the sub-mesh of ``mesh_dims``; the first is coordinate 0's.

    For small Python values (shapes, seeds): gathered one mesh dim at a time, so the first mesh
    dim varies fastest in the result.
    """
    gathered = [value]
    for d in mesh_dims:
        gathered = [item for part in mesh.get_communicator(d).all_gather_object(gathered) for item in part]
    return gathered


def reduce_over(mesh: DeviceMesh, mesh_dims: Sequence[int], tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """``tensor`` reduced with ``reduce_op`` over every rank of the sub-mesh of ``mesh_dims``."""
    for d in mesh_dims:
        tensor = mesh.get_communicator(d).all_reduce(tensor, reduce_op)
    return tensor


# ----- redistribute steps on one mesh dim ----------------------------------------------------------
def all_gather_dim(local: torch.Tensor, comm: Communicator, dim: int, full: int) -> torch.Tensor:
    """Shard(dim) -> Replicate over ``comm``: the whole ``full``-long dim from every member's piece."""
    sizes = shard_sizes(full, comm.size)
    stacked = comm.all_gather(pad_dim(local, dim, sizes[0]))
    if sizes[-1] == sizes[0]:
        if dim == 0:
            return stacked.flatten(0, 1)
        # movedim makes a strided view; later local views (x.view) need a contiguous shard
        return stacked.movedim(0, dim).flatten(dim, dim + 1).contiguous()
    return torch.cat([stacked[i].narrow(dim, 0, size) for i, size in enumerate(sizes)], dim)


def all_gather_strided(local: torch.Tensor, comm: Communicator, placement: _StridedShard, full: int) -> torch.Tensor:
    """``_StridedShard`` -> Replicate over ``comm``: gather every member's piece of the ``full``-long
    dim, then put each entry back where it came from (one index_select)."""
    dim = placement.dim
    longest = placement.local_shard_size(full, comm.size, 0)  # coordinate 0 holds the longest piece
    stacked = comm.all_gather(pad_dim(local, dim, longest))  # [members, ...piece...]
    joined = stacked.movedim(0, dim).flatten(dim, dim + 1)  # member m's entry k at m * longest + k
    where = _strided_gather_order(full, comm.size, placement.split_factor)
    return joined.index_select(dim, where.to(local.device))


@functools.lru_cache(maxsize=256)
def _strided_gather_order(full: int, n: int, split_factor: int) -> torch.Tensor:
    """For each entry of a ``full``-long dim, where it lands in the padded gather of ``n`` strided
    pieces (member ``m``'s entry ``k`` at ``m * longest + k``); built with one arange per block."""
    longest = _StridedShard(0, split_factor=split_factor).local_shard_size(full, n, 0)
    entries, positions = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)]
    for member in range(n):
        held = 0
        for group_start, group in zip(shard_offsets(full, split_factor), shard_sizes(full, split_factor)):
            start, length = group_start + shard_offsets(group, n)[member], shard_sizes(group, n)[member]
            entries.append(torch.arange(start, start + length))
            positions.append(torch.arange(length) + member * longest + held)
            held += length
    where = torch.empty(full, dtype=torch.long)
    where[torch.cat(entries)] = torch.cat(positions)
    return where


def local_chunk(local: torch.Tensor, n: int, index: int, dim: int) -> torch.Tensor:
    """Replicate -> Shard(dim): piece ``index`` of ``n`` (no traffic), contiguous."""
    full = local.size(dim)
    piece = local.narrow(dim, shard_offsets(full, n)[index], shard_sizes(full, n)[index])
    return piece.clone(memory_format=torch.contiguous_format)


def _blocks_on_dim0(tensor: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``tensor`` cut into ``n`` equal blocks along ``dim``, stacked on a new dim 0 (a view when it can be)."""
    shape = list(tensor.shape)
    split = [*shape[:dim], n, shape[dim] // n, *shape[dim + 1 :]]
    return tensor.reshape(split).movedim(dim, 0)


def reduce_scatter_dim(local: torch.Tensor, comm: Communicator, dim: int, reduce_op: str) -> torch.Tensor:
    """Partial -> Shard(dim) over ``comm``: each member keeps its reduced piece."""
    full, n = local.size(dim), comm.size
    if full % n == 0:  # even: the blocks are one reshape of the tensor (no per-member ops at any n)
        return comm.reduce_scatter(_blocks_on_dim0(local, dim, n), reduce_op)
    sizes, offsets = shard_sizes(full, n), shard_offsets(full, n)
    blocks = [pad_dim(local.narrow(dim, o, s), dim, sizes[0]) for o, s in zip(offsets, sizes)]
    reduced = comm.reduce_scatter(torch.stack(blocks), reduce_op)
    return reduced.narrow(dim, 0, sizes[comm.local_rank])


def all_to_all_dims(local: torch.Tensor, comm: Communicator, src_dim: int, dst_dim: int, full_src: int) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim) over ``comm`` in one all_to_all."""
    n, me = comm.size, comm.local_rank
    dst_full = local.size(dst_dim)
    if full_src % n == 0 and dst_full % n == 0:  # even: one reshape each way (no per-member ops at any n)
        stacked = _blocks_on_dim0(local, dst_dim, n)
        received = comm.all_to_all(stacked)
        return received.movedim(0, src_dim).flatten(src_dim, src_dim + 1).contiguous()
    src_sizes = shard_sizes(full_src, n)
    dst_sizes, dst_offsets = shard_sizes(dst_full, n), shard_offsets(dst_full, n)
    blocks = [
        pad_dim(pad_dim(local.narrow(dst_dim, o, s), dst_dim, dst_sizes[0]), src_dim, src_sizes[0])
        for o, s in zip(dst_offsets, dst_sizes)
    ]
    received = comm.all_to_all(torch.stack(blocks))
    pieces = [received[s].narrow(src_dim, 0, src_sizes[s]).narrow(dst_dim, 0, dst_sizes[me]) for s in range(n)]
    return torch.cat(pieces, src_dim)


def shard_dim_alltoall(
    input: torch.Tensor, gather_dim: int, shard_dim: int, mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """This rank's piece of a tensor sharded on ``gather_dim`` over ``mesh_dim``, re-cut on
    ``shard_dim``: Shard(gather_dim) -> Shard(shard_dim) in one all_to_all.

    torch's private name (``_collective_utils``). As in torch, every member's ``input`` is equally
    long on ``gather_dim``; ``shard_dim`` may split unevenly (``shard_sizes``).
    """
    comm = mesh.get_communicator(mesh_dim)
    return all_to_all_dims(input, comm, gather_dim, shard_dim, input.size(gather_dim) * comm.size)


def reduction_identity(reduce_op: str, dtype: torch.dtype) -> float | int | bool:
    """The value ``x`` with ``reduce(x, v) == v`` for every ``v`` of ``dtype`` (avg has none: scale instead)."""
    if reduce_op == "sum":
        return 0
    if reduce_op == "product":
        return 1
    if reduce_op not in ("max", "min"):
        raise ValueError(f"Partial({reduce_op!r}) has no identity element")
    if dtype == torch.bool:
        return reduce_op == "min"
    if dtype.is_floating_point:
        return -torch.inf if reduce_op == "max" else torch.inf
    info = torch.iinfo(dtype)
    return info.min if reduce_op == "max" else info.max


def pad_into_partial(local: torch.Tensor, n: int, index: int, dim: int, full: int, reduce_op: str) -> torch.Tensor:
    """Shard -> Partial without traffic: the shard at its offset, the reduction's identity elsewhere.

    An average has no identity: zeros around the shard scaled by ``n`` average to the shard.
    """
    shape = list(local.shape)
    shape[dim] = full
    if reduce_op == "avg":
        out, local = local.new_zeros(shape), local * n
    else:
        out = local.new_full(shape, reduction_identity(reduce_op, local.dtype))
    out.narrow(dim, shard_offsets(full, n)[index], local.size(dim)).copy_(local)
    return out


def partition_value(local: torch.Tensor, reduce_op: str, index: int) -> torch.Tensor:
    """Replicate -> Partial(reduce_op) at mesh coordinate ``index`` (no traffic).

    A sum or a product keeps the value on coordinate 0 and the identity (0 or 1) elsewhere, so
    the reduction is exact; avg, max and min keep it everywhere. The one place this rule is written.
    """
    if reduce_op in ("sum", "product") and index != 0:
        return torch.full_like(local, reduction_identity(reduce_op, local.dtype))
    return local.clone()
