"""The in-process world: results in rank order, failures surface promptly, nothing hangs."""

from __future__ import annotations

import time

import pytest
import torch

from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.testing import CollectiveTimeoutError, run_threaded


def test_results_come_back_in_rank_order() -> None:
    def rank_and_sum() -> tuple[int, float]:
        mesh = init_device_mesh("cpu", (4,))
        total = mesh.get_communicator(0).all_reduce(torch.tensor([float(mesh.get_rank())]), "sum")
        return mesh.get_rank(), total.item()

    assert run_threaded(rank_and_sum, 4) == [(r, 6.0) for r in range(4)]


def test_args_and_kwargs_reach_every_rank() -> None:
    def scaled(x: int, *, factor: int) -> int:
        return x * factor

    assert run_threaded(scaled, 3, 2, factor=5) == [10, 10, 10]


def test_a_rank_that_raises_is_reported_with_its_rank() -> None:
    def fail_on_rank_two() -> None:
        mesh = init_device_mesh("cpu", (4,))
        if mesh.get_rank() == 2:
            raise ValueError("bad input on this rank")
        # the others block in a collective that rank 2 never joins
        mesh.get_communicator(0).all_reduce(torch.ones(1), "sum")

    start = time.monotonic()
    with pytest.raises(ValueError, match="bad input on this rank") as info:
        run_threaded(fail_on_rank_two, 4, timeout=30)
    assert time.monotonic() - start < 10, "the other ranks must be released at once, not at the timeout"
    assert "raised on rank 2" in "".join(getattr(info.value, "__notes__", []))


def test_a_rank_that_fails_mid_redistribute_releases_the_others() -> None:
    def fail_during_gather() -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(1)])
        if mesh.get_rank() == 3:
            raise RuntimeError("rank 3 lost its device")
        x.redistribute(mesh, [Replicate(), Replicate()])

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 3 lost its device"):
        run_threaded(fail_during_gather, 4, timeout=30)
    assert time.monotonic() - start < 10


def test_a_missing_collective_times_out_instead_of_hanging() -> None:
    def skip_on_rank_zero() -> None:
        mesh = init_device_mesh("cpu", (2,))
        if mesh.get_rank() == 1:
            mesh.get_communicator(0).all_gather(torch.ones(2))

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"waiting for ranks \[0\]"):
        run_threaded(skip_on_rank_zero, 2, timeout=0.5)
    assert time.monotonic() - start < 5


def test_mismatched_collectives_are_named() -> None:
    def mismatched() -> None:
        mesh = init_device_mesh("cpu", (2,))
        comm = mesh.get_communicator(0)
        if mesh.get_rank() == 0:
            comm.all_gather(torch.ones(2))
        else:
            time.sleep(0.05)
            comm.all_reduce(torch.ones(2), "sum")

    with pytest.raises(
        RuntimeError, match=r"disagree on a collective.*\n.*all_gather.*mismatched\n.*all_reduce\(sum\)"
    ):
        run_threaded(mismatched, 2, timeout=5)


def test_collectives_do_not_alias_between_ranks() -> None:
    def mutate_after_broadcast() -> float:
        mesh = init_device_mesh("cpu", (2,))
        received = mesh.get_communicator(0).broadcast(torch.zeros(3), 0)
        if mesh.get_rank() == 0:
            received.add_(1)
        mesh.get_communicator(0).all_gather(torch.zeros(1))  # a barrier
        return received.sum().item()

    assert run_threaded(mutate_after_broadcast, 2) == [3.0, 0.0]


def test_outside_a_world_the_error_says_how_to_start_one() -> None:
    with pytest.raises(RuntimeError, match=r"torchrun.*run_threaded"):
        init_device_mesh("cpu", (2,))


def test_a_fast_rank_overwriting_its_input_does_not_change_what_others_receive() -> None:
    def reduce_then_overwrite() -> float:
        mesh = init_device_mesh("cpu", (4,))
        mine = torch.full((1000,), float(mesh.get_rank()))
        total = mesh.get_communicator(0).all_reduce(mine, "sum")
        mine.fill_(100.0)  # rank 0 may get here before rank 3 has read its input
        if mesh.get_rank() == 3:
            time.sleep(0.01)
        return total.sum().item()

    for _ in range(5):
        assert run_threaded(reduce_then_overwrite, 4) == [6000.0] * 4


def test_backward_runs_on_the_rank_threads_while_a_world_runs() -> None:
    # CUDA backward would otherwise move to autograd's device thread, which is no rank of the world
    assert torch.autograd.is_multithreading_enabled()
    inside = run_threaded(torch.autograd.is_multithreading_enabled, 2)
    assert inside == [False, False]
    assert torch.autograd.is_multithreading_enabled()  # restored when the world ends
