"""Redistribute, the plan half: the steps from one set of placements to another, and what a move costs.

**The search.** A plan is a shortest path, found by a uniform-cost search (search.py):

* a *state* is a layout, one placement per mesh dim: Replicate, a Shard of a tensor dim, or a
  Partial that the source holds or the target wants there;
* an *edge* is one step on one mesh dim that the executor runs: ``S -> R`` all_gather,
  ``S(i) -> S(j)`` all_to_all, ``P -> R`` all_reduce, ``P -> S`` reduce_scatter, and the local ones,
  ``R -> S`` (a chunk), ``R -> P`` (partition the value) and ``S -> P`` (pad with the reduction's
  identity, only when that partial is the lone one, now and in the target, so no other reduction
  sees the identity). A partial is entered only as the target's placement on that dim, and left
  by a reduction;
* *legality*: a tensor dim that several mesh dims shard is cut by the lower mesh dim first, so a
  step on mesh dim ``d`` that touches tensor dim ``k`` (shards it, unshards it, or re-cuts it) is a
  plain collective over d's group only while no mesh dim after ``d`` shards ``k``; other edges
  do not exist;
* the *cost* of an edge is the bytes the rank that moves the most receives (the ring model of
  cost.py on the buffer the executor hands the collective, uneven pieces padded to the longest),
  computed from the local piece at that state: the global shape cut by the state's shards. Ties
  go to fewer collectives, then fewer steps. Tensors under ``SCATTERED_REDUCTION_MIN_BYTES`` pay
  latency more than bandwidth, so for them collectives come first and bytes break the tie.

Because every edge cost is non-negative and the search expands states cheapest first, the plan it
returns is the cheapest sequence of legal steps: no plan built from the executor's collectives moves
fewer bytes. It finds what greedy passes miss: reducing while the piece is small, re-cutting with one
all_to_all instead of a gather and a chunk, and reducing several partial dims through a
reduce_scatter over a tensor dim neither side uses (then an all_gather). Where a lower bound on the
bytes is still lower (benchmarks/redistribute.py prints why, per transition), reaching it needs a
layout the legality rule excludes (a mesh dim gathering a tensor dim that a later mesh dim still
cuts: a strided layout), not a better order of these steps.

States hold at most ``MAX_FREE_DIMS`` unused tensor dims (the longest) besides the ones the source
and target shard, so a 4-d mesh searches a few thousand states at most. Plans are cached per
``(src, dst, mesh shape, tensor shape)`` (``plan_for_shape``); ``plan_redistribute`` plans without
sizes (a large even tensor) for callers that know only placements. A 1-d mesh takes its one direct
step without a search.

A ``_StridedShard`` mesh dim is never part of the search: the plan first gathers it (and every
later mesh dim cutting the same tensor dim, inner first: all_gather, then a local reorder), plans
the plain placements left, then cuts the target's strided dims locally (``strided_route``). So a
change between ``_StridedShard`` and ``Shard`` goes through ``Replicate`` on that tensor dim.

A mesh dim of one rank moves no data: that rank holds the whole dim whatever the placement (S(d),
R and P are the same local tensor), so a change there is a relabel, never a step of a plan.

When the mesh has flattened dims (``mesh["dp", "cp"]._flatten()``), steps in a row that run the same
collective on the mesh dims of one flattened dim run it once over the flattened group
(``FlattenedStep``, steps.py): one all_reduce instead of two. A rank outside the mesh holds an
empty piece, and nothing moves through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard
from spmd.tensor.redistribute.cost import collective_bytes
from spmd.tensor.redistribute.search import cheapest_steps, plan_bytes
from spmd.tensor.redistribute.steps import FlattenedStep, TransformStep, collective_count, merge_flattened_steps
from spmd.tensor.spec import DTensorSpec, has_strided, unstrided_placements

__all__ = [
    "TransformStep",
    "FlattenedStep",
    "merge_flattened_steps",
    "plan_redistribute",
    "plan_for_shape",
    "plan_for_spec",
    "steps_for_spec",
    "strided_route",
    "redistribute_cost",
    "moves_data",
]
REPLICATE = Replicate()
SCATTERED_REDUCTION_MIN_BYTES = 64 * 1024
"""Below this many bytes a plan issues the fewest collectives first (latency outweighs bandwidth)."""
MAX_FREE_DIMS = 2
"""How many tensor dims that neither side shards the search may shard on the way (the longest)."""
ASSUMED_DIM_SIZE = 4096
"""``plan_redistribute``'s tensor dims when it has no sizes: large and even on any mesh."""
ASSUMED_MESH_DIM_SIZE = 4
"""``plan_redistribute``'s mesh dims when it has no sizes."""


@functools.lru_cache(maxsize=4096)
def plan_redistribute(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], ndim: int | None = None
) -> tuple[TransformStep, ...]:
    """The ordered steps that turn placements ``src`` into ``dst``, without the tensor's sizes.

    Plans as for a large, evenly divisible tensor on a mesh of 4 ranks a dim (the legality rule
    does not depend on sizes, so the plan runs on any mesh). With the tensor's ``ndim`` known, the
    steps may also shard a tensor dim that neither side uses (a reduce_scatter before several
    reductions). ``plan_for_shape`` is the plan the executor runs.
    """
    _check_lengths(src, dst)
    used = [p.dim for p in (*src, *dst) if isinstance(p, (Shard, _StridedShard))]
    rank = max([ndim or 0, *(k + 1 for k in used)])
    shape = (ASSUMED_DIM_SIZE,) * rank
    return plan_for_shape(src, dst, (ASSUMED_MESH_DIM_SIZE,) * len(src), shape, free_dims=ndim is not None)


@functools.lru_cache(maxsize=4096)
def plan_for_shape(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...],
    *,
    fewest_collectives_first: bool = False,
    free_dims: bool = True,
) -> tuple[TransformStep, ...]:
    """The steps that turn a ``shape`` tensor on a ``mesh_shape`` mesh from ``src`` into ``dst``
    moving the fewest bytes (see the module docstring); the same tuple on every call with equal arguments.

    ``fewest_collectives_first`` orders plans by collectives, then bytes (for small tensors);
    ``free_dims`` lets the steps shard tensor dims neither side uses. A one-rank mesh dim changes
    by a relabel, outside any plan.
    """
    _check_lengths(src, dst)
    src = tuple(t if n == 1 else s for s, t, n in zip(src, dst, mesh_shape))
    if src == dst:
        return ()
    if has_strided(src) or has_strided(dst):
        return strided_route(
            src, dst, functools.partial(_plain_plan, mesh_shape=mesh_shape, shape=shape, free_dims=free_dims)
        )
    return _plain_plan(src, dst, mesh_shape=mesh_shape, shape=shape, free_dims=free_dims,
                       fewest_collectives_first=fewest_collectives_first)  # fmt: skip


def _plain_plan(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    *,
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...],
    free_dims: bool,
    fewest_collectives_first: bool = False,
) -> tuple[TransformStep, ...]:
    """The searched plan between plain placements; a 1-d mesh takes its one direct step."""
    if src == dst:
        return ()
    if len(src) == 1 and not (isinstance(src[0], Partial) and isinstance(dst[0], Partial)):
        return (TransformStep(0, src[0], dst[0]),)
    used = {p.dim for p in (*src, *dst) if isinstance(p, Shard)}
    free = sorted((k for k in range(len(shape)) if k not in used), key=lambda k: -shape[k])
    shard_dims = tuple(sorted([*used, *(free[:MAX_FREE_DIMS] if free_dims else [])]))
    return cheapest_steps(src, dst, mesh_shape, shape, shard_dims, fewest_collectives_first)


def steps_for_spec(spec: DTensorSpec, dst: tuple[Placement, ...]) -> tuple[TransformStep, ...]:
    """``plan_for_shape`` for ``spec``'s tensor and mesh, before any merge over flattened dims
    (collectives first below ``SCATTERED_REDUCTION_MIN_BYTES``)."""
    small = spec.tensor_meta.nbytes < SCATTERED_REDUCTION_MIN_BYTES
    return plan_for_shape(
        spec.placements, dst, tuple(spec.mesh.shape), tuple(spec.shape), fewest_collectives_first=small
    )


def plan_for_spec(spec: DTensorSpec, dst: tuple[Placement, ...]) -> tuple[TransformStep | FlattenedStep, ...]:
    """The steps the executor runs to lay ``spec``'s tensor out as ``dst`` (empty when nothing moves).

    Small tensors pay latency more than bytes: below ``SCATTERED_REDUCTION_MIN_BYTES`` the plan
    with the fewest collectives wins. Where the mesh has flattened dims, runs of one collective
    merge into one step over the flattened group; then of the bytes-first and collectives-first
    plans, merged, the one that moves fewer bytes (or, small, issues fewer collectives) runs.
    """
    mesh_shape, shape = tuple(spec.mesh.shape), tuple(spec.shape)
    small = spec.tensor_meta.nbytes < SCATTERED_REDUCTION_MIN_BYTES
    steps = steps_for_spec(spec, dst)
    if len(steps) < 2 or not spec.mesh._get_root_mesh()._flattened_dims():
        return steps
    src = tuple(t if n == 1 else s for s, t, n in zip(spec.placements, dst, mesh_shape))
    plans: list[list[TransformStep | FlattenedStep]] = [merge_flattened_steps(steps, spec, src)]
    if not (has_strided(src) or has_strided(dst)):
        other = plan_for_shape(spec.placements, dst, mesh_shape, shape, fewest_collectives_first=not small)
        plans.append(merge_flattened_steps(other, spec, src))

    def order(plan: list[TransformStep | FlattenedStep]) -> tuple[float, float]:
        moved, collectives = round(plan_bytes(plan, src, mesh_shape, shape), 3), collective_count(plan)
        return (collectives, moved) if small else (moved, collectives)

    best = min(plans, key=order)
    return tuple(best)


def _check_lengths(src: Sequence[Placement], dst: Sequence[Placement]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"cannot redistribute {len(src)} placements into {len(dst)}; give one per mesh dim")


def strided_route(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    plain_plan: Callable[[tuple[Placement, ...], tuple[Placement, ...]], tuple[TransformStep, ...]],
) -> tuple[TransformStep, ...]:
    """The plan when ``src`` or ``dst`` holds a ``_StridedShard``, in three parts:

    1. from the last mesh dim to the first, gather the mesh dims ``unstrided_placements(src)``
       replicates (each all_gather runs while no later mesh dim still cuts its tensor dim);
    2. ``plain_plan`` between those plain placements and ``unstrided_placements(dst)``;
    3. from the first mesh dim to the last, cut the target's strided (and nested) dims locally.
    """
    gathered, cut = unstrided_placements(src), unstrided_placements(dst)
    steps = [TransformStep(d, src[d], gathered[d]) for d in reversed(range(len(src))) if src[d] != gathered[d]]
    steps += plain_plan(gathered, cut)
    steps += [TransformStep(d, cut[d], dst[d]) for d in range(len(dst)) if cut[d] != dst[d]]
    return tuple(steps)


RELABEL_COST = 1e-9
"""The cost of changing the placement of a mesh dim of one rank: no data moves, but keeping the
placement still wins a tie, so layouts stay put (a parameter's, and its gradient's after it)."""


def redistribute_cost(src: Placement, dst: Placement, local_bytes: int, group_size: int) -> float:
    """Bytes a rank receives to move a tensor of ``local_bytes`` from ``src`` to ``dst`` on one mesh dim.

    The ring model (cost.py) on the collective the step issues; local steps cost a token amount
    (a copy) so that "do nothing" always wins a tie.
    """
    if src == dst:
        return 0.0
    if group_size == 1:
        return RELABEL_COST
    n = group_size
    token = 1e-3 * local_bytes if isinstance(dst, Partial) else 0.0
    if isinstance(src, _StridedShard):  # gathered, then cut again locally if the target is sharded
        return collective_bytes("all_gather", n, n * local_bytes)
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return collective_bytes("all_to_all", n, local_bytes)
        return collective_bytes("all_gather", n, n * local_bytes) + token
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            return collective_bytes("reduce_scatter", n, local_bytes)
        return collective_bytes("all_reduce", n, local_bytes) + token
    return 1e-3 * local_bytes


def moves_data(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """True when going from ``src`` to ``dst`` changes some rank's local tensor.

    Only a placement change on a mesh dim of more than one rank does; on one rank it is a relabel.
    """
    return any(s != d and size > 1 for s, d, size in zip(src, dst, mesh_shape))
