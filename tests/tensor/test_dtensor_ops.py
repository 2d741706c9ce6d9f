"""OpInfo sweep: PyTorch's OpInfo samples on DTensors in many layouts, compared with plain torch.

For each OpInfo in the slice (``SLICE_OPS`` in ``spmd/testing/op_sweep.py``, about 150 common ops)
the harness takes up to 3 float32 samples and runs each in several layouts (all Replicate; each
tensor argument sharded on each dim, the others replicated; all sharded on their first / last dim;
two mixed layouts on a (2, 2) mesh; uneven and empty shards come from the sample shapes), forward
and, where the OpInfo supports autograd, backward. Every case runs on ONE threaded world of 4 ranks
per sweep. Two sweeps: the rules alone (the dispatcher's replicate fallback off, so an op without
a rule is ERROR-NOT-IMPLEMENTED), and the default with the fallback on.

What is asserted: no FAIL-WRONG anywhere (a wrong value, shape, dtype or gradient), except the
ops in ``KNOWN_WRONG``, each a core bug reported and waiting for a fix; and every slice op passes
unless it is listed in ``XFAIL`` (rules alone) or ``XFAIL_FALLBACK`` (fallback on). An xfail op
that passes is printed as XPASS (remove it from the list); it does not fail the test, since other
work adds rules all the time. Run with ``-s`` for the report. The whole op_db runs in the slow
test and in ``python benchmarks/opinfo_sweep.py --full`` (which also runs torch's DTensor).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest (pip install expecttest)")

from spmd.comm.threaded import current_threaded_world
from spmd.tensor import DTensor, Replicate, Shard
from spmd.testing import op_sweep as sweep

_LIST_INDEX = "x[[0, 2]]-style indexing builds a plain index tensor inside torch (ERROR-OTHER: mixed with DTensors)"
_UNBIND = "unbind along a sharded dim raises, as in torch.distributed.tensor (torch's own op sweep xfails unbind)"

XFAIL: dict[str, str] = {
    # Ops of the slice that do not pass on the rules alone, one line each: why.
    "__getitem__": _LIST_INDEX,
    "unbind": _UNBIND,
}

XFAIL_FALLBACK: dict[str, str] = {
    # Ops of the slice that do not pass even with the replicate fallback.
    "__getitem__": _LIST_INDEX,
    "unbind": _UNBIND,
}

KNOWN_WRONG: dict[str, str] = {
    # FAIL-WRONG that a core bug causes, reported with a reproduction; remove once fixed (the test
    # fails while an op listed here no longer gives a wrong value, so the list stays honest).
    # Empty: the fallback's wrong results (in-place views, views of gathered copies, conj views)
    # were fixed by refusing those cases; they now raise and are counted as errors, not passes.
}


def _prepare(keys: list[str] | None) -> list[sweep.PreparedOp]:
    op_db = sorted(sweep.load_op_db(), key=sweep.op_key)
    return sweep.prepare_ops(op_db if keys is None else [o for o in op_db if sweep.op_key(o) in keys])


def _sweep(prepared: list[sweep.PreparedOp], *, fallback: bool, title: str) -> list[sweep.OpReport]:
    began = time.monotonic()
    reports = sweep.summarize(prepared, sweep.run_threaded_sweep(prepared, fallback=fallback))
    print("\n" + sweep.format_report(reports, title=f"{title} ({time.monotonic() - began:.0f}s)"))
    return reports


@pytest.fixture(scope="module", autouse=True)
def _quiet_fallback_warnings() -> Iterator[None]:
    logger = logging.getLogger("spmd.tensor.dispatch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture(scope="module")
def slice_ops() -> list[sweep.PreparedOp]:
    return _prepare(list(sweep.SLICE_OPS))


@pytest.fixture(scope="module")
def rules_report(slice_ops: list[sweep.PreparedOp]) -> list[sweep.OpReport]:
    return _sweep(slice_ops, fallback=False, title="slice, rules alone")


@pytest.fixture(scope="module")
def fallback_report(slice_ops: list[sweep.PreparedOp]) -> list[sweep.OpReport]:
    return _sweep(slice_ops, fallback=True, title="slice, replicate fallback on")


def _check_wrong(reports: list[sweep.OpReport]) -> None:
    wrong = {r.key: r.worst for r in reports if r.status == sweep.FAIL_WRONG}
    new = {k: v for k, v in wrong.items() if k not in KNOWN_WRONG}
    assert not new, "wrong values:\n" + "\n".join(f"{k}: {v}" for k, v in new.items())


def _check_passing(reports: list[sweep.OpReport], xfail: dict[str, str]) -> None:
    failing = {
        r.key: f"{r.status}: {r.worst}" for r in reports if r.status not in (sweep.PASS, sweep.FAIL_WRONG, "SKIP")
    }
    unexpected = {k: v for k, v in failing.items() if k not in xfail}
    xpass = sorted(r.key for r in reports if r.status == sweep.PASS and r.key in xfail)
    if xpass:
        print(f"\nXPASS (remove from the xfail list): {', '.join(xpass)}")
    assert not unexpected, "ops that no longer pass:\n" + "\n".join(f"{k}: {v}" for k, v in unexpected.items())


# ----- the harness itself ------------------------------------------------------------------------
@dataclass
class _Sample:
    input: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def _op(key: str, fn: Callable[..., Any], *samples: _Sample) -> sweep.PreparedOp:
    prepared = [sweep.prepare_sample(fn, s, check_backward=True, seed=i) for i, s in enumerate(samples)]
    assert all(not isinstance(p, str) for p in prepared), prepared
    return sweep.PreparedOp(key, fn, [p for p in prepared if not isinstance(p, str)])


def _rank() -> int:
    world = current_threaded_world()
    assert world is not None
    return world.current_rank()


def _fails_off_rank_0(x: torch.Tensor) -> torch.Tensor:
    """Right everywhere, except that it raises on ranks 1-3 for one layout."""
    if isinstance(x, DTensor) and x.placements == (Shard(1),) and _rank() != 0:
        raise ValueError("only rank 0 gets past this")
    return x * 2


def _wrong_on_sharded(x: torch.Tensor) -> torch.Tensor:
    if isinstance(x, DTensor) and x.placements[0] != Replicate():
        return x + 1
    return x * 1


def _wrong_grad_on_sharded(x: torch.Tensor) -> torch.Tensor:
    """The right value, but twice the gradient when x is sharded."""
    if isinstance(x, DTensor) and x.placements[0] != Replicate():
        return x * 2 - x.detach()
    return x * 1


def test_harness_recovers_from_rank_dependent_failure_and_flags_wrong_values() -> None:
    """One rank failing alone leaves the others in a collective: the case is ERROR-OTHER, and the
    sweep goes on in a fresh world with every later case right; a wrong value or gradient is FAIL-WRONG."""
    x = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    ops = [
        _op("fails_off_rank_0", _fails_off_rank_0, _Sample(x)),
        _op("add", torch.add, _Sample(x, (x.flip(0),))),
        _op("wrong_on_sharded", _wrong_on_sharded, _Sample(x)),
        _op("wrong_grad_on_sharded", _wrong_grad_on_sharded, _Sample(x)),
    ]
    reports = sweep.summarize(ops, sweep.run_threaded_sweep(ops, collective_timeout=2.0))
    status = {r.key: r.status for r in reports}
    assert status == {
        "fails_off_rank_0": sweep.ERROR_OTHER,
        "add": sweep.PASS,
        "wrong_on_sharded": sweep.FAIL_WRONG,
        "wrong_grad_on_sharded": sweep.FAIL_WRONG,
    }
    assert reports[3].worst.split(" | ")[-1].startswith("backward: grad of tensor argument 0")
    assert "ranks disagree" in reports[0].worst and "only rank 0 gets past this" in reports[0].worst
    assert reports[0].counts == {sweep.PASS: reports[0].cases - 1, sweep.ERROR_OTHER: 1}
    assert reports[1].cases == len(ops[1].samples[0].layouts) > 4


def test_slice_ops_are_all_swept(rules_report: list[sweep.OpReport]) -> None:
    """Every op of the slice is in op_db and has usable samples (a rename must not shrink the slice)."""
    swept = {r.key for r in rules_report if r.status != "SKIP"}
    skipped = {r.key: r.worst for r in rules_report if r.status == "SKIP"}
    assert not skipped, f"slice ops that were not swept: {skipped}"
    assert swept == set(sweep.SLICE_OPS)


def test_rules_give_no_wrong_values(rules_report: list[sweep.OpReport]) -> None:
    _check_wrong(rules_report)


def test_rules_pass_every_op_not_in_xfail(rules_report: list[sweep.OpReport]) -> None:
    _check_passing(rules_report, XFAIL)


def test_fallback_gives_no_wrong_values(fallback_report: list[sweep.OpReport]) -> None:
    _check_wrong(fallback_report)


def test_fallback_passes_every_op_not_in_xfail(fallback_report: list[sweep.OpReport]) -> None:
    _check_passing(fallback_report, XFAIL_FALLBACK)


def test_known_wrong_are_still_wrong(rules_report: list[sweep.OpReport], fallback_report: list[sweep.OpReport]) -> None:
    """A KNOWN_WRONG op of the slice that gives right values now must leave the list."""
    slice_known = set(KNOWN_WRONG) & set(sweep.SLICE_OPS)
    still = {r.key for r in rules_report + fallback_report if r.status == sweep.FAIL_WRONG}
    fixed = sorted(slice_known - still)
    assert not fixed, f"no longer wrong, remove from KNOWN_WRONG: {fixed}"


@pytest.mark.slow
@pytest.mark.parametrize("fallback", [False, True], ids=["rules", "fallback"])
def test_full_op_db_gives_no_wrong_values(fallback: bool) -> None:
    """Every OpInfo (about 2-4 minutes per mode on two cores): no wrong value outside KNOWN_WRONG."""
    _check_wrong(_sweep(_prepare(None), fallback=fallback, title=f"op_db, fallback={fallback}"))


def test_importing_the_harness_leaves_op_db_alone() -> None:
    """``import spmd.testing.op_sweep`` must not load torch's OpInfo database (only load_op_db does)."""
    code = (
        "import sys, spmd.testing, spmd.testing.op_sweep; "
        "sys.exit('torch.testing._internal.common_methods_invocations' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
