"""From a simulated program to a layout's step: memory over the step and time by kind.

The model of the step (stated, and the same one the bounds use):

* Compute: the program's FLOPs (matrix products and attention, recomputation included) over the
  cluster's FLOP/s, plus, when the cluster gives a memory bandwidth, the bytes its other ops read
  and write (norms, activations, adds, the optimizer's updates) over it. The optimizer step's work
  is in proportion to the stage's parameter bytes.
* Tensor-parallel and context-parallel collectives are on the critical path: their ring time adds.
* Data-parallel collectives (FSDP's gathers and reduce-scatters, DDP's and HSDP's all-reduces)
  overlap with compute; only what exceeds the step's compute is exposed.
* Pipeline: a stage sends its activation forward and its gradient back per micro-batch
  (point-to-point, on the critical path), and the schedule's bubble makes the step
  ``(m + pp - 1)`` times the slowest stage's micro-batch time. A stage's memory replays its
  micro-batches in the schedule's order (1F1B: ``pp - s`` in flight on stage s; GPipe: all ``m``).

Each piece of the program is summarised once (net bytes, peak over its start, FLOPs, ring rounds
and bytes per mesh dim), so a piece repeated ``k`` times, a schedule of micro-batches and every
mesh order cost a few arithmetic steps. Ring times come from ``spmd.tensor.redistribute.cost``,
the library's one cost model.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from spmd.plan.cluster import Cluster
from spmd.plan.layout import Layout, groups_share_node
from spmd.plan.program import PROGRAM_DIMS, ProgramKey, Segment, simulate_program
from spmd.tensor.redistribute.cost import collective_rounds, received_bytes

__all__ = ["StepEstimate", "StageEstimate", "estimate_step", "stage_blocks", "OVERLAPPED_DIMS", "group_dims"]

OVERLAPPED_DIMS = frozenset({"dp_replicate", "dp_shard", "dp_shard_cp", "dp"})
"""Collectives on these dims overlap with compute (``dp_shard_cp``: FSDP over dp_shard x cp;
``dp``: HSDP's whole data-parallel group)."""
_LAYOUT_DIMS = {"dp_shard_cp": ("dp_shard", "cp"), "dp": ("dp_replicate", "dp_shard", "cp")}


@dataclass(frozen=True, slots=True)
class Summary:
    """A stretch of the timeline in a few numbers; ``then`` chains two, ``times`` repeats one."""

    net: int = 0
    peak: int = 0
    """Most bytes above the stretch's start."""
    net_no_grad: int = 0
    peak_no_grad: int = 0
    """The same without gradient storages (allocated once, in the first backward)."""
    flops: int = 0
    comm: tuple[tuple[str, int, int], ...] = ()
    traffic: int = 0
    """Bytes the memory-bound ops read and write."""
    """(mesh dim, ring rounds, bytes received) per dim."""

    def then(self, other: Summary) -> Summary:
        comm: dict[str, list[int]] = {}
        for dim, rounds, nbytes in (*self.comm, *other.comm):
            cell = comm.setdefault(dim, [0, 0])
            cell[0] += rounds
            cell[1] += nbytes
        return Summary(
            self.net + other.net,
            max(self.peak, self.net + other.peak),
            self.net_no_grad + other.net_no_grad,
            max(self.peak_no_grad, self.net_no_grad + other.peak_no_grad),
            self.flops + other.flops,
            tuple((dim, r, b) for dim, (r, b) in comm.items()),
            self.traffic + other.traffic,
        )

    def times(self, k: int) -> Summary:
        if k <= 0:
            return Summary()
        return Summary(
            k * self.net,
            (k - 1) * max(self.net, 0) + self.peak,
            k * self.net_no_grad,
            (k - 1) * max(self.net_no_grad, 0) + self.peak_no_grad,
            k * self.flops,
            tuple((dim, k * r, k * b) for dim, r, b in self.comm),
            k * self.traffic,
        )

    def scaled(self, ratio: float) -> Summary:
        """The work of the stretch (FLOPs, traffic, collectives) scaled by ``ratio``; memory kept."""
        comm = tuple((dim, round(ratio * r), round(ratio * b)) for dim, r, b in self.comm)
        return replace(self, flops=round(ratio * self.flops), traffic=round(ratio * self.traffic), comm=comm)

    def without_grads(self) -> Summary:
        """The stretch once gradients exist: their storages are not allocated again."""
        return Summary(
            self.net_no_grad,
            self.peak_no_grad,
            self.net_no_grad,
            self.peak_no_grad,
            self.flops,
            self.comm,
            self.traffic,
        )


def group_dims(key: ProgramKey) -> dict[tuple[int, ...], str]:
    """Rank 0's group over each mesh dim (and FSDP's groups) -> the dim's name."""
    sizes = [getattr(key, dim) for dim in PROGRAM_DIMS]
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]

    def ranks(dims: Sequence[int]) -> tuple[int, ...]:
        axes = [range(0, sizes[d] * strides[d], strides[d]) for d in dims]
        return tuple(sorted(sum(c) for c in itertools.product(*axes)))

    named = {ranks([i]): dim for i, dim in reversed(list(enumerate(PROGRAM_DIMS)))}
    named.setdefault(ranks([1, 2]), "dp_shard_cp")
    named.setdefault(ranks([0, 1, 2]), "dp")
    return named


def _summarize(segment: Segment, names: dict[tuple[int, ...], str], grads: frozenset[int], replicas: int) -> Summary:
    live = peak = live_ng = peak_ng = 0
    for token, change in segment.events:
        live += change
        peak = max(peak, live)
        if token not in grads:
            live_ng += change
            peak_ng = max(peak_ng, live_ng)
    comm: dict[str, list[int]] = {}
    for record in segment.records:
        if record.group_size > 1:
            dim = names.get(record.ranks, "other")
            size = replicas if dim == "dp_replicate" else record.group_size
            cell = comm.setdefault(dim, [0, 0])
            cell[0] += collective_rounds(record.kind, size)
            cell[1] += received_bytes(record.kind, size, record.tensor_bytes)
    comm_dims = tuple((d, r, b) for d, (r, b) in comm.items())
    return Summary(live, peak, live_ng, peak_ng, segment.flops, comm_dims, segment.traffic)


@functools.lru_cache(maxsize=512)
def summaries(key: ProgramKey, replicas: int) -> dict[str, Summary]:
    """Each piece of ``key``'s simulated program, summarised, with ``replicas`` ranks on dp_replicate.

    The per-rank program is the same for any number of whole replicas (``ProgramKey`` holds 2 for
    any number above one): only the group of their all-reduces grows, priced here.
    """
    program = simulate_program(key)
    names = group_dims(key)
    return {name: _summarize(seg, names, program.grad_tokens, replicas) for name, seg in program.pieces.items()}


def stage_blocks(layers: int, stages: int) -> list[int]:
    """Blocks per stage: as even as possible, the extra ones on the first stages."""
    base, extra = divmod(layers, stages)
    return [base + (s < extra) for s in range(stages)]


def stage_pieces(pieces: dict[str, Summary], stage: int, stages: int, blocks: int) -> tuple[Summary, Summary]:
    """One micro-batch's forward and backward on ``stage`` of ``blocks`` blocks."""
    first, last = stage == 0, stage == stages - 1
    middle = blocks - int(first) - int(last)
    forward = Summary()
    if first:
        forward = forward.then(pieces["embed"]).then(pieces["fwd_first"])
    forward = forward.then(pieces["fwd_block"].times(middle))
    backward = Summary()
    if last:
        forward = forward.then(pieces["fwd_last"]).then(pieces["head"])
        backward = pieces["bwd_last"]
    backward = backward.then(pieces["bwd_block"].times(middle))
    if first:
        backward = backward.then(pieces["bwd_first"]).then(pieces["embed_bwd"])
    return forward, backward


def schedule_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[str]:
    """The "F"/"B" order one stage runs its micro-batches in (1F1B: warm-up forwards, then one of each)."""
    m = microbatches
    if stages == 1:
        return ["F", "B"] * m
    if schedule == "GPipe":
        return ["F"] * m + ["B"] * m
    warmup = min(stages - stage - 1, m)
    return ["F"] * warmup + ["F", "B"] * (m - warmup) + ["B"] * warmup


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """One pipeline stage (the whole model without a pipeline) over one step, before times."""

    stage: int
    blocks: int
    params: int
    grads: int
    optimizer: int
    activations: int
    """Peak bytes of everything but the training state: activations, gathered parameters, buffers."""
    peak: int
    step: Summary
    """The whole step's micro-batches (FLOPs and collectives)."""
    microbatch: Summary
    """One micro-batch's forward and backward."""
    optimizer_step: Summary


def estimate_stage(key: ProgramKey, layout: Layout, stage: int, blocks: int) -> StageEstimate:
    """Memory, FLOPs and collectives of one stage over the step (order-independent)."""
    pieces = summaries(key, layout.dp_replicate)
    program = simulate_program(key)
    forward, backward = stage_pieces(pieces, stage, layout.pp, blocks)
    step = Summary()
    seen_backward = False
    for kind in schedule_order(layout.schedule, stage, layout.pp, layout.microbatches):
        piece = forward if kind == "F" else backward
        step = step.then(piece.without_grads() if seen_backward else piece)
        seen_backward = seen_backward or kind == "B"
    first, last = stage == 0, stage == layout.pp - 1
    params = blocks * program.param_bytes["block"]
    params += first * program.param_bytes["embed"] + last * program.param_bytes["head"]
    optimizer = int(params * program.optimizer_bytes_per_param_byte)
    return StageEstimate(
        stage, blocks, params, params, optimizer, step.peak_no_grad, params + optimizer + step.peak,
        step, forward.then(backward), pieces["optimizer"].scaled(params / max(program.param_bytes["block"], 1)),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """A layout's step: per-rank memory of its fullest stage and the step time by kind."""

    layout: Layout
    stages: tuple[StageEstimate, ...]
    step_s: float
    compute_s: float
    exposed_s: dict[str, float]
    """Critical-path collective time by mesh dim; data-parallel dims hold what compute does not hide."""
    hidden_s: dict[str, float]
    """Data-parallel collective time hidden under compute."""
    bubble_s: float
    comm_bytes: dict[str, int]
    """Bytes the slowest stage's rank receives over the step, by mesh dim."""

    @property
    def peak(self) -> int:
        return max(stage.peak for stage in self.stages)

    @property
    def fullest(self) -> StageEstimate:
        return max(self.stages, key=lambda stage: stage.peak)


def _dim_seconds(comm: Iterable[tuple[str, int, int]], layout: Layout, cluster: Cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for dim, rounds, nbytes in comm:
        link = cluster.link(groups_share_node(layout, _LAYOUT_DIMS.get(dim, (dim,)), cluster.ranks_per_node))
        out[dim] = out.get(dim, 0.0) + rounds * link.latency + nbytes / link.bandwidth
    return out


def _compute_seconds(summary: Summary, cluster: Cluster) -> float:
    """FLOPs at the FLOP/s, plus the memory-bound ops' bytes at the memory bandwidth (if priced)."""
    seconds = summary.flops / cluster.flops
    if cluster.memory_bandwidth is not None:
        seconds += summary.traffic / cluster.memory_bandwidth
    return seconds


def _p2p(key: ProgramKey, layout: Layout, cluster: Cluster, stage: int) -> tuple[float, int]:
    """Seconds and bytes of one micro-batch's sends and receives on ``stage`` (activation forward,
    gradient back, each the size of the stage's output)."""
    if layout.pp == 1:
        return 0.0, 0
    item = key.dtype.itemsize
    nbytes = key.micro_batch * key.seq // key.cp * key.model.dim * item // (key.tp if key.sp else 1)
    edges = int(stage > 0) + int(stage < layout.pp - 1)
    link = cluster.link(groups_share_node(layout, ("pp",), cluster.ranks_per_node))
    return edges * (link.latency + nbytes / link.bandwidth), edges * nbytes


def stages_of(key: ProgramKey, layout: Layout, layers: int) -> tuple[StageEstimate, ...]:
    return tuple(estimate_stage(key, layout, s, b) for s, b in enumerate(stage_blocks(layers, layout.pp)))


def step_time(key: ProgramKey, layout: Layout, cluster: Cluster, stages: Sequence[StageEstimate]) -> StepEstimate:
    """The step's time under ``layout``'s mesh order (see the module docstring)."""
    m = layout.microbatches
    best: tuple[float, StageEstimate, dict[str, float], dict[str, float]] | None = None
    for stage in stages:
        per_mb = _dim_seconds(stage.microbatch.comm, layout, cluster)
        exposed = {d: t for d, t in per_mb.items() if d not in OVERLAPPED_DIMS}
        p2p, _ = _p2p(key, layout, cluster, stage.stage)
        if p2p:
            exposed["pp"] = p2p
        t = _compute_seconds(stage.microbatch, cluster) + sum(exposed.values())
        if best is None or t > best[0]:
            whole = _dim_seconds(stage.step.then(stage.optimizer_step).comm, layout, cluster)
            best = (t, stage, exposed, {d: s for d, s in whole.items() if d in OVERLAPPED_DIMS})
    assert best is not None
    per_microbatch, slowest, exposed_mb, overlapped = best
    compute = m * _compute_seconds(slowest.microbatch, cluster) + _compute_seconds(slowest.optimizer_step, cluster)
    exposed = {d: m * t for d, t in exposed_mb.items()}
    hidden: dict[str, float] = {}
    budget = compute if cluster.overlap else 0.0  # data-parallel collectives hide under the step's compute
    for d, t in sorted(overlapped.items()):
        hidden[d] = min(t, budget)
        budget -= hidden[d]
        if t > hidden[d]:
            exposed[d] = t - hidden[d]
    bubble = (layout.pp - 1) * per_microbatch
    comm_bytes = {d: b for d, _, b in slowest.step.then(slowest.optimizer_step).comm}
    _, p2p_bytes = _p2p(key, layout, cluster, slowest.stage)
    if p2p_bytes:
        comm_bytes["pp"] = m * p2p_bytes
    step = compute + bubble + sum(exposed.values())
    return StepEstimate(layout, tuple(stages), step, compute, exposed, hidden, bubble, comm_bytes)


def estimate_step(key: ProgramKey, layout: Layout, cluster: Cluster, layers: int) -> StepEstimate:
    """``layout``'s step, from its micro-batch program ``key``, under its own mesh order."""
    return step_time(key, layout, cluster, stages_of(key, layout, layers))
