"""One all_gather per module: its parameters' dp shards packed into one flat DTensor on the dp sub-mesh.

Each rank packs its local shards (padded to the largest dp shard, so every dp rank's piece has one
length) into a 1-d buffer, read as ``Shard(0)`` of a DTensor on the dp sub-mesh; redistributing
it to ``Replicate()`` is one all_gather, and each parameter's gathered local tensor is cut out of
the result. In backward the gathered copies' gradients, Partial(sum) over dp, flow back into the
buffer and the redistribute's backward reduce-scatters the whole buffer once. Both collectives go
through the redistribute executor, so CommDebugMode and the verbose log see them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spmd.fsdp.layout import ShardedParameter
from spmd.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from spmd.tensor.placement import shard_sizes
from spmd.tensor.redistribute import redistribute_traced

__all__ = ["FlatGroup", "flat_groups"]


@dataclass(frozen=True, slots=True)
class _Piece:
    """Where one parameter's local dp shard sits in the flat buffer."""

    param: ShardedParameter
    padded_shape: tuple[int, ...]
    """The local shard's shape with dim ``dim`` padded to the largest dp shard."""
    dim: int
    """The tensor dim dp shards."""
    sizes: tuple[int, ...]
    """Each dp rank's length along ``dim``."""

    @property
    def numel(self) -> int:
        return int(torch.Size(self.padded_shape).numel())


@dataclass(frozen=True, slots=True)
class FlatGroup:
    """Parameters of one dtype gathered with one all_gather over ``dp_mesh``."""

    dp_mesh: DeviceMesh
    dp: int
    """The dp dim's index in the parameters' mesh."""
    pieces: tuple[_Piece, ...]
    length: int
    """Elements per dp rank."""

    def gather(self) -> list[DTensor]:
        """The parameters gathered over dp (Replicate() there), autograd-tracked when grad is enabled."""
        flat_local = torch.cat([_padded(p).reshape(-1) for p in self.pieces])
        n = self.dp_mesh.size()
        flat = DTensor.from_local(flat_local, self.dp_mesh, [Shard(0)], shape=(n * self.length,), stride=(1,))
        rows = flat.redistribute(self.dp_mesh, [Replicate()]).to_local(grad_placements=[Partial()]).view(n, -1)
        # split and unbind (not slicing) so that backward assembles the buffer's gradient in one copy
        blocks = torch.split(rows, [piece.numel for piece in self.pieces], dim=1)
        return [self._unpack(block, piece) for block, piece in zip(blocks, self.pieces)]

    def _unpack(self, block: torch.Tensor, piece: _Piece) -> DTensor:
        """Rank r's padded shard of the parameter sits in row r of ``block``: cut and join them along its dim."""
        if all(size == piece.padded_shape[piece.dim] for size in piece.sizes):
            # even shards: the rows side by side along the dim, in a few ops whatever the dp size (a
            # 512-way dp cut and join per row costs 512 ops per parameter, and as many in backward)
            stacked = block.view(len(piece.sizes), *piece.padded_shape).movedim(0, piece.dim)
            local = stacked.flatten(piece.dim, piece.dim + 1)
            if local._is_view():
                local = local.clone()  # the gathered copy owns its storage: after forward it is freed alone
        else:
            parts = [
                row.view(piece.padded_shape).narrow(piece.dim, 0, size)
                for row, size in zip(block.unbind(0), piece.sizes)
                if size
            ]
            local = torch.cat(parts, piece.dim)
        return _AsGathered.apply(local, piece.param, self.dp)  # type: ignore[no-untyped-call]


def flat_groups(params: Sequence[ShardedParameter], mesh: DeviceMesh, dp: int) -> list[FlatGroup]:
    """The sharded parameters packed by dtype (a flat buffer holds one dtype), each parameter once."""
    distinct = {id(p.parameter): p for p in reversed(params) if p.is_sharded}
    sharded = [p for p in params if distinct.get(id(p.parameter)) is p]
    if not sharded:
        return []
    dp_mesh = _dp_sub_mesh(mesh, dp)
    n = mesh.size(dp)
    by_dtype: dict[torch.dtype, list[_Piece]] = {}
    lengths: dict[torch.dtype, int] = {}
    for p in sharded:
        param: DTensor = p.parameter  # type: ignore[assignment]
        dim = param.placements[dp].dim  # type: ignore[attr-defined]
        sizes = tuple(shard_sizes(param.shape[dim], n))
        shape = list(param.to_local().shape)
        shape[dim] = sizes[0]
        piece = _Piece(p, tuple(shape), dim, sizes)
        by_dtype.setdefault(param.dtype, []).append(piece)
        lengths[param.dtype] = lengths.get(param.dtype, 0) + piece.numel
    return [FlatGroup(dp_mesh, dp, tuple(pieces), lengths[dtype]) for dtype, pieces in by_dtype.items()]


def _dp_sub_mesh(mesh: DeviceMesh, dp: int) -> DeviceMesh:
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"fully_shard on the {mesh.ndim}-d {mesh} needs named mesh dims (mesh_dim_names=...)")
    return mesh[names[dp]]


def _padded(piece: _Piece) -> torch.Tensor:
    """This rank's shard, zero-padded along the dp dim to the largest dp shard (autograd-tracked)."""
    local = piece.param.parameter.to_local()  # type: ignore[attr-defined]
    missing = piece.padded_shape[piece.dim] - local.size(piece.dim)
    if missing == 0:
        return local
    shape = list(local.shape)
    shape[piece.dim] = missing
    return torch.cat([local, local.new_zeros(shape)], piece.dim)


class _AsGathered(torch.autograd.Function):
    """This rank's gathered local tensor as the parameter's DTensor with Replicate() over dp.

    Backward hands back this rank's share of the gradient unreduced over dp (Partial(sum)), with the
    other mesh dims laid out as the parameter is: the flat buffer's reduce_scatter sums it.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, param: ShardedParameter, dp: int) -> DTensor:
        spec = param.parameter._spec.with_placements(param.gathered_placements)  # type: ignore[attr-defined]
        ctx.spec, ctx.dp = spec, dp
        return DTensor(local, spec, requires_grad=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None, None]:
        target = tuple(Partial() if d == ctx.dp else p for d, p in enumerate(ctx.spec.placements))
        return redistribute_traced(grad._local_tensor, grad._spec, target, "fully_shard (backward)"), None, None
