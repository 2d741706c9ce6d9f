"""Faults in the threaded world: a failing or missing rank releases the others with a named error,
and ranks that disagree raise on every rank instead of computing something silently wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn

from spmd.comm import CollectiveAbortedError, CollectiveError, current_world
from spmd.tensor import DTensor, Partial, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CollectiveMismatchError, CommDebugMode, check_collectives, warmup_check
from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from spmd.testing import CollectiveTimeoutError, run_threaded


def _rank() -> int:
    return current_world().current_rank()


# ----- a rank that fails or never arrives ----------------------------------------------------------
def test_every_rank_is_released_within_a_second_of_another_ranks_exception() -> None:
    lock = threading.Lock()
    seen: dict[object, tuple[float, str]] = {}

    def fail_on_rank_2() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0), Shard(1)])
        if mesh.get_rank() == 2:
            time.sleep(0.2)  # the others are waiting for rank 2 in the gathers by now
            seen["raised"] = (time.monotonic(), "")
            raise ValueError("rank 2 lost its input")
        try:
            x.full_tensor()
        except CollectiveAbortedError as error:
            with lock:
                seen[mesh.get_rank()] = (time.monotonic(), str(error))
            raise

    with pytest.raises(ValueError, match="rank 2 lost its input"):
        run_threaded(fail_on_rank_2, 4, timeout=30)
    raised_at = seen["raised"][0]
    for rank in (0, 1, 3):
        released_at, message = seen[rank]
        assert released_at - raised_at < 1.0
        assert "cancelled because rank 2 failed: ValueError: rank 2 lost its input" in message
    # rank 3 waited on its tp group with rank 2; ranks 0 and 1 on their dp groups
    assert "all_gather on mesh dim 'tp' (ranks [2, 3])" in seen[3][1]
    assert "all_gather on mesh dim 'dp' (ranks [0, 2])" in seen[0][1]


def test_a_rank_that_never_arrives_is_named_after_the_timeout() -> None:
    def rank_3_stuck_at_step_2() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for step in range(3):
            if step == 2 and mesh.get_rank() == 3:
                time.sleep(2.0)  # stuck outside any collective
                return
            mesh.get_communicator("tp").all_reduce(torch.ones(1), "sum")

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        run_threaded(rank_3_stuck_at_step_2, 4, timeout=0.5)
    assert time.monotonic() - start < 0.5 + 5
    assert str(info.value).startswith(
        "rank 2: all_reduce on mesh dim 'tp' (ranks [2, 3]) timed out after 0.5s waiting for ranks [3]"
    )


def test_init_device_mesh_timeout_bounds_the_meshs_collectives() -> None:
    def missing_rank() -> float:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",), timeout=0.3)
        if mesh.get_rank() == 1:
            time.sleep(1.0)
            return 0.0
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"on mesh dim 'tp' \(ranks \[0, 1\]\) timed out after 0.3s"):
            mesh.get_communicator(0).all_gather(torch.ones(2))
        return time.monotonic() - start

    waited, _ = run_threaded(missing_rank, 2, timeout=30)
    assert 0.3 <= waited < 10.0  # the mesh's 0.3 s, not the world's 30 s


def test_ranks_passing_different_mesh_shapes_all_raise_at_once() -> None:
    def build_mesh() -> str:
        shape = (4, 1) if _rank() == 1 else (2, 2)
        with pytest.raises(ValueError) as info:
            init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        return str(info.value)

    start = time.monotonic()
    messages = run_threaded(build_mesh, 4, timeout=30)
    assert time.monotonic() - start < 5.0, "the ranks compare their arguments; the 30 s timeout is not involved"
    assert messages == [messages[0]] * 4
    assert "ranks [0, 2, 3]: mesh_shape=(2, 2), mesh_dim_names=('dp', 'tp')" in messages[0]
    assert "ranks [1]: mesh_shape=(4, 1), mesh_dim_names=('dp', 'tp')" in messages[0]


def test_ranks_passing_different_mesh_dim_names_all_raise() -> None:
    def build_mesh() -> str:
        names = ("tp", "dp") if _rank() == 0 else ("dp", "tp")
        with pytest.raises(ValueError, match="every rank must build the same mesh") as info:
            init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        return str(info.value)

    messages = run_threaded(build_mesh, 4, timeout=30)
    assert all("ranks [0]: mesh_shape=(2, 2), mesh_dim_names=('tp', 'dp')" in m for m in messages)


# ----- ranks that disagree: silent without the check, named with it -------------------------------
def reduce_with_rank_0_disagreeing(checked: bool) -> torch.Tensor | str:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    op = "sum" if mesh.get_rank() == 0 else "max"
    x = DTensor.from_local(torch.full((2, 2), float(mesh.get_rank())), mesh, [Partial(op)])
    if not checked:
        with warmup_check(False):
            return x.full_tensor()
    with check_collectives(), pytest.raises(CollectiveMismatchError) as info:
        x.full_tensor()
    return str(info.value)


def test_disagreeing_reduce_ops_are_silently_wrong_with_every_check_off() -> None:
    results = run_threaded(reduce_with_rank_0_disagreeing, 4, False)
    # rank 0 summed, the others took the max: the ranks now hold different "replicated" tensors
    assert [r[0, 0].item() for r in results] == [6.0, 3.0, 3.0, 3.0]  # type: ignore[index]


def test_disagreeing_reduce_ops_raise_on_every_rank_under_the_check() -> None:
    messages = [str(m) for m in run_threaded(reduce_with_rank_0_disagreeing, 4, True)]
    assert [m.split(": ", 1)[0] for m in messages] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert len({m.split(": ", 1)[1] for m in messages}) == 1, "every rank raises the same error"
    message = messages[0]
    assert (
        "the ranks on mesh dim 'tp' (ranks [0, 1, 2, 3]) disagree on a collective (their #1 on this group); ranks [0] differ from rank 1"
        in message
    )
    assert "ranks [0]: all_reduce(sum) on mesh dim 'tp' f32[2,2] in redistribute [f32[2,2] (P(sum))" in message
    assert "ranks [1, 2, 3]: all_reduce(max) on mesh dim 'tp' f32[2,2] in redistribute [f32[2,2] (P(max))" in message
    assert "test_faults.py:" in message and "in reduce_with_rank_0_disagreeing" in message


def test_disagreeing_placements_with_equal_local_shapes_raise_under_the_check() -> None:
    # Both ranks gather a 2x4 block; only the placements say one is a row of a 4x4, the other a column of a 2x8.
    def gather(checked: bool) -> torch.Tensor | str:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.arange(8.0).reshape(2, 4) + 10 * mesh.get_rank()
        if mesh.get_rank() == 0:
            x = DTensor.from_local(local, mesh, [Shard(0)], shape=(4, 4), stride=(4, 1))
        else:
            x = DTensor.from_local(local, mesh, [Shard(1)], shape=(2, 8), stride=(8, 1))
        if not checked:
            with warmup_check(False):
                return x.full_tensor()
        with check_collectives(), pytest.raises(CollectiveMismatchError) as info:
            x.full_tensor()
        return str(info.value)

    unchecked = run_threaded(gather, 2, False)
    assert [tuple(t.shape) for t in unchecked] == [(4, 4), (2, 8)]  # type: ignore[union-attr]
    messages = run_threaded(gather, 2, True)
    assert str(messages[0]).replace("rank 0:", "rank 1:", 1) == messages[1]
    assert "f32[4,4] (S(0)) on mesh(d0=2), step mesh dim 0: S(0) -> R  all_gather(dim=0)" in str(messages[0])
    assert "f32[2,8] (S(1)) on mesh(d0=2), step mesh dim 0: S(1) -> R  all_gather(dim=1)" in str(messages[0])


def test_disagreeing_redistribute_targets_raise_under_the_check() -> None:
    def reduce_scatter() -> str:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        x = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
        target = Shard(0) if mesh.get_rank() == 0 else Shard(1)
        with check_collectives(), pytest.raises(CollectiveMismatchError) as info:
            x.redistribute(mesh, [target])
        return str(info.value)

    message = run_threaded(reduce_scatter, 2)[0]
    assert "reduce_scatter(sum) on mesh dim 'tp' f32[2,2,4]" in message
    assert "reduce_scatter(sum) on mesh dim 'tp' f32[2,4,2]" in message
    assert "P(sum) -> S(0)" in message and "P(sum) -> S(1)" in message


def test_disagreeing_parallelize_plans_raise_under_the_check() -> None:
    def parallelize() -> str:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        style = ColwiseParallel() if mesh.get_rank() == 0 else RowwiseParallel()
        with check_collectives(), pytest.raises(CollectiveMismatchError) as info:
            parallelize_module(nn.Linear(8, 8), mesh, style)
        return str(info.value)

    message = run_threaded(parallelize, 2, timeout=30)[0]
    # the weight's blocks: rows of it on rank 0, columns on rank 1
    assert "ranks [0]: scatter(src=0) on mesh dim 'tp' f32[2,4,8] at tests/comm/test_faults.py:" in message
    assert "ranks [1]: scatter(src=0) on mesh dim 'tp' f32[2,8,4] at tests/comm/test_faults.py:" in message


def test_disagreeing_sequence_parallelism_raises_under_the_check() -> None:
    def norm_then_linear() -> str:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        torch.manual_seed(0)
        model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
        plan = {"1": ColwiseParallel()}
        if mesh.get_rank() == 0:
            plan = {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1))}
        with check_collectives(), pytest.raises(CollectiveMismatchError) as info:
            parallelize_module(model, mesh, plan)
            model(torch.randn(2, 4, 8))
        return str(info.value)

    messages = run_threaded(norm_then_linear, 2, timeout=30)
    assert messages[0].replace("rank 0:", "rank 1:", 1) == messages[1]
    # rank 0 replicates the norm's weight; rank 1 skipped the norm and scatters the Linear's
    assert "ranks [0]: broadcast(src=0) on mesh dim 'tp' f32[8]" in messages[0]
    assert "ranks [1]: scatter(src=0) on mesh dim 'tp' f32[2,4,8]" in messages[0]


def test_without_the_check_disagreeing_plans_fail_within_the_timeout() -> None:
    def parallelize() -> None:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
        plan = {"1": ColwiseParallel()}
        if mesh.get_rank() == 0:
            plan = {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1))}
        with warmup_check(False):
            parallelize_module(model, mesh, plan)
            model(torch.randn(2, 4, 8)).sum().backward()

    start = time.monotonic()
    with pytest.raises((CollectiveError, RuntimeError)):
        run_threaded(parallelize, 2, timeout=1.0)
    assert time.monotonic() - start < 1.0 + 5


# ----- the check itself ------------------------------------------------------------------------------
def test_the_check_changes_no_values_and_no_collective_counts() -> None:
    def step(checked: bool) -> tuple[torch.Tensor, dict[str, int]]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        gen = torch.Generator().manual_seed(0)
        a = distribute_tensor(torch.randn(8, 6, generator=gen), mesh, [Shard(0), Shard(1)])
        b = distribute_tensor(torch.randn(6, 4, generator=gen), mesh, [Shard(0), Shard(0)])
        with CommDebugMode() as comm, check_collectives() if checked else CommDebugMode():
            c = (a @ b).relu().full_tensor()
        return c, comm.get_comm_counts()

    plain, checked = run_threaded(step, 4, False), run_threaded(step, 4, True)
    for (c0, counts0), (c1, counts1) in zip(plain, checked):
        torch.testing.assert_close(c0, c1)
        assert counts0 == counts1


def test_spmd_debug_check_turns_the_check_on_for_the_process() -> None:
    script = textwrap.dedent(
        """
        import torch
        from spmd.tensor import DTensor, Partial, init_device_mesh
        from spmd.testing import run_threaded

        def main():
            mesh = init_device_mesh("cpu", (2,))
            op = "sum" if mesh.get_rank() == 0 else "min"
            DTensor.from_local(torch.ones(3), mesh, [Partial(op)]).full_tensor()

        run_threaded(main, 2, timeout=30)
        """
    )
    env = {**os.environ, "SPMD_DEBUG": "check"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "CollectiveMismatchError" in done.stderr
    assert "all_reduce(sum)" in done.stderr and "all_reduce(min)" in done.stderr
