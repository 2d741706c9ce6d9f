"""Where a mesh dim's ranks sit in its root mesh: strided axes over the root's row-major rank list.

A root mesh of shape ``(2, 4)`` lists its ranks row-major; its dim 0 steps through that list by 4,
its dim 1 by 1. Every mesh cut from the root (``mesh["tp"]``), flattened (``_flatten``) or unflattened
(``_unflatten``) describes each of its dims the same way, as axes ``(size, stride)`` over that list,
major first: splitting dim 0 of a ``(8,)`` root into ``(2, 4)`` gives the axes ``((2, 4),)`` and
``((4, 1),)``; flattening them again gives ``((2, 4), (4, 1))``, which ``canonical`` reads as
``((8, 1),)``. The strides always nest (each is a product of the sizes below it), so two axes share
ranks exactly when their stride ranges ``[stride, stride * size)`` overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["Axis", "DimLayout", "canonical", "offsets", "overlaps", "root_layout", "split", "without_axes"]

Axis = tuple[int, int]
"""``(size, stride)``: ``size`` positions, ``stride`` apart in the root's row-major rank list."""
DimLayout = tuple[Axis, ...]
"""One mesh dim as its axes, major first; its size is the product of theirs."""


def root_layout(shape: Sequence[int]) -> tuple[DimLayout, ...]:
    """Each dim of a root mesh of ``shape`` as one axis."""
    return tuple(((size, math.prod(shape[d + 1 :])),) for d, size in enumerate(shape))


def offsets(axes: Sequence[Axis]) -> list[int]:
    """Positions (relative to the first) of the ranks along ``axes``, row-major."""
    positions = [0]
    for size, stride in axes:
        positions = [p + i * stride for p in positions for i in range(size)]
    return positions


def without_axes(position: int, axes: Sequence[Axis]) -> int:
    """``position`` moved to coordinate 0 along each of ``axes``: where its group along them starts."""
    return position - sum((position // stride) % size * stride for size, stride in axes)


def canonical(axes: Sequence[Axis]) -> DimLayout:
    """``axes`` without size-1 axes and with neighbours that step as one merged: equal ranks, equal form."""
    merged: list[Axis] = []
    for size, stride in axes:
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return tuple(merged)


def overlaps(a: Sequence[Axis], b: Sequence[Axis]) -> bool:
    """Whether two dims share an axis (or part of one), so that a mesh cannot hold both."""
    return any(max(sa, sb) < min(sa * na, sb * nb) for na, sa in a for nb, sb in b if na > 1 and nb > 1)


def split(axes: DimLayout, sizes: Sequence[int]) -> tuple[DimLayout, ...] | None:
    """``axes`` cut into consecutive dims of ``sizes`` (major first), or None if the sizes do not
    fall on the axes' boundaries (e.g. ``(3, 2)`` out of the axes ``((2, 3), (3, 1))``)."""
    rest = list(canonical(axes))
    dims: list[DimLayout] = []
    for want in sizes:
        taken: list[Axis] = []
        while want > 1:
            if not rest:
                return None
            size, stride = rest[0]
            if want % size == 0:  # take the whole axis, want more from the next
                taken.append(rest.pop(0))
                want //= size
            elif size % want == 0:  # take the major part of the axis
                taken.append((want, stride * size // want))
                rest[0] = (size // want, stride)
                want = 1
            else:
                return None
        dims.append(tuple(taken) if taken else ((1, 1),))
    return tuple(dims) if not rest else None
