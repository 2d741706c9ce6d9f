"""The c10d backend end to end: redistribute on real gloo process groups, one process per rank.

Every other test runs ranks as threads; this module spawns processes that talk over loopback TCP
through ``torch.distributed`` (gloo), so the c10d communicators, their sub-groups and gloo's missing
reduce_scatter are exercised. A failing rank fails the test with that rank's traceback, and the
whole run is bounded by a timeout, so a broken collective cannot hang the suite.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spmd.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from spmd.tensor.debug import CommDebugMode
from spmd.testing import run_subtests
from spmd.testing.multiprocess import RankFailed, run_multiprocess

pytestmark = pytest.mark.multiprocess

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial("sum")


# ----- what each rank runs -------------------------------------------------------------------------
def _expected_local(full: torch.Tensor, mesh: Any, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's shard of ``full``, cut the way torch.chunk cuts (mesh dim 0 first)."""
    local = full
    for d, p in enumerate(placements):
        if isinstance(p, Shard):
            local = torch.chunk(local, mesh.size(d), p.dim)[mesh.get_local_rank(d)]
    return local


def _source(
    parts: torch.Tensor, mesh: Any, src: Sequence[Placement]
) -> tuple[DTensor, torch.Tensor, torch.Tensor]:
    """A DTensor laid out as ``src``, the plain tensor it stands for, and the leaf its gradient lands on.

    With sum-Partial mesh dims, the rank at coordinates ``c`` on those dims holds addend ``parts[c]``
    (flattened), and the tensor is the sum of the addends; otherwise it is ``parts[0]``.
    """
    partial_dims = [d for d, p in enumerate(src) if isinstance(p, Partial)]
    if not partial_dims:
        x = distribute_tensor(parts[0], mesh, src)
        x.requires_grad_()
        return x, parts[0], x
    coordinate = mesh.get_coordinate()
    index = 0
    for d in partial_dims:
        index = index * mesh.size(d) + coordinate[d]
    full = parts[: math.prod(mesh.size(d) for d in partial_dims)].sum(0)
    addend = parts[index].clone().requires_grad_()
    return DTensor.from_local(addend, mesh, src, shape=full.shape, run_check=False), full, addend


def check_redistribute(
    mesh: Any, shape: tuple[int, ...], transition: tuple[list[Placement], list[Placement], dict[str, int]]
) -> None:
    """``src -> dst`` keeps the values, cuts shards like torch.chunk, issues the expected collectives
    and sends the gradient back to the source layout."""
    src, dst, expected_counts = transition
    torch.manual_seed(0)
    parts = torch.randn(mesh.size(), *shape)
    x, full, leaf = _source(parts, mesh, src)

    with CommDebugMode() as comm_mode:
        y = x.redistribute(mesh, dst)
    # Children are not under pytest's assertion rewriting, so messages say what differed.
    counts = comm_mode.get_comm_counts()
    assert counts == expected_counts, f"collectives {counts}, expected {expected_counts}"
    assert y.placements == tuple(dst), f"placements {y.placements}, expected {tuple(dst)}"
    torch.testing.assert_close(y.to_local(), _expected_local(full, mesh, dst))
    torch.testing.assert_close(y.full_tensor(), full)

    weight = torch.arange(full.numel(), dtype=full.dtype).reshape(shape)
    (y.full_tensor() * weight).sum().backward()
    grad = leaf.grad
    assert grad is not None, "no gradient reached the source"
    if isinstance(grad, DTensor):
        assert grad.placements == tuple(src), f"gradient placements {grad.placements}, expected {tuple(src)}"
        grad = grad.full_tensor()
    # Each addend of a Partial sum gets the whole gradient; a laid-out tensor gets it laid out.
    torch.testing.assert_close(grad, weight)


TRANSITIONS_1D = [
    ([S0], [R], {"all_gather": 1}),
    ([R], [S1], {}),
    ([P], [R], {"all_reduce": 1}),
    ([P], [S0], {"reduce_scatter": 1}),
    ([S0], [S1], {"all_to_all": 1}),
    ([S1], [S0], {"all_to_all": 1}),
]

TRANSITIONS_2D = [
    ([S0, R], [R, S1], {"all_gather": 1}),
    ([S0, S1], [R, R], {"all_gather": 2}),
    ([S0, S0], [R, R], {"all_gather": 2}),
    ([S0, S0], [S1, R], {"all_gather": 1, "all_to_all": 1}),
    ([R, S0], [S0, S1], {"all_to_all": 1}),
    ([P, R], [R, S0], {"all_reduce": 1}),
    ([P, P], [S0, R], {"reduce_scatter": 1, "all_reduce": 1}),
]


def redistribute_on_1d_mesh() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    assert isinstance(mesh.get_group(), dist.ProcessGroup)  # really c10d, not the threaded world
    run_subtests({"shape": [(8, 6), (7, 5)], "transition": TRANSITIONS_1D}, check_redistribute, mesh)


def redistribute_on_2d_mesh() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    run_subtests({"shape": [(8, 6), (7, 5)], "transition": TRANSITIONS_2D}, check_redistribute, mesh)


def fail_on_rank_1_midway() -> None:
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.ones(4, 4), mesh, [S0])
    x.redistribute(mesh, [R])
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    # Rank 0 now waits in a collective that rank 1 never joins.
    x.redistribute(mesh, [S1]).redistribute(mesh, [R])


# ----- tests ---------------------------------------------------------------------------------------
def test_redistribute_on_gloo_1d_mesh() -> None:
    run_multiprocess(redistribute_on_1d_mesh, 2)


def test_redistribute_on_gloo_2d_mesh() -> None:
    run_multiprocess(redistribute_on_2d_mesh, 4)


def test_failing_rank_fails_the_run_promptly() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 fails on purpose"):
        run_multiprocess(fail_on_rank_1_midway, 2, timeout=120.0)
    # Far below both the run timeout and the gloo collective timeout: the failure was noticed, not waited out.
    assert time.monotonic() - start < 30.0
