"""What ``python -m spmd.plan`` prints: the ranked table with its reasons, one plan explained, the frontier plot."""

from __future__ import annotations

from collections import defaultdict

import torch

from spmd.plan.branch_and_bound import SearchResult, program_key
from spmd.plan.cluster import Cluster, Workload
from spmd.plan.compose import StepEstimate, group_dims, stage_blocks
from spmd.plan.decoder import PlanModel
from spmd.plan.program import simulate_program
from spmd.plan.why import memory_line, order_line, time_line, why
from spmd.simulate.report import human_bytes, human_seconds

__all__ = ["format_result", "format_explain", "plot_frontier"]


def _exposed(estimate: StepEstimate) -> str:
    return human_seconds(sum(estimate.exposed_s.values())) if estimate.exposed_s else "-"


def format_header(cfg: PlanModel, name: str, cluster: Cluster, workload: Workload, dtype: torch.dtype) -> str:
    params = cfg.params()
    return (
        f"{name}: {params / 1e9:.1f}B parameters, {cfg.layers} layers; {cluster.world} ranks "
        f"({cluster.ranks_per_node} per node), {human_bytes(cluster.memory)} and {cluster.peak_flops / 1e12:.0f} "
        f"TFLOP/s per rank; global batch {workload.global_batch} x {workload.seq} tokens, {str(dtype).replace('torch.', '')}"
    )


def format_result(result: SearchResult, name: str = "model", *, reasons: bool = True) -> str:
    """The ranked table, how the search went, and each plan's why lines."""
    assert result.model is not None and result.cluster is not None and result.workload is not None
    cfg, cluster, workload = result.model, result.cluster, result.workload
    lines = [format_header(cfg, name, cluster, workload, result.dtype), ""]
    lines.append(
        f"searched {result.candidates} layouts in {result.seconds:.1f} s: {result.pruned_by_memory} over the memory "
        f"bound (never simulated), {result.simulated_layouts} simulated ({result.programs} distinct per-rank programs, "
        f"{len(result.over_budget)} of them over budget), {result.dominated} skipped as dominated, the rest bounded "
        "out by step time"
    )
    for reason, count in result.not_searched.items():
        lines.append(f"not searched: {count} layouts, {reason}")
    if result.failed:
        layout, error = next(iter(result.failed.items()))
        lines.append(f"could not run {len(result.failed)} layouts, e.g. {layout}: {error}")
    if not result.top:
        lines.append(f"\nno layout fits {human_bytes(cluster.memory)} per rank")
        return "\n".join(lines)
    width = max(len("layout"), *(len(str(r.layout)) for r in result.top))
    lines += [
        "",
        f"{'#':>2}  {'layout':<{width}}  {'step':>10}  {'compute':>10}  {'exposed':>10}  {'bubble':>10}  {'peak/rank':>11}",
    ]
    for i, ranked in enumerate(result.top, 1):
        e = ranked.estimate
        bubble = human_seconds(e.bubble_s) if e.bubble_s else "-"
        lines.append(
            f"{i:>2}  {e.layout!s:<{width}}  {human_seconds(e.step_s):>10}  {human_seconds(e.compute_s):>10}  "
            f"{_exposed(e):>10}  {bubble:>10}  {human_bytes(e.peak):>11}"
        )
    if reasons:
        for i, ranked in enumerate(result.top, 1):
            head, why_lines = why(ranked.estimate, cfg, cluster, workload, result.dtype)
            lines += ["", f"why #{i} {ranked.layout}:"] + [f"  {line}" for line in head]
            lines += [f"  - {reason}" for reason in why_lines]
    return "\n".join(lines)


def format_explain(estimate: StepEstimate, cfg: PlanModel, cluster: Cluster, workload: Workload,
                   dtype: torch.dtype) -> str:  # fmt: skip
    """One plan: its memory and time, then each block's collectives (per micro-batch) and the ops behind them."""
    layout = estimate.layout
    key = program_key(cfg, layout, workload, dtype)
    program = simulate_program(key)
    names = group_dims(key)
    lines = [f"plan {layout}", f"  {memory_line(estimate, cluster)}", f"  {time_line(estimate, cluster)}"]
    lines.append(f"  {order_line(layout, cluster)}")
    if layout.pp > 1:
        lines.append(
            f"  stages hold {stage_blocks(cfg.layers, layout.pp)} blocks; {layout.schedule} over {layout.microbatches} micro-batches"
        )
    lines += [
        "",
        f"collectives of one micro-batch (micro-batch of {key.micro_batch} x {key.seq} tokens on each data-parallel rank)",
    ]
    sections = (("before the blocks", "embed"), ("each block, forward", "fwd_block"), ("norm, head and loss", "head"),
                ("each block, backward", "bwd_block"), ("after the blocks, backward", "embed_bwd"), ("optimizer step", "optimizer"))  # fmt: skip
    for title, piece in sections:
        segment = program.pieces[piece]
        grouped: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for record, (op, module, _) in zip(segment.records, segment.causes):
            if record.group_size > 1:
                dim = names.get(record.ranks, "other")
                cell = grouped[(dim, record.kind, f"{op} in {module or 'the model'}")]
                cell[0] += 1
                cell[1] += record.moved_bytes
        lines.append(f"  {title}: {segment.flops / 1e9:.1f} GFLOP")
        if not grouped:
            lines.append("    no collectives")
        for (dim, kind, cause), (count, nbytes) in grouped.items():
            lines.append(f"    {dim:<12} {kind:<15} x{count:<3} {human_bytes(nbytes):>11}  {cause}")
    return "\n".join(lines)


def plot_frontier(result: SearchResult, path: str) -> None:
    """Peak memory per rank against step time for every simulated layout; the fastest per memory marked."""
    from spmd.simulate.plot import require_matplotlib

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [
        (r.estimate.peak / 2**30, r.estimate.step_s, str(r.layout)) for r in [*result.fitting, *result.over_budget]
    ]
    frontier: list[tuple[float, float, str]] = []
    for mem, step, label in sorted(points):
        if not frontier or step < frontier[-1][1]:
            frontier.append((mem, step, label))
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=12, color="0.6", label="simulated layouts")
    ax.plot([p[0] for p in frontier], [p[1] for p in frontier], "o-", color="C0", label="frontier")
    for mem, step, label in frontier:
        ax.annotate(label, (mem, step), fontsize=7, xytext=(4, 4), textcoords="offset points")
    assert result.cluster is not None
    ax.axvline(result.cluster.memory / 2**30, color="C3", linestyle="--", label="memory per rank")
    ax.set_xlabel("peak memory per rank (GiB)")
    ax.set_ylabel("step time (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
