"""Bytes each rank receives per redistribute: ours vs ``torch.distributed.tensor`` vs the minimum.

Run ``python benchmarks/redistribute.py`` (``--quick`` for a subset, ``--plans`` for our plan of
every transition that moves more than the minimum or more than torch).

Accounting (both libraries, one formula: the library's ring model, spmd/tensor/redistribute/cost.py,
the one our planner minimises): a collective over ``n`` ranks on a buffer
of ``B`` bytes per rank (the full, unsplit buffer: the gathered output of an all_gather, the stacked
input of a reduce_scatter or all_to_all) costs the bytes a rank receives under ring algorithms:
``(n-1)/n * B`` for all_gather, reduce_scatter, all_to_all and scatter, ``2(n-1)/n * B`` for
all_reduce and ``B`` for broadcast. Ours is read from ``CommDebugMode`` records (the cost model's
own unit); torch's from a ``TorchDispatchMode`` that sees the ``_c10d_functional`` ops its
redistribute issues. Every column is the maximum over ranks, so uneven shards are judged by the
rank that moves the most.

Minimum (per rank, then the maximum over ranks), a lower bound built from two disjoint parts:

* movement: the bytes of the rank's target region of the global tensor that lie outside its
  source region (a rank cannot produce an element it never held without receiving it). A Partial
  source dim covers like Replicate. A Partial target dim costs nothing by itself: a rank can keep
  what it holds on that dim (a shard zero-padded, or for max/min padded with -inf/+inf, is a valid
  partial), so the target is read with the source placement there.
* reduction: the source-Partial mesh dims that the target does not keep Partial form groups of
  ``N`` ranks (product of their sizes) that hold ``N`` different contributions to the same source
  region. Each element of that region that ``m >= 1`` group members need in their target must
  travel ``N - 1`` times (every contribution but one leaves its rank) plus ``m - 1`` times (each
  further member gets the result), i.e. ``(N + m - 2) / N`` element-bytes per rank on average.
  For one dim this is the usual bandwidth bound: ``(n-1)/n * B`` for P -> S (reduce_scatter),
  ``2(n-1)/n * B`` for P -> R (all_reduce, Patarasuk and Yuan 2009). Replicas of a contribution
  on other mesh dims are assumed not to split the work.

So R -> S and R -> P need 0; S -> R needs the bytes the rank does not hold; S(i) -> S(j) the part of
the new shard not already held. Ratios: 0/0 prints ``-``; x/0 with x > 0 prints ``inf``. The bound
and the transitions live in redistribute_bound.py, torch's side in redistribute_torch.py.

Reachable: our planner searches every plan of one-mesh-dim collectives, so where it stays above the
bound no such plan reaches it. The script names the reason per transition: a mesh dim that re-cuts
a tensor dim that a later mesh dim also cuts (in the source or the target) can run a collective only
once that later dim lets go of it, while the bound counts a route that keeps the cut (a strided
layout, or blocks relayed between ranks that share no mesh-dim group). The other transitions are
"reachable"; on them ours/min is 1.00 for even shapes and a few percent above for uneven ones (every
piece travels padded to the longest). Shapes are above 64 KiB: smaller tensors plan for the fewest
collectives first (latency), then bytes.

Ours runs in the in-process threaded world (and its values are checked against the source); the
same transitions also run ours on the gloo processes used for torch, and the script reports
whether the bytes agree. torch runs on gloo processes over loopback (world of 4, and of 8 for the
3-d mesh); for the 4-d mesh (world of 16, too slow as 16 gloo processes on a small machine) it runs
on the fake process group, rank after rank in this process (its collectives move no data there but
are issued on the same buffers; a case torch cannot run there would print n/a with the reason). On a CPU mesh torch replaces all_to_all with all_gather + chunk
(``torch/distributed/tensor/_collective_utils.py``), so S(i) -> S(j) rows are torch's gloo path.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from redistribute_bound import Case, min_bytes, recut_under_later_cut, spmd_placements
from redistribute_torch import Measured, full_tensor_of, torch_on_fake_pg, torch_rank

from spmd.tensor import init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.redistribute.cost import received_bytes
from spmd.tensor.redistribute.plan import plan_for_shape
from spmd.testing import run_multiprocess, run_threaded
from spmd.testing.layouts import make_dtensor

TIMEOUT_S = 120.0
"""Longest one multi-process run (and any one gloo collective in it) may take."""
PADDING_SLACK = 1.05
"""``--plans`` shows transitions whose ratio exceeds this (uneven shards pad by a few percent)."""


# ----- transitions ---------------------------------------------------------------------------------
TRANSITIONS: dict[tuple[int, ...], list[tuple[str, str]]] = {
    (4,): [
        ("S(0)", "R"),
        ("P", "R"),
        ("P", "S(0)"),
        ("R", "S(0)"),
        ("S(0)", "S(1)"),
        ("R", "P"),
        ("S(0)", "P"),
        ("P(max)", "R"),
    ],
    (2, 2): [
        ("S(0),S(1)", "R,R"),
        ("P,S(0)", "R,R"),
        ("S(0),S(0)", "R,S(0)"),
        ("R,S(0)", "S(0),R"),
        ("P,P", "S(0),S(1)"),
        ("S(1),S(0)", "S(0),S(1)"),
        ("P,P", "R,R"),
        ("S(0),S(0)", "R,R"),
    ],
    (2, 2, 2): [
        ("S(0),S(1),R", "R,R,R"),
        ("P,P,P", "R,R,R"),
        ("S(0),S(0),S(1)", "S(1),R,S(0)"),
        ("P,S(0),R", "S(0),R,S(1)"),
        ("S(0),S(1),S(0)", "R,R,R"),
        ("P,P,S(0)", "R,S(1),R"),
        ("R,S(0),S(1)", "S(1),S(0),R"),
        ("S(1),P,S(0)", "R,S(1),S(0)"),
        ("P,R,P", "S(0),S(0),R"),
    ],
    (2, 2, 2, 2): [
        ("S(0),S(0),S(0),S(0)", "R,R,R,R"),
        ("P,P,P,P", "R,R,R,R"),
        ("P,S(0),P,S(1)", "R,S(1),S(0),R"),
        ("S(0),R,S(1),P", "R,S(0),R,S(1)"),
        ("P,P,S(0),S(1)", "S(0),S(1),R,R"),
        ("S(0),S(1),S(0),S(1)", "S(1),S(0),S(1),S(0)"),
    ],
}
QUICK: dict[tuple[int, ...], list[tuple[str, str]]] = {
    (4,): [("S(0)", "R"), ("P", "R"), ("S(0)", "S(1)")],
    (2, 2): [("P,S(0)", "R,R"), ("S(1),S(0)", "S(0),S(1)"), ("P,P", "R,R")],
}
SHAPES = ((256, 192), (255, 191))
"""Even and uneven, and above ``SCATTERED_REDUCTION_MIN_BYTES`` (smaller tensors plan for fewest collectives)."""
FAKE_PG_WORLD = 16
"""From this world size on, torch runs on the fake process group, one rank after another in this
process: 16 gloo processes on a small machine take minutes. Its collectives move nothing there, but
its redistribute issues the same ops with the same buffers, which is all the accounting reads."""


def build_cases(quick: bool) -> list[Case]:
    table, shapes = (QUICK, SHAPES[:1]) if quick else (TRANSITIONS, SHAPES)
    return [
        Case(mesh_shape, tuple(src.split(",")), tuple(dst.split(",")), shape)
        for mesh_shape, pairs in table.items()
        for src, dst in pairs
        for shape in shapes
    ]


# ----- accounting ----------------------------------------------------------------------------------
ring_bytes = received_bytes
"""Bytes one rank receives for a collective on a buffer: the library's ring model (module docstring)."""


_SHORT = {
    "all_gather": "AG",
    "all_reduce": "AR",
    "reduce_scatter": "RS",
    "all_to_all": "A2A",
    "broadcast": "BC",
    "scatter": "SC",
}


def comms_summary(collectives: Sequence[tuple[str, int, int]]) -> str:
    """``AG(4)+AR(2)``: the collectives in issue order, each with its group size."""
    return "+".join(f"{_SHORT.get(kind, kind)}({n})" for kind, n, _ in collectives) or "-"


# ----- ours, threaded world ------------------------------------------------------------------------
def _ours_rank(cases: Sequence[Case], check_values: bool) -> list[Measured]:
    """Every case on this rank, with our DTensor (threaded world or gloo, whichever is current)."""
    meshes: dict[tuple[int, ...], Any] = {}
    results = []
    for case in cases:
        if case.mesh_shape not in meshes:
            meshes[case.mesh_shape] = init_device_mesh("cpu", case.mesh_shape)
        mesh = meshes[case.mesh_shape]
        full = full_tensor_of(case.shape)
        x = make_dtensor(full, mesh, spmd_placements(case.src))
        with CommDebugMode() as mode:
            y = x.redistribute(mesh, spmd_placements(case.dst))
        records = tuple((r.kind, r.group_size, r.tensor_bytes) for r in mode.records)
        received = sum(ring_bytes(*r) for r in records)
        if received != mode.get_total_bytes():
            raise AssertionError(f"{case.label}: our CommDebugMode disagrees with ring_bytes")
        ok = bool(torch.equal(y.full_tensor(), full)) if check_values else True
        results.append(Measured(received, records, ok))
    return results


def measure_ours_threaded(cases: Sequence[Case]) -> list[list[Measured]]:
    """``[case][rank]`` measurements of our library, each world size in one threaded world."""
    by_case: list[list[Measured]] = [[] for _ in cases]
    for world_size in sorted({c.world_size for c in cases}):
        index = [i for i, c in enumerate(cases) if c.world_size == world_size]
        per_rank = run_threaded(_ours_rank, world_size, [cases[i] for i in index], True)
        for j, i in enumerate(index):
            by_case[i] = [per_rank[r][j] for r in range(world_size)]
    return by_case


# ----- torch, gloo processes -----------------------------------------------------------------------
def _gloo_rank(cases: Sequence[Case]) -> tuple[list[Measured], list[Measured] | str]:
    """One gloo rank (under ``run_multiprocess``): torch's side, then ours on the same default group."""
    # torch's one-time notes (gloo's all_to_all fallback, deprecated c10d names) would bury the table.
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    theirs = torch_rank(cases)
    try:
        ours: list[Measured] | str = _ours_rank(cases, check_values=False)
    except Exception as error:  # reported next to the table; torch's numbers still count
        ours = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return theirs, ours


def measure_gloo(cases: Sequence[Case]) -> tuple[list[list[Measured]], list[list[Measured]] | str]:
    """``[case][rank]`` measurements of torch and of ours, on spawned gloo processes over loopback.

    Ours comes back as the first rank's error message instead if it failed on gloo.
    """
    torch_by_case: list[list[Measured]] = [[] for _ in cases]
    ours_by_case: list[list[Measured]] = [[] for _ in cases]
    ours_error = ""
    for world_size in sorted({c.world_size for c in cases}):
        index = [i for i, c in enumerate(cases) if c.world_size == world_size]
        if world_size >= FAKE_PG_WORLD:
            for i, measured in zip(index, torch_on_fake_pg([cases[i] for i in index], world_size)):
                torch_by_case[i] = measured
            continue
        gathered = run_multiprocess(_gloo_rank, world_size, [cases[i] for i in index], timeout=TIMEOUT_S)
        for j, i in enumerate(index):
            torch_by_case[i] = [gathered[r][0][j] for r in range(world_size)]
        errors = [ours for _, ours in gathered if isinstance(ours, str)]
        if errors:
            ours_error = ours_error or f"world of {world_size}: {errors[0]}"
            continue
        for j, i in enumerate(index):
            ours_by_case[i] = [gathered[r][1][j] for r in range(world_size)]
    return torch_by_case, ours_error or ours_by_case


# ----- report --------------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    return f"{n:.0f} B" if n < 1024 else f"{n / 1024:.2f} KiB"


def ratio(num: int, den: int) -> float | None:
    """``num / den``; None for 0/0 (nothing to move, nothing moved), inf for x/0."""
    if den == 0:
        return None if num == 0 else math.inf
    return num / den


def format_ratio(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else "inf" if math.isinf(value) else f"{value:.{digits}f}"


@dataclass(frozen=True, slots=True)
class Row:
    """One case's figures: the max over ranks of ours, torch's and the bound, and the ratios."""

    case: Case
    ours: int
    torch: int | None
    least: int
    vs_min: float | None
    vs_torch: float | None
    comms: tuple[str, str]

    def cells(self) -> tuple[str, ...]:
        c = self.case
        na = self.torch is None
        return (
            c.label,
            "x".join(map(str, c.mesh_shape)),
            "x".join(map(str, c.shape)),
            human_bytes(self.ours),
            "n/a" if na else human_bytes(self.torch or 0),
            human_bytes(self.least),
            format_ratio(self.vs_min),
            "n/a" if na else format_ratio(self.vs_torch),
            *self.comms,
        )


def build_rows(cases: Sequence[Case], ours: list[list[Measured]], theirs: list[list[Measured]]) -> list[Row]:
    rows = []
    for case, mine, other in zip(cases, ours, theirs):
        ours_b, least = max(m.bytes for m in mine), min_bytes(case)
        torch_b = None if other[0].unsupported else max(m.bytes for m in other)
        rows.append(
            Row(
                case,
                ours_b,
                torch_b,
                least,
                ratio(ours_b, least),
                None if torch_b is None else ratio(ours_b, torch_b),
                (comms_summary(mine[0].collectives), "n/a" if torch_b is None else comms_summary(other[0].collectives)),
            )
        )
    return rows


def print_table(rows: Sequence[Row]) -> None:
    header = (
        "transition",
        "mesh",
        "shape",
        "ours",
        "torch",
        "min",
        "ours/min",
        "ours/torch",
        "ours comms",
        "torch comms",
    )
    cells = [r.cells() for r in rows]
    widths = [max(len(str(r[i])) for r in (header, *cells)) for i in range(len(header))]
    right = {3, 4, 5, 6, 7}

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    print(
        "bytes received per rank (max over ranks), ring accounting; ours: threaded world, torch: gloo "
        f"processes (fake process group from a world of {FAKE_PG_WORLD})"
    )
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))


def _worst(rows: Sequence[Row], field: str) -> tuple[float, str]:
    found = [
        (getattr(r, field), f"{r.case.label} mesh {r.case.mesh_shape} {r.case.shape}")
        for r in rows
        if getattr(r, field) is not None
    ]
    return max(found, default=(0.0, ""))


def _is_even(case: Case) -> bool:
    return not any(n % math.prod(case.mesh_shape) for n in case.shape)


def out_of_reach(rows: Sequence[Row]) -> dict[tuple[Any, ...], tuple[Row, str]]:
    """The transitions whose even shape moves more than the bound, each with why no plan of ours reaches it."""
    found = {}
    for r in rows:
        if _is_even(r.case) and (r.vs_min or 0) > 1 + 1e-9:
            why = recut_under_later_cut(r.case) or "UNEXPLAINED: the planner should reach the bound here"
            found[(r.case.mesh_shape, r.case.src, r.case.dst)] = (r, why)
    return found


def print_summary(rows: Sequence[Row]) -> None:
    """The worst ratios, overall and per mesh rank, and why each transition above the bound stops short."""
    beyond = out_of_reach(rows)
    reachable = [r for r in rows if (r.case.mesh_shape, r.case.src, r.case.dst) not in beyond]
    even = [r for r in reachable if _is_even(r.case)]
    print()
    for name, subset in (("ours/min", rows), ("ours/min, bound reachable", reachable),
                         ("ours/min, reachable, even", even)):  # fmt: skip
        value, where = _worst(subset, "vs_min")
        print(f"worst {name + ':':<27}{format_ratio(value, 3)} ({where})")
    value, where = _worst(rows, "vs_torch")
    print(f"worst {'ours/torch:':<27}{format_ratio(value, 3)} ({where})")
    for ndim in sorted({len(r.case.mesh_shape) for r in rows}):
        mine = [r for r in rows if len(r.case.mesh_shape) == ndim]
        reach = [r for r in mine if r in reachable]
        print(f"  {ndim}-d mesh: worst ours/min {format_ratio(_worst(mine, 'vs_min')[0], 3)} "
              f"({format_ratio(_worst(reach, 'vs_min')[0], 3)} where reachable, uneven pieces padded), "
              f"worst ours/torch {format_ratio(_worst(mine, 'vs_torch')[0], 3)}")  # fmt: skip
    if beyond:
        print("bound out of reach of one-mesh-dim collectives (the planner searched them all):")
    for r, why in beyond.values():
        print(f"  {r.case.label} mesh {'x'.join(map(str, r.case.mesh_shape))} ({format_ratio(r.vs_min)}x): {why}")


def report(
    cases: Sequence[Case],
    ours: list[list[Measured]],
    theirs: list[list[Measured]],
    ours_gloo: list[list[Measured]] | str,
    *,
    plans: bool,
) -> None:
    rows = build_rows(cases, ours, theirs)
    print_table(rows)
    print_summary(rows)
    for r in rows:
        if r.torch is None:
            print(f"torch n/a for {r.case.label}: {theirs[cases.index(r.case)][0].unsupported}")
    bad_values = [c.label + f" {c.shape}" for c, m in zip(cases, ours) if not all(r.values_ok for r in m)]
    print(f"our values: {'all match the source' if not bad_values else 'WRONG for ' + '; '.join(bad_values)}")
    if isinstance(ours_gloo, str):
        print(f"ours on gloo: FAILED, {ours_gloo}")
    else:
        pairs = [(c, a, b) for c, a, b in zip(cases, ours, ours_gloo) if b]
        differ = [f"{c.label} {c.shape}" for c, a, b in pairs if [r.bytes for r in a] != [r.bytes for r in b]]
        print(
            "ours on gloo: "
            + (
                "differs for " + "; ".join(differ)
                if differ
                else f"same bytes as threaded on all {len(pairs)} run there"
            )
        )
    flagged = [r.case for r in rows if (r.vs_min or 0) > PADDING_SLACK or (r.vs_torch or 0) > PADDING_SLACK]
    if plans and flagged:
        print(f"\nour plans where ours/min or ours/torch exceeds {PADDING_SLACK}:")
        for case in flagged:
            print(f"  {case.label} mesh {case.mesh_shape} {case.shape}")
            for step in plan_for_shape(
                spmd_placements(case.src), spmd_placements(case.dst), case.mesh_shape, case.shape
            ):
                print(f"    {step}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few transitions on one shape, world of 4 only")
    parser.add_argument(
        "--plans",
        action="store_true",
        help="print our plan for each transition that moves more than the minimum or torch",
    )
    args = parser.parse_args(argv)
    cases = build_cases(args.quick)
    started = time.monotonic()
    ours = measure_ours_threaded(cases)
    theirs, ours_gloo = measure_gloo(cases)
    report(cases, ours, theirs, ours_gloo, plans=args.plans)
    print(f"\n{len(cases)} transitions in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
