"""visualize_sharding: which rank holds which block of a 1-d or 2-d DTensor, as a text table."""

from __future__ import annotations

import itertools
from typing import Any, TextIO

from spmd.tensor.placement import Partial
from spmd.tensor.spec import local_shape_and_offset
from spmd.tensor.trace import current_rank_or_none

__all__ = ["visualize_sharding", "sharding_table"]


def _span(start: int, size: int) -> str:
    return f"{start}:{start + size}"


def sharding_table(dtensor: Any) -> str:
    """The table ``visualize_sharding`` prints: rows and columns are global index ranges.

    Uneven shards show their real sizes (7 rows over 4 ranks: ``0:2 2:4 4:6 6:7``); a rank with an
    empty shard is listed under the table. Computed from the spec alone, with no communication.
    """
    spec = dtensor._spec
    mesh = spec.mesh
    shape = tuple(spec.shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"visualize_sharding shows 1-d and 2-d tensors; this one is {len(shape)}-d")
    cells: dict[tuple[tuple[int, int], tuple[int, int]], list[str]] = {}
    empty: list[str] = []
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        rank = int(mesh.mesh[coordinate].item())
        local, offset = local_shape_and_offset(shape, mesh, spec.placements, coordinate)
        if len(shape) == 1:
            local, offset = (1, *local), (0, *offset)
        label = f"{rank}" if mesh.ndim == 1 else f"{rank} {coordinate}"
        if 0 in local:
            empty.append(label)
            continue
        key = ((offset[0], local[0]), (offset[1], local[1]))
        cells.setdefault(key, []).append(label)
    rows = sorted({k[0] for k in cells})
    cols = sorted({k[1] for k in cells})
    header = [""] + [("cols " if len(shape) == 2 else "") + _span(*c) for c in cols]
    table = [header]
    for r in rows:
        line = ["rows " + _span(*r) if len(shape) == 2 else ""]
        line += ["ranks " + ", ".join(cells.get((r, c), ["-"])) for c in cols]
        table.append(line)
    if len(shape) == 1:  # one row: drop the row-label column
        table = [row[1:] for row in table]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [str(spec)]
    lines += [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    partial_dims = [f"mesh dim {d} ({p})" for d, p in enumerate(spec.placements) if isinstance(p, Partial)]
    if partial_dims:
        lines.append(
            "partial over " + ", ".join(partial_dims) + ": the ranks in a cell hold contributions to be reduced"
        )
    if empty:
        lines.append("empty shards on ranks " + ", ".join(empty))
    return "\n".join(lines)


def visualize_sharding(dtensor: Any, header: str = "", *, file: TextIO | None = None) -> str:
    """Print (on rank 0) and return the table of which rank holds which block of ``dtensor``."""
    text = (header + "\n" if header else "") + sharding_table(dtensor)
    if current_rank_or_none() in (None, 0):
        print(text, file=file)
    return text
