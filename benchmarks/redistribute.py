"""Bytes each rank receives per redistribute: ours vs ``torch.distributed.tensor`` vs the minimum.

Run ``python benchmarks/redistribute.py`` (``--quick`` for a subset, ``--plans`` for our plan of
every transition that moves more than the minimum or more than torch).

Accounting (both libraries, one formula, ``ring_bytes``): a collective over ``n`` ranks on a buffer
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
the new shard not already held. Ratios: 0/0 prints ``-``; x/0 with x > 0 prints ``inf``.

Ours runs in the in-process threaded world (and its values are checked against the source); the
same transitions also run ours on the gloo processes used for torch, and the script reports
whether the bytes agree. torch runs on gloo processes over loopback (world of 4, and of 8 for the
3-d mesh). On a CPU mesh torch replaces all_to_all with all_gather + chunk
(``torch/distributed/tensor/_collective_utils.py``), so S(i) -> S(j) rows are torch's gloo path.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import re
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import spmd.tensor
from spmd.tensor import Partial, Placement, Shard, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.redistribute.plan import plan_redistribute
from spmd.testing import run_multiprocess, run_threaded
from spmd.testing.layouts import make_dtensor

TIMEOUT_S = 120.0
"""Longest one multi-process run (and any one gloo collective in it) may take."""
PADDING_SLACK = 1.05
"""``--plans`` shows transitions whose ratio exceeds this (uneven shards pad by a few percent)."""


# ----- transitions ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Case:
    """One redistribute: ``src -> dst`` of a float32 tensor of ``shape`` on a mesh of ``mesh_shape``."""

    mesh_shape: tuple[int, ...]
    src: tuple[str, ...]
    dst: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def label(self) -> str:
        return f"[{','.join(self.src)}] -> [{','.join(self.dst)}]"


TRANSITIONS: dict[tuple[int, ...], list[tuple[str, str]]] = {
    (4,): [
        ("S(0)", "R"), ("P", "R"), ("P", "S(0)"), ("R", "S(0)"), ("S(0)", "S(1)"),
        ("R", "P"), ("S(0)", "P"), ("P(max)", "R"),
    ],
    (2, 2): [
        ("S(0),S(1)", "R,R"), ("P,S(0)", "R,R"), ("S(0),S(0)", "R,S(0)"), ("R,S(0)", "S(0),R"),
        ("P,P", "S(0),S(1)"), ("S(1),S(0)", "S(0),S(1)"), ("P,P", "R,R"), ("S(0),S(0)", "R,R"),
    ],
    (2, 2, 2): [
        ("S(0),S(1),R", "R,R,R"), ("P,P,P", "R,R,R"), ("S(0),S(0),S(1)", "S(1),R,S(0)"),
    ],
}
QUICK: dict[tuple[int, ...], list[tuple[str, str]]] = {
    (4,): [("S(0)", "R"), ("P", "R"), ("S(0)", "S(1)")],
    (2, 2): [("P,S(0)", "R,R"), ("S(1),S(0)", "S(0),S(1)")],
}
SHAPES = ((64, 48), (63, 47))


def build_cases(quick: bool) -> list[Case]:
    table, shapes = (QUICK, SHAPES[:1]) if quick else (TRANSITIONS, SHAPES)
    return [
        Case(mesh_shape, tuple(src.split(",")), tuple(dst.split(",")), shape)
        for mesh_shape, pairs in table.items()
        for src, dst in pairs
        for shape in shapes
    ]


_PLACEMENT = re.compile(r"^(?:R|S\((-?\d+)\)|P(?:\((sum|avg|max|min)\))?)$")


def parse_placement(text: str, lib: Any) -> Any:
    """``"S(1)"``, ``"R"``, ``"P"`` or ``"P(max)"`` as a placement of ``lib`` (spmd.tensor or torch's)."""
    match = _PLACEMENT.match(text)
    if match is None:
        raise ValueError(f"cannot read placement {text!r}; write R, S(dim), P or P(op)")
    if text == "R":
        return lib.Replicate()
    if text.startswith("S"):
        return lib.Shard(int(match.group(1)))
    return lib.Partial(match.group(2) or "sum")


def spmd_placements(texts: Sequence[str]) -> tuple[Placement, ...]:
    return tuple(parse_placement(t, spmd.tensor) for t in texts)


# ----- accounting ----------------------------------------------------------------------------------
def ring_bytes(kind: str, group_size: int, tensor_bytes: int) -> int:
    """Bytes one rank receives for a collective on a ``tensor_bytes`` buffer (see module docstring)."""
    n = group_size
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1) * tensor_bytes // n
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "scatter"):
        return (n - 1) * tensor_bytes // n
    if kind == "broadcast":
        return tensor_bytes
    raise ValueError(f"no ring accounting for collective {kind!r}")


_SHORT = {"all_gather": "AG", "all_reduce": "AR", "reduce_scatter": "RS", "all_to_all": "A2A",
          "broadcast": "BC", "scatter": "SC"}


def comms_summary(collectives: Sequence[tuple[str, int, int]]) -> str:
    """``AG(4)+AR(2)``: the collectives in issue order, each with its group size."""
    return "+".join(f"{_SHORT.get(kind, kind)}({n})" for kind, n, _ in collectives) or "-"


# ----- the minimum ---------------------------------------------------------------------------------
def _chunks(size: int, n: int) -> list[tuple[int, int]]:
    """(offset, length) of the n pieces of ``size`` as torch.chunk cuts it, empty pieces at the end."""
    step = -(-size // n) if size else 0
    return [(min(i * step, size), max(0, min(step, size - i * step))) for i in range(n)]


def _region(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
            coord: Sequence[int]) -> torch.Tensor:
    """Boolean mask of the global elements a rank at ``coord`` holds (mesh dim 0 cuts first)."""
    start, size = [0] * len(shape), list(shape)
    for d, p in enumerate(placements):
        if isinstance(p, Shard):
            offset, length = _chunks(size[p.dim], mesh_shape[d])[coord[d]]
            start[p.dim] += offset
            size[p.dim] = length
    mask = torch.zeros(tuple(shape), dtype=torch.bool)
    mask[tuple(slice(s, s + n) for s, n in zip(start, size))] = True
    return mask


def min_bytes(case: Case, itemsize: int = 4) -> int:
    """The lower bound of the module docstring: max over ranks of movement + reduction bytes."""
    src, dst = spmd_placements(case.src), spmd_placements(case.dst)
    target = []
    for s, t in zip(src, dst):
        if isinstance(t, Partial) and isinstance(s, Partial) and s != t:
            raise ValueError(f"{case.label}: no bound for changing {s} into {t}")
        target.append(s if isinstance(t, Partial) else t)
    reduced = [d for d, (s, t) in enumerate(zip(src, dst)) if isinstance(s, Partial) and s != t]
    group = math.prod(case.mesh_shape[d] for d in reduced)
    coords = list(itertools.product(*(range(n) for n in case.mesh_shape)))
    worst = 0.0
    for coord in coords:
        held = _region(case.shape, case.mesh_shape, src, coord)
        wanted = _region(case.shape, case.mesh_shape, target, coord)
        total = float((wanted & ~held).sum())
        if reduced:
            # need[e]: how many members of this rank's reduction group want element e of the region.
            need = torch.zeros(case.shape, dtype=torch.int64)
            for other in coords:
                if all(other[d] == coord[d] for d in range(len(coord)) if d not in reduced):
                    need += _region(case.shape, case.mesh_shape, target, other)
            need = need * held
            total += float(((group + need - 2) * (need > 0)).sum()) / group
        worst = max(worst, total)
    return round(worst * itemsize)


# ----- ours, threaded world ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Measured:
    """One rank's traffic for one case: bytes received and the collectives, in issue order."""

    bytes: int
    collectives: tuple[tuple[str, int, int], ...]
    values_ok: bool = True
    unsupported: str = ""
    """Why the library refused the transition (then ``bytes`` is 0 and means nothing)."""


def _full(shape: Sequence[int]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(tuple(shape))


def _ours_rank(cases: Sequence[Case], check_values: bool) -> list[Measured]:
    """Every case on this rank, with our DTensor (threaded world or gloo, whichever is current)."""
    meshes: dict[tuple[int, ...], Any] = {}
    results = []
    for case in cases:
        if case.mesh_shape not in meshes:
            meshes[case.mesh_shape] = init_device_mesh("cpu", case.mesh_shape)
        mesh = meshes[case.mesh_shape]
        full = _full(case.shape)
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
def _torch_collective(func: Any, args: Sequence[Any]) -> tuple[str, int, int] | None:
    """(kind, group size, buffer bytes) of a c10d op torch's redistribute issued; None if not one."""
    namespace, _, name = func.name().partition("::")
    if namespace not in ("_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"):
        return None
    name = name.split(".")[0]
    if name in ("wait_tensor", "_wrap_tensor_autograd"):
        return None

    def nbytes(value: Any) -> int:
        tensors = value if isinstance(value, (list, tuple)) else [value]
        return sum(t.numel() * t.element_size() for t in tensors)

    def size_of(group_name: Any) -> int:
        return int(dist.distributed_c10d._resolve_process_group(group_name).size())

    if name.startswith("all_gather_into_tensor"):
        return "all_gather", int(args[1]), nbytes(args[0]) * int(args[1])
    if name.startswith("reduce_scatter_tensor"):
        return "reduce_scatter", int(args[2]), nbytes(args[0])
    if name.startswith("all_reduce"):
        return "all_reduce", size_of(args[2]), nbytes(args[0])
    if name == "all_to_all_single":
        return "all_to_all", size_of(args[3]), nbytes(args[0])
    if name == "shard_dim_alltoall":
        return "all_to_all", size_of(args[3]), nbytes(args[0])
    if name == "broadcast":
        return "broadcast", size_of(args[2]), nbytes(args[0])
    raise NotImplementedError(f"torch issued {namespace}::{name}, which this benchmark cannot account for")


def _torch_rank(cases: Sequence[Case]) -> list[Measured]:
    """Every case on this rank, with torch.distributed.tensor."""
    from torch.distributed import tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import redistribute_local_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCollectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.collectives: list[tuple[str, int, int]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            record = _torch_collective(func, args)
            if record is not None:
                self.collectives.append(record)
            return func(*args, **(kwargs or {}))

    meshes: dict[tuple[int, ...], Any] = {}
    results = []
    for case in cases:
        if case.mesh_shape not in meshes:
            meshes[case.mesh_shape] = torch_init_device_mesh("cpu", case.mesh_shape)
        mesh = meshes[case.mesh_shape]
        src = tuple(parse_placement(t, tdt) for t in case.src)
        dst = tuple(parse_placement(t, tdt) for t in case.dst)
        local_shape, _ = compute_local_shape_and_global_offset(case.shape, mesh, src)
        x = tdt.DTensor.from_local(torch.ones(local_shape), mesh, src, shape=torch.Size(case.shape),
                                   stride=_full(case.shape).stride(), run_check=False)
        try:
            with CountCollectives() as mode:
                if any(p.is_partial() and p != s for p, s in zip(dst, src)):
                    # torch's public redistribute refuses a new Partial; its executor takes it.
                    target = DTensorSpec(mesh, dst, tensor_meta=x._spec.tensor_meta)
                    redistribute_local_tensor(x._local_tensor, x._spec, target)
                else:
                    x.redistribute(mesh, dst)
        except (RuntimeError, NotImplementedError) as error:
            # Raised while planning, before any collective, so every rank stays in step.
            if mode.collectives:
                raise
            results.append(Measured(0, (), unsupported=str(error).splitlines()[0]))
            continue
        collectives = tuple(mode.collectives)
        results.append(Measured(sum(ring_bytes(*c) for c in collectives), collectives))
    return results


def _gloo_rank(cases: Sequence[Case]) -> tuple[list[Measured], list[Measured] | str]:
    """One gloo rank (under ``run_multiprocess``): torch's side, then ours on the same default group."""
    # torch's one-time notes (gloo's all_to_all fallback, deprecated c10d names) would bury the table.
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    theirs = _torch_rank(cases)
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


def report(cases: Sequence[Case], ours: list[list[Measured]], theirs: list[list[Measured]],
           ours_gloo: list[list[Measured]] | str, *, plans: bool) -> None:
    header = ("transition", "mesh", "shape", "ours", "torch", "min", "ours/min", "ours/torch",
              "ours comms", "torch comms")
    rows, flagged = [], []
    worst_min: tuple[float, str] = (0.0, "")
    worst_torch: tuple[float, str] = (0.0, "")
    unsupported: dict[str, str] = {}
    for case, mine, other in zip(cases, ours, theirs):
        ours_b, torch_b, least = max(m.bytes for m in mine), max(m.bytes for m in other), min_bytes(case)
        vs_min, vs_torch = ratio(ours_b, least), ratio(ours_b, torch_b)
        if other[0].unsupported:
            unsupported[case.label] = other[0].unsupported
            vs_torch = None
        name = f"{case.label} mesh {case.mesh_shape} {case.shape}"
        if vs_min is not None and vs_min > worst_min[0]:
            worst_min = (vs_min, name)
        if vs_torch is not None and vs_torch > worst_torch[0]:
            worst_torch = (vs_torch, name)
        # Padding uneven shards to equal blocks costs up to a few percent; flag only real excess.
        if (vs_min or 0) > PADDING_SLACK or (vs_torch or 0) > PADDING_SLACK:
            flagged.append(case)
        rows.append((case.label, "x".join(map(str, case.mesh_shape)), "x".join(map(str, case.shape)),
                     human_bytes(ours_b), "n/a" if other[0].unsupported else human_bytes(torch_b),
                     human_bytes(least), format_ratio(vs_min),
                     "n/a" if other[0].unsupported else format_ratio(vs_torch),
                     comms_summary(mine[0].collectives),
                     "n/a" if other[0].unsupported else comms_summary(other[0].collectives)))
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    right = {3, 4, 5, 6, 7}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    print("bytes received per rank (max over ranks), ring accounting; "
          "ours: threaded world, torch: gloo processes")
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))
    print()
    print(f"worst ours/min:   {format_ratio(worst_min[0], 3)} ({worst_min[1]})")
    print(f"worst ours/torch: {format_ratio(worst_torch[0], 3)} ({worst_torch[1]})")
    for label, why in unsupported.items():
        print(f"torch n/a for {label}: {why}")
    bad_values = [c.label + f" {c.shape}" for c, m in zip(cases, ours) if not all(r.values_ok for r in m)]
    print(f"our values: {'all match the source' if not bad_values else 'WRONG for ' + '; '.join(bad_values)}")
    if isinstance(ours_gloo, str):
        print(f"ours on gloo: FAILED, {ours_gloo}")
    else:
        differ = [f"{c.label} {c.shape}" for c, a, b in zip(cases, ours, ours_gloo)
                  if [r.bytes for r in a] != [r.bytes for r in b]]
        print("ours on gloo: " + ("differs for " + "; ".join(differ) if differ
                                  else f"same bytes as threaded on all {len(cases)}"))
    if plans and flagged:
        print(f"\nour plans where ours/min or ours/torch exceeds {PADDING_SLACK}:")
        for src, dst in dict.fromkeys((c.src, c.dst) for c in flagged):
            print(f"  [{','.join(src)}] -> [{','.join(dst)}]")
            for step in plan_redistribute(spmd_placements(src), spmd_placements(dst)):
                print(f"    {step}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few transitions on one shape, world of 4 only")
    parser.add_argument("--plans", action="store_true",
                        help="print our plan for each transition that moves more than the minimum or torch")
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
