"""The collectives as spmd:: torch.library ops: the same values as the communicator's methods, fake
kernels that only give shapes, and traffic records when they run (eager or compiled)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from spmd.comm import add_comm_observer, remove_comm_observer
from spmd.comm.handles import communicator_for
from spmd.tensor import init_device_mesh
from spmd.testing import run_threaded


def test_each_op_gives_what_the_communicator_method_gives() -> None:
    def rank():
        mesh = init_device_mesh("cpu", (2,))
        comm, me = mesh.get_communicator(0), mesh.get_rank()
        t = torch.arange(6.0).reshape(2, 3) + 10 * me
        stacked = torch.stack([t, -t])
        group = comm.group_handle()
        ops = torch.ops.spmd
        return [
            (ops.all_gather(t, group, 2), comm.all_gather(t)),
            (ops.all_reduce(t, group, "sum"), comm.all_reduce(t, "sum")),
            (ops.reduce_scatter(stacked, group, "max"), comm.reduce_scatter(stacked, "max")),
            (ops.all_to_all(stacked, group), comm.all_to_all(stacked)),
            (ops.broadcast(t, group, 1), comm.broadcast(t, 1)),
            (ops.scatter(stacked, group, 0), comm.scatter(stacked, 0)),
        ]

    for pairs in run_threaded(rank, 2):
        for from_op, from_method in pairs:
            torch.testing.assert_close(from_op, from_method)
    rank_1 = run_threaded(rank, 2)[1]
    torch.testing.assert_close(rank_1[0][0][0], torch.arange(6.0).reshape(2, 3))  # all_gather: rank 0's block


def test_fake_kernels_give_shapes_without_talking_to_other_ranks() -> None:
    """One rank of a 4-rank group traces alone: a real collective would wait for the others."""

    def rank():
        mesh = init_device_mesh("cpu", (4,))
        group = mesh.get_communicator(0).group_handle()
        if mesh.get_rank() != 0:
            return None
        with FakeTensorMode() as fake:
            t = fake.from_tensor(torch.empty(2, 3))
            stacked = fake.from_tensor(torch.empty(4, 2, 3))
            ops = torch.ops.spmd
            return [
                tuple(out.shape)
                for out in (
                    ops.all_gather(t, group, 4),
                    ops.all_reduce(t, group, "sum"),
                    ops.reduce_scatter(stacked, group, "sum"),
                    ops.all_to_all(stacked, group),
                    ops.broadcast(t, group, 0),
                    ops.scatter(stacked, group, 0),
                )
            ]

    assert run_threaded(rank, 4)[0] == [(4, 2, 3), (2, 3), (2, 3), (4, 2, 3), (2, 3), (2, 3)]


def test_an_op_records_its_traffic_once() -> None:
    def rank():
        records = []
        add_comm_observer(records.append)
        try:
            mesh = init_device_mesh("cpu", (2,))
            mesh.get_communicator(0).all_reduce(torch.ones(4), "sum")
        finally:
            remove_comm_observer(records.append)
        return [(r.kind, r.tensor_bytes) for r in records if r.rank == mesh.get_rank()]

    assert run_threaded(rank, 2) == [[("all_reduce", 16)], [("all_reduce", 16)]]


def test_a_handle_of_a_finished_world_is_refused_with_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no longer exists"):
        communicator_for(-1)
