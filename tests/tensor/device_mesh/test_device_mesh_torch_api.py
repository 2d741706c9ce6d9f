"""DeviceMesh calls torchtitan's ``ParallelDims.build_mesh`` makes, checked against torch's DeviceMesh.

``_unflatten`` splits a dim of the world mesh into named dims (pp, dp_replicate, dp_shard, cp, tp);
the result shares the world mesh as root, is sliced by the new names and flattened again.
``from_group`` wraps groups that exist already. torch's answers come from its own DeviceMesh on a
fake process group, one rank at a time; ours from rank threads and from gloo processes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spmd.tensor import DeviceMesh, DTensor, Partial, Replicate, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, with_comms
from spmd.testing.multiprocess import run_multiprocess

# (pp, dp_replicate, dp_shard, cp, tp, ep) on 8 ranks
DP_SHARD_TP = (1, 1, 4, 1, 2, 1)
HSDP_TP = (1, 2, 2, 1, 2, 1)
FSDP_CP_TP = (1, 1, 2, 2, 2, 1)
TITAN_LAYOUTS = {"dp_shard-tp": DP_SHARD_TP, "hsdp-tp": HSDP_TP, "fsdp-cp-tp": FSDP_CP_TP}


def build_titan_meshes(init_mesh: Callable[..., Any], degrees: tuple[int, ...]) -> dict[str, Any]:
    """The meshes torchtitan 0.3.0's ``ParallelDims.build_mesh`` makes, by the same calls, by name."""
    pp, dp_replicate, dp_shard, cp, tp, ep = degrees
    world_size = pp * dp_replicate * dp_shard * cp * tp
    batch, fsdp = dp_replicate * dp_shard, dp_shard * cp
    efsdp = fsdp * tp // ep
    real = {"fsdp", "dp_shard"} | ({"efsdp"} if ep > 1 else set())

    def unflatten(world: Any, names: tuple[str, ...], sizes: tuple[int, ...]) -> Any:
        fake = {n: "fake" for n, size in zip(names, sizes) if n not in real and size == 1}
        return world._unflatten(0, sizes, names, backend_override=fake)

    world = init_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    dataloading = unflatten(world, ("pp", "batch", "cp", "tp"), (pp, batch, cp, tp))
    loss = dataloading["batch", "cp"]._flatten("loss_mesh")
    dense = unflatten(world, ("pp", "dp_replicate", "dp_shard", "cp", "tp"), (pp, dp_replicate, dp_shard, cp, tp))
    fwdbwd = unflatten(world, ("pp", "dp", "cp", "tp"), (pp, batch, cp, tp))["dp", "cp", "tp"]
    legacy = unflatten(world, ("pp", "dp_replicate", "fsdp", "tp"), (pp, dp_replicate, fsdp, tp))
    sparse = unflatten(world, ("pp", "dp_replicate", "efsdp", "ep"), (pp, dp_replicate, efsdp, ep))
    return {
        "world": world,
        "dataloading": dataloading,
        "loss": loss,
        "dense": dense,
        "spmd_dense_for_fwdbwd": fwdbwd,
        "legacy_dense": legacy,
        "sparse": sparse,
        "pp": dataloading["pp"],
        "batch": dataloading["batch"],
        "cp": dataloading["cp"],
        "tp": dataloading["tp"],
        "dp_replicate": dense["dp_replicate"],
        "dp_shard": dense["dp_shard"],
        "dp": fwdbwd["dp"],
        "fsdp": legacy["fsdp"],
        "efsdp": sparse["efsdp"],
        "ep": sparse["ep"],
        "dp_shard_tp": dense["dp_shard", "tp"],
    }


def group_ranks(group: Any) -> tuple[int, ...]:
    """The ranks of a mesh's group: an spmd communicator (threads) or a c10d ProcessGroup."""
    return tuple(group.ranks) if hasattr(group, "ranks") else tuple(dist.get_process_group_ranks(group))


def describe(mesh: Any, world: Any) -> tuple[Any, ...]:
    """What torchtitan reads off a mesh: names, shape, ranks, the caller's coordinate and groups, root."""
    return (
        mesh.mesh_dim_names,
        tuple(mesh.shape),
        mesh.size(),
        mesh.mesh.tolist(),
        tuple(mesh.get_coordinate()),
        tuple(mesh.get_local_rank(d) for d in range(mesh.ndim)),
        tuple(group_ranks(mesh.get_group(d)) for d in range(mesh.ndim)),
        mesh._get_root_mesh() is world,
    )


def describe_titan_meshes(degrees: tuple[int, ...]) -> dict[str, tuple[Any, ...]]:
    meshes = build_titan_meshes(init_device_mesh, degrees)
    return {name: describe(mesh, meshes["world"]) for name, mesh in meshes.items()}


@functools.cache
def torch_titan_meshes(degrees: tuple[int, ...], world_size: int = 8) -> list[dict[str, tuple[Any, ...]]]:
    """torch's answers, rank by rank, on a fake process group."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    per_rank = []
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            meshes = build_titan_meshes(torch_init_device_mesh, degrees)
            per_rank.append({name: describe(mesh, meshes["world"]) for name, mesh in meshes.items()})
        finally:
            dist.destroy_process_group()
    return per_rank


def describe_every_titan_layout() -> dict[str, dict[str, tuple[Any, ...]]]:
    """Each layout's meshes, built one layout after another in one world."""
    return {layout: describe_titan_meshes(degrees) for layout, degrees in TITAN_LAYOUTS.items()}


def test_torchtitan_build_mesh_matches_torch(world: Callable[..., list[Any]]) -> None:
    ours = world(describe_every_titan_layout, 8, timeout=120)
    for layout, degrees in TITAN_LAYOUTS.items():
        theirs = torch_titan_meshes(degrees)
        for rank in range(8):
            assert ours[rank][layout] == theirs[rank], f"{layout}, rank {rank}"


class UnflattenTest(DTensorTestBase):
    world_size = 8

    @with_comms
    def test_unflatten_splits_a_dim_into_named_dims_that_share_the_root(self) -> None:
        world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
        mesh = world._unflatten(0, (2, 2, 2), ("pp", "dp", "tp"))
        self.assertEqual(mesh.mesh.tolist(), torch.arange(8).reshape(2, 2, 2).tolist())
        self.assertEqual(mesh.mesh_dim_names, ("pp", "dp", "tp"))
        # slices, and slices of slices, know the world mesh as their root
        dp_tp = mesh["dp", "tp"]
        self.assertIs(dp_tp._get_root_mesh(), world)
        self.assertIs(dp_tp["tp"]._get_root_mesh(), world)
        self.assertEqual(dp_tp["tp"].mesh.tolist(), [self.rank - self.rank % 2, self.rank - self.rank % 2 + 1])
        # each new dim communicates over its own groups
        ones = torch.ones(1)
        self.assertEqual(mesh.get_communicator("dp").all_reduce(ones, "sum").item(), 2)
        self.assertEqual(mesh["pp", "dp"]._flatten().get_communicator(0).all_reduce(ones, "sum").item(), 4)

    @with_comms
    def test_unflatten_any_dim_of_any_mesh_and_flatten_back(self) -> None:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "rest"))
        split = mesh._unflatten("rest", (2, 2), ("cp", "tp"))
        self.assertEqual(split.mesh_dim_names, ("dp", "cp", "tp"))
        self.assertEqual(split.mesh.tolist(), torch.arange(8).reshape(2, 2, 2).tolist())
        # a flattened dim splits again, back into the dims it was made of
        dp_tp = split["dp", "tp"]._flatten("dp_tp")
        self.assertEqual(dp_tp._unflatten(0, (2, 2), ("dp", "tp")), split["dp", "tp"])
        self.assertEqual(mesh["dp_tp"], dp_tp)  # flattened dims are named on the root
        self.assertEqual(mesh._flatten_mapping, {"dp_tp": dp_tp})  # as torch lists them (Megatron reads it)
        self.assertEqual(split._flatten_mapping, {})
        # a redistribute over both dims of the unflattened mesh uses the flattened group
        partial = DTensor.from_local(torch.ones(4), split["dp", "tp"], [Partial(), Partial()])
        with CommDebugMode() as comm:
            summed = partial.redistribute(split["dp", "tp"], [Replicate(), Replicate()])
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 1})
        self.assertEqual(summed.to_local().tolist(), [4.0] * 4)

    @with_comms
    def test_unflatten_errors_name_the_fix(self) -> None:
        world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
        with self.assertRaisesRegex(ValueError, r"hold 6 ranks but mesh dim 'world' has 8; make their product 8"):
            world._unflatten(0, (3, 2), ("dp", "tp"))
        with self.assertRaisesRegex(ValueError, r"names \['dp'\] twice.*give each dim its own name"):
            world._unflatten(0, (2, 4), ("dp", "dp"))
        mesh = world._unflatten(0, (2, 4), ("dp", "rest"))
        with self.assertRaisesRegex(ValueError, r"names \['dp'\] twice"):
            mesh._unflatten("rest", (2, 2), ("dp", "tp"))
        with self.assertRaisesRegex(RuntimeError, "pass one name per size"):
            world._unflatten(0, (2, 4), ("dp",))
        with self.assertRaisesRegex(ValueError, "not one of the mesh's dims"):
            world._unflatten("tp", (8,), ("a",))
        with self.assertRaisesRegex(ValueError, "out of range"):
            world._unflatten(1, (8,), ("a",))
        with self.assertRaisesRegex(RuntimeError, r"keys \['cp'\] that name no new dim"):
            world._unflatten(0, (2, 4), ("dp", "tp"), backend_override={"cp": "fake"})


class FromGroupTest(DTensorTestBase):
    world_size = 4

    @with_comms
    def test_from_group_wraps_the_groups_of_another_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = DeviceMesh.from_group(mesh.get_group("tp"), "cpu", mesh_dim_names=("tp",))
        self.assertEqual(tp, mesh["tp"])
        self.assertEqual(tp.get_communicator(0).all_reduce(torch.ones(1), "sum").item(), 2)
        both = DeviceMesh.from_group(mesh.get_all_groups(), "cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))
        self.assertEqual(both, mesh)
        self.assertIs(both._get_root_mesh(), both)

    @with_comms
    def test_from_group_errors_name_the_fix(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with self.assertRaisesRegex(ValueError, "pass mesh=None"):
            DeviceMesh.from_group(mesh.get_group("tp"), "cpu", [0, 1, 2, 3])
        with self.assertRaisesRegex(ValueError, "needs mesh="):
            DeviceMesh.from_group(mesh.get_all_groups(), "cpu")
        with self.assertRaisesRegex(ValueError, "pass one group per mesh dim"):
            DeviceMesh.from_group([mesh.get_group("tp")], "cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))
        with self.assertRaisesRegex(ValueError, "in mesh-dim order"):
            DeviceMesh.from_group(mesh.get_all_groups()[::-1], "cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))


def _from_group_on_gloo() -> tuple[Any, ...]:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    tp = DeviceMesh.from_group(mine, "cpu", mesh_dim_names=("tp",))
    summed = tp.get_communicator(0).all_reduce(torch.tensor([float(rank)]), "sum")
    return tp.mesh.tolist(), tp.get_group() is mine, summed.item()


@pytest.mark.multiprocess
def test_from_group_on_gloo_communicates_over_the_given_group() -> None:
    assert run_multiprocess(_from_group_on_gloo, 4) == [
        ([0, 1], True, 1.0),
        ([0, 1], True, 1.0),
        ([2, 3], True, 5.0),
        ([2, 3], True, 5.0),
    ]
