"""The warm-up check, on by default: the first runs of each distinct collective are compared across ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from spmd.comm.base import CheckTicket
from spmd.comm.threaded import ThreadedCommunicator
from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import (
    CollectiveMismatchError,
    is_warmup_check,
    set_warmup_check,
    warmup_check,
)
from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd.testing import run_threaded
from spmd.testing.multiprocess import RankFailed, run_multiprocess


def _error_of(fn: Any) -> str:
    """``fn()``'s CollectiveMismatchError message, or "no error"."""
    try:
        fn()
    except CollectiveMismatchError as error:
        return str(error)
    return "no error"


def _same_on_every_rank(messages: list[str]) -> str:
    """Every rank raised the same error (its own rank in front); return rank 0's."""
    assert [m.split(": ", 1)[0] for m in messages] == [f"rank {r}" for r in range(len(messages))], messages
    assert len({m.split(": ", 1)[1] for m in messages}) == 1, "every rank raises the same error"
    return messages[0]


def test_the_warmup_check_is_on_by_default() -> None:
    assert run_threaded(lambda: is_warmup_check(), 2) == [True, True]


# ----- what the default catches ------------------------------------------------------------------
def test_disagreeing_reduce_ops_raise_by_default() -> None:
    def reduce() -> str:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        op = "sum" if mesh.get_rank() == 0 else "max"
        x = DTensor.from_local(torch.full((2, 2), float(mesh.get_rank())), mesh, [Partial(op)])
        return _error_of(x.full_tensor)

    start = time.monotonic()
    message = _same_on_every_rank(run_threaded(reduce, 4, timeout=30))
    assert time.monotonic() - start < 10
    assert "ranks [0] differ from rank 1" in message
    assert "ranks [0]: all_reduce(sum) on mesh dim 'tp' f32[2,2] [f32[2,2] (P(sum))" in message
    assert "ranks [1, 2, 3]: all_reduce(max) on mesh dim 'tp' f32[2,2] [f32[2,2] (P(max))" in message
    assert "tests/tensor/debug/test_warmup_check.py:" in message and "in _error_of" in message


def test_disagreeing_redistribute_targets_raise_by_default() -> None:
    def reduce_scatter() -> str:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        x = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
        target = Shard(0) if mesh.get_rank() == 0 else Shard(1)
        return _error_of(lambda: x.redistribute(mesh, [target]))

    message = _same_on_every_rank(run_threaded(reduce_scatter, 2, timeout=30))
    assert "reduce_scatter(sum) on mesh dim 'tp' f32[2,2,4]" in message
    assert "reduce_scatter(sum) on mesh dim 'tp' f32[2,4,2]" in message
    assert "P(sum) -> S(0)" in message and "P(sum) -> S(1)" in message


def test_disagreeing_parallelize_plans_raise_by_default() -> None:
    def parallelize() -> str:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        style = ColwiseParallel() if mesh.get_rank() == 0 else RowwiseParallel()
        return _error_of(lambda: parallelize_module(nn.Linear(8, 8), mesh, style))

    message = _same_on_every_rank(run_threaded(parallelize, 2, timeout=30))
    assert (
        "ranks [0]: scatter(src=0) on mesh dim 'tp' f32[2,4,8] at tests/tensor/debug/test_warmup_check.py:" in message
    )
    assert (
        "ranks [1]: scatter(src=0) on mesh dim 'tp' f32[2,8,4] at tests/tensor/debug/test_warmup_check.py:" in message
    )


def test_a_rank_taking_a_new_branch_after_the_warmup_raises_on_every_rank() -> None:
    # Rank 0 reduce-scatters to rows every step (checked twice, then not); at step 3 rank 1 takes a
    # branch it never took: its collective is new, so it checks while rank 0 issues its own unchecked.
    def steps() -> str:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        x = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
        for step in range(4):
            target = Shard(1) if step == 3 and mesh.get_rank() == 1 else Shard(0)
            message = _error_of(lambda: x.redistribute(mesh, [target]))  # noqa: B023
            if message != "no error":
                return f"{message}\nat step {step}"
        return "no error"

    start = time.monotonic()
    message = _same_on_every_rank(run_threaded(steps, 2, timeout=30))
    assert time.monotonic() - start < 10
    assert message.endswith("at step 3")
    assert "the ranks on mesh dim 'tp' (ranks [0, 1]) disagree on a collective (their #" in message
    assert (
        "ranks [0]: reduce_scatter(sum) on mesh dim 'tp' f32[2,2,4] [f32[4,4] (P(sum)) on mesh(tp=2), step mesh dim 0: "
        "P(sum) -> S(0)  reduce_scatter(sum, dim=0)] at tests/tensor/debug/test_warmup_check.py:"
    ) in message
    assert "(not checked: this rank had issued it before)" in message
    assert "ranks [1]: reduce_scatter(sum) on mesh dim 'tp' f32[2,4,2]" in message and "P(sum) -> S(1)" in message


# ----- what it costs: nothing after the first runs -------------------------------------------------
def _count_checks(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Count the collectives each rank checks (by global rank)."""
    counts: Counter[int] = Counter()
    verify = ThreadedCommunicator._verify

    def counted(self: ThreadedCommunicator, ticket: CheckTicket) -> None:
        if ticket.checked:
            counts[ticket.comm.ranks[ticket.comm.local_rank]] += 1
        verify(self, ticket)

    monkeypatch.setattr(ThreadedCommunicator, "_verify", counted)
    return counts


def _train(mesh_shape: tuple[int, ...], steps: int) -> torch.Tensor:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    generator = torch.Generator().manual_seed(0)  # the rank threads share torch's default generator
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    model = parallelize_module(
        model,
        mesh["tp"],
        {"0": ColwiseParallel(), "2": RowwiseParallel()},
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(batch).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    weight = model[0].weight
    assert isinstance(weight, DTensor)
    return weight.full_tensor()


def test_each_collective_is_checked_only_in_its_first_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_checks(monkeypatch)
    run_threaded(_train, 4, (2, 2), 2)
    after_two_steps = dict(counts)
    counts.clear()
    run_threaded(_train, 4, (2, 2), 6)
    # four more steps issue the same collectives again: no more checks than two steps made
    assert dict(counts) == after_two_steps
    assert all(n > 0 for n in after_two_steps.values())


def test_the_warmup_check_changes_no_values() -> None:
    checked = run_threaded(_train, 4, (2, 2), 3)
    set_warmup_check(False)
    try:
        unchecked = run_threaded(_train, 4, (2, 2), 3)
    finally:
        set_warmup_check(True)
    for a, b in zip(checked, unchecked):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_warmup_check_false_turns_it_off_for_the_calling_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_checks(monkeypatch)

    def gather() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        with warmup_check(False):
            assert not is_warmup_check()
            return x.full_tensor()

    results = run_threaded(gather, 2)
    assert all(torch.equal(r, torch.arange(4.0)) for r in results)
    # distribute_tensor's scatter was checked; the gather was not (init_device_mesh's agreement is
    # itself a check, an all_gather of a digest, not a checked collective)
    assert counts == Counter({0: 1, 1: 1})
    counts.clear()
    run_threaded(
        lambda: distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (2,)), [Shard(0)]).full_tensor(), 2
    )
    assert counts == Counter({0: 2, 1: 2})  # with the check on, the gather is checked too


# ----- the switches --------------------------------------------------------------------------------
SILENT_REDUCE = """
import torch
from spmd.tensor import DTensor, Partial, init_device_mesh
from spmd.testing import run_threaded
from spmd.testing.multiprocess import RankFailed, run_multiprocess

def main():
    mesh = init_device_mesh("cpu", (2,))
    op = "sum" if mesh.get_rank() == 0 else "max"
    return DTensor.from_local(torch.full((2,), mesh.get_rank() + 1.0), mesh, [Partial(op)]).full_tensor()[0].item()

print(run_threaded(main, 2, timeout=30))
"""


@pytest.mark.parametrize(("spmd_debug", "fails"), [("", True), ("nocheck", False), ("verbose,nocheck", False)])
def test_spmd_debug_nocheck_turns_the_warmup_check_off(spmd_debug: str, fails: bool) -> None:
    env = {**os.environ, "SPMD_DEBUG": spmd_debug}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SILENT_REDUCE)], env=env, capture_output=True, text=True, timeout=120
    )
    if fails:
        assert done.returncode != 0 and "CollectiveMismatchError" in done.stderr
        assert "all_reduce(sum)" in done.stderr and "all_reduce(max)" in done.stderr
    else:
        # unchecked, the ranks silently disagree: rank 0 summed 1 + 2, rank 1 took max(1, 2)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[3.0, 2.0]"


def test_replicated_values_stay_replicated_under_the_default() -> None:
    def step() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        a = distribute_tensor(torch.arange(24.0).reshape(4, 6), mesh, [Shard(0), Replicate()])
        return (a @ a.t()).full_tensor()

    expected = torch.arange(24.0).reshape(4, 6)
    for result in run_threaded(step, 4):
        torch.testing.assert_close(result, expected @ expected.t())


# ----- gloo processes ------------------------------------------------------------------------------
def new_branch_after_the_warmup() -> None:
    """test_a_rank_taking_a_new_branch_after_the_warmup_raises_on_every_rank, on processes (uncaught)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
    for step in range(4):
        target = Shard(1) if step == 3 and mesh.get_rank() == 1 else Shard(0)
        x.redistribute(mesh, [target])


@pytest.mark.multiprocess
def test_a_new_branch_after_the_warmup_raises_on_every_gloo_process_within_seconds() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        # the group's timeout (60 s) is far beyond what this may take
        run_multiprocess(new_branch_after_the_warmup, 2, timeout=60.0)
    assert time.monotonic() - start < 30
    report = str(info.value)
    # rank 1 checked its new collective through the store and saw rank 0 waiting in its old one unchecked;
    # rank 0 raised the same error when rank 1's process went away. Rank 1 fails first, so the report
    # holds its error; rank 0's only if it came within the run's grace period, not always so under load.
    messages = dict(re.findall(r"CollectiveMismatchError: rank (\d+): ([^\n]*(?:\n  [^\n]*)*)", report))
    assert "1" in messages and set(messages.values()) == {messages["1"]}, report
    assert "ranks [0]: reduce_scatter(sum) on mesh dim 'tp' f32[2,2,4]" in messages["1"]
    assert "(not checked: this rank had issued it before)" in messages["1"]
    assert "ranks [1]: reduce_scatter(sum) on mesh dim 'tp' f32[2,4,2]" in messages["1"]
    assert "test_warmup_check.py:" in messages["1"] and "in new_branch_after_the_warmup" in messages["1"]
