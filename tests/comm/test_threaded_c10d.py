"""torch.distributed on the threaded world: a mesh's groups are c10d process groups there too.

Model code written for torchrun calls c10d directly on a mesh's groups (torchtitan's vocab-parallel
embedding asks ``dist.get_rank(tp_group)``; its loss calls the functional collectives). On
``run_threaded`` those groups are ``ThreadedProcessGroup`` objects, and each call gives what gloo
would give.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from spmd.tensor import DeviceMesh, init_device_mesh
from spmd.testing import run_threaded


def _mesh_2x2() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_ranks_and_sizes_are_the_calling_threads() -> None:
    def main() -> tuple[int, int, int, int, list[int], bool]:
        tp = _mesh_2x2().get_group("tp")
        return (
            dist.get_rank(),
            dist.get_world_size(),
            dist.get_rank(tp),
            dist.get_world_size(tp),
            dist.get_process_group_ranks(tp),
            isinstance(tp, dist.ProcessGroup),
        )

    assert run_threaded(main, 4) == [
        (0, 4, 0, 2, [0, 1], True),
        (1, 4, 1, 2, [0, 1], True),
        (2, 4, 0, 2, [2, 3], True),
        (3, 4, 1, 2, [2, 3], True),
    ]


def test_the_default_group_lasts_as_long_as_the_world() -> None:
    assert not dist.is_initialized()
    assert run_threaded(lambda: dist.is_initialized() and dist.get_backend(), 2) == ["spmd_threads"] * 2
    assert not dist.is_initialized()


def test_collectives_on_a_mesh_group_equal_the_single_process_math() -> None:
    def main() -> dict[str, list[float]]:
        tp = _mesh_2x2().get_group("tp")
        rank = float(dist.get_rank())
        summed, largest = torch.full((3,), rank), torch.full((3,), rank)
        dist.all_reduce(summed, group=tp)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=tp)
        gathered = torch.empty(4)
        dist.all_gather_single(gathered, torch.full((2,), rank), group=tp)
        scattered = torch.empty(2)
        dist.reduce_scatter_single(scattered, torch.arange(4.0) + rank, group=tp)
        root = dist.get_process_group_ranks(tp)[1]
        broadcast = torch.full((1,), rank)
        dist.broadcast(broadcast, src=root, group=tp)
        listed = [torch.empty(1), torch.empty(1)]
        dist.all_gather(listed, torch.full((1,), rank), group=tp)
        return {
            "all_reduce": summed.tolist(),
            "max": largest.tolist(),
            "all_gather": gathered.tolist(),
            "reduce_scatter": scattered.tolist(),
            "broadcast": broadcast.tolist(),
            "all_gather_list": torch.cat(listed).tolist(),
        }

    first_tp_pair, second_tp_pair = run_threaded(main, 4)[0], run_threaded(main, 4)[3]
    assert first_tp_pair == {
        "all_reduce": [1.0] * 3,
        "max": [1.0] * 3,
        "all_gather": [0.0, 0.0, 1.0, 1.0],
        "reduce_scatter": [1.0, 3.0],  # (0 + 1, 1 + 2): rank 0 keeps the first half
        "broadcast": [1.0],
        "all_gather_list": [0.0, 1.0],
    }
    assert second_tp_pair == {
        "all_reduce": [5.0] * 3,
        "max": [3.0] * 3,
        "all_gather": [2.0, 2.0, 3.0, 3.0],
        "reduce_scatter": [9.0, 11.0],  # (2,3,4,5) + (3,4,5,6): rank 3 keeps the second half
        "broadcast": [3.0],
        "all_gather_list": [2.0, 3.0],
    }


def test_functional_collectives_resolve_a_threaded_group() -> None:
    def main() -> list[list[float]]:
        dp = _mesh_2x2().get_group("dp")
        rank = float(dist.get_rank())
        splits = [1, 2] if rank < 2 else [2, 1]  # the first of each pair sends 1 to itself, 2 to the other
        return [
            funcol.all_reduce(torch.full((2,), rank), "sum", dp).tolist(),
            funcol.all_gather_single(torch.full((1,), rank), 0, dp).tolist(),
            funcol.reduce_scatter_single(torch.arange(4.0) + rank, "sum", 0, dp).tolist(),
            funcol.all_to_all_single(torch.arange(3.0) + 10 * rank, splits, splits, dp).tolist(),
        ]

    rank0, _, rank2, _ = run_threaded(main, 4)
    assert rank0 == [[2.0, 2.0], [0.0, 2.0], [2.0, 4.0], [0.0, 20.0, 21.0]]
    assert rank2 == [[2.0, 2.0], [0.0, 2.0], [6.0, 8.0], [1.0, 2.0, 22.0]]


def test_objects_uneven_all_to_all_and_root_collectives() -> None:
    def main() -> tuple[list[object], list[float], list[float], list[float], list[float]]:
        rank = dist.get_rank()
        objects: list[object] = [None] * 3
        dist.all_gather_object(objects, {"rank": rank})
        splits = [rank + 1, 1, 1]  # rank r sends r + 1 values to rank 0, one to each other rank
        received = torch.empty(sum(r + 1 for r in range(3)) if rank == 0 else 3)
        output_splits = [r + 1 for r in range(3)] if rank == 0 else [1, 1, 1]
        dist.all_to_all_single(received, torch.arange(float(sum(splits))) + 100 * rank, output_splits, splits)
        reduced = torch.full((1,), float(rank))
        dist.reduce(reduced, dst=2)
        pieces = [torch.full((1,), 7.0 * r) for r in range(3)] if rank == 1 else None
        piece = torch.empty(1)
        dist.scatter(piece, pieces, src=1)
        gathered = [torch.empty(1) for _ in range(3)] if rank == 0 else None
        dist.gather(torch.full((1,), float(rank)), gathered, dst=0)
        dist.barrier()
        return (
            objects,
            received.tolist(),
            reduced.tolist(),
            piece.tolist(),
            torch.cat(gathered).tolist() if gathered else [],
        )

    results = run_threaded(main, 3)
    assert results[0][0] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert results[0][1] == [0.0, 100.0, 101.0, 200.0, 201.0, 202.0]
    assert results[2][1] == [2.0, 103.0, 204.0]
    assert results[2][2] == [3.0]  # only the destination holds the sum
    assert [r[3] for r in results] == [[0.0], [7.0], [14.0]]
    assert results[0][4] == [0.0, 1.0, 2.0]


def test_a_compiled_function_runs_functional_collectives_on_threads() -> None:
    def main() -> list[float]:
        tp = _mesh_2x2().get_group("tp")

        @torch.compile(backend="aot_eager", fullgraph=True)
        def scaled_sum(x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(x * 2, "sum", tp) + 1

        return scaled_sum(torch.full((2,), float(dist.get_rank()))).tolist()

    torch._dynamo.reset()
    assert run_threaded(main, 4) == [[3.0, 3.0], [3.0, 3.0], [11.0, 11.0], [11.0, 11.0]]


def test_a_group_serves_as_a_mesh_again() -> None:
    def main() -> tuple[list[int], float]:
        tp = DeviceMesh.from_group(_mesh_2x2().get_group("tp"), "cpu", mesh_dim_names=("tp",))
        total = torch.ones(1)
        dist.all_reduce(total, group=tp.get_group())
        return tp.mesh.tolist(), total.item()

    assert run_threaded(main, 4)[3] == ([2, 3], 2.0)


def test_torchs_own_checkpoint_functions_run_on_threads(tmp_path) -> None:
    """torchtitan's checkpointer calls ``dcp.save``/``dcp.load`` itself; DCP coordinates over c10d."""
    import torch.distributed.checkpoint as dcp

    from spmd.tensor import Shard, distribute_tensor

    full = torch.arange(24.0).reshape(6, 4)

    def save() -> None:
        state = {"weight": distribute_tensor(full, init_device_mesh("cpu", (4,)), [Shard(0)]), "step": 3}
        dcp.save(state, checkpoint_id=tmp_path)

    def load() -> tuple[bool, int]:
        state = {"weight": distribute_tensor(torch.zeros(6, 4), init_device_mesh("cpu", (2,)), [Shard(1)]), "step": 0}
        dcp.load(state, checkpoint_id=tmp_path)
        return torch.equal(state["weight"].full_tensor(), full), state["step"]

    run_threaded(save, 4)
    assert run_threaded(load, 2) == [(True, 3), (True, 3)]


def test_with_torchs_init_barrier_on_the_groups_still_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_DIST_INIT_BARRIER=1 would make a default group wait for ranks that are threads: the world
    runs without one, and its mesh groups still are process groups."""
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")

    def main() -> tuple[bool, float]:
        group = init_device_mesh("cpu", (2,)).get_group()
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        return dist.is_initialized(), total.item()

    assert run_threaded(main, 2) == [(False, 2.0), (False, 2.0)]
