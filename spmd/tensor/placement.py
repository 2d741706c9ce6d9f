"""Placements: how one mesh dimension lays out a tensor (Shard, Replicate, Partial).

Placements are plain frozen values. They carry no communication code: every collective lives in
the redistribute executor. The uneven-shard arithmetic (``shard_sizes``) follows ``torch.chunk``:
7 rows over 4 ranks are 2, 2, 2, 1 and 5 rows over 4 ranks are 2, 2, 1, 0. ``Shard`` also cuts a
local tensor into those pieces (``_split_tensor``, ``_select_split_tensor``: torch's names, which
code written for torch calls), with no traffic.

``_StridedShard(dim, split_factor=k)`` is torch's private placement for a dim sharded "right to
left" (FSDP2 over TP: the TP mesh dim cut the dim first, then the FSDP dim cut each TP piece). It
is not a ``Shard`` (as in torch, ``is_shard()`` is False and it never equals one); see its
docstring for the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeGuard

import torch

from spmd.compile.properties import traceable_property

__all__ = [
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "shard_sizes",
    "shard_offsets",
    "pad_dim",
    "pad_tensor",
    "unpad_tensor",
    "strided_shard_indices",
]


class Placement:
    """Base of the three placements; query methods let callers avoid isinstance chains."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild through the constructor (it validates), the same on every Python version.
        return type(self), tuple(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        """Source that rebuilds this placement in a torch.compile graph, and the names it uses."""
        return repr(self), {type(self).__name__: type(self)}


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The mesh dimension splits tensor dimension ``dim`` into contiguous chunks, one per rank."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) takes an int dim, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """Size and start of piece ``rank`` when a dim of ``curr_local_size`` is cut into ``num_chunks``.

        The offset is relative to the tensor being cut; an empty trailing piece starts at its end.
        """
        return shard_sizes(curr_local_size, num_chunks)[rank], shard_offsets(curr_local_size, num_chunks)[rank]

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """``local_shard_size_and_offset``, called on an instance (torch's name for it there)."""
        return Shard.local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _split_tensor(
        self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True
    ) -> tuple[list[torch.Tensor], list[int]]:
        """``tensor`` cut along ``dim`` into ``num_chunks`` pieces, and the zeros that pad each one.

        Pieces follow ``shard_sizes`` (trailing ones may be empty). ``with_padding`` grows every
        piece with zeros to the first piece's length (the equal blocks collectives move) and lists
        the zeros added to each; without it that list is empty. ``contiguous=False`` keeps views.

        >>> pieces, pads = Shard(0)._split_tensor(torch.arange(5), 4)
        >>> [p.tolist() for p in pieces], pads
        ([[0, 1], [2, 3], [4, 0], [0, 0]], [0, 0, 1, 2])
        """
        dim = self._dim_in(tensor)
        size = tensor.size(dim)
        sizes, offsets = shard_sizes(size, num_chunks), shard_offsets(size, num_chunks)
        pieces = [tensor.narrow(dim, start, length) for start, length in zip(offsets, sizes)]
        pad_sizes = []
        if with_padding:
            pad_sizes = [sizes[0] - length for length in sizes]
            pieces = [pad_dim(piece, dim, sizes[0]) for piece in pieces]
        if contiguous:
            pieces = [piece.contiguous() for piece in pieces]
        return pieces, pad_sizes

    def _select_split_tensor(
        self,
        tensor: torch.Tensor,
        num_chunks: int,
        index: int | torch.SymInt,
        *,
        with_padding: bool = True,
        contiguous: bool = True,
        clone: bool = True,
    ) -> torch.Tensor:
        """Piece ``index`` of ``_split_tensor(tensor, num_chunks, ...)``, cutting only that piece.

        ``clone`` returns a copy; otherwise a view, made contiguous when ``contiguous``. While
        tracing, ``index`` may be a SymInt; padding needs the piece's concrete length, so pass
        ``with_padding=False`` then (with it, the guard on the unknown length raises).
        """
        if isinstance(index, int):
            if not -num_chunks <= index < num_chunks:
                raise IndexError(f"piece {index} is out of range for {num_chunks} pieces")
            index %= num_chunks
        dim = self._dim_in(tensor)
        size = tensor.size(dim)
        longest = chunk_length(size, num_chunks)
        # sym_min keeps a SymInt index symbolic while tracing; on ints it is min
        start = torch.sym_min(longest * index, size)  # type: ignore[no-untyped-call]
        piece = tensor.narrow(dim, start, torch.sym_min(longest, size - start))  # type: ignore[no-untyped-call]
        if with_padding:
            piece = pad_dim(piece, dim, longest)
        if clone:
            return piece.clone()
        return piece.contiguous() if contiguous else piece

    def _dim_in(self, tensor: torch.Tensor) -> int:
        """``dim`` as a non-negative dim of ``tensor`` (a 0-d tensor has none to shard)."""
        if tensor.ndim == 0 or not -tensor.ndim <= self.dim < tensor.ndim:
            raise ValueError(
                f"{self} is out of range for a {tensor.ndim}-d tensor"
                + (f"; use a dim in [{-tensor.ndim}, {tensor.ndim - 1}]" if tensor.ndim else "")
            )
        return self.dim % tensor.ndim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class _StridedShard(Placement):
    """The mesh dimension shards tensor dimension ``dim`` inside a ``split_factor``-way cut that later
    mesh dims make: a right-to-left shard (torch's private placement, same name and meaning).

    The dim is first cut into ``split_factor`` groups (``torch.chunk``), each group is cut into one
    piece per rank, and a rank holds its piece of every group, in group order. With
    ``[_StridedShard(0, split_factor=2), Shard(0)]`` on a 2 x 2 mesh, an 8-row tensor is laid out
    as FSDP2 over TP lays it out: the TP dim (mesh dim 1) owns rows 0-3 / 4-7 and the FSDP dim
    (mesh dim 0) halves each of those, so coordinate (0, 1) holds rows 4-5, not 2-3.

    Unlike torch's, it is a frozen dataclass; as in torch it is not a ``Shard``: ``is_shard()``
    is False, it never equals ``Shard(dim)``, and ``split_factor`` is keyword-only.

    >>> pieces, _ = _StridedShard(0, split_factor=2)._split_tensor(torch.arange(8), 2)
    >>> [p.tolist() for p in pieces]
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """

    dim: int
    split_factor: int = field(default=1, kw_only=True)

    def __init__(self, dim: int, *, split_factor: int = 1, sf: int | None = None) -> None:
        # ``sf`` is the spelling of the repr (and torch's constructor accepts it too).
        if sf is not None:
            if split_factor != 1:
                raise TypeError("_StridedShard takes split_factor or sf, not both")
            split_factor = sf
        for name, value in (("dim", dim), ("split_factor", split_factor)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"_StridedShard({name}) takes an int, got {value!r}")
        if split_factor < 1:
            raise ValueError(f"_StridedShard split_factor must be >= 1 (the number of earlier cuts), got {split_factor}")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", split_factor)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_strided_shard, (self.dim, self.split_factor)

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"

    def local_shard_size(self, curr_local_size: int, num_chunks: int, rank: int) -> int:
        """How many entries of a dim of ``curr_local_size`` rank ``rank`` of ``num_chunks`` holds."""
        return sum(shard_sizes(group, num_chunks)[rank] for group in shard_sizes(curr_local_size, self.split_factor))

    def local_shard_indices(self, curr_local_size: int, num_chunks: int, rank: int) -> list[int]:
        """The entries (indices into a dim of ``curr_local_size``) rank ``rank`` holds, in its order."""
        return strided_shard_indices(curr_local_size, num_chunks, self.split_factor)[rank]

    def local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """Refused: a strided piece is not one contiguous block, so it has no single offset.

        Use ``local_shard_size`` and ``local_shard_indices``.
        """
        raise ValueError(
            f"{self!r} holds {self.split_factor} separate blocks of the dim on each rank, so its piece has no "
            "single offset; use local_shard_size() for its length and local_shard_indices() for the entries "
            "it holds, or redistribute to Shard/Replicate first"
        )

    _local_shard_size_and_offset = local_shard_size_and_offset

    def _split_tensor(
        self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True
    ) -> tuple[list[torch.Tensor], list[int]]:
        """``tensor`` cut along ``dim`` into each rank's strided piece, and how short each one is.

        As torch's: ``with_padding`` lists, per piece, the zeros that would make it as long as the
        longest, but the pieces themselves stay unpadded (else the list is empty);
        ``contiguous=False`` may leave pieces as views.
        """
        dim = self._dim_in(tensor)
        pieces = [self._piece(tensor, dim, num_chunks, rank) for rank in range(num_chunks)]
        pad_sizes: list[int] = []
        if with_padding:
            longest = max(piece.size(dim) for piece in pieces)
            pad_sizes = [longest - piece.size(dim) for piece in pieces]
        if contiguous:
            pieces = [piece.contiguous() for piece in pieces]
        return pieces, pad_sizes

    def _select_split_tensor(
        self,
        tensor: torch.Tensor,
        num_chunks: int,
        index: int,
        *,
        with_padding: bool = True,
        contiguous: bool = True,
        clone: bool = True,
    ) -> torch.Tensor:
        """Piece ``index`` of ``_split_tensor(tensor, num_chunks, ...)``, cutting only that piece
        (unpadded whatever ``with_padding`` says, as there)."""
        if not -num_chunks <= index < num_chunks:
            raise IndexError(f"piece {index} is out of range for {num_chunks} pieces")
        index %= num_chunks
        piece = self._piece(tensor, self._dim_in(tensor), num_chunks, index)
        if clone:
            return piece.clone()
        return piece.contiguous() if contiguous else piece

    def _piece(self, tensor: torch.Tensor, dim: int, num_chunks: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece: its chunk of every group, joined (a view when it is one block)."""
        size = tensor.size(dim)
        blocks = []
        for group_start, group in zip(shard_offsets(size, self.split_factor), shard_sizes(size, self.split_factor)):
            start = group_start + shard_offsets(group, num_chunks)[rank]
            length = shard_sizes(group, num_chunks)[rank]
            if length:
                blocks.append(tensor.narrow(dim, start, length))
        if not blocks:
            return tensor.narrow(dim, 0, 0)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim)

    def _dim_in(self, tensor: torch.Tensor) -> int:
        if tensor.ndim == 0 or not -tensor.ndim <= self.dim < tensor.ndim:
            raise ValueError(
                f"{self!r} is out of range for a {tensor.ndim}-d tensor"
                + (f"; use a dim in [{-tensor.ndim}, {tensor.ndim - 1}]" if tensor.ndim else "")
            )
        return self.dim % tensor.ndim


def _rebuild_strided_shard(dim: int, split_factor: int) -> _StridedShard:
    """``pickle``'s way back to a ``_StridedShard`` (through the checking constructor)."""
    return _StridedShard(dim, split_factor=split_factor)


def _is_shard_like(p: Placement) -> TypeGuard[Shard | _StridedShard]:
    """True for ``Shard`` and ``_StridedShard``: the mesh dim cuts a tensor dim (torch's helper name)."""
    return isinstance(p, (Shard, _StridedShard))


def strided_shard_indices(size: int, num_chunks: int, split_factor: int) -> list[list[int]]:
    """For each of ``num_chunks`` ranks, the entries of a dim of ``size`` that
    ``_StridedShard(split_factor=split_factor)`` gives it, in the order its piece holds them.

    >>> strided_shard_indices(9, 4, 2)
    [[0, 1, 5], [2, 3, 6], [4, 7], [8]]
    """
    owned: list[list[int]] = [[] for _ in range(num_chunks)]
    for group_start, group in zip(shard_offsets(size, split_factor), shard_sizes(size, split_factor)):
        for rank, (start, length) in enumerate(zip(shard_offsets(group, num_chunks), shard_sizes(group, num_chunks))):
            owned[rank].extend(range(group_start + start, group_start + start + length))
    return owned


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along the mesh dimension holds the whole (not yet sharded) tensor."""

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a partial value; the logical tensor is their reduction by ``reduce_op``.

    ``reduce_op`` is one of ``ALL_REDUCE_OPS``; ``"prod"`` is read as ``"product"``.
    """

    reduce_op: str = "sum"
    ALL_REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg", "min", "max", "product")
    """Every reduction a Partial may stand for (torch's list)."""
    REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg", "max", "min")
    """The reductions op rules carry through an op; a product partial is reduced before it instead."""
    LINEAR_REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg")
    """Reductions that commute with addition and scaling."""

    def __post_init__(self) -> None:
        if self.reduce_op == "prod":
            object.__setattr__(self, "reduce_op", _canonical_reduce_op(self.reduce_op))
        if self.reduce_op not in self.ALL_REDUCE_OPS:
            raise ValueError(
                f"Partial({self.reduce_op!r}) is not supported; use one of {', '.join(self.ALL_REDUCE_OPS)}"
            )

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or _canonical_reduce_op(reduce_op) == self.reduce_op

    @traceable_property  # not property: torch.compile reads it on placements from outside the region
    def is_linear(self) -> bool:
        """True for sum and avg: the reduction commutes with addition and scaling."""
        return self.reduce_op in self.LINEAR_REDUCE_OPS

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


def _canonical_reduce_op(name: str) -> str:
    """``name`` with ``"prod"`` (torch.prod's name) read as ``"product"``.

    torch's Partial keeps ``"prod"`` as given, and its collectives then reject it; c10d knows only
    ``"product"``, so spmd settles on that spelling when the placement is built.
    """
    return "product" if name == "prod" else name


def chunk_length(size: int, num_chunks: int) -> int:
    """Length of the first (longest) of the ``num_chunks`` pieces of ``size``: ``ceil(size / num_chunks)``."""
    if num_chunks <= 0:
        raise ValueError(f"cannot split into {num_chunks} chunks; the mesh dimension must be >= 1")
    return -(-size // num_chunks)


def shard_sizes(size: int, num_chunks: int) -> list[int]:
    """Sizes of the ``num_chunks`` pieces of a dimension of ``size``, as ``torch.chunk`` cuts it.

    Chunks are ``ceil(size / num_chunks)`` long; trailing ranks get the remainder or nothing.
    """
    step = chunk_length(size, num_chunks)
    sizes = []
    left = size
    for _ in range(num_chunks):
        take = min(step, left)
        sizes.append(take)
        left -= take
    return sizes


def shard_offsets(size: int, num_chunks: int) -> list[int]:
    """Start offset of each chunk of ``shard_sizes(size, num_chunks)``."""
    offsets, start = [], 0
    for piece in shard_sizes(size, num_chunks):
        offsets.append(start)
        start += piece
    return offsets


def pad_dim(tensor: torch.Tensor, dim: int, to: int) -> torch.Tensor:
    """``tensor`` grown to ``to`` along ``dim`` with zeros (uneven shards travel padded to the longest)."""
    return pad_tensor(tensor, dim, to - tensor.size(dim))


def pad_tensor(tensor: torch.Tensor, pad_dim: int, pad_size: int) -> torch.Tensor:
    """``tensor`` with ``pad_size`` zeros appended along ``pad_dim`` (itself when there are none).

    torch's private name (``_collective_utils``), the padding ``Shard._split_tensor(with_padding=True)``
    adds to the short pieces; ``unpad_tensor`` takes it off again.
    """
    if pad_size <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[pad_dim] = pad_size
    return torch.cat([tensor, tensor.new_zeros(shape)], pad_dim)


def unpad_tensor(tensor: torch.Tensor, pad_dim: int, pad_size: int) -> torch.Tensor:
    """``tensor`` without its last ``pad_size`` entries along ``pad_dim``: a view, no copy.

    Undoes ``pad_tensor``; e.g. ``pieces, pads = Shard(0)._split_tensor(t, n)`` then
    ``unpad_tensor(pieces[i], 0, pads[i])`` is piece ``i`` as ``torch.chunk`` cuts it.
    """
    if pad_size <= 0:
        return tensor
    return tensor.narrow(pad_dim, 0, tensor.size(pad_dim) - pad_size)


def format_placements(placements: Sequence[Placement]) -> str:
    """Compact form used in logs and errors: ``(S(0), R)``."""
    return "(" + ", ".join(str(p) for p in placements) + ")"
