"""One all_gather per module and dtype: its parameters' dp shards packed into one flat buffer on the dp mesh.

Each rank packs its local shards (padded to the largest dp shard, so every dp rank's piece has one
length) into a 1-d buffer; one all_gather over the dp mesh brings every rank's buffer, and each
parameter's gathered local tensor is cut out of it. One autograd node covers the group: its backward
packs the gathered copies' gradients (each dp rank's contribution) the same way, in the reduce
dtype, and reduce-scatters the buffer once (sum; under HSDP then all-reduces this rank's part over
the replicate mesh), then divides by the gradient divide factor and
casts back to each parameter's dtype. Parameters kept whole over dp pass through, their gradients
all-reduced in one collective. Both collectives go through the redistribute executor, so
CommDebugMode and the verbose log see them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.fsdp.layout import ShardedParameter
from spmd.tensor import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard
from spmd.tensor.placement import shard_sizes
from spmd.tensor.redistribute.run import redistribute_traced
from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = ["FlatGroup", "GradSync", "ReduceOptions", "flat_groups", "local_shard"]


@dataclass(frozen=True, slots=True)
class _Piece:
    """Where one parameter's local dp shard sits in the flat buffer."""

    param: ShardedParameter
    padded_shape: tuple[int, ...]
    """The local shard's shape with the dp dim padded to the largest dp shard."""
    sizes: tuple[int, ...]
    """Each dp rank's length along the dp dim."""

    @property
    def dim(self) -> int:
        return self.param.dim  # type: ignore[return-value]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.padded_shape).numel())


@dataclass
class GradSync:
    """Whether backward reduces gradients now, and the unreduced ones kept while it does not."""

    requires_sync: bool = True
    pending: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    """By ``id`` of the group and its part (sharded, whole): the unreduced gradients of backwards run without sync."""


@dataclass(frozen=True, slots=True)
class ReduceOptions:
    """How one forward's gradients are reduced in its backward."""

    reduce_dtype: torch.dtype | None
    divide_factor: float
    sync: GradSync
    after_backward: Callable[[], None] | None = None
    """Called when the group's backward has run (the module un-shadows its gathered copies)."""


@dataclass(frozen=True, slots=True)
class FlatGroup:
    """Parameters gathered in one dtype over ``dp_mesh``: the sharded ones in one all_gather."""

    dp_mesh: DeviceMesh
    dtype: torch.dtype
    """The gathered copies' dtype (the mixed-precision ``param_dtype``, or the parameters' own)."""
    pieces: tuple[_Piece, ...]
    whole: tuple[ShardedParameter, ...]
    """Parameters kept whole over dp: passed through, their gradients all-reduced."""
    length: int
    """Elements per dp rank in the flat buffer."""
    replicate_mesh: DeviceMesh | None = None
    """HSDP's replicate mesh: reduced gradients are all-reduced over it too."""

    @property
    def params(self) -> tuple[ShardedParameter, ...]:
        """The group's parameters in the order ``gather`` returns their copies."""
        return (*(p.param for p in self.pieces), *self.whole)

    def gather(self, options: ReduceOptions) -> list[torch.Tensor]:
        """Each parameter's gathered local tensor, autograd-tracked when grad is enabled."""
        shards = [local_shard(p.parameter) for p in self.params]
        if torch.is_grad_enabled() and any(s.requires_grad for s in shards):
            return list(_GatherGroup.apply(self, options, *shards))  # type: ignore[no-untyped-call]
        with torch.no_grad():
            return self.gather_values(shards)

    def gather_values(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The all_gather itself, outside autograd."""
        count = len(self.pieces)
        gathered: list[torch.Tensor] = []
        if count:
            flat_local = torch.cat([_padded(s.to(self.dtype), p).reshape(-1) for s, p in zip(shards, self.pieces)])
            n = self.dp_mesh.size()
            full = redistribute_traced(
                flat_local, self._flat_spec((Shard(0),), n * self.length), (Replicate(),), "fully_shard (forward)"
            )
            blocks = torch.split(full.view(n, self.length), [p.numel for p in self.pieces], dim=1)
            gathered = [_unpack(block, piece) for block, piece in zip(blocks, self.pieces)]
        for shard in shards[count:]:
            gathered.append(shard.to(self.dtype) if shard.dtype != self.dtype else shard.view_as(shard))
        return gathered

    def reduce_grads(
        self, grads: Sequence[torch.Tensor | None], options: ReduceOptions, dtypes: Sequence[torch.dtype]
    ) -> list[torch.Tensor | None]:
        """The shards' gradients: each dp rank's contributions summed over dp, divided by the factor."""
        reduce_dtype = options.reduce_dtype or self.dtype
        count = len(self.pieces)
        out: list[torch.Tensor | None] = []
        if count:
            rows = [
                _pack(g.to(reduce_dtype) if g is not None else None, p, reduce_dtype)
                for g, p in zip(grads, self.pieces)
            ]
            flat = torch.cat(rows, dim=1) if len(rows) > 1 else rows[0]
            out.extend(self._reduce(flat, options, "sharded", self._scatter_back))
        if len(self.whole):
            flat = torch.cat([
                (g.to(reduce_dtype) if g is not None else torch.zeros(p.gathered_shape, dtype=reduce_dtype)).reshape(-1)
                for g, p in zip(grads[count:], self.whole)
            ])  # fmt: skip
            out.extend(self._reduce(flat, options, "whole", self._all_reduce))
        return [None if g is None else g.to(dtype) for g, dtype in zip(out, dtypes)]

    def _reduce(
        self,
        flat: torch.Tensor,
        options: ReduceOptions,
        which: str,
        collective: Callable[[torch.Tensor], list[torch.Tensor]],
    ) -> list[torch.Tensor | None]:
        key = (id(self), which)
        pending = options.sync.pending.pop(key, None)
        if pending is not None:
            flat = flat + pending
        if not options.sync.requires_sync:  # keep the unreduced sum for the backward that syncs
            options.sync.pending[key] = flat
            return [None] * (len(self.pieces) if which == "sharded" else len(self.whole))
        grads = collective(flat)
        if options.divide_factor != 1:
            grads = [g / options.divide_factor for g in grads]
        return list(grads)

    def _scatter_back(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """reduce_scatter the ``[dp, length]`` gradient rows; each shard's gradient, cut to this rank's size."""
        n = self.dp_mesh.size()
        local = redistribute_traced(
            flat.reshape(-1), self._flat_spec((Partial(),), n * self.length, flat.dtype), (Shard(0),),
            "fully_shard (backward)",
        )  # fmt: skip
        local = self._sum_over_replicas(local)
        rank = self.dp_mesh.get_local_rank(0)
        grads = []
        for block, piece in zip(torch.split(local, [p.numel for p in self.pieces]), self.pieces):
            grads.append(block.view(piece.padded_shape).narrow(piece.dim, 0, piece.sizes[rank]))
        return grads

    def _all_reduce(self, flat: torch.Tensor) -> list[torch.Tensor]:
        total = redistribute_traced(
            flat, self._flat_spec((Partial(),), flat.numel(), flat.dtype), (Replicate(),), "fully_shard (backward)"
        )
        total = self._sum_over_replicas(total)
        sizes = [int(torch.Size(p.gathered_shape).numel()) for p in self.whole]
        return [block.view(p.gathered_shape) for block, p in zip(torch.split(total, sizes), self.whole)]

    def _sum_over_replicas(self, flat: torch.Tensor) -> torch.Tensor:
        """HSDP: a gradient reduced over the shard mesh, summed over the replicate mesh (all_reduce)."""
        if self.replicate_mesh is None:
            return flat
        spec = DTensorSpec(self.replicate_mesh, (Partial(),), TensorMeta((flat.numel(),), (1,), flat.dtype))
        return redistribute_traced(flat, spec, (Replicate(),), "fully_shard (backward)")

    def _flat_spec(
        self, placements: tuple[Placement, ...], numel: int, dtype: torch.dtype | None = None
    ) -> DTensorSpec:
        return DTensorSpec(self.dp_mesh, placements, TensorMeta((numel,), (1,), dtype or self.dtype))


def flat_groups(
    params: Sequence[ShardedParameter],
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    replicate_mesh: DeviceMesh | None = None,
) -> list[FlatGroup]:
    """The parameters packed by gathered dtype (a flat buffer holds one dtype), each parameter once."""
    distinct = {id(p.parameter): p for p in reversed(params)}
    unique = [p for p in params if distinct.get(id(p.parameter)) is p]
    n = dp_mesh.size()
    pieces: dict[torch.dtype, list[_Piece]] = {}
    whole: dict[torch.dtype, list[ShardedParameter]] = {}
    for p in unique:
        dtype = param_dtype if param_dtype is not None and p.parameter.is_floating_point() else p.parameter.dtype
        if p.dim is None:
            whole.setdefault(dtype, []).append(p)
            continue
        sizes = tuple(shard_sizes(p.gathered_shape[p.dim], n))
        shape = list(p.gathered_shape)
        shape[p.dim] = sizes[0]
        pieces.setdefault(dtype, []).append(_Piece(p, tuple(shape), sizes))
    groups = []
    for dtype in {**pieces, **whole}:
        own = tuple(pieces.get(dtype, ()))
        whole_here = tuple(whole.get(dtype, ()))
        groups.append(FlatGroup(dp_mesh, dtype, own, whole_here, sum(p.numel for p in own), replicate_mesh))
    return groups


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's local tensor, autograd flowing back into the DTensor parameter."""
    assert isinstance(param, DTensor)  # fully_shard registers only DTensor parameters
    return param.to_local()


def _padded(local: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """This rank's shard, zero-padded along the dp dim to the largest dp shard."""
    missing = piece.padded_shape[piece.dim] - local.size(piece.dim)
    if missing == 0:
        return local
    shape = list(local.shape)
    shape[piece.dim] = missing
    return torch.cat([local, local.new_zeros(shape)], piece.dim)


def _is_even(piece: _Piece) -> bool:
    return all(size == piece.padded_shape[piece.dim] for size in piece.sizes)


def _unpack(block: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """Rank r's padded shard sits in row r of ``block``: cut and join them along the dp dim."""
    if _is_even(piece):
        # the rows side by side along the dim, in a few ops whatever the dp size
        stacked = block.view(len(piece.sizes), *piece.padded_shape).movedim(0, piece.dim)
        local = stacked.flatten(piece.dim, piece.dim + 1)
        # the gathered copy owns its storage: after forward it is freed alone
        return local.clone() if local._is_view() else local
    parts = [
        row.view(piece.padded_shape).narrow(piece.dim, 0, size)
        for row, size in zip(block.unbind(0), piece.sizes)
        if size
    ]
    return torch.cat(parts, piece.dim)


def _pack(grad: torch.Tensor | None, piece: _Piece, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``_unpack``: a gathered gradient as ``[dp, numel]`` rows of padded shards."""
    n = len(piece.sizes)
    if grad is None:
        return torch.zeros(n, piece.numel, dtype=dtype)
    if _is_even(piece):
        return grad.unflatten(piece.dim, (n, piece.sizes[0])).movedim(piece.dim, 0).reshape(n, -1)  # type: ignore[no-untyped-call]
    parts = torch.split(grad, list(piece.sizes), dim=piece.dim)
    return torch.stack([_padded(part, piece).reshape(-1) for part in parts])


class _GatherGroup(torch.autograd.Function):
    """The group's shards in, their gathered copies out; backward reduces the copies' gradients to the shards."""

    @staticmethod
    def forward(ctx: Any, group: FlatGroup, options: ReduceOptions, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.options = group, options
        ctx.dtypes = [s.dtype for s in shards]
        return tuple(group.gather_values(shards))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        options: ReduceOptions = ctx.options
        if options.after_backward is not None:
            options.after_backward()
        return (None, None, *ctx.group.reduce_grads(grads, options, ctx.dtypes))
