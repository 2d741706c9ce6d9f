"""Check ``spmd.plan``'s predictions against real training steps: the order of step times, and peak memory per rank.

Run ``python benchmarks/plan_validation.py`` (4 and 8 gloo processes, a few minutes on two CPU
cores; ``--quick`` for 4 processes, 6 layouts and fewer steps; ``--no-check`` to always exit 0).

For each world size, one gloo world (one intra-op thread per process, the ranks sharing the
machine's cores) does three things, and the parent then predicts and compares:

1. Calibrates the cluster once, every rank measuring at the same time (so what one rank gets is
   what it gets under the contention the training steps see). Compute: the float32 matrix
   products of the model's linear layers (forward and both backward products, at the first
   layout's tokens per rank), giving FLOP/s per rank. Memory: elementwise ops on 16 MiB buffers,
   giving the bytes per second the memory-bound ops get. Link: ``all_reduce``, ``all_gather`` and
   ``reduce_scatter`` over the world on float32 buffers of 4 KiB .. 16 MiB (the slowest rank's
   median per size), fitted together to the ring model of ``spmd.tensor.redistribute.cost``
   (``time = rounds * latency + received / bandwidth``) by least squares on relative error; the one
   link serves intra and inter (``ranks_per_node = world``). ``Cluster(overlap=False)``: a gloo
   collective blocks its rank, so none hides under compute.
2. Builds every layout of the list with ``spmd.plan.program.build`` on the real mesh
   (``init_device_mesh("cpu", (dp_replicate, dp_shard, cp, tp))``) and trains it: a step is
   ``zero_grad``, ``microbatches`` x ``train_microbatch`` (this data-parallel rank's sequences)
   and ``AdamW.step``. One warm-up step creates the optimizer state; one step under
   ``spmd.simulate.memory.MemoryTracker`` measures the peak (parameters + optimizer state + the
   most bytes the step allocated at once, gradients included: what the prediction counts); then
   the timed steps run in rounds, one step of each layout per round, so load from other jobs on
   the machine falls on every layout alike. A step's time is the slowest rank's (a barrier before
   each); the figure is the median over the rounds. Peak memory is the largest over the ranks.
3. Predicts every layout with ``spmd.plan.evaluate`` (its own mesh order, float32) on the
   calibrated ``Cluster``, and prints predicted vs measured side by side, the Spearman rank
   correlation of the step times and the worst memory error.

The check (exit status 1 unless ``--no-check``): correlation >= 0.8 and memory error <= 10% for
every world size. Pipeline layouts (pp > 1) are left out: ``train_microbatch`` runs no pipeline
schedule.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and spmd load in the functions that use them: --help and importing stay cheap
    import torch

    from spmd.plan.cluster import Cluster, Workload
    from spmd.plan.layout import Layout
    from spmd.plan.llama import LlamaConfig
    from spmd.simulate.plan import Link

DEMO_DIM = 256
"""The demo GPT (``GPT_PRESETS["demo"]``): 4 blocks, dim 256, 8 heads, a 1024 GELU MLP, vocab 2048."""
SEQ = 256
GLOBAL_BATCH = 16
LAYOUTS: dict[int, tuple[str, ...]] = {
    4: ("dp=4", "fsdp=4", "tp=4", "fsdp=2,tp=2", "fsdp=2,tp=2,sp", "dp=2,tp=2", "fsdp=4,ac=full", "fsdp=2,cp=2",
        "fsdp=4,accum=4"),
    8: ("dp=8", "fsdp=8", "fsdp=2,tp=4", "fsdp=4,tp=2,sp", "dp=2,fsdp=2,tp=2", "fsdp=8,ac=full", "fsdp=4,cp=2",
        "fsdp=8,accum=2", "dp=2,fsdp=4"),
}  # fmt: skip
"""The layouts each world trains (parse_layout's syntax: dp= replicas, fsdp= shards, accum= micro-batches)."""
QUICK_LAYOUTS = ("dp=4", "fsdp=4", "tp=4", "fsdp=2,tp=2,sp", "fsdp=4,ac=full", "fsdp=4,accum=4")
COLLECTIVE_BYTES = tuple(4096 * 4**i for i in range(7))
"""4 KiB .. 16 MiB."""
MIN_CORRELATION = 0.8
MAX_MEMORY_ERROR = 0.10
TIMEOUT_S = 1800.0
"""Longest one gloo world may take."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """What one gloo world measured of the machine: FLOP/s and elementwise bandwidth per rank, collective times."""

    world: int
    peak_flops: float
    """Float32 matrix-product FLOP/s of one rank while every rank runs them."""
    collectives_s: tuple[tuple[str, int, float], ...]
    """(kind, buffer bytes, seconds: the slowest rank's median)."""
    memory_bandwidth: float = 1e12
    """Bytes per second one rank's elementwise ops read and write while every rank runs them."""

    def link(self) -> Link:
        return fit_link(self.collectives_s, self.world)

    def cluster(self) -> Cluster:
        from spmd.plan.cluster import Cluster
        from spmd.simulate.plan import Links

        link = self.link()
        return Cluster(
            world=self.world,
            memory=2**40,
            ranks_per_node=self.world,
            peak_flops=self.peak_flops,
            memory_bandwidth=self.memory_bandwidth,
            links=Links(intra=link, inter=link, ranks_per_node=self.world),
            overlap=False,
        )


@dataclass(frozen=True, slots=True)
class Measured:
    """One layout on the gloo world: the slowest rank's step times, and the largest peak over the ranks."""

    layout: str
    step_s: tuple[float, ...]
    peak: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


@dataclass(frozen=True, slots=True)
class Row:
    layout: str
    predicted_s: float
    measured_s: float
    predicted_peak: int
    measured_peak: int

    @property
    def memory_error(self) -> float:
        return (self.predicted_peak - self.measured_peak) / self.measured_peak


# ----- calibration: the fit runs in the parent, the timing in every rank -----------------------------
def fit_link(points: Sequence[tuple[str, int, float]], world: int) -> Link:
    """The ring-model link that best fits measured collective times: least squares on relative error
    over the two unknowns (latency per round, seconds per byte received), every kind together."""
    from spmd.simulate.plan import Link
    from spmd.tensor.redistribute.cost import collective_rounds, received_bytes

    rows = [(collective_rounds(kind, world) / t, received_bytes(kind, world, nbytes) / t) for kind, nbytes, t in points]
    # normal equations of  min sum (a*latency + b*inverse_bandwidth - 1)^2
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    latency = (sa * sbb - sb * sab) / det
    per_byte = (saa * sb - sab * sa) / det
    if latency <= 0 or per_byte <= 0:  # one term explains it all: fit the other alone
        latency = max(latency, 0.0) if per_byte > 0 else sa / saa
        per_byte = sb / sbb if latency == 0 else max(per_byte, 1e-15)
    return Link(bandwidth=1 / per_byte, latency=latency)


def _linear_shapes(cfg: LlamaConfig, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every matrix product one micro-batch's linear layers run, forward and backward."""
    linears = [(cfg.dim, cfg.dim)] * 4 + [(cfg.dim, cfg.ffn_dim), (cfg.ffn_dim, cfg.dim)] * (1 + cfg.gated)
    shapes = []
    for k, n in linears:
        shapes += [(tokens, k, n), (tokens, n, k), (k, tokens, n)]  # y = x w; dx = dy w^T; dw = x^T dy
    return [
        *shapes * cfg.layers,
        (tokens, cfg.dim, cfg.vocab),
        (tokens, cfg.vocab, cfg.dim),
        (cfg.dim, tokens, cfg.vocab),
    ]


def measure_flops(cfg: LlamaConfig, tokens: int, seconds: float) -> float:
    """This rank's float32 FLOP/s on the model's matrix products, all ranks running at once."""
    import torch
    import torch.distributed as dist

    operands = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in _linear_shapes(cfg, tokens)]
    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in operands)
    for a, b in operands:  # warm-up
        torch.mm(a, b)
    dist.barrier()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for a, b in operands:
            torch.mm(a, b)
        done += flops
    return done / (time.perf_counter() - start)


def measure_memory_bandwidth(seconds: float) -> float:
    """This rank's bytes per second through elementwise ops (two reads, one write each), all ranks at once."""
    import torch
    import torch.distributed as dist

    a, b, c = (torch.rand(2**22) for _ in range(3))  # 16 MiB each
    moved = 3 * a.nbytes
    torch.add(a, b, out=c)
    dist.barrier()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.add(a, b, out=c)
        torch.mul(c, b, out=a)
        done += 2 * moved
    return done / (time.perf_counter() - start)


def measure_collectives(sizes: Sequence[int], repeats: int) -> list[tuple[str, int, float]]:
    """(kind, buffer bytes, seconds) of all_reduce, all_gather and reduce_scatter over the world: the
    slowest rank's median for each size (the buffer is the full one: gathered, or to be scattered)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    out = []
    for nbytes in sizes:
        full = torch.ones(nbytes // 4)
        piece = torch.ones(nbytes // 4 // world)
        calls = {
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda full=full, piece=piece: dist.all_gather_into_tensor(full, piece),
            "reduce_scatter": lambda full=full, piece=piece: dist.reduce_scatter_tensor(piece, full),
        }
        for kind, call in calls.items():
            call()
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            out.append((kind, nbytes, statistics.median(slowest.tolist())))
    return out


# ----- the layouts, trained for real -----------------------------------------------------------------
def _layout(text: str) -> Layout:
    """The layout in the default mesh order: the order of the real mesh and of its program."""
    from spmd.plan.layout import MESH_DIMS, parse_layout

    return replace(parse_layout(text), order=MESH_DIMS)


def program_key(cfg: LlamaConfig, layout: Layout, workload: Workload) -> object:
    import torch

    from spmd.plan.program import ProgramKey

    micro_batch = workload.global_batch // layout.dp // layout.microbatches
    return ProgramKey(cfg, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.sp, layout.ac,
                      micro_batch, workload.seq, torch.float32)  # fmt: skip


class _Trained:
    """One layout on this rank: its mesh, model, optimizer and this data-parallel rank's batches."""

    def __init__(self, cfg: LlamaConfig, layout: Layout, workload: Workload) -> None:
        import torch
        import torch.distributed as dist

        from spmd.plan.program import build
        from spmd.tensor import init_device_mesh

        self.layout, self.key = layout, program_key(cfg, layout, workload)
        shape = (layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
        self.mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        torch.manual_seed(0)
        self.model, self.optimizer = build(self.key, self.mesh, layers=cfg.layers, device="cpu")  # type: ignore[arg-type]
        dp_rank = dist.get_rank() // (layout.cp * layout.tp)
        generator = torch.Generator().manual_seed(dp_rank)
        micro_batch = self.key.micro_batch  # type: ignore[attr-defined]
        self.batches = [
            (torch.randint(cfg.vocab, (micro_batch, workload.seq), generator=generator),
             torch.randint(cfg.vocab, (micro_batch, workload.seq), generator=generator))
            for _ in range(layout.microbatches)
        ]  # fmt: skip

    def inputs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # context parallel cuts the tokens in place: every step gets fresh whole copies
        return [(tokens.clone(), targets.clone()) for tokens, targets in self.batches]

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        from spmd.plan.program import train_microbatch

        for tokens, targets in batches:
            train_microbatch(self.model, self.key, self.mesh, tokens, targets)  # type: ignore[arg-type]
        self.optimizer.step()

    def timed_step(self) -> float:
        import torch.distributed as dist

        batches = self.inputs()
        dist.barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.step(batches)
        return time.perf_counter() - start

    def peak_bytes(self) -> int:
        """Parameters + optimizer state + the most bytes one step allocates at once (gradients included)."""
        from spmd.simulate.memory import MemoryTracker, local_storages, training_state_bytes

        self.optimizer.zero_grad()
        batches = self.inputs()
        with MemoryTracker(local_storages(self.model, self.optimizer)) as tracker:
            self.step(batches)
        state = training_state_bytes(self.model, self.optimizer)
        return state.params + state.optimizer + tracker.peak()


def _quiet_torch() -> None:
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def _rank(cfg: LlamaConfig, layouts: Sequence[str], workload: Workload, steps: int, calibrate_s: float,
          repeats: int) -> tuple[float, float, list[tuple[str, int, float]], list[tuple[str, list[float], int]]]:  # fmt: skip
    """One gloo rank: calibration, then every layout trained; (FLOP/s, memory bytes/s, collective
    times, per layout (name, this rank's step times, this rank's peak))."""
    _quiet_torch()
    first = _layout(layouts[0])
    tokens = workload.global_batch // first.dp // first.microbatches * workload.seq // first.cp
    flops = measure_flops(cfg, tokens, calibrate_s)
    bandwidth = measure_memory_bandwidth(calibrate_s)
    collectives = measure_collectives(COLLECTIVE_BYTES, repeats)
    trained = [_Trained(cfg, _layout(text), workload) for text in layouts]
    for t in trained:  # warm-up: the optimizer state, the sharding caches
        t.timed_step()
    peaks = [t.peak_bytes() for t in trained]
    times: list[list[float]] = [[] for _ in trained]
    for _ in range(steps):
        for t, seconds in zip(trained, times):
            seconds.append(t.timed_step())
    return flops, bandwidth, collectives, [(text, s, p) for text, s, p in zip(layouts, times, peaks)]


def measure(cfg: LlamaConfig, world: int, layouts: Sequence[str], workload: Workload, *, steps: int, calibrate_s: float = 1.0,
            repeats: int = 10) -> tuple[Calibration, list[Measured]]:  # fmt: skip
    """Calibrate and train every layout on ``world`` gloo processes; per layout, the slowest rank."""
    from spmd.testing import run_multiprocess

    ranks = run_multiprocess(_rank, world, cfg, layouts, workload, steps, calibrate_s, repeats, timeout=TIMEOUT_S)
    flops = statistics.median(r[0] for r in ranks)
    bandwidth = statistics.median(r[1] for r in ranks)
    calibration = Calibration(world, flops, tuple(ranks[0][2]), bandwidth)
    measured = []
    for i, text in enumerate(layouts):
        per_rank = [r[3][i] for r in ranks]
        slowest = tuple(max(s) for s in zip(*(times for _, times, _ in per_rank)))
        measured.append(Measured(text, slowest, max(peak for *_, peak in per_rank)))
    return calibration, measured


# ----- predictions and the comparison ----------------------------------------------------------------
def predict(cfg: LlamaConfig, layouts: Sequence[str], cluster: Cluster, workload: Workload) -> list[tuple[float, int]]:
    """(step seconds, peak bytes per rank) of each layout, as ``spmd.plan`` predicts them."""
    import torch

    from spmd.plan import evaluate

    out = []
    for text in layouts:
        estimate = evaluate(cfg, _layout(text), cluster, workload, torch.float32, keep_order=True)
        out.append((estimate.step_s, estimate.peak))
    return out


def ranks_of(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties by average rank)."""
    rx, ry = ranks_of(xs), ranks_of(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def print_world(
    cfg: LlamaConfig, calibration: Calibration, rows: Sequence[Row], workload: Workload, steps: int
) -> tuple[float, float]:
    """The world's table; returns (rank correlation, worst |memory error|)."""
    from spmd.tensor.redistribute.cost import collective_rounds, received_bytes

    link = calibration.link()
    print(
        f"\n{calibration.world} gloo processes: {cfg.layers} blocks, dim {cfg.dim}, heads {cfg.heads}, ffn {cfg.ffn_dim}, "
        f"vocab {cfg.vocab}, float32, global batch {workload.global_batch} x {workload.seq} tokens; median of {steps} "
        "steps (the slowest rank's)"
    )
    print(
        f"calibration: {calibration.peak_flops / 1e9:.2f} GFLOP/s and {calibration.memory_bandwidth / 1e9:.2f} GB/s "
        f"of elementwise traffic per rank; collectives fit latency {link.latency * 1e6:.0f} us/round, bandwidth "
        f"{link.bandwidth / 1e9:.3f} GB/s"
    )
    for kind, nbytes, seconds in calibration.collectives_s:
        fitted = collective_rounds(kind, calibration.world) * link.latency
        fitted += received_bytes(kind, calibration.world, nbytes) / link.bandwidth
        print(f"  {kind:<15}{_mib(nbytes):>10}: measured {seconds * 1e3:8.2f} ms, fitted {fitted * 1e3:8.2f} ms")
    print(
        f"{'layout':<18}{'pred step':>11}{'meas step':>11}{'meas/pred':>10}{'pred peak':>13}{'meas peak':>13}"
        f"{'mem err':>9}"
    )
    for row in rows:
        print(
            f"{row.layout:<18}{row.predicted_s * 1e3:>8.0f} ms{row.measured_s * 1e3:>8.0f} ms"
            f"{row.measured_s / row.predicted_s:>10.2f}"
            f"{_mib(row.predicted_peak):>13}{_mib(row.measured_peak):>13}{row.memory_error:>+9.1%}"
        )
    correlation = spearman([r.predicted_s for r in rows], [r.measured_s for r in rows])
    worst = max(abs(r.memory_error) for r in rows)
    print(f"rank correlation (Spearman) {correlation:.2f}; worst memory error {worst:.1%}")
    return correlation, worst


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 processes, 6 layouts, 3 timed steps")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8], choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (one step of every layout each)")
    parser.add_argument("--dim", type=int, default=DEMO_DIM, help="model width (the MLP is 4x)")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=GLOBAL_BATCH, help="sequences per step (global batch)")
    parser.add_argument("--no-check", action="store_true", help="exit 0 whatever the figures")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    worlds, steps = ([4], 3) if args.quick else (args.worlds, args.steps)
    from spmd.plan.cluster import Workload
    from spmd.plan.llama import GPT_PRESETS

    workload = Workload(args.batch, args.seq)
    cfg = replace(GPT_PRESETS["demo"], dim=args.dim, ffn_dim=4 * args.dim)
    _quiet_torch()
    ok = True
    for world in worlds:
        layouts = QUICK_LAYOUTS if args.quick else LAYOUTS[world]
        started = time.perf_counter()
        calibration, measured = measure(cfg, world, layouts, workload, steps=steps)
        predicted = predict(cfg, layouts, calibration.cluster(), workload)
        rows = [Row(m.layout, p_step, m.median_s, p_peak, m.peak) for m, (p_step, p_peak) in zip(measured, predicted)]
        correlation, worst = print_world(cfg, calibration, rows, workload, steps)
        print(f"ran in {time.perf_counter() - started:.0f} s")
        ok = ok and correlation >= MIN_CORRELATION and worst <= MAX_MEMORY_ERROR
    if not ok:
        print(f"FAILED: want rank correlation >= {MIN_CORRELATION} and memory error <= {MAX_MEMORY_ERROR:.0%}")
    return 0 if ok or args.no_check else 1


if __name__ == "__main__":
    sys.exit(main())
