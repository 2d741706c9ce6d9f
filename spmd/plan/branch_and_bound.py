"""Search the layouts of a model on a cluster: enumerate, bound, simulate the promising, rank.

1. ``candidate_layouts`` lists what a user would consider: every split of the world into
   pp x dp_replicate x dp_shard x cp x tp that the model's shapes allow, tp with and without
   sequence parallelism, activation checkpointing none / selective / full, micro-batch counts
   (gradient accumulation, or the pipeline's), 1F1B and GPipe.
2. ``lower_bounds`` (closed form) rejects every layout whose memory bound exceeds the budget; a
   bound never exceeds the simulated value, so no layout that fits is dropped.
3. The rest are visited by increasing time bound (branch and bound): each is simulated
   (``simulate_program``, once per distinct per-rank program) and composed into a step
   (``estimate_step``) under its best mesh order; the visit stops when the next bound is no better
   than the k-th best simulated step, since no later layout can enter the top k.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from spmd.plan.bounds import Bounds, lower_bounds
from spmd.plan.cluster import Cluster, Workload
from spmd.plan.compose import StepEstimate, stages_of, step_time, summaries
from spmd.plan.decoder import PlanModel
from spmd.plan.layout import AC_MODES, MESH_DIMS, Layout, divisors, factorizations, mesh_orders
from spmd.plan.llama import LlamaConfig
from spmd.plan.program import ProgramKey, simulate_program

__all__ = ["SearchResult", "Ranked", "search_layouts", "candidate_layouts", "evaluate", "best_order"]


@dataclass(frozen=True, slots=True)
class Ranked:
    """A simulated layout: its step, and the bound the search visited it by."""

    estimate: StepEstimate
    bounds: Bounds

    @property
    def layout(self) -> Layout:
        return self.estimate.layout


@dataclass(slots=True)
class SearchResult:
    """The best layouts (fastest first) and what the search did to find them."""

    top: list[Ranked]
    candidates: int
    """Layouts enumerated."""
    pruned_by_memory: int
    """Rejected by the closed-form memory bound, never simulated."""
    simulated_layouts: int
    """Layouts composed from a simulated program."""
    programs: int
    """Distinct per-rank programs simulated."""
    dominated: int = 0
    """Skipped: the same layout with less checkpointing or fewer micro-batches fits, and is never slower."""
    not_searched: dict[str, int] = field(default_factory=dict)
    """Layouts spmd cannot run yet: the reason -> how many (never estimated)."""
    over_budget: list[Ranked] = field(default_factory=list)
    """Simulated layouts whose peak exceeded the budget."""
    fitting: list[Ranked] = field(default_factory=list)
    """Every simulated layout that fits, fastest first (``top`` is its head)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Layouts whose program raised when simulated (the model cannot run them): layout -> the error."""
    seconds: float = 0.0
    model: PlanModel | None = None
    cluster: Cluster | None = None
    workload: Workload | None = None
    dtype: torch.dtype = torch.bfloat16


def _powers_of_two_upto(n: int) -> list[int]:
    return [d for d in divisors(n) if d & (d - 1) == 0]


NOT_SEARCHED = {
    "pp_cp": "pipeline stages with context parallelism: spmd has not run the two together yet (each is "
    "tested with tp and fsdp, not with the other)",
    "pp_module": "pipeline stages of a model given as a module: the planner cannot tell which of its "
    "parameters outside the blocks come before them and which after",
}
"""Layouts spmd cannot run yet, by reason: listed, never estimated."""


def not_searched(layout: Layout, model: PlanModel | None = None) -> str | None:
    """Why spmd cannot run ``layout`` (of ``model``) yet (a key of ``NOT_SEARCHED``), or None."""
    if layout.pp > 1 and layout.cp > 1:
        return "pp_cp"
    if layout.pp > 1 and model is not None and not isinstance(model, LlamaConfig):
        return "pp_module"
    return None


def admissible(cfg: PlanModel, layout: Layout, cluster: Cluster, workload: Workload) -> bool:
    """Whether the model's shapes and the batch allow ``layout`` on ``cluster`` (runnable or not)."""
    tp, cp, pp, m = layout.tp, layout.cp, layout.pp, layout.microbatches
    if layout.world_size != cluster.world or workload.global_batch % (layout.dp * m) or cfg.layers < pp:
        return False
    if not cfg.allows_tp(tp) or tp > cluster.ranks_per_node:
        return False
    if workload.seq % (2 * cp) or (tp > 1 and workload.seq // cp % tp):
        return False
    return pp == 1 or m >= pp


def candidate_layouts(cfg: PlanModel, cluster: Cluster, workload: Workload) -> Iterator[Layout]:
    """Every layout of the search space that the model's shapes and the batch allow (default mesh order).

    It includes the layouts spmd cannot run yet (``not_searched``); the search sets them apart.
    Micro-batch counts are powers of two (at least the pipeline's depth).
    """
    for pp, replicate, shard, cp, tp in factorizations(cluster.world, 5):
        dp = replicate * shard
        if workload.global_batch % dp:
            continue
        counts = _powers_of_two_upto(workload.global_batch // dp)
        for sp, ac, m in itertools.product((False, True) if tp > 1 else (False,), AC_MODES, counts):
            for schedule in ("1F1B", "GPipe") if pp > 1 else ("1F1B",):
                layout = Layout(replicate, shard, cp, tp, pp, sp, ac, m, schedule)
                if admissible(cfg, layout, cluster, workload):
                    yield layout


def program_key(cfg: PlanModel, layout: Layout, workload: Workload, dtype: torch.dtype) -> ProgramKey:
    micro_batch = workload.global_batch // layout.dp // layout.microbatches
    return ProgramKey(  # any number of whole replicas runs the same per-rank program (see ``summaries``)
        cfg, min(layout.dp_replicate, 2), layout.dp_shard, layout.cp, layout.tp, layout.sp, layout.ac, micro_batch,
        workload.seq, dtype,
    )  # fmt: skip


def best_order(cfg: PlanModel, layout: Layout, cluster: Cluster, workload: Workload,
               dtype: torch.dtype) -> StepEstimate:  # fmt: skip
    """The layout's step under its fastest mesh order (the per-rank program is the same in every order)."""
    key = program_key(cfg, layout, workload, dtype)
    stages = stages_of(key, layout, cfg.layers)
    estimates = [step_time(key, layout.with_order(order), cluster, stages) for order in mesh_orders(layout)]
    return min(estimates, key=lambda e: (e.step_s, e.layout.order != MESH_DIMS))


def evaluate(cfg: PlanModel, layout: Layout, cluster: Cluster, workload: Workload,
             dtype: torch.dtype = torch.bfloat16, *, keep_order: bool = False) -> StepEstimate:  # fmt: skip
    """Simulate one layout (under its best mesh order, or its own with ``keep_order``)."""
    if keep_order:
        key = program_key(cfg, layout, workload, dtype)
        return step_time(key, layout, cluster, stages_of(key, layout, cfg.layers))
    return best_order(cfg, layout, cluster, workload, dtype)


def dominated_by(layout: Layout) -> list[Layout]:
    """Layouts that are never slower than ``layout``: the same with less checkpointing, fewer
    micro-batches (the same FLOPs or fewer, the same collectives or fewer) or 1F1B instead of
    GPipe (the same time, less memory). When one of them fits, ``layout`` cannot win, and the
    search skips it."""
    out = []
    if layout.ac != "none":
        out.append(replace(layout, ac=AC_MODES[AC_MODES.index(layout.ac) - 1]))
    if layout.microbatches > 1 and layout.pp == 1:
        out.append(replace(layout, microbatches=layout.microbatches // 2))
    if layout.schedule == "GPipe":  # the same bubble; 1F1B holds fewer micro-batches at once
        out.append(replace(layout, schedule="1F1B"))
    return out


def _runnable_layouts(cfg: PlanModel, cluster: Cluster, workload: Workload) -> tuple[list[Layout], dict[str, int]]:
    """The candidate layouts spmd runs, and how many it cannot run yet, by reason."""
    layouts: list[Layout] = []
    skipped: dict[str, int] = {}
    for layout in candidate_layouts(cfg, cluster, workload):
        reason = not_searched(layout, cfg)
        if reason is None:
            layouts.append(layout)
        else:
            skipped[reason] = skipped.get(reason, 0) + 1
    if not layouts:
        raise ValueError(
            f"no layout of {cluster.world} ranks fits the model's shapes and a global batch of {workload.global_batch}: "
            "the data-parallel degree must divide the batch, tp the key/value heads, and cp half the sequence"
        )
    return layouts, skipped


def search_layouts(cfg: PlanModel, cluster: Cluster, workload: Workload, *, top_k: int = 5,
                   dtype: torch.dtype = torch.bfloat16, exhaustive: bool = False) -> SearchResult:  # fmt: skip
    """The ``top_k`` fastest layouts that fit (see the module docstring); ``exhaustive`` simulates every
    layout the memory bound keeps (the brute force the tests compare against)."""
    started = time.perf_counter()
    simulate_program.cache_clear()
    summaries.cache_clear()
    layouts, skipped = _runnable_layouts(cfg, cluster, workload)
    bounded = [(lower_bounds(cfg, lay, cluster, workload.global_batch, workload.seq, dtype), lay) for lay in layouts]
    kept = [(b, lay) for b, lay in bounded if b.memory <= cluster.memory]
    kept.sort(key=lambda item: (item[0].step_s, AC_MODES.index(item[1].ac), item[1].microbatches, item[1].schedule))
    top: list[Ranked] = []
    over: list[Ranked] = []
    beaten: set[Layout] = set()  # layouts that fit, or that a fitting one dominates
    simulated = dominated = 0
    failed: dict[str, str] = {}
    for bounds, layout in kept:
        if not exhaustive and len(top) >= top_k and bounds.step_s >= top[top_k - 1].estimate.step_s:
            break
        if not exhaustive and any(simpler in beaten for simpler in dominated_by(layout)):
            dominated += 1
            beaten.add(layout)  # what it dominates is dominated too
            continue
        try:
            estimate = best_order(cfg, layout, cluster, workload, dtype)
        except Exception as error:  # the model cannot run it: reported, never estimated
            failed[str(layout)] = f"{type(error).__name__}: {error}".splitlines()[0]
            continue
        simulated += 1
        ranked = Ranked(estimate, bounds)
        if estimate.peak > cluster.memory:
            over.append(ranked)
            continue
        beaten.add(layout)
        top.append(ranked)
        top.sort(key=lambda r: (r.estimate.step_s, r.estimate.peak))  # a tie goes to more headroom
    return SearchResult(
        top=top if exhaustive else top[:top_k],
        fitting=top,
        candidates=len(layouts),
        not_searched={NOT_SEARCHED[k]: n for k, n in skipped.items()},
        pruned_by_memory=len(layouts) - len(kept),
        simulated_layouts=simulated,
        dominated=dominated,
        programs=simulate_program.cache_info().misses,
        over_budget=over,
        failed=failed,
        seconds=time.perf_counter() - started,
        model=cfg,
        cluster=cluster,
        workload=workload,
        dtype=dtype,
    )


def relaxed(layout: Layout) -> list[tuple[str, Layout]]:
    """The simpler layouts next to ``layout``: each gives up one thing it pays for (for the why lines).

    A tensor-, context- or pipeline-parallel degree halves and its ranks go to FSDP; where the batch
    cannot take more data-parallel ranks, a halved tp or pp goes to cp and a halved cp to tp instead
    (several entries for one dim: the first the batch and the model allow is the one that counts).
    """
    out: list[tuple[str, Layout]] = []
    elsewhere = {"tp": ("dp_shard", "cp"), "cp": ("dp_shard", "tp"), "pp": ("dp_shard", "cp")}
    for dim, targets in elsewhere.items():
        size = layout.size(dim)
        if size > 1 and size % 2 == 0:
            for target in targets:
                lay = replace(layout, **{dim: size // 2, target: layout.size(target) * 2})  # type: ignore[arg-type]
                if lay.tp == 1:
                    lay = replace(lay, sp=False)
                if lay.pp == 1:
                    lay = replace(lay, schedule="1F1B")
                out.append((dim, lay))
    if layout.ac != "none":
        out.append(("ac", replace(layout, ac=AC_MODES[AC_MODES.index(layout.ac) - 1])))
    if layout.microbatches > 1 and (layout.pp == 1 or layout.microbatches // 2 >= layout.pp):
        out.append(("microbatches", replace(layout, microbatches=layout.microbatches // 2)))
    if layout.dp_shard > 1 and layout.dp_shard % 2 == 0:
        out.append(("dp_shard", replace(layout, dp_shard=layout.dp_shard // 2, dp_replicate=layout.dp_replicate * 2)))
    if layout.dp_replicate > 1 and layout.dp_replicate % 2 == 0:
        out.append(
            ("dp_replicate", replace(layout, dp_replicate=layout.dp_replicate // 2, dp_shard=layout.dp_shard * 2))
        )
    if layout.tp > 1 and not layout.sp:
        out.append(("sp", replace(layout, sp=True)))
    return out
