"""DeviceMesh behaviours torch users rely on: ``_flatten`` (torchtitan's dp_shard_cp, dp_cp meshes),
redistributes that reduce over a flattened dim in one collective, and meshes that leave some
ranks out (those ranks hold empty pieces and run nothing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmd.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    full,
    init_device_mesh,
    ones,
    rand,
    zeros,
)
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, with_comms


def assert_same(got: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=msg)


class FlattenTest(DTensorTestBase):
    world_size = 8

    @with_comms
    def test_flatten_joins_the_dim_names_and_groups_ranks_row_major(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        dp_cp = mesh["dp", "cp"]._flatten()
        # torch's own example: ranks 0, 2, 4, 6 share one dp_cp group, the odd ranks the other
        self.assertEqual(dp_cp.mesh_dim_names, ("dp_cp",))
        self.assertEqual(dp_cp.mesh.tolist(), [0, 2, 4, 6] if self.rank % 2 == 0 else [1, 3, 5, 7])
        self.assertEqual(dp_cp.get_local_rank(), self.rank // 2)
        # the root finds it by name, alone or next to its other dims
        self.assertEqual(mesh["dp_cp"], dp_cp)
        self.assertEqual(mesh["dp_cp", "tp"].mesh.tolist(), torch.arange(8).reshape(4, 2).tolist())
        self.assertIs(mesh.get_group("dp_cp"), dp_cp.get_group())
        total = dp_cp.get_communicator(0).all_reduce(torch.tensor([float(self.rank)]), "sum")
        self.assertEqual(total.item(), sum(r for r in range(8) if r % 2 == self.rank % 2))

    @with_comms
    def test_torchtitan_meshes_flatten_flattened_dims_again(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        hsdp = mesh["dp_replicate", "dp_shard_cp"]
        replica, rest = divmod(self.rank, 4)
        self.assertEqual(hsdp.mesh.tolist(), [[0, 1, 2, 3], [4, 5, 6, 7]])
        self.assertEqual(mesh["dp"].mesh.tolist(), [rest % 2, 2 + rest % 2, 4 + rest % 2, 6 + rest % 2])
        everyone = hsdp._flatten("dp_cp")
        self.assertEqual(everyone.mesh.tolist(), list(range(8)))
        self.assertEqual(everyone.get_local_rank(), self.rank)
        self.assertEqual(hsdp.get_local_rank("dp_replicate"), replica)

    @with_comms
    def test_flatten_again_reuses_a_name_and_refuses_clashes(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        first = mesh["a", "b"]._flatten("ab")
        self.assertEqual(mesh["a", "b"]._flatten("ab"), first)
        with self.assertRaisesRegex(ValueError, "already made from mesh dims"):
            mesh["a", "c"]._flatten("ab")
        with self.assertRaisesRegex(ValueError, "already has a dim of that name"):
            mesh["a", "b"]._flatten("c")
        a = mesh["a"]
        self.assertIs(a._flatten("a"), a)  # a 1-d mesh flattened into its own name is itself
        with self.assertRaisesRegex(RuntimeError, "without mesh_dim_names"):
            DeviceMesh("cpu", torch.arange(8).reshape(2, 4))._flatten()
        with self.assertRaisesRegex(KeyError, "sliced from the mesh they were made on"):
            mesh["a", "b"]["ab"]

    @with_comms
    def test_flattened_names_belong_to_their_root_mesh(self) -> None:
        """As torch's: a second mesh over the same ranks flattens its own dims under the same name
        (torchtitan builds a ParallelDims per run; a test builds several in one world)."""
        first = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        second = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        self.assertEqual(first, second)  # equal values, still two roots
        ab = first["a", "b"]._flatten("x")
        bc = second["b", "c"]._flatten("x")
        self.assertEqual(first["x"], ab)
        self.assertEqual(second["x"], bc)
        self.assertNotEqual(ab.mesh.tolist(), bc.mesh.tolist())
        with self.assertRaisesRegex(KeyError, "x"):
            init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))["x"]

    @with_comms
    def test_reductions_over_a_flattened_dim_are_one_collective(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        ones_ = torch.ones(8, 8)
        partial = DTensor.from_local(ones_, mesh, [Partial(), Partial(), Replicate()])
        with CommDebugMode() as comm:
            partial.redistribute(mesh, [Replicate()] * 3)
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 2})

        mesh["a", "b"]._flatten()
        with CommDebugMode() as comm:
            summed = partial.redistribute(mesh, [Replicate()] * 3)
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 1})
        assert_same(summed.to_local(), ones_ * 4)

        # a mesh dim left alone between the flattened ones does not stop the merge ...
        mesh["a", "c"]._flatten()
        skip_b = DTensor.from_local(ones_, mesh, [Partial(), Replicate(), Partial()])
        with CommDebugMode() as comm:
            assert_same(skip_b.redistribute(mesh, [Replicate()] * 3).to_local(), ones_ * 4)
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 1})
        # ... a dim that changes between them does (each collective keeps its place in the plan)
        gather_b = DTensor.from_local(ones_, mesh, [Partial(), Shard(0), Partial()])
        with CommDebugMode() as comm:
            gathered = gather_b.redistribute(mesh, [Replicate()] * 3)
        self.assertEqual(comm.get_total_counts(), 3)
        assert_same(gathered.to_local(), torch.ones(16, 8) * 4)

    @with_comms
    def test_nested_shards_gather_and_scatter_in_one_collective_when_even(self) -> None:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "b"))
        mesh._flatten("ab")
        full_tensor = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
        sharded = distribute_tensor(full_tensor, mesh, [Shard(0), Shard(0)])
        with CommDebugMode() as comm:
            assert_same(sharded.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full_tensor)
        self.assertEqual(comm.get_comm_counts(), {"all_gather": 1})

        partial = DTensor.from_local(full_tensor, mesh, [Partial(), Partial()])
        with CommDebugMode() as comm:
            scattered = partial.redistribute(mesh, [Shard(0), Shard(0)])
        self.assertEqual(comm.get_comm_counts(), {"reduce_scatter": 1})
        assert_same(scattered.to_local(), (full_tensor * 8).chunk(8)[self.rank])

        # 13 rows cut 4 ways and then 2 ways are not 13 rows cut 8 ways: two gathers, same value
        uneven = full_tensor[:13]
        sharded = distribute_tensor(uneven, mesh, [Shard(0), Shard(0)])
        with CommDebugMode() as comm:
            assert_same(sharded.full_tensor(), uneven)
        self.assertEqual(comm.get_comm_counts(), {"all_gather": 2})

    @with_comms
    def test_large_partials_use_the_flattened_all_reduce(self) -> None:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "b"))
        big = torch.ones(64, 512)  # 128 KiB: without a flattened dim the plan scatters first
        partial = DTensor.from_local(big, mesh, [Partial(), Partial()])
        with CommDebugMode() as comm:
            partial.redistribute(mesh, [Replicate(), Replicate()])
        self.assertEqual(comm.get_total_counts(), 3)
        mesh._flatten()
        with CommDebugMode() as comm:
            assert_same(partial.redistribute(mesh, [Replicate(), Replicate()]).to_local(), big * 8)
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 1})

    @with_comms
    def test_a_sub_mesh_reduces_over_a_dim_flattened_on_its_root(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        mesh["a", "b"]._flatten()
        sub = mesh["a", "b"]
        partial = DTensor.from_local(torch.ones(4), sub, [Partial(), Partial()])
        with CommDebugMode() as comm:
            assert_same(partial.full_tensor(), torch.ones(4) * 4)
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 1})


class RanksOutsideTheMeshTest(DTensorTestBase):
    world_size = 4

    def in_mesh(self) -> bool:
        return self.rank in (0, 2)

    @with_comms
    def test_outside_ranks_hold_empty_pieces_of_the_global_tensor(self) -> None:
        mesh = DeviceMesh("cpu", [0, 2])
        self.assertEqual(mesh.get_coordinate(), (self.rank // 2,) if self.in_mesh() else None)
        full_tensor = torch.arange(12.0).reshape(4, 3)
        dt = distribute_tensor(full_tensor, mesh, [Shard(0)])
        self.assertEqual(dt.shape, (4, 3))
        expected = full_tensor.chunk(2)[self.rank // 2] if self.in_mesh() else torch.tensor([])
        assert_same(dt.to_local(), expected)

        local = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)])
        self.assertEqual(local.shape, (6, 4))
        assert_same(local.to_local(), torch.ones(3, 4) if self.in_mesh() else torch.tensor([]))

        made = {
            "zeros": (zeros(4, 2, device_mesh=mesh, placements=[Shard(0)]), torch.zeros(2, 2)),
            "ones": (ones(4, device_mesh=mesh), torch.ones(4)),
            "full": (full((4,), 7.0, device_mesh=mesh), torch.full((4,), 7.0)),
        }
        for name, (dtensor, member_local) in made.items():
            self.assertEqual(dtensor.shape, (4, 2) if name == "zeros" else (4,))
            assert_same(dtensor.to_local(), member_local if self.in_mesh() else torch.tensor([]), msg=name)
        drawn = rand(4, 2, device_mesh=mesh)
        self.assertEqual(drawn.to_local().shape, (4, 2) if self.in_mesh() else (0,))

    @with_comms
    def test_ops_and_redistributes_run_only_on_the_mesh(self) -> None:
        mesh = DeviceMesh("cpu", [0, 2])
        x = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0)])
        with CommDebugMode() as comm:
            gathered = x.redistribute(mesh, [Replicate()])
        self.assertEqual(comm.get_total_counts(), 1 if self.in_mesh() else 0)
        assert_same(gathered.to_local(), torch.ones(8, 3) if self.in_mesh() else torch.tensor([]))

        assert_same((x + 2).to_local(), torch.ones(4, 3) + 2 if self.in_mesh() else torch.tensor([]))
        total = x.sum()  # Partial: each member holds its own rows' sum; outside ranks a 0-d zero
        assert_same(total.to_local(), torch.tensor(12.0 if self.in_mesh() else 0.0))
        assert_same(total.full_tensor(), torch.tensor(24.0) if self.in_mesh() else torch.tensor(0.0))
        self.assertTrue(x.equal(x))
        pieces = x.split([2, 1], dim=1)
        self.assertEqual([p.shape for p in pieces], [(8, 2), (8, 1)])
        if not self.in_mesh():
            self.assertEqual([p.to_local().numel() for p in pieces], [0, 0])
        x_ = x.clone()
        x_.mul_(3)
        assert_same(x_.full_tensor(), torch.full((8, 3), 3.0) if self.in_mesh() else torch.tensor([]))

    @with_comms
    def test_gradients_flow_on_the_mesh_and_outside_ranks_get_none(self) -> None:
        mesh = DeviceMesh("cpu", [0, 2])
        local = torch.ones(3, 4, requires_grad=True)
        (DTensor.from_local(local, mesh, [Shard(0)]) * 2).sum().backward()
        if self.in_mesh():
            assert_same(local.grad, torch.full((3, 4), 2.0))
        else:
            self.assertIsNone(local.grad)

    @with_comms
    def test_outside_ranks_still_get_errors_for_what_they_cannot_do(self) -> None:
        mesh = DeviceMesh("cpu", [0, 2], mesh_dim_names=("dp",))
        other = DeviceMesh("cpu", [1, 3])
        a = DTensor.from_local(torch.ones(2), mesh, [Shard(0)])
        b = DTensor.from_local(torch.ones(2), other, [Shard(0)])
        with self.assertRaisesRegex(ValueError, "different meshes"):
            a + b
        if not self.in_mesh():
            with self.assertRaisesRegex(RuntimeError, "is not part of"):
                mesh.get_local_rank()


# ----- the same on gloo process groups (one process per rank) -------------------------------------
def flatten_and_leave_ranks_out() -> list[int]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    mesh._flatten("ab")  # every rank joins the new group (c10d's new_group is collective)
    partial = DTensor.from_local(torch.ones(4, 4), mesh, [Partial(), Partial()])
    with CommDebugMode() as comm:
        assert_same(partial.redistribute(mesh, [Replicate(), Replicate()]).to_local(), torch.ones(4, 4) * 4)
    pair = DeviceMesh("cpu", [0, 2])
    gathered = distribute_tensor(torch.arange(4.0), pair, [Shard(0)]).full_tensor()
    return [comm.get_total_counts(), gathered.numel()]


def test_flatten_and_ranks_outside_a_mesh(world: Callable[..., list[Any]]) -> None:
    counts = world(flatten_and_leave_ranks_out, 4)
    assert counts == [[1, 4], [1, 0], [1, 4], [1, 0]]
