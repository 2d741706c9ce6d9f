"""The lower bound on the bytes each rank receives per redistribute (benchmarks/redistribute.py).

Read redistribute.py's docstring for the bound; ``recut_under_later_cut`` says why a transition's
bound lies out of reach of plans built from one-mesh-dim collectives.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import spmd.tensor
from spmd.tensor import Partial, Placement, Shard


# ----- transitions ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Case:
    """One redistribute: ``src -> dst`` of a float32 tensor of ``shape`` on a mesh of ``mesh_shape``."""

    mesh_shape: tuple[int, ...]
    src: tuple[str, ...]
    dst: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def label(self) -> str:
        return f"[{','.join(self.src)}] -> [{','.join(self.dst)}]"


_PLACEMENT = re.compile(r"^(?:R|S\((-?\d+)\)|P(?:\((sum|avg|max|min)\))?)$")


def parse_placement(text: str, lib: Any) -> Any:
    """``"S(1)"``, ``"R"``, ``"P"`` or ``"P(max)"`` as a placement of ``lib`` (spmd.tensor or torch's)."""
    match = _PLACEMENT.match(text)
    if match is None:
        raise ValueError(f"cannot read placement {text!r}; write R, S(dim), P or P(op)")
    if text == "R":
        return lib.Replicate()
    if text.startswith("S"):
        return lib.Shard(int(match.group(1)))
    return lib.Partial(match.group(2) or "sum")


def spmd_placements(texts: Sequence[str]) -> tuple[Placement, ...]:
    return tuple(parse_placement(t, spmd.tensor) for t in texts)


# ----- the minimum ---------------------------------------------------------------------------------
def _chunks(size: int, n: int) -> list[tuple[int, int]]:
    """(offset, length) of the n pieces of ``size`` as torch.chunk cuts it, empty pieces at the end."""
    step = -(-size // n) if size else 0
    return [(min(i * step, size), max(0, min(step, size - i * step))) for i in range(n)]


def _region(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coord: Sequence[int]
) -> torch.Tensor:
    """Boolean mask of the global elements a rank at ``coord`` holds (mesh dim 0 cuts first)."""
    start, size = [0] * len(shape), list(shape)
    for d, p in enumerate(placements):
        if isinstance(p, Shard):
            offset, length = _chunks(size[p.dim], mesh_shape[d])[coord[d]]
            start[p.dim] += offset
            size[p.dim] = length
    mask = torch.zeros(tuple(shape), dtype=torch.bool)
    mask[tuple(slice(s, s + n) for s, n in zip(start, size))] = True
    return mask


def min_bytes(case: Case, itemsize: int = 4) -> int:
    """The lower bound of the module docstring: max over ranks of movement + reduction bytes."""
    src, dst = spmd_placements(case.src), spmd_placements(case.dst)
    target = []
    for s, t in zip(src, dst):
        if isinstance(t, Partial) and isinstance(s, Partial) and s != t:
            raise ValueError(f"{case.label}: no bound for changing {s} into {t}")
        target.append(s if isinstance(t, Partial) else t)
    reduced = [d for d, (s, t) in enumerate(zip(src, dst)) if isinstance(s, Partial) and s != t]
    group = math.prod(case.mesh_shape[d] for d in reduced)
    coords = list(itertools.product(*(range(n) for n in case.mesh_shape)))
    worst = 0.0
    for coord in coords:
        held = _region(case.shape, case.mesh_shape, src, coord)
        wanted = _region(case.shape, case.mesh_shape, target, coord)
        total = float((wanted & ~held).sum())
        if reduced:
            # need[e]: how many members of this rank's reduction group want element e of the region.
            need = torch.zeros(case.shape, dtype=torch.int64)
            for other in coords:
                if all(other[d] == coord[d] for d in range(len(coord)) if d not in reduced):
                    need += _region(case.shape, case.mesh_shape, target, other)
            need = need * held
            total += float(((group + need - 2) * (need > 0)).sum()) / group
        worst = max(worst, total)
    return round(worst * itemsize)


def recut_under_later_cut(case: Case) -> str | None:
    """Why no plan of one-mesh-dim collectives reaches the bound for ``case``, if the legality rule is why.

    A mesh dim that changes which tensor dim it cuts, while a later mesh dim cuts that tensor dim
    (in the source or the target), can run its collective only after the later one lets go of it.
    """
    src, dst = spmd_placements(case.src), spmd_placements(case.dst)
    for d, (s, t) in enumerate(zip(src, dst)):
        touched = {p.dim for p in (s, t) if isinstance(p, Shard)} if s != t else set()
        for e in range(d + 1, len(src)):
            for side, p in (("source", src[e]), ("target", dst[e])):
                if isinstance(p, Shard) and p.dim in touched:
                    return (
                        f"mesh dim {d} ({s} -> {t}) re-cuts tensor dim {p.dim}, which later mesh dim {e} cuts in "
                        f"the {side}: a collective on mesh dim {d} runs only once mesh dim {e} lets go of it, "
                        "while the bound's route keeps it cut (a strided layout, or blocks relayed between "
                        "ranks that share no mesh-dim group)"
                    )
    return None
