"""CommDebugMode reads like torch's: it counts the collectives a program calls through torch itself,
its counts compare equal to dicts keyed by torch's ops, and one mode can be entered again and again."""

from __future__ import annotations

import unittest
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, with_comms
from spmd.testing import seeded_randn as seeded
from spmd.testing.multiprocess import run_multiprocess

native = torch.ops._c10d_functional
legacy = torch.ops.c10d_functional
c10d = torch.ops.c10d

# torch's newer spellings (all_gather_single ...) are missing from older releases; keep the old ones
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


class GatherScatterReduce(nn.Module):
    """torch's test model: a linear layer between functional collectives the module calls itself."""

    def __init__(self, group: Any, *, coalesced: bool = False) -> None:
        super().__init__()
        self.group = group
        self.coalesced = coalesced
        self.linear = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> Any:
        x = funcol.all_gather_tensor(x, 0, self.group)
        x = funcol.reduce_scatter_tensor(x, "sum", 0, self.group)
        out = self.linear(x)
        if self.coalesced:
            return funcol.all_reduce_coalesced([out], "sum", self.group)
        return funcol.all_reduce(out, "sum", self.group)


class TorchCollectivesTest(unittest.TestCase):
    """Collectives called through torch on a one-rank gloo group (real values, no peers needed)."""

    def setUp(self) -> None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.group = dist.group.WORLD

    def tearDown(self) -> None:
        dist.destroy_process_group()

    def test_functional_collectives_a_module_calls(self) -> None:
        model = GatherScatterReduce(self.group)
        with CommDebugMode() as comm:
            out = model(seeded(4, 10))
        self.assertEqual(comm.get_total_counts(), 3)
        counts = comm.get_comm_counts()
        for key in (native.all_gather_into_tensor, legacy.all_gather_into_tensor, funcol.all_gather_tensor):
            self.assertEqual(counts[key], 1, key)
        self.assertEqual(counts[legacy.reduce_scatter_tensor], 1)
        self.assertEqual(counts[legacy.all_reduce], 1)
        self.assertEqual(counts, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1})
        # one rank: every collective gives back its input
        torch.testing.assert_close(out, model.linear(seeded(4, 10)))
        # counted inside the module that called them, in the forward pass
        self.assertEqual(comm.comm_module_counts["GatherScatterReduce"]["forward"], counts)

    def test_coalesced_all_reduce(self) -> None:
        with CommDebugMode() as comm:
            outs = GatherScatterReduce(self.group, coalesced=True)(seeded(4, 10))
        self.assertEqual(len(outs), 1)
        funcol.wait_tensor(outs[0])
        self.assertEqual(comm.get_total_counts(), 3)
        self.assertEqual(comm.get_comm_counts()[legacy.all_reduce_coalesced], 1)

    def test_torch_distributed_eager_api(self) -> None:
        x = seeded(2, 3)
        gathered = x.new_empty(2, 3)
        with CommDebugMode() as comm:
            dist.all_reduce(x)
            dist.broadcast(x, 0)
            dist.all_gather_into_tensor(gathered, x)
        self.assertEqual(comm.get_comm_counts(), {c10d.allreduce_: 1, c10d.broadcast_: 1, c10d._allgather_base_: 1})
        torch.testing.assert_close(gathered, x)

    def test_only_collectives_inside_the_block_count(self) -> None:
        x = seeded(2, 3)
        funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))
        comm = CommDebugMode()
        with comm:
            funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))  # the wait is no collective
        funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))
        self.assertEqual(comm.get_comm_counts(), {funcol.all_reduce: 1})


class CountsCompareLikeTorchsTest(unittest.TestCase):
    def test_equal_to_dicts_keyed_by_any_of_torchs_names(self) -> None:
        mesh_free = CommDebugMode()
        counts = mesh_free.get_comm_counts()
        self.assertEqual(counts, {})
        counts.update({"all_reduce": 1, "all_gather": 2})
        self.assertTrue(counts == {funcol.all_reduce: 1, funcol.all_gather_tensor: 2})
        self.assertTrue(counts == {native.all_reduce: 1, legacy.all_gather_into_tensor: 2})
        self.assertTrue({native.all_reduce.default: 1, c10d._allgather_base_: 2} == counts)
        self.assertTrue(counts == {"all_reduce": 1, "all_gather": 2, legacy.reduce_scatter_tensor: 0})
        self.assertFalse(counts != {funcol.all_reduce: 1, funcol.all_gather_tensor: 2})
        self.assertNotEqual(counts, {funcol.all_reduce: 1})
        self.assertNotEqual(counts, {funcol.all_reduce: 1, funcol.all_gather_tensor: 2, "no such op": 0})
        self.assertNotEqual(counts, [("all_reduce", 1), ("all_gather", 2)])


class ReenteredModeTest(DTensorTestBase):
    @with_comms
    def test_second_entry_keeps_parameter_and_sharding_info(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))
        linear = nn.Linear(8, 4)
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
        linear.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Shard(0)]))
        x = distribute_tensor(seeded(3, 8), mesh, [Replicate()])  # needs no gradient
        comm = CommDebugMode()
        with comm:
            linear(x).to_local().sum().backward()
        expected = {"Linear.weight": (Shard(0),), "Linear.bias": (Shard(0),)}
        self.assertEqual(comm.get_sharding_info(), expected)
        with comm:
            linear(x)
        self.assertEqual(comm.get_sharding_info(), expected)
        self.assertEqual(set(comm.get_parameter_info()["Linear"]), {"weight", "bias"})

    @with_comms
    def test_a_forward_after_a_backward_counts_as_forward(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))

        class ScaleThenGather(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.scale = nn.Parameter(distribute_tensor(seeded(8, 4, seed=1), mesh, [Shard(0)]))

            def forward(self, x: DTensor) -> torch.Tensor:
                # backward of the gather is a local slice: no collective
                return (x * self.scale).redistribute(mesh, [Replicate()]).to_local()

        model = ScaleThenGather()
        x = distribute_tensor(seeded(8, 4), mesh, [Shard(0)])  # needs no gradient: the module's backward
        with CommDebugMode() as comm:                          # ends without reaching its input
            model(x).sum().backward()
            model(x)
        forward = comm.get_per_module_comm_counts(backward=False)
        self.assertEqual(forward, {"Global": {"all_gather": 2}, "ScaleThenGather": {"all_gather": 2}})
        self.assertEqual(comm.get_per_module_comm_counts(backward=True), {})


def _dtensor_and_funcol_on_gloo() -> dict[str, int]:
    """One rank: a redistribute (spmd's all_gather on gloo) and the program's own funcol all_reduce."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(seeded(4, 2), mesh, [Shard(0)])
    with CommDebugMode() as comm:
        full = x.full_tensor()
        total = funcol.all_reduce(full, "sum", mesh.get_group())
    torch.testing.assert_close(total, seeded(4, 2) * dist.get_world_size())
    return dict(comm.get_comm_counts())


@pytest.mark.multiprocess
def test_spmd_collectives_on_gloo_are_counted_once() -> None:
    # spmd's c10d backend issues its all_gather through torch's functional collectives: still one count
    for counts in run_multiprocess(_dtensor_and_funcol_on_gloo, 2):
        assert counts == {"all_gather": 1, "all_reduce": 1}
