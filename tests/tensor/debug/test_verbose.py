"""Verbose mode: one line per op with placements, strategy, redistributes and cache hits."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import is_verbose, set_verbose, verbose
from spmd.testing import run_threaded
from spmd.testing import seeded_randn as seeded


def matmul_then_relu() -> None:
    mesh = init_device_mesh("cpu", (4,))
    a = distribute_tensor(seeded(8, 6), mesh, [Shard(1)])
    b = distribute_tensor(seeded(6, 4), mesh, [Shard(0)])
    torch.relu(a @ b)
    torch.relu(a @ b)


def verbose_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("spmd.tensor")]


def test_each_op_logs_placements_strategy_and_cache(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spmd.tensor")
    with verbose():
        run_threaded(matmul_then_relu, 4)
    lines = verbose_lines(caplog)
    mm = [line for line in lines if "aten.mm.default" in line]
    assert mm[0].startswith("[rank 0] aten.mm.default")
    assert "(S(1)) f32[8,6], (S(0)) f32[6,4]  ->  (P(sum)) f32[8,4]" in mm[0]
    assert "via S(1), S(0) -> P(sum)" in mm[0]
    assert "[MISS]" in mm[0] or "[HIT]" in mm[0]
    assert mm[-1].endswith("[HIT]")
    relu = lines.index(next(line for line in lines if "aten.relu.default" in line))
    # the partial is reduced before relu: the redistribute and its collective follow the op line
    assert lines[relu + 1].startswith("[rank 0]   input 0: (P(sum)) -> (R)")
    assert "mesh dim 0: P(sum) -> R  all_reduce(sum)" in lines[relu + 2]
    assert lines[relu + 2].rstrip().endswith("B")
    assert all(line.startswith("[rank 0]") for line in lines), "only rank 0 logs by default"


def test_rank_selection(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spmd.tensor")
    with verbose(ranks="all"):
        run_threaded(matmul_then_relu, 4)
    ranks = {line.split("]")[0] + "]" for line in verbose_lines(caplog)}
    assert ranks == {f"[rank {r}]" for r in range(4)}
    caplog.clear()
    with verbose(ranks=[1, 3]):
        run_threaded(matmul_then_relu, 4)
    assert {line.split("]")[0] + "]" for line in verbose_lines(caplog)} == {"[rank 1]", "[rank 3]"}


def test_user_redistribute_and_its_backward_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    def gather_with_grad() -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(seeded(4, 4), mesh, [Shard(0), Partial()]).requires_grad_()
        x.redistribute(mesh, [Replicate(), Replicate()]).to_local().sum().backward()

    caplog.set_level(logging.INFO, logger="spmd.tensor")
    with verbose():
        run_threaded(gather_with_grad, 4)
    text = "\n".join(verbose_lines(caplog))
    assert "redistribute                 f32[4,4] (S(0), P(sum)) on mesh(d0=2, d1=2) -> (R, R)" in text
    assert "mesh dim 1: P(sum) -> R  all_reduce(sum)" in text
    assert "mesh dim 0: S(0) -> R  all_gather(dim=0)" in text
    assert "redistribute (backward)" in text


def test_off_by_default_and_silent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spmd.tensor")
    assert not is_verbose()
    run_threaded(matmul_then_relu, 4)
    assert verbose_lines(caplog) == []


def test_set_verbose_toggles() -> None:
    set_verbose(True)
    try:
        assert is_verbose()
    finally:
        set_verbose(False)
    assert not is_verbose()


def test_environment_variable_turns_it_on() -> None:
    script = (
        "import torch\n"
        "from spmd.tensor import init_device_mesh, distribute_tensor, Shard\n"
        "import spmd.tensor.debug\n"
        "from spmd.testing import run_threaded\n"
        "def f():\n"
        "    m = init_device_mesh('cpu', (2,))\n"
        "    x = distribute_tensor(torch.ones(4, 2), m, [Shard(0)])\n"
        "    (x + x).full_tensor()\n"
        "run_threaded(f, 2)\n"
    )
    env = {**os.environ, "SPMD_DEBUG": "verbose", "SPMD_DEBUG_RANKS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[rank 1] aten.add.Tensor" in done.stderr
    assert "[rank 0]" not in done.stderr
    assert "all_gather(dim=0)" in done.stderr


def test_a_rule_that_replicates_a_sharded_input_says_how_much_it_gathers(caplog: pytest.LogCaptureFixture) -> None:
    def softmax_over_sharded_dim() -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = seeded(768)
        x = distribute_tensor(full, mesh, [Shard(0), Replicate()])
        torch.testing.assert_close(torch.softmax(x, 0).full_tensor(), torch.softmax(full, 0))
        total = distribute_tensor(full, mesh, [Replicate(), Partial()])
        torch.testing.assert_close(torch.softmax(total, 0).full_tensor(), torch.softmax(full, 0))
        torch.relu(x)  # keeps the shard: no note

    caplog.set_level(logging.INFO, logger="spmd.tensor")
    with verbose():
        run_threaded(softmax_over_sharded_dim, 4)
    lines = verbose_lines(caplog)
    # 768 float32 values = 3 KiB that every rank now holds whole
    assert "[rank 0]   input 0: (S(0), R) -> (R, R)  gathers 3.0 KiB" in lines
    # a partial sum made whole is reduced, not gathered (the rank held 3 KiB already)
    assert "[rank 0]   input 0: (R, P(sum)) -> (R, R)  reduces 3.0 KiB" in lines
    relu = next(i for i, line in enumerate(lines) if "aten.relu.default" in line)
    assert not any("gathers" in line or "reduces" in line for line in lines[relu:])
