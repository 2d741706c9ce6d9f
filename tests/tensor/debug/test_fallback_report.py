"""The replicate fallback never gathers silently: one warning per op and process, a report of every
op that fell back with its calls and bytes gathered, and the bytes in verbose lines."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import FallbackRecord, fallback_report, reset_fallback_report, verbose
from spmd.tensor.debug.fallbacks import _forget_warnings
from spmd.tensor.sharding.registry import REGISTRY
from spmd.testing import run_threaded
from spmd.testing import seeded_randn as randn

aten = torch.ops.aten
F32 = 4


@pytest.fixture(autouse=True)
def fresh_report() -> Iterator[None]:
    reset_fallback_report()
    _forget_warnings()
    yield
    reset_fallback_report()


def fallback_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "spmd.tensor.dispatch" and r.levelno == logging.WARNING]


def sin_three_times() -> bool:
    mesh = init_device_mesh("cpu", (2, 2))
    full = randn(10, 6)  # 10 rows on 2 ranks of mesh dim 0, 6 columns on mesh dim 1
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    ok = True
    for _ in range(3):
        ok = ok and torch.equal(torch.sin(x).full_tensor(), torch.sin(full))
    return ok


def test_an_op_without_rule_warns_once_per_process_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="spmd.tensor.dispatch")
    with REGISTRY.override(aten.sin.default, None):
        assert run_threaded(sin_three_times, 4) == [True] * 4
        assert run_threaded(sin_three_times, 4) == [True] * 4
    warnings = fallback_warnings(caplog)
    assert len(warnings) == 1, warnings  # 4 rank threads, 2 worlds, 6 calls each: one warning
    assert warnings[0].startswith("aten.sin.default has no sharding rule")
    assert "spmd.tensor.debug.fallback_report()" in warnings[0]
    # each call gathers the whole 10x6 float32 input on every rank
    assert fallback_report()[aten.sin.default] == FallbackRecord("aten.sin.default", 6, 6 * 10 * 6 * F32, 4)


def test_bytes_gathered_count_each_input_once_and_replicated_inputs_not_at_all() -> None:
    def mixed_inputs() -> None:
        mesh = init_device_mesh("cpu", (4,))
        a = distribute_tensor(randn(8, 3), mesh, [Shard(0)])
        b = distribute_tensor(randn(8, 3), mesh, [Replicate()])
        p = distribute_tensor(randn(8, 3), mesh, [Partial()])
        full_a, full_b = a.full_tensor(), b.full_tensor()
        torch.testing.assert_close(torch.mul(a, a).full_tensor(), full_a * full_a)  # a is gathered once
        torch.testing.assert_close(torch.mul(a, b).full_tensor(), full_a * full_b)
        torch.testing.assert_close(torch.mul(b, b).full_tensor(), full_b * full_b)  # nothing to gather
        torch.testing.assert_close(torch.mul(p, b).full_tensor(), p.full_tensor() * full_b)  # an all-reduce

    with REGISTRY.override(aten.mul.Tensor, None):
        run_threaded(mixed_inputs, 4)
    record = fallback_report()[aten.mul.Tensor]
    assert (record.calls, record.ranks) == (4, 4)
    assert record.bytes_gathered == 3 * 8 * 3 * F32


def test_report_lists_every_op_most_bytes_first_and_prints_a_table() -> None:
    def two_ops() -> None:
        mesh = init_device_mesh("cpu", (4,))
        small = distribute_tensor(randn(4), mesh, [Shard(0)])
        big = distribute_tensor(randn(64, 4), mesh, [Shard(1)])
        torch.cos(small)
        torch.cos(small)
        torch.sin(big)

    with REGISTRY.override(aten.sin.default, None), REGISTRY.override(aten.cos.default, None):
        run_threaded(two_ops, 4)
    report = fallback_report()
    assert [(r.op, r.calls, r.bytes_gathered) for r in report] == [
        ("aten.sin.default", 1, 64 * 4 * F32),
        ("aten.cos.default", 2, 2 * 4 * F32),
    ]
    assert aten.cos.default in report and "aten.exp.default" not in report
    assert report.bytes_gathered == (64 * 4 + 2 * 4) * F32
    lines = str(report).splitlines()
    assert lines[0].split() == ["op", "calls/rank", "gathered/rank", "ranks"]
    assert lines[1].split() == ["aten.sin.default", "1", "1.0", "KiB", "4"]
    assert lines[2].split() == ["aten.cos.default", "2", "32", "B", "4"]
    assert lines[3].split() == ["total", "3", "1.0", "KiB"]
    with pytest.raises(KeyError, match=r"aten\.exp\.default did not fall back; ops that did"):
        report[aten.exp.default]


def test_reset_starts_counting_afresh() -> None:
    with REGISTRY.override(aten.sin.default, None):
        run_threaded(sin_three_times, 4)
        assert fallback_report()[aten.sin.default].calls == 3
        reset_fallback_report()
        assert len(fallback_report()) == 0
        assert str(fallback_report()) == "no op fell back"
        run_threaded(sin_three_times, 4)
    assert fallback_report()[aten.sin.default].calls == 3


def test_ops_with_rules_are_not_reported() -> None:
    run_threaded(sin_three_times, 4)
    assert aten.sin.default not in fallback_report()


def test_verbose_fallback_lines_show_the_bytes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spmd.tensor")
    with REGISTRY.override(aten.sin.default, None), verbose():
        run_threaded(sin_three_times, 4)
    lines = [r.getMessage() for r in caplog.records if r.name == "spmd.tensor"]
    first = lines.index(next(line for line in lines if "aten.sin.default" in line))
    assert "FALLBACK: inputs replicated" in lines[first]
    assert lines[first + 1] == "[rank 0]   input 0: (S(0), S(1)) -> (R, R)  gathers 240 B"
    gathered = [line for line in lines if "fallback gathered" in line]
    assert len(gathered) == 3
    assert gathered[0] == (
        "[rank 0]   fallback gathered 240 B into replicated inputs (see spmd.tensor.debug.fallback_report())"
    )
