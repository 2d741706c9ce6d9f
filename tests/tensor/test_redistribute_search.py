"""The redistribute planner's search: every plan keeps the values, moves the fewest bytes, and is cached.

Each test lays a known tensor out as one set of placements, redistributes it, and checks the
result (``full_tensor()`` equals the original) and, where the minimum is known, the bytes the rank
that moves the most receives (ring accounting, as CommDebugMode reports it).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from spmd.tensor import Partial, Placement, Replicate, Shard, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.redistribute.plan import plan_for_shape, plan_redistribute
from spmd.tensor.redistribute.search import plan_bytes
from spmd.testing import run_threaded
from spmd.testing.layouts import make_dtensor

R, S0, S1, P, PMAX = Replicate(), Shard(0), Shard(1), Partial(), Partial("max")
OPTIONS = (R, S0, S1, P, PMAX)


def _pairs(mesh_ndim: int, sample: int | None, seed: int = 0) -> list[tuple[tuple[Placement, ...], ...]]:
    """Every (src, dst) over ``OPTIONS`` per mesh dim, or ``sample`` of them drawn with a fixed seed."""
    layouts = list(itertools.product(OPTIONS, repeat=mesh_ndim))
    pairs = [(s, t) for s in layouts for t in layouts if s != t]
    return pairs if sample is None else random.Random(seed).sample(pairs, sample)


def _redistribute_all(mesh_shape: tuple[int, ...], pairs: list, shapes: list[tuple[int, ...]]) -> list[str]:
    """On this rank: each pair on each shape; the transitions whose result differs from the source."""
    mesh = init_device_mesh("cpu", mesh_shape)
    wrong = []
    for shape in shapes:
        full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 3 - 11
        for src, dst in pairs:
            y = make_dtensor(full, mesh, src).redistribute(mesh, dst)
            if y.placements != dst or not torch.equal(y.full_tensor(), full):
                wrong.append(f"{src} -> {dst} on {mesh_shape} for {list(shape)}")
    return wrong


@pytest.mark.parametrize(
    ("mesh_shape", "sample", "shapes"),
    [
        ((4,), None, [(8, 12), (7, 5)]),
        ((2, 2), None, [(8, 12), (7, 5)]),
        ((2, 2, 2), 150, [(8, 12), (7, 5)]),
        ((2, 2, 2, 2), 40, [(16, 12), (13, 7)]),
    ],
    ids=["1d", "2d", "3d", "4d"],
)
def test_every_plan_gives_back_the_source_values(mesh_shape, sample, shapes) -> None:
    pairs = _pairs(len(mesh_shape), sample)
    wrong = run_threaded(_redistribute_all, math.prod(mesh_shape), mesh_shape, pairs, shapes)
    assert wrong[0] == []


@pytest.mark.slow
def test_every_3d_plan_gives_back_the_source_values() -> None:
    pairs = _pairs(3, None)
    assert run_threaded(_redistribute_all, 8, (2, 2, 2), pairs, [(8, 12), (7, 5)])[0] == []


def _received(mesh_shape: tuple[int, ...], src, dst, shape: tuple[int, ...]) -> int:
    """On this rank: the bytes it receives redistributing a float32 ``shape`` tensor, values checked."""
    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    x = make_dtensor(full, mesh, src)
    with CommDebugMode() as comm:
        y = x.redistribute(mesh, dst)
    assert torch.equal(y.full_tensor(), full)
    return comm.get_total_bytes()


B = 256 * 192 * 4  # the whole tensor's bytes: above the size where plans count collectives first
MINIMUM_CASES = [
    # (mesh, src, dst, the bound: bytes the busiest rank must receive), as benchmarks/redistribute.py lists them
    ((4,), (S0,), (S1,), 3 / 4 * B / 4),  # keep your quarter of the new shard, receive the rest
    ((2, 2), (P, S0), (R, R), B),  # all_reduce the half, then all_gather it
    ((2, 2), (P, P), (R, R), 2 * 3 / 4 * B),  # all_reduce's bound over 4 ranks
    ((2, 2, 2), (P, P, P), (R, R, R), 2 * 7 / 8 * B),
    ((2, 2, 2), (S0, S1, R), (R, R, R), 3 / 4 * B),
    ((2, 2, 2, 2), (S0, S0, S0, S0), (R, R, R, R), 15 / 16 * B),
    ((2, 2, 2, 2), (P, P, P, P), (R, R, R, R), 2 * 15 / 16 * B),
]


@pytest.mark.parametrize(("mesh_shape", "src", "dst", "least"), MINIMUM_CASES)
def test_plans_move_the_fewest_bytes(mesh_shape, src, dst, least) -> None:
    shape = (256, 192)
    received = run_threaded(_received, math.prod(mesh_shape), mesh_shape, src, dst, shape)
    assert max(received) == least
    assert plan_bytes(plan_for_shape(src, dst, mesh_shape, shape), src, mesh_shape, shape, itemsize=4) == least


def test_several_partials_reduce_through_a_scatter_over_a_free_dim() -> None:
    plan = plan_for_shape((P, P, P), (R, R, R), (2, 2, 2), (256, 192))
    assert "\n".join(str(step) for step in plan) == (
        "mesh dim 0: P(sum) -> S(0)  reduce_scatter(sum, dim=0)\n"
        "mesh dim 1: P(sum) -> S(0)  reduce_scatter(sum, dim=0)\n"
        "mesh dim 2: P(sum) -> R  all_reduce(sum)\n"
        "mesh dim 1: S(0) -> R  all_gather(dim=0)\n"
        "mesh dim 0: S(0) -> R  all_gather(dim=0)"
    )


def test_a_nested_shard_is_re_cut_with_all_to_all_when_that_moves_less() -> None:
    # Mesh dim 0 may unshard dim 0 only once mesh dim 1 lets go of it: moving mesh dim 1 to S(1)
    # (an all_to_all) costs less than gathering it and chunking again.
    big = plan_for_shape((S0, S0), (R, S0), (2, 2), (256, 192))
    assert [(s.mesh_dim, s.collective) for s in big] == [(1, "all_to_all"), (0, "all_gather"), (1, "all_to_all")]
    assert plan_bytes(big, (S0, S0), (2, 2), (256, 192)) == 256 * 192 * (1 / 8 + 1 / 4 + 1 / 4)
    small = plan_for_shape((S0, S0), (R, S0), (2, 2), (8, 6), fewest_collectives_first=True)
    assert [(s.mesh_dim, s.collective) for s in small] == [(1, "all_gather"), (0, "all_gather"), (1, "local")]


def test_plans_are_cached_per_placements_mesh_and_shape() -> None:
    first = plan_for_shape((S0, S1, P), (S1, R, S0), (2, 2, 2), (64, 48))
    assert plan_for_shape((S0, S1, P), (S1, R, S0), (2, 2, 2), (64, 48)) is first
    assert plan_redistribute((S0, P), (R, S1)) is plan_redistribute((S0, P), (R, S1))


def test_one_rank_mesh_dims_change_by_relabel() -> None:
    assert plan_for_shape((S0, P), (R, P), (1, 4), (8, 8)) == ()
    assert plan_for_shape((S0, P), (R, R), (1, 4), (8, 8)) == plan_for_shape((R, P), (R, R), (1, 4), (8, 8))


def test_a_lone_partial_is_padded_into_but_not_beside_another() -> None:
    lone = plan_for_shape((S0, R), (P, R), (2, 2), (8, 8))
    assert [(s.mesh_dim, s.collective) for s in lone] == [(0, "local")]
    beside = plan_for_shape((S0, P), (P, P), (2, 2), (8, 8))
    assert [s.collective for s in beside] == ["all_gather", "local"]  # gather, then partition
