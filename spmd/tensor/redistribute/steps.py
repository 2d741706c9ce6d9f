"""Redistribute steps: one placement change on one mesh dim (``TransformStep``), one collective over
the group of a flattened mesh dim (``FlattenedStep``), and the merge from the first to the second.

Placements only: a step names the collective that performs it (``step.collective``); the executor
(run.py) runs it, and the planner (search.py, plan.py) chooses the steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spmd.tensor.placement import Partial, Placement, Shard, _StridedShard
from spmd.tensor.spec import DTensorSpec

__all__ = ["TransformStep", "FlattenedStep", "merge_flattened_steps", "collective_count"]


@dataclass(frozen=True, slots=True)
class TransformStep:
    """One placement change on one mesh dim, and the collective that performs it."""

    mesh_dim: int
    src: Placement
    dst: Placement

    @property
    def collective(self) -> str:
        src, dst = self.src, self.dst
        if isinstance(src, _StridedShard):  # the plan only gathers it (strided_route)
            return "all_gather"
        if isinstance(src, Shard):
            if isinstance(dst, Partial):
                return "local"
            return "all_to_all" if isinstance(dst, Shard) else "all_gather"
        if isinstance(src, Partial):
            return "reduce_scatter" if isinstance(dst, Shard) else "all_reduce"
        return "local"

    def describe(self) -> str:
        detail = {
            "all_gather": f"all_gather(dim={getattr(self.src, 'dim', '')})"
            + (" + reorder" if isinstance(self.src, _StridedShard) else ""),
            "all_to_all": f"all_to_all({self.src} -> {self.dst})",
            "all_reduce": f"all_reduce({getattr(self.src, 'reduce_op', '')})",
            "reduce_scatter": f"reduce_scatter({getattr(self.src, 'reduce_op', '')}, dim={getattr(self.dst, 'dim', '')})",
            "local": {
                Shard: "local chunk",
                _StridedShard: "local strided select",
                Partial: "local pad" if isinstance(self.src, Shard) else "local",
            }.get(type(self.dst), "local"),
        }[self.collective]
        return f"mesh dim {self.mesh_dim}: {self.src} -> {self.dst}  {detail}"

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True, slots=True)
class FlattenedStep:
    """One collective over several mesh dims at once, through the group of the dim they were flattened into.

    Runs the collective that ``TransformStep(d, src, dst)`` runs, for every ``d`` of ``mesh_dims``
    (ascending: the first is the major dim of the flattened group).
    """

    mesh_dims: tuple[int, ...]
    src: Placement
    dst: Placement

    @property
    def collective(self) -> str:
        return TransformStep(self.mesh_dims[0], self.src, self.dst).collective

    def describe(self) -> str:
        one = TransformStep(self.mesh_dims[0], self.src, self.dst).describe()
        dims = ", ".join(str(d) for d in self.mesh_dims)
        return f"mesh dims {dims} (flattened){one[one.index(':') :]}"

    def __str__(self) -> str:
        return self.describe()


MERGEABLE = frozenset({"all_reduce", "reduce_scatter", "all_gather"})


def merge_flattened_steps(
    steps: Sequence[TransformStep], spec: DTensorSpec, src: Sequence[Placement]
) -> list[TransformStep | FlattenedStep]:
    """``steps`` with each run of one transform on several mesh dims replaced by one ``FlattenedStep``
    where the mesh has a flattened dim over exactly those mesh dims.

    Only steps next to each other in the plan merge, and only across mesh dims the plan leaves
    alone, so the merged collective does what the steps did in the same order. A gather or scatter
    merges only when every piece is even (a flattened group cuts the dim evenly at once; nested uneven
    cuts differ). The choice reads only values every rank shares, so all ranks make it alike.
    """
    touched = {step.mesh_dim for step in steps}
    cur = list(src)
    merged: list[TransformStep | FlattenedStep] = []
    i = 0
    while i < len(steps):
        step = steps[i]
        end = i + 1
        if step.collective in MERGEABLE:
            while end < len(steps) and (steps[end].src, steps[end].dst) == (step.src, step.dst):
                end += 1
        found = None
        for stop in range(end, i + 1, -1):  # the longest run first, two steps at least
            found = _flattened_step(steps[i:stop], spec, cur, touched)
            if found is not None:
                break
        if found is None:
            merged.append(step)
            cur[step.mesh_dim] = step.dst
            i += 1
            continue
        merged.append(found)
        for d in found.mesh_dims:
            cur[d] = found.dst
        i = stop
    return merged


def _flattened_step(
    run: Sequence[TransformStep], spec: DTensorSpec, cur: Sequence[Placement], touched: set[int]
) -> FlattenedStep | None:
    """The one step that does ``run`` (the same transform on several mesh dims), or None if none can."""
    dims = [step.mesh_dim for step in run]
    ordered = sorted(dims)
    kind, first = run[0].collective, run[0]
    if len(set(dims)) != len(dims) or isinstance(first.src, _StridedShard) or isinstance(first.dst, _StridedShard):
        return None
    # Nested shards are cut by the lower mesh dim first: a scatter cuts outer to inner, a gather
    # joins inner to outer; the flattened group does either at once.
    if (kind == "reduce_scatter" and dims != ordered) or (kind == "all_gather" and dims != ordered[::-1]):
        return None
    between = [e for e in range(ordered[0], ordered[-1]) if e not in dims]
    if any(e in touched for e in between):
        return None
    if kind != "all_reduce":
        shard = first.dst if kind == "reduce_scatter" else first.src
        assert isinstance(shard, Shard)
        mesh_shape = spec.mesh.shape
        cuts = math.prod(
            mesh_shape[e] for e, p in enumerate(cur) if e not in dims and isinstance(p, Shard) and p.dim == shard.dim
        )
        if any(isinstance(cur[e], Shard) and cur[e] == shard for e in between):
            return None
        if spec.shape[shard.dim] % (cuts * math.prod(mesh_shape[d] for d in dims)):
            return None
    if spec.mesh._flattened_communicator(ordered) is None:
        return None
    return FlattenedStep(tuple(ordered), first.src, first.dst)


def collective_count(steps: Sequence[TransformStep | FlattenedStep]) -> int:
    """How many steps of ``steps`` issue a collective (the others are local)."""
    return sum(step.collective != "local" for step in steps)
