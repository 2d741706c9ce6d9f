"""torch.compile(fullgraph=True) of code that reads a DeviceMesh, as torchtitan's compiled blocks do.

The mesh comes from outside the compiled function (an argument or a closure); its properties,
queries and sub-meshes are read while tracing and baked into the graph. On a threaded world every
rank thread shares one compiled-code cache, so each must still see its own rank.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import run_threaded, seeded_randn


def mesh_features(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every DeviceMesh read torchtitan makes in compiled code, folded into one tensor."""
    assert mesh.mesh_dim_names == ("dp", "tp") and mesh.device_type == "cpu"
    tp = mesh["tp"]
    return (
        x * mesh.ndim
        + mesh.shape[1] * 10
        + mesh.size() * 100
        + tp.size() * 1_000
        + mesh.get_local_rank("tp") * 10_000
        + tp.get_local_rank() * 100_000
        + mesh.get_coordinate()[0] * 1_000_000  # type: ignore[index]
    )


def reduce_over_tp(x: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    """A DTensor op steered by the mesh's properties: gather the tp shards, scale by the mesh's size."""
    replicated = x.redistribute(mesh, [Replicate()] * mesh.ndim)
    return replicated.to_local() * mesh.size(mesh.mesh_dim_names.index("tp")) + mesh.get_local_rank("dp")  # type: ignore[union-attr]


def test_mesh_reads_trace_and_each_rank_thread_gets_its_own_values() -> None:
    def rank() -> tuple[Any, ...]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.ones(3)
        as_argument = torch.compile(mesh_features, backend="aot_eager", fullgraph=True)(x, mesh)
        as_closure = torch.compile(lambda t: mesh_features(t, mesh), backend="aot_eager", fullgraph=True)(x)
        return as_argument, as_closure, mesh_features(x, mesh)

    for r, (as_argument, as_closure, eager) in enumerate(run_threaded(rank, 4)):
        torch.testing.assert_close(as_argument, eager)
        torch.testing.assert_close(as_closure, eager)
        assert eager[0].item() == 2 + 20 + 400 + 2_000 + (r % 2) * 110_000 + (r // 2) * 1_000_000


def test_a_dtensor_op_steered_by_mesh_properties_compiles_to_one_all_gather() -> None:
    full = seeded_randn(4, 6, seed=0)

    def rank() -> tuple[Any, ...]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = distribute_tensor(full, mesh, [Replicate(), Shard(1)])
        step = torch.compile(reduce_over_tp, backend="aot_eager", fullgraph=True)
        step(x, mesh)
        with CommDebugMode() as comm:
            out = step(x, mesh)
        return out, mesh.get_local_rank("dp"), comm.get_comm_counts()

    for out, dp, counts in run_threaded(rank, 4):
        torch.testing.assert_close(out, full * 2 + dp)
        assert dict(counts) == {"all_gather": 1}


def test_sub_meshes_made_in_the_compiled_region_carry_dtensors() -> None:
    full = seeded_randn(4, 2, seed=1)

    def sum_tp_shards(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        tp = mesh["tp"]
        piece = DTensor.from_local(local, tp, [Shard(0)], run_check=False)
        return piece.redistribute(tp, [Replicate()]).to_local().sum(0) * tp.size()

    def rank() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        local = full.chunk(2)[mesh.get_local_rank("tp")]
        return torch.compile(sum_tp_shards, backend="aot_eager", fullgraph=True)(local, mesh)

    for out in run_threaded(rank, 4):
        torch.testing.assert_close(out, full.sum(0) * 2)


def test_inductor_compiles_a_dtensor_op_steered_by_mesh_properties() -> None:
    full = seeded_randn(4, 6, seed=2)

    def rank() -> tuple[torch.Tensor, int]:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        x = distribute_tensor(full, mesh, [Replicate(), Shard(1)])
        return torch.compile(reduce_over_tp, backend="inductor", fullgraph=True)(x, mesh), mesh.get_local_rank("dp")

    for out, dp in run_threaded(rank, 2):
        torch.testing.assert_close(out, full * 2 + dp)


def test_get_group_in_compiled_code_is_the_rank_threads_group() -> None:
    """``mesh.get_group`` traced (torchtitan's compiled vocab-parallel loss calls it): a c10d group
    is taken by the graph as an input, each rank thread's own."""
    import torch.distributed as dist

    def rank() -> tuple[Any, ...]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def fn(x: torch.Tensor) -> tuple[torch.Tensor, Any]:
            group = mesh.get_group("tp")
            return x * dist.get_world_size(group) + dist.get_rank(group), group

        out, group = torch.compile(fn, backend="aot_eager", fullgraph=True)(torch.ones(2))
        return out, group is mesh.get_group("tp")

    for r, (out, same_group) in enumerate(run_threaded(rank, 4)):
        assert same_group
        torch.testing.assert_close(out, torch.full((2,), 2.0 + r % 2))
