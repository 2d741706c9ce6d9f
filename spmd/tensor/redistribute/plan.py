"""Redistribute, the plan half: the steps from one set of placements to another (placements only).

The planner works on placements only (so plans are cached by ``(src, dst)``). A tensor dim that
several mesh dims shard is cut by the lower mesh dim first, so a step on mesh dim ``d`` that touches
tensor dim ``k`` is a plain collective over d's group only while no mesh dim after ``d`` shards ``k``.
The plan keeps that true in three passes:

1. reduce pending partials early, while tensors are smallest (``P -> R``, ``P -> S``);
2. from the last mesh dim to the first, unshard what must change (``S -> R``, or ``S -> S`` as one
   all_to_all when nothing later is disturbed);
3. from the first mesh dim to the last, shard and partition into the target (local, no traffic),
   finishing any reduction left.

The steps run through the executor's collectives (spmd/tensor/redistribute/collectives.py), like every other
collective the library issues.

A ``_StridedShard`` mesh dim is never part of those passes: the plan first gathers it (and every
later mesh dim cutting the same tensor dim, inner first: all_gather, then a local reorder), plans
the plain placements left, then cuts the target's strided dims locally (``strided_route``). So a
change between ``_StridedShard`` and ``Shard`` goes through ``Replicate`` on that tensor dim.

A mesh dim of one rank moves no data: that rank holds the whole dim whatever the placement (S(d),
R and P are the same local tensor), so a change there is a relabel, never a step of a plan.

When the mesh has flattened dims (``mesh["dp", "cp"]._flatten()``), steps in a row that run the same
collective on the mesh dims of one flattened dim run it once over the flattened group
(``FlattenedStep``): one all_reduce instead of two. A rank outside the mesh holds an empty piece,
and nothing moves through it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from spmd.tensor.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)
from spmd.tensor.spec import DTensorSpec, has_strided, unstrided_placements

__all__ = [
    "TransformStep",
    "FlattenedStep",
    "plan_redistribute",
    "redistribute_cost",
    "moves_data",
]
REPLICATE = Replicate()
SCATTERED_REDUCTION_MIN_BYTES = 64 * 1024
"""Below this many bytes, several partial dims are all-reduced one by one (fewer collectives)."""


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
            "local": {Shard: "local chunk", _StridedShard: "local strided select", Partial: "local pad" if isinstance(self.src, Shard) else "local"}.get(
                type(self.dst), "local"
            ),
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
        return f"mesh dims {dims} (flattened){one[one.index(':'):]}"

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


def _collective_count(steps: Sequence[TransformStep | FlattenedStep]) -> int:
    return sum(step.collective != "local" for step in steps)


def _shard_dims(p: Placement) -> set[int]:
    return {p.dim} if isinstance(p, Shard) else set()


@functools.lru_cache(maxsize=4096)
def plan_redistribute(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], ndim: int | None = None
) -> tuple[TransformStep, ...]:
    """The ordered steps that turn placements ``src`` into ``dst`` (see the module docstring).

    With the tensor's ``ndim`` known, several partial dims bound for Replicate are reduced
    through a scatter: the last one reduce-scatters over a tensor dim no placement uses, the
    others all-reduce the smaller piece, and an all_gather restores it (less traffic than one
    all_reduce per mesh dim on the whole tensor).
    """
    if len(src) != len(dst):
        raise ValueError(f"cannot redistribute {len(src)} placements into {len(dst)}")
    if has_strided(src) or has_strided(dst):
        return strided_route(src, dst, ndim)
    plan = _PlainPlan(src, dst)
    plan.reduce_partials(ndim)
    plan.unshard()
    plan.shard_into_target()
    if plan.cur != list(dst):  # the passes are complete; this guards future edits
        raise AssertionError(f"redistribute plan {src} -> {dst} ended at {tuple(plan.cur)}")
    return tuple(plan.steps)


class _PlainPlan:
    """The three passes of ``plan_redistribute`` over plain placements, building ``steps``."""

    def __init__(self, src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> None:
        self.src, self.dst, self.n = src, dst, len(src)
        self.cur = list(src)
        self.steps: list[TransformStep] = []
        self.involved = [_shard_dims(src[d]) | _shard_dims(dst[d]) for d in range(self.n)]
        self.rebuilt = [False] * self.n
        """Mesh dims whose piece must be rebuilt: they change, or an earlier rebuilt dim cuts a tensor
        dim they cut too."""
        for d in range(self.n):
            kept = _shard_dims(src[d])
            self.rebuilt[d] = src[d] != dst[d] or any(self.rebuilt[e] and kept & self.involved[e] for e in range(d))

    def move(self, d: int, to: Placement) -> None:
        self.steps.append(TransformStep(d, self.cur[d], to))
        self.cur[d] = to

    def free_after(self, d: int, dims: set[int]) -> bool:
        return not any(_shard_dims(self.cur[e]) & dims for e in range(d + 1, self.n))

    def safe_target(self, d: int, target: Placement) -> bool:
        """Sharding ``target`` at d now must not block an earlier mesh dim that is still to change."""
        dims = _shard_dims(target)
        return self.free_after(d, dims | _shard_dims(self.cur[d])) and not any(
            self.rebuilt[e] and self.involved[e] & dims for e in range(d)
        )

    def reduce_partials(self, ndim: int | None) -> None:
        """Pass 1: reduce pending partials early, while tensors are smallest."""
        src, dst = self.src, self.dst
        to_replicate = [d for d in range(self.n) if isinstance(src[d], Partial) and isinstance(dst[d], Replicate)]
        unused = [k for k in range(ndim or 0) if not any(k in dims for dims in self.involved)]
        scatter_at = to_replicate[-1] if len(to_replicate) >= 2 and unused else None
        for d in reversed(range(self.n)):
            if d == scatter_at:
                self.move(d, Shard(unused[0]))  # gathered back in the last pass
                continue
            reducible = isinstance(dst[d], Replicate) or (isinstance(dst[d], Shard) and self.safe_target(d, dst[d]))
            if self.rebuilt[d] and isinstance(self.cur[d], Partial) and reducible:
                self.move(d, dst[d])

    def unshard(self) -> None:
        """Pass 2, last mesh dim first: unshard what must change (``S -> S`` when nothing later is disturbed)."""
        for d in reversed(range(self.n)):
            if self.rebuilt[d] and isinstance(self.src[d], Shard):  # partial dims reduced above are final
                target = self.dst[d]
                # S -> P pads locally with the reduction's identity; with another partial dim (now or in
                # the target) that identity would be reduced too (and overflow, for integers): gather.
                partial_dims = sum(isinstance(p, Partial) for p in (*self.cur, *self.dst))
                lone_partial = isinstance(target, Partial) and partial_dims == 1
                if lone_partial or (isinstance(target, Shard) and target != self.cur[d] and self.safe_target(d, target)):
                    self.move(d, target)
                else:
                    self.move(d, REPLICATE)

    def shard_into_target(self) -> None:
        """Pass 3, first mesh dim first: shard and partition into the target, finishing any reduction left."""
        for d in range(self.n):
            if self.cur[d] == self.dst[d]:
                continue
            if isinstance(self.cur[d], Partial) and isinstance(self.dst[d], Partial):
                self.move(d, REPLICATE)
            self.move(d, self.dst[d])


def strided_route(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], ndim: int | None = None
) -> tuple[TransformStep, ...]:
    """The plan when ``src`` or ``dst`` holds a ``_StridedShard``, in three parts:

    1. from the last mesh dim to the first, gather the mesh dims ``unstrided_placements(src)``
       replicates (each all_gather runs while no later mesh dim still cuts its tensor dim);
    2. the plain plan between those plain placements and ``unstrided_placements(dst)``;
    3. from the first mesh dim to the last, cut the target's strided (and nested) dims locally.
    """
    gathered, cut = unstrided_placements(src), unstrided_placements(dst)
    steps = [TransformStep(d, src[d], gathered[d]) for d in reversed(range(len(src))) if src[d] != gathered[d]]
    steps += plan_redistribute(gathered, cut, ndim)
    steps += [TransformStep(d, cut[d], dst[d]) for d in range(len(dst)) if cut[d] != dst[d]]
    return tuple(steps)


RELABEL_COST = 1e-9
"""The cost of changing the placement of a mesh dim of one rank: no data moves, but keeping the
placement still wins a tie, so layouts stay put (a parameter's, and its gradient's after it)."""


def redistribute_cost(src: Placement, dst: Placement, local_bytes: int, group_size: int) -> float:
    """Bytes a rank receives to move a tensor of ``local_bytes`` from ``src`` to ``dst`` on one mesh dim.

    Local steps cost a token amount (a copy) so that "do nothing" always wins a tie.
    """
    if src == dst:
        return 0.0
    if group_size == 1:
        return RELABEL_COST
    n = group_size
    if isinstance(src, _StridedShard):  # gathered, then cut again locally if the target is sharded
        return float((n - 1) * local_bytes)
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return (n - 1) / n * local_bytes
        return float((n - 1) * local_bytes) + (1e-3 * local_bytes if isinstance(dst, Partial) else 0.0)
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            return (n - 1) / n * local_bytes
        return 2 * (n - 1) / n * local_bytes + (1e-3 * local_bytes if isinstance(dst, Partial) else 0.0)
    return 1e-3 * local_bytes


def moves_data(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """True when going from ``src`` to ``dst`` changes some rank's local tensor.

    Only a placement change on a mesh dim of more than one rank does; on one rank it is a relabel.
    """
    return any(s != d and size > 1 for s, d, size in zip(src, dst, mesh_shape))
