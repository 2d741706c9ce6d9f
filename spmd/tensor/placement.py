"""Placements: how one mesh dimension lays out a tensor (Shard, Replicate, Partial).

Placements are plain frozen values. They carry no communication code: every collective lives in
the redistribute executor. The uneven-shard arithmetic (``shard_sizes``) follows ``torch.chunk``:
7 rows over 4 ranks are 2, 2, 2, 1 and 5 rows over 4 ranks are 2, 2, 1, 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

__all__ = ["Placement", "Shard", "Replicate", "Partial", "shard_sizes", "shard_offsets"]


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

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along the mesh dimension holds the whole (not yet sharded) tensor."""

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a partial value; the logical tensor is their reduction by ``reduce_op``."""

    reduce_op: str = "sum"
    REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg", "max", "min")
    ALL_REDUCE_OPS: ClassVar[tuple[str, ...]] = REDUCE_OPS
    """torch's name for ``REDUCE_OPS`` (torch also lists "product", which spmd does not offer)."""
    LINEAR_REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg")
    """Reductions that commute with addition and scaling."""

    def __post_init__(self) -> None:
        if self.reduce_op not in self.REDUCE_OPS:
            raise ValueError(
                f"Partial({self.reduce_op!r}) is not supported; use one of {', '.join(self.REDUCE_OPS)}"
            )

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    @property
    def is_linear(self) -> bool:
        """True for sum and avg: the reduction commutes with addition and scaling."""
        return self.reduce_op in self.LINEAR_REDUCE_OPS

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


def shard_sizes(size: int, num_chunks: int) -> list[int]:
    """Sizes of the ``num_chunks`` pieces of a dimension of ``size``, as ``torch.chunk`` cuts it.

    Chunks are ``ceil(size / num_chunks)`` long; trailing ranks get the remainder or nothing.
    """
    if num_chunks <= 0:
        raise ValueError(f"cannot split into {num_chunks} chunks; the mesh dimension must be >= 1")
    step = -(-size // num_chunks) if size else 0
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


def format_placements(placements: Sequence[Placement]) -> str:
    """Compact form used in logs and errors: ``(S(0), R)``."""
    return "(" + ", ".join(str(p) for p in placements) + ")"
