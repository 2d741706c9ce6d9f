"""Redistribute, the search: the cheapest steps between two sets of plain placements.

A uniform-cost search (Dijkstra) over layouts; plan.py's docstring says what the states, edges,
costs and legality rule are. Everything here reads shapes and placements only, never a tensor, so
every rank finds the same plan.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterator, Sequence

from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard, chunk_length
from spmd.tensor.redistribute.cost import collective_bytes
from spmd.tensor.redistribute.steps import FlattenedStep, TransformStep

__all__ = ["cheapest_steps", "local_shape", "step_bytes", "plan_bytes"]

State = tuple[Placement, ...]
REPLICATE = Replicate()


def local_shape(state: Sequence[Placement], mesh_shape: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the largest local piece (coordinate 0's) of a ``shape`` tensor laid out as ``state``.

    Lower mesh dims cut first; every piece of coordinate 0 is the longest of its cut, so its
    collectives' buffers (padded to the longest piece) are the largest of any rank's.
    """
    sizes = list(shape)
    for p, n in zip(state, mesh_shape):
        if isinstance(p, Shard):
            sizes[p.dim] = chunk_length(sizes[p.dim], n)
        elif isinstance(p, _StridedShard):
            sizes[p.dim] = p.local_shard_size(sizes[p.dim], n, 0)
    return tuple(sizes)


def step_bytes(kind: str, dst: Placement, group_size: int, local: Sequence[int]) -> float:
    """Element-bytes one rank receives for one step of ``kind`` into ``dst`` on a ``local``-shaped piece.

    The buffer is what the executor hands the collective: the gathered pieces (each padded to the
    longest) for all_gather, the local piece for all_reduce, and for all_to_all and reduce_scatter
    the local piece cut into ``group_size`` blocks along ``dst``'s dim, each padded to the longest.
    """
    if kind == "local":
        return 0.0
    numel = math.prod(local)
    if kind == "all_gather":
        buffer = group_size * numel
    elif kind == "all_reduce":
        buffer = numel
    else:
        assert isinstance(dst, Shard)
        rest = math.prod(size for k, size in enumerate(local) if k != dst.dim)
        buffer = group_size * chunk_length(local[dst.dim], group_size) * rest
    return collective_bytes(kind, group_size, buffer)


def plan_bytes(
    steps: Sequence[TransformStep | FlattenedStep],
    src: Sequence[Placement],
    mesh_shape: Sequence[int],
    shape: Sequence[int],
    itemsize: int = 1,
) -> float:
    """Bytes the rank that moves the most receives when ``steps`` run from ``src`` on a ``shape`` tensor."""
    state = list(src)
    total = 0.0
    for step in steps:
        dims = step.mesh_dims if isinstance(step, FlattenedStep) else (step.mesh_dim,)
        group_size = math.prod(mesh_shape[d] for d in dims)
        total += step_bytes(step.collective, step.dst, group_size, local_shape(state, mesh_shape, shape))
        for d in dims:
            state[d] = step.dst
    return total * itemsize


def _options(src: Placement, dst: Placement, shard_dims: Sequence[int]) -> tuple[Placement, ...]:
    """What one mesh dim may hold on the way: Replicate, a shard of ``shard_dims``, or its own partials."""
    found = [REPLICATE, *(Shard(k) for k in shard_dims), src, dst]
    return tuple(dict.fromkeys(found))


def _legal_steps(state: State, dst: State, options: Sequence[tuple[Placement, ...]]) -> Iterator[TransformStep]:
    """Every step the executor can run from ``state`` (see plan.py's docstring for the rules)."""
    partials = sum(isinstance(p, Partial) for p in (*state, *dst))
    for d, here in enumerate(state):
        for there in options[d]:
            if there == here:
                continue
            # A partial is entered only as the target, from Replicate, or from a shard padded with the
            # reduction's identity when no other partial could reduce that identity too.
            if isinstance(there, Partial) and (
                there != dst[d] or isinstance(here, Partial) or (isinstance(here, Shard) and partials != 1)
            ):
                continue
            touched = {p.dim for p in (here, there) if isinstance(p, Shard)}
            if any(isinstance(p, Shard) and p.dim in touched for p in state[d + 1 :]):
                continue  # a later mesh dim cuts that tensor dim inside this one's pieces
            yield TransformStep(d, here, there)


def _priority(moved: float, collectives: int, steps: int, fewest_collectives_first: bool) -> tuple[float, ...]:
    # Rounded so that one cost reached through sums in another order still ties.
    moved = round(moved, 3)
    return (collectives, moved, steps) if fewest_collectives_first else (moved, collectives, steps)


@functools.lru_cache(maxsize=4096)
def cheapest_steps(
    src: State,
    dst: State,
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...],
    shard_dims: tuple[int, ...],
    fewest_collectives_first: bool = False,
) -> tuple[TransformStep, ...]:
    """The steps from plain placements ``src`` to ``dst`` of a ``shape`` tensor on a ``mesh_shape``
    mesh that move the fewest bytes, then issue the fewest collectives, then take the fewest steps
    (collectives first when ``fewest_collectives_first``: small tensors pay latency, not bytes).

    Intermediate layouts shard only ``shard_dims``. A mesh dim of one rank must already agree.
    """
    if any(n == 1 and s != t for s, t, n in zip(src, dst, mesh_shape)):
        raise ValueError(f"relabel the one-rank mesh dims of {src} -> {dst} on {mesh_shape} before searching")
    options = [_options(s, t, shard_dims) if n > 1 else (s,) for s, t, n in zip(src, dst, mesh_shape)]
    cost: dict[State, tuple[float, int, int]] = {src: (0.0, 0, 0)}
    came_from: dict[State, tuple[State, TransformStep]] = {}
    heap = [(_priority(0.0, 0, 0, fewest_collectives_first), 0, src)]
    pushed = 1
    while heap:
        priority, _, state = heapq.heappop(heap)
        if state == dst:
            return _path(came_from, src, dst)
        moved, collectives, steps = cost[state]
        if priority != _priority(moved, collectives, steps, fewest_collectives_first):
            continue  # a cheaper way here was found after this entry was pushed
        local = local_shape(state, mesh_shape, shape)
        for step in _legal_steps(state, dst, options):
            kind = step.collective
            reached = (
                moved + step_bytes(kind, step.dst, mesh_shape[step.mesh_dim], local),
                collectives + (kind != "local"),
                steps + 1,
            )
            nxt = (*state[: step.mesh_dim], step.dst, *state[step.mesh_dim + 1 :])
            new_priority = _priority(*reached, fewest_collectives_first)
            old = cost.get(nxt)
            if old is None or new_priority < _priority(*old, fewest_collectives_first):
                cost[nxt], came_from[nxt] = reached, (state, step)
                heapq.heappush(heap, (new_priority, pushed, nxt))
                pushed += 1
    raise AssertionError(f"no redistribute plan from {src} to {dst} on mesh {mesh_shape}")


def _path(came_from: dict[State, tuple[State, TransformStep]], src: State, dst: State) -> tuple[TransformStep, ...]:
    steps: list[TransformStep] = []
    state = dst
    while state != src:
        state, step = came_from[state]
        steps.append(step)
    return tuple(reversed(steps))
