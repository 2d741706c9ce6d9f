"""Why a plan wins: its memory and time by kind, the links its mesh order gives, and the binding
constraint behind each thing it pays for.

For every costly choice of a plan (a tensor-, context- or pipeline-parallel degree, checkpointing,
micro-batches, sharding instead of replicating, replicas instead of sharding) the simpler layout
next to it is evaluated the same way: its closed-form bounds first (it cannot fit, or it cannot be
faster), simulated only when they do not decide. It either does not fit, by how much and in what,
or it is slower, by how much and where. That is the binding constraint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from spmd.plan.bounds import lower_bounds
from spmd.plan.branch_and_bound import admissible, evaluate, not_searched, relaxed
from spmd.plan.cluster import Cluster, Workload
from spmd.plan.compose import StepEstimate
from spmd.plan.decoder import PlanModel
from spmd.plan.layout import Layout, groups_share_node
from spmd.simulate.report import human_bytes, human_seconds

__all__ = ["Reason", "why", "memory_line", "time_line"]

_DIM_WORDS = {
    "dp_replicate": "dp",
    "dp_shard": "fsdp",
    "dp_shard_cp": "fsdp over dp_shard x cp",
    "dp": "dp (all data-parallel ranks)",
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
}


@dataclass(frozen=True, slots=True)
class Reason:
    """One choice of the plan and what binds it."""

    choice: str
    """What the plan pays for, e.g. ``tp=8`` or ``ac=full``."""
    alternative: str
    """The simpler layout next to it."""
    binding: str
    """``memory`` (the alternative does not fit) or ``time`` (it is slower)."""
    text: str

    def __str__(self) -> str:
        return self.text


def memory_line(estimate: StepEstimate, cluster: Cluster) -> str:
    stage = estimate.fullest
    where = f" (stage {stage.stage} of {estimate.layout.pp})" if estimate.layout.pp > 1 else ""
    return (
        f"memory {human_bytes(stage.peak)} of {human_bytes(cluster.memory)} per rank{where}: parameters "
        f"{human_bytes(stage.params)}, gradients {human_bytes(stage.grads)}, optimizer {human_bytes(stage.optimizer)}, "
        f"activations and gathered parameters {human_bytes(stage.activations)}"
    )


def time_line(estimate: StepEstimate, cluster: Cluster) -> str:
    parts = [f"compute {human_seconds(estimate.compute_s)}"]
    for dim, seconds in sorted(estimate.exposed_s.items(), key=lambda item: -item[1]):
        hidden = estimate.hidden_s.get(dim, 0.0)
        extra = f" (of {human_seconds(seconds + hidden)}, the rest under compute)" if hidden else ""
        parts.append(f"exposed {_DIM_WORDS.get(dim, dim)} {human_seconds(seconds)}{extra}")
    hidden_only = [d for d, t in estimate.hidden_s.items() if t and d not in estimate.exposed_s]
    if hidden_only:
        words = ", ".join(f"{_DIM_WORDS.get(d, d)} {human_seconds(estimate.hidden_s[d])}" for d in hidden_only)
        parts.append(f"hidden under compute: {words}")
    if estimate.bubble_s:
        parts.append(f"pipeline bubble {human_seconds(estimate.bubble_s)}")
    share = estimate.compute_s / estimate.step_s if estimate.step_s else 1.0
    return f"step {human_seconds(estimate.step_s)} ({share:.0%} compute): " + ", ".join(parts)


def order_line(layout: Layout, cluster: Cluster) -> str:
    used = [dim for dim in layout.order if layout.size(dim) > 1]
    if not used:
        return "one rank: no mesh"
    inside = [d for d in used if groups_share_node(layout, (d,), cluster.ranks_per_node)]
    words = ", ".join(f"{_DIM_WORDS[d]}={layout.size(d)}" for d in used)
    where = ", ".join(_DIM_WORDS[d] for d in inside) or "no dim"
    return f"mesh {words} (outermost first): {where} inside a node of {cluster.ranks_per_node}"


def _choice(dim: str, layout: Layout) -> str:
    if dim in ("tp", "cp", "pp"):
        return f"{dim}={layout.size(dim)}"
    if dim == "ac":
        return f"ac={layout.ac}"
    if dim == "microbatches":
        return f"{layout.microbatches} micro-batches"
    if dim == "sp":
        return "no sequence parallelism"
    if dim == "dp_shard":
        return f"fsdp={layout.dp_shard}"
    return f"dp={layout.dp_replicate} replicas"


def _reason(dim: str, plan: StepEstimate, other: Layout, cfg: PlanModel, cluster: Cluster, workload: Workload,
            dtype: torch.dtype) -> Reason:  # fmt: skip
    choice = _choice(dim, plan.layout)
    budget = human_bytes(cluster.memory)
    bounds = lower_bounds(cfg, other, cluster, workload.global_batch, workload.seq, dtype)
    if bounds.state > cluster.memory:
        text = (
            f"{choice}: with {other} the parameters, gradients and optimizer state alone need at least "
            f"{human_bytes(bounds.state)} per rank > {budget}"
        )
        return Reason(choice, str(other), "memory", text)
    if bounds.memory > cluster.memory:
        text = f"{choice}: with {other} a rank needs at least {human_bytes(bounds.memory)} > {budget} (activations)"
        return Reason(choice, str(other), "memory", text)
    if bounds.step_s > plan.step_s:  # slower whatever it needs: no simulation required
        text = (
            f"{choice}: {other} is slower, whether or not it fits: its step takes at least "
            f"{human_seconds(bounds.step_s)} (the closed-form bound)"
        )
        return Reason(choice, str(other), "time", text)
    alt = evaluate(cfg, other, cluster, workload, dtype)
    if alt.peak > cluster.memory:
        stage = alt.fullest
        text = (
            f"{choice}: with {other} the peak is {human_bytes(alt.peak)} > {budget} "
            f"(activations and gathered parameters {human_bytes(stage.activations)}, "
            f"state {human_bytes(stage.params + stage.grads + stage.optimizer)})"
        )
        return Reason(choice, str(other), "memory", text)
    slower = alt.step_s - plan.step_s
    detail = _biggest_difference(plan, alt)
    if slower > 0:
        text = f"{choice}: {other} fits ({human_bytes(alt.peak)}) but is slower, {human_seconds(alt.step_s)} ({detail})"
    elif slower < 0:
        text = (
            f"{choice} is not needed: {other} fits ({human_bytes(alt.peak)}) and is faster, {human_seconds(alt.step_s)}"
        )
    else:
        text = f"{choice}: {other} fits ({human_bytes(alt.peak)}) and takes {human_seconds(alt.step_s)} too: a tie"
    return Reason(choice, str(other), "time", text)


def _biggest_difference(plan: StepEstimate, alt: StepEstimate) -> str:
    kinds = {"compute": (plan.compute_s, alt.compute_s), "bubble": (plan.bubble_s, alt.bubble_s)}
    for dim in {*plan.exposed_s, *alt.exposed_s}:
        kinds[f"exposed {_DIM_WORDS.get(dim, dim)}"] = (plan.exposed_s.get(dim, 0.0), alt.exposed_s.get(dim, 0.0))
    name, (mine, theirs) = max(kinds.items(), key=lambda item: item[1][1] - item[1][0])
    return f"{name} {_seconds(theirs)} instead of {_seconds(mine)}"


def _seconds(seconds: float) -> str:
    return human_seconds(seconds) if seconds else "none"


def _with_batch(layout: Layout, workload: Workload) -> Layout:
    """``layout`` with as many of its micro-batches as its data-parallel ranks' share of the batch allows."""
    m = layout.microbatches
    while m > 1 and workload.global_batch % (layout.dp * m):
        m //= 2
    return replace(layout, microbatches=m)


def why(plan: StepEstimate, cfg: PlanModel, cluster: Cluster, workload: Workload,
        dtype: torch.dtype = torch.bfloat16) -> tuple[list[str], list[Reason]]:  # fmt: skip
    """The lines that explain ``plan``: memory, time, mesh order, then one ``Reason`` per costly choice."""
    lines = [memory_line(plan, cluster), time_line(plan, cluster), order_line(plan.layout, cluster)]
    neighbours: dict[str, Layout] = {}
    for dim, other in relaxed(plan.layout):
        other = _with_batch(other, workload)
        if dim not in neighbours and admissible(cfg, other, cluster, workload) and not_searched(other, cfg) is None:
            neighbours[dim] = other
    reasons = [_reason(dim, plan, other, cfg, cluster, workload, dtype) for dim, other in neighbours.items()]
    return lines, reasons
